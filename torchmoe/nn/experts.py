"""Feed-forward building blocks of MoE layers: the SwiGLU MLP (dense layers, shared experts) and
routed experts stored as stacked weights, run by one grouped GEMM per projection.

    python -m pytest -q tests/unit/test_moe.py

The per-expert loop (`_looped_swiglu`) is kept as the reference the grouped path is tested
against. Which tokens reach which expert is the router's and the dispatcher's (`nn.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchmoe import _torch_private as private
from torchmoe.nn.init import ParamInit, TruncNormal
from torchmoe.nn.moe_ops import grouped_mm
from torchmoe.nn.shards import local_shard
from torchmoe.regions import region

__all__ = ["FeedForward", "GroupedExperts", "compute_dtype"]


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``. Used for dense layers and the shared expert."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> (..., dim)."""
        return self.project(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The gated hidden activation ``silu(w1 x) * w3 x``: (..., dim) -> (..., hidden_dim).
        The MoE layer runs it and `project` as separate steps (see `MoE.forward`)."""
        with region("ffn"):
            return F.silu(self.w1(x)) * self.w3(x)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """``w2 h``: (..., hidden_dim) -> (..., dim)."""
        with region("ffn"):
            return self.w2(h)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        return {"w1.weight": TruncNormal(0.02), "w2.weight": TruncNormal(init_std), "w3.weight": TruncNormal(init_std)}


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as stacked weights.

    Weights follow ``nn.Linear`` (out, in) per expert: ``w1, w3: [E, hidden, dim]``,
    ``w2: [E, dim, hidden]``, so tensor parallel shards dim 1 of w1/w3 and dim 2 of w2, and expert
    parallel shards dim 0 of all three.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # Set by `distributed.float8.convert_float8_experts`: (rows, w, offsets) -> rows @ w[e].T
        # per expert block, in float8.
        self.float8_grouped_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Run each expert on its contiguous block of rows.

        Args:
            x: (rows, dim) tokens sorted expert-major; expert e owns the next
                ``num_tokens_per_expert[e]`` rows. Rows past the last block are ignored.
            num_tokens_per_expert: (num_local_experts,) integer row counts.
        Returns:
            (rows, dim); rows past the last block are unspecified.
        """
        with region("routed_experts"):
            # TP/EP place experts so that each rank's shard is self-contained.
            w1, w2, w3 = (local_shard(w) for w in (self.w1, self.w2, self.w3))
            if _autocast_on(x):
                # autocast has no rule for _grouped_mm (it would run in fp32, or fail on mixed
                # dtypes): cast the operands as autocast casts a matmul's.
                dtype = compute_dtype(x)
                x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
            if self.use_grouped_mm:
                return _grouped_swiglu(x, w1, w2, w3, num_tokens_per_expert, self.float8_grouped_mm)
            return _looped_swiglu(x, w1, w2, w3, num_tokens_per_expert)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        return {"w1": TruncNormal(0.02), "w2": TruncNormal(init_std), "w3": TruncNormal(init_std)}


def _autocast_on(x: torch.Tensor) -> bool:
    """autocast is enabled for x's device (devices without autocast, such as meta, never are)."""
    device = x.device.type
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` computes in: autocast's when it is on for x's device, else x's."""
    return torch.get_autocast_dtype(x.device.type) if _autocast_on(x) else x.dtype


def _grouped_swiglu(x, w1, w2, w3, counts, float8_mm=None) -> torch.Tensor:
    """One grouped GEMM per projection; no host-device synchronisation. `float8_mm`, when set,
    runs them in float8; else bf16 runs torch's ``_grouped_mm`` (which the compiler lowers to its
    kernels) and other dtypes run it through the ``torchmoe::grouped_mm`` custom op, which the
    compiler can trace (see `moe_ops`)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,) end row of each expert
    native = x.dtype == torch.bfloat16

    def mm(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if float8_mm is not None:
            return float8_mm(rows, w, offsets)
        return private.grouped_mm(rows, w.transpose(-2, -1), offsets) if native else grouped_mm(rows, w, offsets)

    h = F.silu(mm(x, w1)) * mm(x, w3)  # (rows, hidden)
    return mm(h, w2)  # (rows, dim)


def _looped_swiglu(x, w1, w2, w3, counts) -> torch.Tensor:
    """Reference path: a Python loop over experts (``tolist`` syncs; fine for a reference)."""
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start : start + n]
        h = F.silu(rows @ w1[e].T) * (rows @ w3[e].T)
        out[start : start + n] = h @ w2[e].T
        start += n
    return out
