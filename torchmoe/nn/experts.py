"""Feed-forward building blocks of MoE layers: the SwiGLU MLP (dense layers, shared experts) and
routed experts stored as stacked weights, run by one grouped GEMM per projection: SwiGLU
(`GroupedExperts`) or gpt-oss's biased, clamped SwiGLU (`ClampedSwiGLUExperts`).

    python -m pytest -q tests/unit/test_moe.py

The per-expert loop (``use_grouped_mm = False``) is kept as the reference the grouped path is
tested against. Experts given LoRA adapters (`nn.lora.add_expert_adapters`) add each adapter to
its projection's output, by the same grouped GEMMs in high precision (never float8: the rank is
small, and the adapters are what trains). Which tokens reach which expert is the router's and the
dispatcher's (`nn.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from torchmoe import _torch_private as private
from torchmoe.nn.grouped_gemm import fits_kernel
from torchmoe.nn.init import ParamInit, TruncNormal
from torchmoe.nn.lora import ADAPTER_PREFIX, grouped_lora
from torchmoe.nn.moe_ops import grouped_mm
from torchmoe.nn.profiler_regions import region
from torchmoe.nn.shards import local_shard

__all__ = ["ClampedSwiGLUExperts", "FeedForward", "GroupedExperts", "RoutedExperts", "compute_dtype"]


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


class RoutedExperts(nn.Module):
    """What every kind of routed experts shares: ``num_experts`` experts stored as stacked
    weights ``[E, ...]`` (expert parallel shards dim 0 of every parameter), run on tokens sorted
    expert-major by one grouped GEMM per projection (or the per-expert reference loop).

    `tp_dims`: parameter name -> the dim MoE tensor parallel shards (`ExpertTensorParallel`).
    `lora_projections`: adapter name -> the weights whose rows its output covers, in order (as
    Hugging Face fuses them: one adapter on the fused gate/up projection, A shared by both).
    `lora_tp_dims`: adapter name -> the dim MoE tensor parallel shards, as its weights' hidden
    units; the other adapters are replicated, and their gradient, a partial sum over this rank's
    hidden units, is summed over the mesh (`_adapter_factor`).
    """

    tp_dims: dict[str, int] = {}
    lora_projections: dict[str, tuple[str, ...]] = {}
    lora_tp_dims: dict[str, int] = {}

    def __init__(self, num_experts: int, use_grouped_mm: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        # Set by `distributed.float8.convert_float8_experts`: (rows, w, offsets) -> rows @ w[e].T
        # per expert block, in float8.
        self.float8_grouped_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Set by `nn.lora.add_expert_adapters` (with its parameters): adapters are on.
        self.lora_scaling: float | None = None

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """Each adapter's (out, in): the rows of its weights together, and their columns."""
        return {proj: (sum(getattr(self, w).shape[1] for w in weights), getattr(self, weights[0]).shape[2])
                for proj, weights in self.lora_projections.items()}

    def _adapter(self, proj: str, x: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
        """Adapter `proj` on x (rows, in) sorted expert-major -> (rows, out), or None without adapters."""
        if self.lora_scaling is None:
            return None
        a, b = (_adapter_factor(getattr(self, f"{ADAPTER_PREFIX}{proj}_{side}")) for side in "ab")
        x, a, b = _in_compute_dtype(x, a, b)
        return grouped_lora(x, a, b, self.lora_scaling, self.lora_dropout, self._high_precision_mm, counts, offsets)

    def _mm(self, rows: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``rows @ w[e].T`` for each expert's block of rows: one grouped GEMM (float8 when
        `float8_grouped_mm` is set; torch's ``_grouped_mm`` in bf16 on operands in its layout
        contract, which the compiler lowers to its kernels; else the ``torchmoe::grouped_mm``
        custom op, which it can trace and which pads what is off the contract: any K and N in
        any dtype, `nn.grouped_gemm`), or the reference loop (``tolist`` syncs; fine for a
        reference). rows: (R, K), w: (E, N, K), offsets: (E,) int32 block ends -> (R, N); rows
        past the last block are unspecified."""
        if self.float8_grouped_mm is not None:
            return self.float8_grouped_mm(rows, w, offsets)
        return self._high_precision_mm(rows, w, counts, offsets)

    def _high_precision_mm(self, rows: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                           offsets: torch.Tensor) -> torch.Tensor:
        """`_mm` without float8: rows (R, K), w (E, N, K) -> (R, N)."""
        if not self.use_grouped_mm:
            out = rows.new_zeros(rows.shape[0], w.shape[1])
            start = 0
            for e, n in enumerate(counts.tolist()):
                out[start:start + n] = rows[start:start + n] @ w[e].T
                start += n
            return out
        if rows.dtype == torch.bfloat16 and fits_kernel(rows, w):
            return private.grouped_mm(rows, w.transpose(-2, -1), offsets)
        return grouped_mm(rows, w, offsets)


class GroupedExperts(RoutedExperts):
    """SwiGLU experts, ``w2(silu(w1 x) * w3 x)`` per expert.

    Weights follow ``nn.Linear`` (out, in) per expert: ``w1, w3: [E, hidden, dim]``,
    ``w2: [E, dim, hidden]``, so tensor parallel shards dim 1 of w1/w3 and dim 2 of w2, and expert
    parallel shards dim 0 of all three.
    """

    tp_dims = {"w1": 1, "w2": 2, "w3": 1}
    lora_projections = {"w13": ("w1", "w3"), "w2": ("w2",)}
    # The fused gate/up adapter's B rows are [w1's; w3's]: no contiguous shard matches w1's and
    # w3's, so B is replicated and each rank takes its hidden units' rows of the output
    # (rows x r x 2 hidden multiply-adds a projection, a fraction r / dim of the base's).
    lora_tp_dims = {"lora_w2_a": 2}

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool) -> None:
        super().__init__(num_experts, use_grouped_mm)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

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
            x, w1, w2, w3 = _in_compute_dtype(x, *(local_shard(w) for w in (self.w1, self.w2, self.w3)))
            counts = num_tokens_per_expert
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,) end row of each expert
            gate, up = self._mm(x, w1, counts, offsets), self._mm(x, w3, counts, offsets)  # (rows, hidden)
            if (delta := self._adapter("w13", x, counts, offsets)) is not None:  # (rows, 2 * all hidden)
                hidden, start, local = delta.shape[1] // 2, _hidden_offset(self.w1), gate.shape[1]
                gate = gate + delta[:, start:start + local]
                up = up + delta[:, hidden + start:hidden + start + local]
            h = F.silu(gate) * up
            out = self._mm(h, w2, counts, offsets)  # (rows, dim)
            delta = self._adapter("w2", h, counts, offsets)
            return out if delta is None else out + delta

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        return {"w1": TruncNormal(0.02), "w2": TruncNormal(init_std), "w3": TruncNormal(init_std)}


class ClampedSwiGLUExperts(RoutedExperts):
    """gpt-oss's experts: per expert ``w2 act(w13 x + b13) + b2`` with the clamped SwiGLU

        gate, up = (w13 x + b13)[0::2], (w13 x + b13)[1::2]      (interleaved columns)
        act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)

    Weights (Hugging Face's ``gate_up_proj`` and ``down_proj``, in ``nn.Linear`` orientation):
    ``w13: [E, 2 * hidden, dim]`` (gate and up rows interleaved), ``b13: [E, 2 * hidden]``,
    ``w2: [E, dim, hidden]``, ``b2: [E, dim]``. Tensor parallel shards w13/b13 on their rows (each
    rank's rows hold whole (gate, up) pairs: its hidden units) and w2 on its columns, so each
    rank's output is a partial sum; b2 is sharded on dim, and each rank adds its own columns of
    it (`_down_bias`): summed over the ranks, the bias is added once, and each rank's gradient of
    its columns is the whole one.
    """

    tp_dims = {"w13": 1, "b13": 1, "w2": 2, "b2": 1}
    lora_projections = {"w13": ("w13",), "w2": ("w2",)}
    lora_tp_dims = {"lora_w13_b": 1, "lora_w2_a": 2}

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool, *, limit: float,
                 alpha: float) -> None:
        super().__init__(num_experts, use_grouped_mm)
        self.limit, self.alpha = limit, alpha
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.b2 = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """As `GroupedExperts.forward`: x (rows, dim) sorted expert-major -> (rows, dim)."""
        with region("routed_experts"):
            x, w13, b13, w2, b2 = _in_compute_dtype(x, local_shard(self.w13), local_shard(self.b13),
                                                    local_shard(self.w2), self._down_bias())
            counts = num_tokens_per_expert
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            # Each row's expert, by device-side search. Rows past the last block (the dispatcher's
            # padding on CUDA and for float8) get index E, a zero bias: the GEMMs leave their
            # values and gradients unspecified (uninitialised memory), which must reach no bias.
            rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
            expert = torch.searchsorted(offsets, rows, right=True)  # (rows,) in [0, E]
            b13, b2 = F.pad(b13, (0, 0, 0, 1)), F.pad(b2, (0, 0, 0, 1))  # (E + 1, ...)
            h = self._mm(x, w13, counts, offsets) + b13[expert]  # (rows, 2 * hidden)
            if (delta := self._adapter("w13", x, counts, offsets)) is not None:
                h = h + delta
            gate, up = h[:, 0::2].clamp(max=self.limit), h[:, 1::2].clamp(-self.limit, self.limit)
            act = (up + 1) * gate * torch.sigmoid(gate * self.alpha)  # (rows, hidden)
            out = self._mm(act, w2, counts, offsets) + b2[expert]
            delta = self._adapter("w2", act, counts, offsets)
            return out if delta is None else out + delta

    def _down_bias(self) -> torch.Tensor:
        """This rank's (E_local, dim) share of b2: its own columns, zero elsewhere (all of b2 on
        one rank or under expert parallel, whose shards hold whole experts)."""
        b2 = self.b2
        if not isinstance(b2, DTensor):
            return b2
        _, offset = private.local_shape_and_offset(b2.shape, b2.device_mesh, b2.placements)
        local = b2.to_local()
        return F.pad(local, (offset[1], b2.shape[1] - offset[1] - local.shape[1]))

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        return {"w13": TruncNormal(0.02), "b13": TruncNormal(init_std), "w2": TruncNormal(init_std),
                "b2": TruncNormal(init_std)}


def _adapter_factor(p: torch.Tensor) -> torch.Tensor:
    """What this rank computes with of an expert adapter `p`: its local shard. A replicated one
    (MoE tensor parallel's A of the gate/up adapter, B of the down one) meets this rank's hidden
    units only, so its local gradient is a partial sum: marked ``Partial``, summed over the mesh."""
    if isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements):
        return p.to_local(grad_placements=[Partial()] * len(p.placements))
    return local_shard(p)


def _hidden_offset(w: torch.Tensor) -> int:
    """The first hidden unit this rank holds of expert weight `w` (E, hidden, dim)."""
    if not isinstance(w, DTensor):
        return 0
    return private.local_shape_and_offset(w.shape, w.device_mesh, w.placements)[1][1]


def _in_compute_dtype(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x and the experts' weights, cast as autocast casts a matmul's operands when it is on:
    autocast has no rule for _grouped_mm (it would run in fp32, or fail on mixed dtypes)."""
    if not _autocast_on(x):
        return (x, *weights)
    dtype = compute_dtype(x)
    return tuple(t.to(dtype) for t in (x, *weights))


def _autocast_on(x: torch.Tensor) -> bool:
    """autocast is enabled for x's device (meta, which has no autocast, never is)."""
    device = x.device.type
    # Not `torch.amp.is_autocast_available`: dynamo cannot trace it before torch 2.13 (a
    # fullgraph compile then fails), and meta is the one device type the model meets without
    # autocast (`is_autocast_enabled` raises there).
    return device != "meta" and torch.is_autocast_enabled(device)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` computes in: autocast's when it is on for x's device, else x's."""
    return torch.get_autocast_dtype(x.device.type) if _autocast_on(x) else x.dtype
