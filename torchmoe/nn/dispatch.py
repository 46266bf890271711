"""Token dispatch of an MoE layer on one rank: the routed copies of each token sorted expert-major,
run through the experts, and summed back per token, in three phases.

    python -m pytest -q tests/unit/test_moe.py

Expert parallelism (`torchmoe.distributed.expert_parallel`) subclasses `TokenDispatcher` to
exchange rows with the ranks owning the experts between the phases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchmoe.nn.experts import compute_dtype

__all__ = ["Routed", "TokenDispatcher", "copies_per_expert", "pad_expert_blocks"]

# On CUDA, grouped GEMM kernels want every expert's row block to start at a multiple of 16 rows
# (bf16 tensor-core tiles), and float8 grouped GEMMs need it on any device; else no padding.
_GROUP_ALIGN = 16


@dataclass
class Routed:
    """A micro-batch's routed copies between the phases of a `TokenDispatcher`.

    Attributes:
        token_of: (R,) source token of each copy; the copies are sorted expert-major. R = T*k,
            or under expert parallelism with padding the data's copies only.
        gates: (R, 1) fp32 gate value of each copy.
        gate_outputs: the gates scale the experts' outputs (``score_before_experts`` off); else
            they scaled the rows before the experts.
        num_tokens: T.
        rows: (R, dim) in the compute dtype: the copies after `dispatch`, their experts'
            outputs after `run_experts` (expert parallelism leaves the copies there: the
            outputs arrive through `exchange`).
        counts: (E,) int64 copies per expert.
        exchange: the dispatcher's state between phases (expert parallelism: the all-to-all
            under way), or None.
    """

    token_of: torch.Tensor
    gates: torch.Tensor
    gate_outputs: bool
    num_tokens: int
    rows: torch.Tensor
    counts: torch.Tensor
    exchange: object | None = None


def copies_per_expert(selected: torch.Tensor, num_experts: int, real: torch.Tensor | None = None) -> torch.Tensor:
    """(E,) int64 routed copies per expert of `selected` ((T, k) expert ids); with `real` ((T,)
    bool) of the tokens where it is True only. scatter_add rather than bincount: bincount sizes
    its output from the data (a host sync)."""
    flat = selected.reshape(-1)  # (T*k,) token-major
    ones = torch.ones_like(flat) if real is None else real.repeat_interleave(selected.shape[-1]).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=selected.device).scatter_add_(0, flat, ones)


class TokenDispatcher:
    """Single-rank dispatch in three phases: `dispatch` sorts the routed copies expert-major,
    `run_experts` runs the experts on them, `combine` sums each token's gated outputs.

    Expert parallelism subclasses this to exchange rows with the ranks owning the experts: it
    launches the exchange at the end of one phase and waits for it at the start of the next, so
    what the caller runs between phases overlaps the exchange. Everything here is index
    arithmetic on device: no host sync.
    """

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts = num_experts
        self.top_k = top_k

    def dispatch(self, tokens: torch.Tensor, top_scores: torch.Tensor, selected: torch.Tensor,
                 counts: torch.Tensor, score_before_experts: bool, real: torch.Tensor | None = None) -> Routed:
        """Sort each token's top-k copies expert-major and cast them to the compute dtype.

        Args:
            tokens: (T, dim); top_scores, selected: (T, k); counts: (E,) int64 routed copies per
                expert (every token's).
            real: (T,) bool, False where the token is padding, whose output no loss reads (it
                ends its row: no data attends to it), so it needs no expert; None: every token
                is data. On one rank padding is routed as any token all the same: the shapes
                stay static (T * k rows), with no host read, and under MoE TP every rank routes
                the whole sequence alike; expert parallelism leaves it out of the all-to-all.
        """
        flat_expert = selected.reshape(-1)  # (T*k,) expert of each routed copy
        order = torch.argsort(flat_expert, stable=True)  # routed copies sorted expert-major
        token_of = order // self.top_k  # (T*k,) source token of each sorted row
        rows = tokens[token_of]  # (T*k, dim)
        gates = top_scores.reshape(-1)[order].unsqueeze(-1)  # (T*k, 1) fp32
        # The experts compute in `dtype`; under autocast the tokens are the fp32 residual stream,
        # so rows are cast before they travel (EP's all-to-all moves half the bytes in bf16).
        dtype = compute_dtype(tokens)
        rows = (rows.float() * gates).to(dtype) if score_before_experts else rows.to(dtype)
        return Routed(token_of, gates, not score_before_experts, tokens.shape[0], rows, counts)

    def run_experts(self, routed: Routed, experts: nn.Module) -> None:
        """Replace ``routed.rows`` by their experts' outputs."""
        routed.rows = self.run_local_experts(routed.rows, routed.counts, experts)

    def combine(self, routed: Routed) -> torch.Tensor:
        """Each token's gate-weighted sum of its top-k expert outputs: (T, dim)."""
        return self._weighted_sum(routed, routed.rows)

    @staticmethod
    def _weighted_sum(routed: Routed, out: torch.Tensor) -> torch.Tensor:
        """out: (T*k, dim) expert outputs in the copies' order -> (T, dim)."""
        if routed.gate_outputs:
            out = (out.float() * routed.gates).to(out.dtype)
        result = torch.zeros(routed.num_tokens, out.shape[1], dtype=out.dtype, device=out.device)
        return result.index_add_(0, routed.token_of, out)

    def run_local_experts(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """Run this rank's experts on rows sorted by local expert, padding expert blocks to the
        kernel's alignment on CUDA and for float8. rows: (R, dim), counts: (local experts,) -> (R, dim)."""
        align = _GROUP_ALIGN if rows.is_cuda or experts.float8_grouped_mm is not None else 1
        padded_rows, positions, padded_counts = pad_expert_blocks(rows, counts, align)
        out = experts(padded_rows, padded_counts)
        return out[positions] if positions is not None else out


def pad_expert_blocks(rows: torch.Tensor, counts: torch.Tensor, align: int):
    """Place each expert's block of rows at an offset that is a multiple of `align` (CUDA grouped
    GEMM kernels want 16-row-aligned groups).

    Args:
        rows: (R, dim) sorted by expert; counts: (E,) rows per expert.
    Returns:
        The padded rows (R + E * (align - 1), rounded up to a multiple of `align`; dim) — a
        static size, so no host sync — with zero rows in the gaps and at the end; the index (R,)
        of each original row in them (None when align is 1, the rows are then returned as they
        are); and the per-expert counts including padding.
    """
    if align == 1:
        return rows, None, counts
    padded = (counts + align - 1) // align * align  # (E,)
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_expert = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts,
                                            output_size=rows.shape[0])
    rank_in_expert = torch.arange(rows.shape[0], device=rows.device) - start[sorted_expert]
    positions = padded_start[sorted_expert] + rank_in_expert  # (R,)
    # The row count is a multiple of `align` too: float8's weight gradient multiplies the rows'
    # transpose, whose row stride (the row count, one byte an element) the kernel wants in
    # 16-byte steps (CUDA's `_scaled_grouped_mm`: "strides should be multiple of 16 bytes").
    total = -(-(rows.shape[0] + counts.numel() * (align - 1)) // align) * align
    buffer = rows.new_zeros(total, rows.shape[1])
    buffer[positions] = rows
    return buffer, positions, padded
