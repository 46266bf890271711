"""RMSNorm as Hugging Face computes it: ``x / rms(x) * weight``, normalised in fp32, in either of
the two orders of the weight's multiply and the cast back to the input's dtype that the families'
reference modules use (equal in fp32; in bf16 they round differently).

    python -m pytest -q tests/unit/test_bf16_numerics.py -k norm
"""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.nn.init import ONES, ParamInit

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim (``dim`` wide), with a learned weight unless
    ``elementwise_affine`` is false (Llama 4's QK L2-norm).

    The order (transformers' modules): by default the fp32 normalised values are cast to the
    input's dtype and then multiplied by the weight (``Llama4TextRMSNorm``, ``Qwen3MoeRMSNorm``,
    ``DeepseekV3RMSNorm``); with ``weight_in_fp32`` the weight multiplies the fp32 values and the
    product is cast once (``GptOssRMSNorm``).
    """

    def __init__(self, dim: int, eps: float, *, elementwise_affine: bool = True, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> (..., dim), x's dtype."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return normed.type_as(x)
        if self.weight_in_fp32:
            return (normed * self.weight).type_as(x)  # fp32: the weight promotes to it
        return normed.type_as(x) * self.weight

    def param_inits(self) -> dict[str, ParamInit]:
        return {"weight": ONES} if self.weight is not None else {}
