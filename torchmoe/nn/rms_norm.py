"""RMSNorm as Hugging Face computes it: ``x / rms(x) * weight``, normalised in fp32 and cast back
to the input's dtype before the weight."""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.nn.init import ONES, ParamInit

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim (``dim`` wide), with a learned weight unless
    ``elementwise_affine`` is false (Llama 4's QK L2-norm)."""

    def __init__(self, dim: int, eps: float, *, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> (..., dim), x's dtype."""
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return out * self.weight if self.weight is not None else out

    def param_inits(self) -> dict[str, ParamInit]:
        return {"weight": ONES} if self.weight is not None else {}
