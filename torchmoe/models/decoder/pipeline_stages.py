"""Llama 4's pipeline stages: pruned copies of the model for the stages a pp rank runs, and those
stages seen as one model under the unsplit model's names.

The split itself comes from `plan.pipeline.pipeline_layout`, the function the dry run prints;
torch's schedule over the stages is `distributed.pipeline_parallel.build_schedule`'s. Each stage
keeps its blocks, plus the embedding on the first stage and the final norm + head on the last, so
parameter names stay the full model's; each then goes through the parallelize pipeline like a
whole model.
"""

from __future__ import annotations

import copy

from torch import nn

from torchmoe.models.decoder.model import Transformer
from torchmoe.plan.pipeline import PipelineLayout

__all__ = ["PipelineRankModel", "split_into_stages"]


def split_into_stages(model: Transformer, pipe: PipelineLayout, pp_rank: int) -> list[Transformer]:
    """Pruned copies of `model` (meta device) for the stages `pp_rank` runs, in stage order."""
    parts = []
    for stage in pipe.ranks[pp_rank]:
        part = copy.deepcopy(model)
        keep = {str(i) for i in pipe.layers[stage]}
        for name in [n for n in part.layers if n not in keep]:
            del part.layers[name]
        if stage != 0:
            part.tok_embeddings = None
        if stage != pipe.num_stages - 1:
            part.norm = None
            part.output = None
        parts.append(part)
    return parts


class PipelineRankModel(nn.Module):
    """The stages of one pp rank seen as one model, under the unsplit model's names.

    Holds the stages' own modules (no copies): ``tok_embeddings`` / ``norm`` / ``output`` when
    this rank has the first / last stage, and every block of its stages in ``layers``. The
    optimizer, checkpoints and clipping use it like a `Transformer`; only the schedule runs the
    stages themselves.
    """

    def __init__(self, stages: list[Transformer]) -> None:
        super().__init__()
        self.tok_embeddings = next((s.tok_embeddings for s in stages if s.tok_embeddings is not None), None)
        blocks = sorted(((name, block) for s in stages for name, block in s.layers.items()), key=lambda nb: int(nb[0]))
        self.layers = nn.ModuleDict(blocks)
        self.norm = next((s.norm for s in stages if s.norm is not None), None)
        self.output = next((s.output for s in stages if s.output is not None), None)

    def moe_layers(self) -> list[nn.Module]:
        """The MoE modules of this rank's blocks, in layer order."""
        return [block.moe for block in self.layers.values() if block.moe_enabled]

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank's stages run through the pipeline schedule, not as one model")
