"""gpt-oss's attention: causal, or over a sliding window, with a learned sink logit per head, by the
fused kernels of `nn.attention_kernels`, never a mask tensor.

    python -m pytest -q tests/unit/test_sink_attention.py

**Sinks.** Each head h has a logit s_h that joins every query's softmax as one more key whose
value is zero: it takes a share of the probability and gives nothing back. With the kernels'
log-sum-exp ``L`` of the real scores, the sink is one more block to merge (as
`nn.attention` merges a prefix block):

    L' = logaddexp(L, s_h),   out' = exp(L - L') * out.

The backward is each kernel's own with ``out'`` and ``L'``: a kernel recomputes the probabilities
``exp(score - L')``, which are then the softmax over the keys and the sink, and ``D = rowsum(grad
* out')`` is the true output's, so dq, dk, dv are exact. The sink's gradient is
``-sum over queries of exp(s_h - L') * D`` (its probability times the zero value, less D).
`join_sinks` and `sink_gradient` are those two formulas, shared with document masking's segments
(`nn.segment_attention`), where each document's softmax takes the sink alone.

**Sliding window W** (a query at t sees the keys in ``(t - W, t]``): two causal kernel calls over
blocks of W, merged (`nn.window_attention`). Under context parallelism a piece's queries see the
keys before it as a prefix (``k``, ``v`` longer than ``q``), at most W - 1 of them on a windowed
layer.

The op is one custom operator (`SINK_ATTENTION`): torch.compile and selective activation
checkpointing see one node.
"""

from __future__ import annotations

import torch

from torchmoe.nn.attention_kernels import accumulation_dtype, heads_inner
from torchmoe.nn.window_attention import span_backward, span_forward

__all__ = ["SINK_ATTENTION", "cached_sink_attention", "join_sinks", "no_sinks", "sink_attention", "sink_gradient"]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                   window: int | None) -> torch.Tensor:
    """Causal attention with per-head sinks, within a sliding window when `window` is set.

    Args:
        q: (B, H, n, hd) queries at positions m .. m + n - 1; k, v: (B, Hkv, m + n, hd), the keys
            at positions 0 .. m + n - 1 (m = 0 for whole rows; under context parallelism the
            prefix a piece's queries see).
        sinks: (H,) the heads' sink logits, or None (no sink).
        window: W: a query sees the W latest keys (its own included); None: every earlier key.
    Returns:
        (B, H, n, hd) in q's dtype.
    """
    sinks = no_sinks(q) if sinks is None else sinks
    return torch.ops.torchmoe.sink_attention(q, k, v, sinks, window or 0)[0]


def no_sinks(q: torch.Tensor) -> torch.Tensor:
    """(H,) sink logits of -inf for the heads of q ((B, H, n, hd), or packed (T, H, hd)): exp(-inf)
    = 0, no share of the softmax and no gradient (attention without sinks through the same operator)."""
    return torch.full((q.shape[1],), float("-inf"), dtype=accumulation_dtype(q), device=q.device)


def join_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over the keys joined by the sinks: (out * exp(L - L'), L'), L' = logaddexp(L, s).

    Args:
        out: the keys' attention, its rows shaped as `lse` then the head dim, in the accumulation
            dtype.
        lse: the keys' log-sum-exp L, in the accumulation dtype.
        sinks: the sink logits, broadcastable to `lse`.
    """
    merged = torch.logaddexp(lse, sinks.to(lse.dtype))
    return torch.exp(lse - merged).unsqueeze(-1) * out, merged


def sink_gradient(grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                  dims: tuple[int, ...]) -> torch.Tensor:
    """The sinks' gradient ``-sum exp(s - L') * rowsum(grad * out')`` over `dims` of `lse`, from the
    joined `out` and `lse` (`join_sinks`); `sinks` broadcastable to `lse`."""
    acc = lse.dtype
    rowsum = (grad.to(acc) * out.to(acc)).sum(-1)  # D, the kernels' own
    return -(torch.exp(sinks.to(acc) - lse) * rowsum).sum(dims)


def cached_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                          window: int | None) -> torch.Tensor:
    """Decoding's attention after the prompt: the n last queries over every cached key by the math
    definition (a few queries a step, an (n x m) score matrix; no backward). q: (B, H, n, hd) at
    the last n of the m positions of k, v (B, Hkv, m, hd) -> (B, H, n, hd)."""
    acc = accumulation_dtype(q)
    n, m = q.shape[-2], k.shape[-2]
    heads = q.shape[1]
    keys = k.repeat_interleave(heads // k.shape[1], dim=1).to(acc)
    values = v.repeat_interleave(heads // v.shape[1], dim=1).to(acc)
    scores = q.to(acc) @ keys.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, n, m)
    query_pos = torch.arange(m - n, m, device=q.device).unsqueeze(-1)
    key_pos = torch.arange(m, device=q.device)
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :m]
    return (probs @ values).to(q.dtype)


# ---- the custom operator -----------------------------------------------------------------------


@torch.library.custom_op("torchmoe::sink_attention", mutates_args=())
def _sink_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, n, hd) in q's dtype, lse (B, H, n) with the sinks merged, in the accumulation
    dtype): `sink_attention` with `window` 0 for plain causal attention."""
    out, lse = join_sinks(*span_forward(q, k, v, window), sinks.view(1, -1, 1))
    # The output in (B, S, H, hd) memory order, as the fake kernel promises (the output
    # projection's input is then a free view of it), and the log-sum-exp contiguous, as CUDA's
    # kernels read it.
    return heads_inner(out.to(q.dtype)), lse.contiguous()


@_sink_forward.register_fake
def _(q, k, v, sinks, window):
    b, h, s, hd = q.shape
    return q.new_empty(b, s, h, hd).transpose(1, 2), q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q))


@torch.library.custom_op("torchmoe::sink_attention_backward", mutates_args=())
def _sink_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Gradients [dq, dk, dv, dsinks] of `sink_attention` for the output gradient `grad`."""
    dsinks = sink_gradient(grad, out, lse, sinks.view(1, -1, 1), (0, 2))
    dq, dk, dv = span_backward(grad, q, k, v, out, lse, window)
    return [dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks.to(sinks.dtype)]


@_sink_backward.register_fake
def _(grad, q, k, v, sinks, out, lse, window):
    return [*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)), torch.empty_like(sinks)]


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, sinks, window = inputs
    out, lse = output
    ctx.window = window
    ctx.save_for_backward(q, k, v, sinks, out, lse)


def _backward(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
    # The log-sum-exp is an output for the backward's sake only: nothing differentiates it.
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.torchmoe.sink_attention_backward(grad_out.contiguous(), q, k, v, sinks, out, lse,
                                                                    ctx.window)
    return dq, dk, dv, dsinks, None


_sink_forward.register_autograd(_backward, setup_context=_setup_context)
# The operator as dispatch modes see it (selective activation checkpointing's policy saves it).
SINK_ATTENTION = torch.ops.torchmoe.sink_attention.default
