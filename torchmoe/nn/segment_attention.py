"""Causal attention over packed segments given by cumulative lengths: torch's public varlen kernel
where flash runs, the same interface and contract on the host everywhere else; with gpt-oss's
sliding window and sinks inside each segment.

    python -m pytest -q tests/unit/test_segment_attention.py

The interface is `torch.nn.attention.varlen.varlen_attn`'s:

    q (Tq, H, hd), k, v (Tk, Hkv, hd)   every segment's queries and keys, packed along dim 0
    cu_q, cu_k (N + 1,) int32            cumulative offsets: segment i holds the queries
                                         q[cu_q[i]:cu_q[i+1]] and the keys k[cu_k[i]:cu_k[i+1]]

Causal, aligned bottom right (FlashAttention-2's rule): a segment's last query sees every key of
its segment; with more keys than queries, the first ``keys - queries`` keys are a prefix that
every query of the segment sees (context parallelism's keys from earlier pieces). Segments may
be empty (padding, the unused keys between two rows' spans). A sliding window W (varlen's
``window_size = (W - 1, 0)``) counts within the segment: a query sees its own key and the W - 1
before it in its segment. Sinks (H,) join every segment's softmax, each its own
(`sink_attention.join_sinks`): a segment is a document, attended as if alone.

Kernels (`attention_kernel.choose`): on flash, ``varlen_attn`` for the whole batch, its
cumulative lengths read on the device (the host reads nothing): its own autograd without sinks;
with sinks, its forward and log-sum-exp, the sinks joined, and flash's varlen backward given the
joined output and log-sum-exp (`_torch_private.flash_varlen_attention_backward`: varlen's own
autograd drops a log-sum-exp gradient). Elsewhere (the CPU, fp32 on CUDA, the math definition)
the `torchmoe::segment_attention` operator runs each segment through
`window_attention.span_forward` (the fused block kernels), reading the host copies of the
cumulative lengths, which the caller built on the host: no device value is read. Its
log-sum-exp has varlen's layout, (H, Tq) contiguous, and each segment's share goes to the
kernels as a contiguous (1, H, n) copy (`attention_kernels.require_layout`): the CPU suite runs
the layouts CUDA reads.
"""

from __future__ import annotations

import torch
from torch.nn.attention.varlen import AuxRequest, varlen_attn

from torchmoe import _torch_private as private
from torchmoe.nn.attention_kernel_choice import FLASH
from torchmoe.nn.attention_kernels import CALLS, accumulation_dtype, kernel_for, require_layout
from torchmoe.nn.sink_attention import join_sinks, sink_gradient
from torchmoe.nn.window_attention import span_backward, span_forward

__all__ = ["SEGMENT_ATTENTION", "packed", "packed_with_prefix", "segment_attention"]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      host_cu_q: torch.Tensor, host_cu_k: torch.Tensor, *, max_q: int, max_k: int,
                      window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each segment (module docstring).

    Args:
        q: (Tq, H, hd); k, v: (Tk, Hkv, hd), the head dim contiguous.
        cu_q, cu_k: (N + 1,) int32 on q's device; host_cu_q, host_cu_k: the same values on the CPU.
        max_q, max_k: bounds on a segment's queries and keys (the kernel's grid).
        window: W, a sliding window within each segment (None: none).
        sinks: (H,) sink logits joined to each segment's softmax (None: none).
    Returns:
        (Tq, H, hd).
    """
    require_layout(q=q, k=k, v=v)
    for name, cu, device in (("cu_q", cu_q, q.device), ("cu_k", cu_k, q.device),
                             ("host_cu_q", host_cu_q, torch.device("cpu")), ("host_cu_k", host_cu_k, torch.device("cpu"))):
        if cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous() or cu.device.type != device.type:
            raise ValueError(f"segment_attention: {name} must be a contiguous 1-D int32 tensor on {device.type}, "
                             f"got {cu.dtype} {tuple(cu.shape)} on {cu.device}")
    width = window or 0
    if kernel_for(q) == FLASH and sinks is None:
        CALLS["flash_varlen"] += 1
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(width - 1, 0), enable_gqa=True)
    return torch.ops.torchmoe.segment_attention(q, k, v, cu_q, cu_k, host_cu_q, host_cu_k, sinks, width, max_q,
                                                max_k)[0]


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


# ---- the operator -------------------------------------------------------------------------------


def _spans(host_cu_q: torch.Tensor, host_cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(first query, end, first key, end) of every non-empty segment, from the host tables."""
    if host_cu_q.device.type != "cpu" or host_cu_k.device.type != "cpu":
        raise ValueError("segment_attention: the segment tables must be host tensors (reading a device one would "
                         "synchronise the host with the device in every layer)")
    qs, ks = host_cu_q.tolist(), host_cu_k.tolist()
    spans = [(qa, qb, ka, kb) for qa, qb, ka, kb in zip(qs, qs[1:], ks, ks[1:]) if qb > qa]
    for qa, qb, ka, kb in spans:
        if kb - ka < qb - qa:
            raise ValueError(f"segment_attention: segment of queries [{qa}, {qb}) has fewer keys [{ka}, {kb})")
    return spans


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """A segment's (n, H, hd) rows as the kernels' (1, H, n, hd): a view, head dim contiguous."""
    return t.transpose(0, 1).unsqueeze(0)


def host_segments_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, host_cu_q: torch.Tensor,
                          host_cu_k: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (Tq, H, hd), lse (H, Tq)), both in the accumulation dtype, of the segments' attention
    without sinks: each segment's `span_forward`, from the host tables (what ``varlen_attn`` returns
    on flash)."""
    out = torch.zeros(q.shape, dtype=accumulation_dtype(q), device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=out.dtype, device=q.device)
    for qa, qb, ka, kb in _spans(host_cu_q, host_cu_k):
        o, s = span_forward(_heads_first(q[qa:qb]), _heads_first(k[ka:kb]), _heads_first(v[ka:kb]), window)
        _heads_first(out[qa:qb]).copy_(o)
        lse[:, qa:qb] = s[0]
    return out, lse


def host_segments_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, host_cu_q: torch.Tensor, host_cu_k: torch.Tensor,
                           window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the segments' attention for the output gradient `grad` (Tq, H, hd), from the
    whole softmax's `out` and `lse` (H, Tq) (sinks joined, where they are), segment by segment."""
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for qa, qb, ka, kb in _spans(host_cu_q, host_cu_k):
        gs, qs, os = (_heads_first(t[qa:qb]) for t in (grad, q, out))
        # The kernels read the log-sum-exp as a contiguous (B, H, n): a copy of the segment's columns.
        ls = lse[:, qa:qb].contiguous().unsqueeze(0)
        grads = span_backward(gs, qs, _heads_first(k[ka:kb]), _heads_first(v[ka:kb]), os, ls, window)
        for target, g in zip((dq[qa:qb], dk[ka:kb], dv[ka:kb]), grads):
            _heads_first(target).copy_(g)
    return dq, dk, dv


@torch.library.custom_op("torchmoe::segment_attention", mutates_args=())
def _segment_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     host_cu_q: torch.Tensor, host_cu_k: torch.Tensor, sinks: torch.Tensor | None, window: int,
                     max_q: int, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (Tq, H, hd) in q's dtype, lse (H, Tq) in the accumulation dtype, the sinks joined) of
    `segment_attention`: varlen's forward on flash, else the host tables' segments."""
    if kernel_for(q) == FLASH:
        CALLS["flash_varlen"] += 1
        out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True),
                               window_size=(window - 1, 0), enable_gqa=True)
        out, lse = out.to(accumulation_dtype(q)), lse.to(accumulation_dtype(q))
    else:
        out, lse = host_segments_forward(q, k, v, host_cu_q, host_cu_k, window)
    if sinks is not None:  # in (Tq, H) rows: the sink of each query's head
        out, joined = join_sinks(out, lse.t(), sinks.view(1, -1))
        lse = joined.t()
    return out.to(q.dtype).contiguous(), lse.contiguous()


@_segment_forward.register_fake
def _(q, k, v, cu_q, cu_k, host_cu_q, host_cu_k, sinks, window, max_q, max_k):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=accumulation_dtype(q)))


@torch.library.custom_op("torchmoe::segment_attention_backward", mutates_args=())
def _segment_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, host_cu_q: torch.Tensor,
                      host_cu_k: torch.Tensor, sinks: torch.Tensor | None, window: int, max_q: int,
                      max_k: int) -> list[torch.Tensor]:
    """[dq, dk, dv] of `segment_attention` for the output gradient `grad` (Tq, H, hd), from the
    forward's `out` and `lse`, and dsinks (H,) after them when there are sinks."""
    if kernel_for(q) == FLASH:
        CALLS["flash_varlen"] += 1
        dq, dk, dv = private.flash_varlen_attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                              window - 1)
    else:
        dq, dk, dv = host_segments_backward(grad, q, k, v, out, lse, host_cu_q, host_cu_k, window)
    grads = [dq.contiguous(), dk.contiguous(), dv.contiguous()]
    if sinks is not None:
        grads.append(sink_gradient(grad, out, lse.t(), sinks.view(1, -1), (0,)).to(sinks.dtype))
    return grads


@_segment_backward.register_fake
def _(grad, q, k, v, out, lse, cu_q, cu_k, host_cu_q, host_cu_k, sinks, window, max_q, max_k):
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    return grads + ([torch.empty_like(sinks)] if sinks is not None else [])


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, host_cu_q, host_cu_k, sinks, window, max_q, max_k = inputs
    out, lse = output
    ctx.window, ctx.max_q, ctx.max_k, ctx.sinks = window, max_q, max_k, sinks is not None
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, host_cu_q, host_cu_k, sinks)


def _backward(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
    # The log-sum-exp is an output for the backward's sake only: nothing differentiates it.
    q, k, v, out, lse, cu_q, cu_k, host_cu_q, host_cu_k, sinks = ctx.saved_tensors
    dq, dk, dv, *dsinks = torch.ops.torchmoe.segment_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, host_cu_q, host_cu_k, sinks, ctx.window, ctx.max_q,
        ctx.max_k)
    return dq, dk, dv, None, None, None, None, dsinks[0] if dsinks else None, None, None, None


_segment_forward.register_autograd(_backward, setup_context=_setup_context)
# The operator as dispatch modes see it (selective activation checkpointing's policy saves it).
SEGMENT_ATTENTION = torch.ops.torchmoe.segment_attention.default
