"""THE loss: the one place where what training minimises is computed from logits and labels.

Every loss is a sum of token losses (fp32 cross entropy; a label of -100 is ignored) over the
global batch's supervised-token count, so summing micro-batches and data-parallel ranks gives
exactly the global mean, for any dp degree and gradient accumulation. Pretraining supervises
every label: the count is the constant rows x seq_len (`Trainer`). A loss over masked labels
(chat SFT) sets `Objective.tokens` each step to the count the host made with the batch, summed
over the data-parallel ranks in one all-reduce before the first forward
(`step.StepRunner.global_targets`): a device tensor, which the host never reads. The pipeline
schedule's loss is `loss`, so it divides by the same count.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchmoe.arch.model_args import ModelArgs
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.models.decoder.mtp import mtp_targets
from torchmoe.nn.document_attention import DocumentSegments


class Objective:
    """The training objective of one model.

    Args:
        model_args: the model (its multi-token prediction modules and their coefficient).
        tokens: the global batch's supervised-token count every loss is normalised by: a
            constant, or (masked labels) each step's count as a 0-dim device tensor.
        tp_mesh: with loss parallel, the TP mesh whose ranks hold the logits' vocabulary shards;
            None: the logits are whole.
    """

    def __init__(self, model_args: ModelArgs, *, tokens: int | torch.Tensor, tp_mesh: DeviceMesh | None) -> None:
        self.mtp_layers = model_args.mtp_layers
        self.mtp_loss_coeff = model_args.mtp_loss_coeff
        self.tokens = tokens
        self.tp_mesh = tp_mesh

    def summed(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's token losses summed (fp32 cross entropy). Runs inside
        `loss_parallel()` when the logits are vocab-sharded.

        Args:
            logits: (B, S, V) or, with loss parallel, this rank's (B, S, V / tp) vocab shard.
            labels: (B, S) int64.
        """
        if self.tp_mesh is not None:
            logits = DTensor.from_local(logits, self.tp_mesh, [Shard(-1)], run_check=False)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the global mean loss (shapes as `summed`'s): its summed
        token losses over the global batch's supervised-token count."""
        return self.summed(logits, labels) / self.tokens

    def forward(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, documents: DocumentSegments | None,
                real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward on one (B, S) micro-batch, `real` its mask of the tokens that are
        data (None: all; `Transformer.forward`): (its share of the objective, for the
        backward; the shares of the losses logged, detached). The objective is the main loss
        (`loss`); with multi-token prediction modules, plus ``mtp_loss_coeff`` times their mean
        loss, each depth's summed over its targets (`models.decoder.mtp`) over the same token
        count. Logged: the main loss alone (what validation and `eval` compute), then the
        modules' mean loss (a plain (2,) tensor; without the modules the objective itself)."""
        if not self.mtp_layers:
            loss = self.loss(model(inputs, documents, real=real), labels)
            return loss, loss.detach()
        logits, depths = model(inputs, documents, labels=labels, real=real)
        main = self.summed(logits, labels)
        mtp = sum(self.summed(out, mtp_targets(labels, k)) for k, out in enumerate(depths, start=1))
        scale = self.mtp_loss_coeff / len(depths)
        whole = [t.detach().full_tensor() if isinstance(t, DTensor) else t.detach() for t in (main, mtp)]
        logged = torch.stack([whole[0], whole[1] / len(depths)]) / self.tokens
        return (main + scale * mtp) / self.tokens, logged


def loss_weight(mesh: ParallelMesh | None) -> float:
    """This rank's share in sums of the loss over the world: only tp-coordinate 0 counts it,
    since its TP peers hold the same value."""
    return 1.0 if mesh is None or mesh["tp"].get_local_rank() == 0 else 0.0
