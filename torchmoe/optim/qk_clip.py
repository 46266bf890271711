"""QK-Clip (Kimi K2's MuonClip): after each optimizer step, every attention head whose largest
pre-softmax logit in the step exceeded ``optimizer.qk_clip_threshold`` (tau) has its query and key
weights scaled so that those logits would have been tau.

    python -m pytest -q tests/unit/test_qk_clip.py tests/distributed/test_families.py -k qk_clip

The layers whose logits no QK-norm bounds (`watch_attention_logits`: every MLA layer, Llama 4's
NoPE layers, gpt-oss's, Llama 4 without QK-norm) record each head's largest logit of every training
forward (`nn.logit_max`) in a buffer of their own. At the step's end `QKClip.reduce` takes the
maximum over every rank (one all-reduce of layers x heads fp32 values over the world: data-parallel
ranks saw other rows, tensor-parallel ranks other heads, pipeline stages other layers), and after
the optimizer's step `QKClip.apply` multiplies head h's logits by gamma_h = min(1, tau / max_h)
through its rows of the projections (`qk_clip_factors` of each attention class: MLA's rotated key,
shared by all heads, stays; a GQA key head shared by several query heads stays). The factors are
built whole, the same on every rank, and each rank scales its own shard of the rows: the result is
the single process's in every layout. Nothing is read on the host but the step's two metrics,
which ride in the step's one read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torchmoe.models.decoder.attention import CausalAttention

__all__ = ["QKClip", "watch_attention_logits"]


def watch_attention_logits(model: nn.Module, n_heads: int) -> list[str]:
    """Make every attention layer of `model` (the whole model, on the meta device, before the
    pipeline split and parallelize) whose logits no QK-norm bounds record its heads' largest
    logit; returns their names, in the model's order (every rank the same list)."""
    watched = []
    for name, module in model.named_modules():
        if isinstance(module, CausalAttention) and module.logits_unbounded:
            module.watch_logits(n_heads, len(watched))
            watched.append(name)
    return watched


class QKClip:
    """The clip of this rank's watched attention layers.

    Args:
        model: this rank's model (PP: its stages as one).
        watched: `watch_attention_logits`' names (of the whole model; this rank holds some).
        threshold: tau, in logits.
        n_heads: the model's attention heads per layer.
        device: where the table of maxima lives.
    """

    def __init__(self, model: nn.Module, watched: list[str], threshold: float, n_heads: int,
                 device: torch.device) -> None:
        # Found by the row `watch_attention_logits` gave each (wrappers, activation checkpointing's
        # and compile's, change the modules' names).
        self.layers = [(m.logit_index, m) for m in model.modules()
                       if isinstance(m, CausalAttention) and m.logit_max is not None]
        self.threshold = threshold
        self.maxima = torch.full((len(watched), n_heads), float("-inf"), device=device)

    def begin_step(self) -> None:
        """Forget the previous step's logits (before the step's first forward)."""
        for _, attention in self.layers:
            attention.logit_max.fill_(float("-inf"))

    def reduce(self) -> dict[str, torch.Tensor]:
        """Every watched head's largest logit of the step, over every rank (collective: every rank
        calls it, after the step's backward); returns the step's metrics as 0-dim device tensors:
        ``qk_max_logit``, the largest logit of any head, and ``qk_clipped_heads``, how many heads
        the step's `apply` clips."""
        self.maxima.fill_(float("-inf"))
        for index, attention in self.layers:
            self.maxima[index] = attention.logit_max
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.maxima, op=dist.ReduceOp.MAX)
        return {"qk_max_logit": self.maxima.max(), "qk_clipped_heads": (self.maxima > self.threshold).sum().float()}

    @torch.no_grad()
    def apply(self) -> None:
        """Scale the query and key rows of every head `reduce` found above the threshold (after
        the optimizer's step)."""
        over = self.maxima > self.threshold
        gamma = torch.where(over, self.threshold / torch.where(over, self.maxima, 1.0), 1.0)
        for index, attention in self.layers:
            for name, factor in attention.qk_clip_factors(gamma[index]).items():
                _scale_rows(attention.get_parameter(name), factor)


def _scale_rows(param: torch.Tensor, factor: torch.Tensor) -> None:
    """Multiply row i of `param` (out, in) or (out,) by factor[i] in place; a DTensor's shard by
    its rows of the factor (given whole: the same on every rank)."""
    factor = factor.to(torch.float32).view(-1, *([1] * (param.dim() - 1)))
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        whole = DTensor.from_local(factor, mesh, [Replicate()] * mesh.ndim, run_check=False)
        factor = whole.redistribute(mesh, param.placements).to_local()
        param = param.to_local()
    param.copy_((param.float() * factor).to(param.dtype))
