"""Causal attention over packed segments given by cumulative lengths: torch's public varlen kernel
where flash runs, the same interface and contract on the host everywhere else.

    python -m pytest -q tests/unit/test_segment_attention.py

The interface is `torch.nn.attention.varlen.varlen_attn`'s:

    q (Tq, H, hd), k, v (Tk, Hkv, hd)   every segment's queries and keys, packed along dim 0
    cu_q, cu_k (N + 1,) int32            cumulative offsets: segment i holds the queries
                                         q[cu_q[i]:cu_q[i+1]] and the keys k[cu_k[i]:cu_k[i+1]]

Causal, aligned bottom right (FlashAttention-2's rule): a segment's last query sees every key of
its segment; with more keys than queries, the first ``keys - queries`` keys are a prefix that
every query of the segment sees (context parallelism's keys from earlier pieces). Segments may
be empty (padding, the unused keys between two rows' spans).

Kernels (`attention_kernel.choose`): on flash, one ``varlen_attn`` call for the whole batch, its
cumulative lengths read on the device (the host reads nothing). Elsewhere (the CPU, fp32 on
CUDA, the math definition) the `torchmoe::segment_attention` operator runs each segment through
`attention_kernels.block_forward` (a prefixed segment as a prefix block and a causal block merged
by their log-sum-exp), reading the host copies of the cumulative lengths, which the caller built
on the host: no device value is read. Its log-sum-exp has varlen's layout, (H, Tq) contiguous,
and each segment's share goes to the kernels as a contiguous (1, H, n) copy
(`attention_kernels.require_layout`): the CPU suite runs the layouts CUDA reads.
"""

from __future__ import annotations

import torch
from torch.nn.attention.varlen import varlen_attn

from torchmoe.nn.attention_kernel_choice import FLASH
from torchmoe.nn.attention_kernels import (
    CALLS,
    accumulation_dtype,
    block_backward,
    block_forward,
    kernel_for,
    prefixed_block_backward,
    prefixed_block_forward,
    require_layout,
)

__all__ = ["SEGMENT_ATTENTION", "packed", "packed_with_prefix", "segment_attention"]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      host_cu_q: torch.Tensor, host_cu_k: torch.Tensor, *, max_q: int, max_k: int) -> torch.Tensor:
    """Causal attention within each segment (module docstring).

    Args:
        q: (Tq, H, hd); k, v: (Tk, Hkv, hd), the head dim contiguous.
        cu_q, cu_k: (N + 1,) int32 on q's device; host_cu_q, host_cu_k: the same values on the CPU.
        max_q, max_k: bounds on a segment's queries and keys (the kernel's grid).
    Returns:
        (Tq, H, hd).
    """
    require_layout(q=q, k=k, v=v)
    for name, cu, device in (("cu_q", cu_q, q.device), ("cu_k", cu_k, q.device),
                             ("host_cu_q", host_cu_q, torch.device("cpu")), ("host_cu_k", host_cu_k, torch.device("cpu"))):
        if cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous() or cu.device.type != device.type:
            raise ValueError(f"segment_attention: {name} must be a contiguous 1-D int32 tensor on {device.type}, "
                             f"got {cu.dtype} {tuple(cu.shape)} on {cu.device}")
    if kernel_for(q) == FLASH:
        CALLS["flash_varlen"] += 1
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), enable_gqa=True)
    return torch.ops.torchmoe.segment_attention(q, k, v, host_cu_q, host_cu_k)[0]


def packed(t: torch.Tensor) -> torch.Tensor:
    """(B, H, S, hd) -> (B * S, H, hd): rows packed for `segment_attention`. A view of the model's
    transposed projections ((B, S, H, hd) underneath), a copy otherwise."""
    b, h, s, hd = t.shape
    return t.transpose(1, 2).reshape(b * s, h, hd)


def packed_with_prefix(prefix: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, m, hd) and (B, Hkv, n, hd) -> (B * (m + n), Hkv, hd): each row's prefix then its own
    keys, packed (one copy: the concatenation, laid out as `packed` wants it)."""
    b, heads, _, hd = own.shape
    return torch.cat([prefix.transpose(1, 2), own.transpose(1, 2)], dim=1).view(-1, heads, hd)


# ---- the host operator -------------------------------------------------------------------------


def _spans(host_cu_q: torch.Tensor, host_cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(first query, end, first key, end) of every non-empty segment, from the host tables."""
    if host_cu_q.device.type != "cpu" or host_cu_k.device.type != "cpu":
        raise ValueError("segment_attention: the segment tables must be host tensors (reading a device one would "
                         "synchronise the host with the device in every layer)")
    qs, ks = host_cu_q.tolist(), host_cu_k.tolist()
    return [(qa, qb, ka, kb) for qa, qb, ka, kb in zip(qs, qs[1:], ks, ks[1:]) if qb > qa]


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """A segment's (n, H, hd) rows as the kernels' (1, H, n, hd): a view, head dim contiguous."""
    return t.transpose(0, 1).unsqueeze(0)


@torch.library.custom_op("torchmoe::segment_attention", mutates_args=())
def _segment_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (Tq, H, hd), lse (H, Tq) in the accumulation dtype) of `segment_attention`, segment by
    segment from the host tables `cu_q`, `cu_k`."""
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=accumulation_dtype(q), device=q.device)
    for qa, qb, ka, kb in _spans(cu_q, cu_k):
        m = (kb - ka) - (qb - qa)  # the segment's prefix keys
        if m < 0:
            raise ValueError(f"segment_attention: segment of queries [{qa}, {qb}) has fewer keys [{ka}, {kb})")
        qs, os = _heads_first(q[qa:qb]), _heads_first(out[qa:qb])
        ks, vs = _heads_first(k[ka:kb]), _heads_first(v[ka:kb])
        if m:
            s = prefixed_block_forward(qs, ks[..., :m, :], vs[..., :m, :], ks[..., m:, :], vs[..., m:, :], os)
        else:
            o, s = block_forward(qs, ks, vs, causal=True)
            os.copy_(o)
        lse[:, qa:qb] = s[0]
    return out, lse


@_segment_forward.register_fake
def _(q, k, v, cu_q, cu_k):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=accumulation_dtype(q)))


@torch.library.custom_op("torchmoe::segment_attention_backward", mutates_args=())
def _segment_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[torch.Tensor]:
    """[dq, dk, dv] of `segment_attention` for the output gradient `grad` (Tq, H, hd), segment by
    segment from the forward's `out` and `lse`."""
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for qa, qb, ka, kb in _spans(cu_q, cu_k):
        m = (kb - ka) - (qb - qa)
        gs, qs, os = (_heads_first(t[qa:qb]) for t in (grad, q, out))
        ks, vs = _heads_first(k[ka:kb]), _heads_first(v[ka:kb])
        # The kernels read the log-sum-exp as a contiguous (B, H, n): a copy of the segment's columns.
        ls = lse[:, qa:qb].contiguous().unsqueeze(0)
        dqs, dks, dvs = _heads_first(dq[qa:qb]), _heads_first(dk[ka:kb]), _heads_first(dv[ka:kb])
        if m:
            dk_p, dv_p, dk_d, dv_d = prefixed_block_backward(gs, qs, ks[..., :m, :], vs[..., :m, :], ks[..., m:, :],
                                                             vs[..., m:, :], os, ls, dqs)
            for target, grads in ((dks, (dk_p, dk_d)), (dvs, (dv_p, dv_d))):
                target[..., :m, :].copy_(grads[0])
                target[..., m:, :].copy_(grads[1])
        else:
            for target, g in zip((dqs, dks, dvs), block_backward(gs, qs, ks, vs, os, ls, causal=True)):
                target.copy_(g)
    return [dq, dk, dv]


@_segment_backward.register_fake
def _(grad, q, k, v, out, lse, cu_q, cu_k):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)


def _backward(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
    # The log-sum-exp is an output for the backward's sake only: nothing differentiates it.
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.torchmoe.segment_attention_backward(grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k)
    return dq, dk, dv, None, None


_segment_forward.register_autograd(_backward, setup_context=_setup_context)
# The operator as dispatch modes see it (selective activation checkpointing's policy saves it).
SEGMENT_ATTENTION = torch.ops.torchmoe.segment_attention.default
