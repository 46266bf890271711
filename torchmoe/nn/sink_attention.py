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

**Sliding window W** (a query at t sees the keys in ``(t - W, t]``). The queries are cut into
blocks of W; block j's queries see their own block causally, and the keys of block j - 1 after
their own offset (query i sees previous-block offsets ``i + 1 .. W - 1``: a strictly upper
triangle). Reversing both the queries ``0 .. W - 2`` and the keys ``1 .. W - 1`` of that band
makes it a causal square of side W - 1, which the kernels take as it is. So a windowed layer is
two causal kernel calls over blocks folded into the batch, merged: work and memory linear in the
length. A length that is not a multiple of W is padded with zeros at the end (later positions,
which no real query sees).

The op is one custom operator (`SINK_ATTENTION`): torch.compile and selective activation
checkpointing see one node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchmoe.nn.attention_kernels import accumulation_dtype, block_backward, block_forward, heads_inner

__all__ = ["SINK_ATTENTION", "cached_sink_attention", "sink_attention"]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                   window: int | None) -> torch.Tensor:
    """Causal attention with per-head sinks, within a sliding window when `window` is set.

    Args:
        q: (B, H, S, hd); k, v: (B, Hkv, S, hd), positions 0 .. S - 1.
        sinks: (H,) the heads' sink logits, or None (no sink).
        window: W: a query sees the W latest keys (its own included); None: every earlier key.
    Returns:
        (B, H, S, hd) in q's dtype.
    """
    if sinks is None:  # exp(-inf) = 0: no share of the softmax, and no gradient
        sinks = torch.full((q.shape[1],), float("-inf"), dtype=accumulation_dtype(q), device=q.device)
    width = window if window is not None and window < q.shape[-2] else 0
    return torch.ops.torchmoe.sink_attention(q, k, v, sinks, width)[0]


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


# ---- blocks of the window --------------------------------------------------------------------


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """(..., S, hd) zero-padded to `length` positions (a view when no padding is needed)."""
    return t if t.shape[-2] == length else F.pad(t, (0, 0, 0, length - t.shape[-2]))


def _fold(t: torch.Tensor, window: int) -> torch.Tensor:
    """(B, h, S, ...) -> (B, S / W, h, W, ...): the window-long blocks of each row."""
    b, h, s, *rest = t.shape
    return t.reshape(b, h, s // window, window, *rest).transpose(1, 2)


def _unfold(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `_fold`: (B, nb, h, W, ...) -> (B, h, nb * W, ...)."""
    b, nb, h, w, *rest = t.shape
    return t.transpose(1, 2).reshape(b, h, nb * w, *rest)


def _batch(t: torch.Tensor) -> torch.Tensor:
    """(B, nb, h, W', ...) -> (B * nb, h, W', ...): blocks folded into the batch."""
    return t.reshape(-1, *t.shape[2:])


def _band_queries(t: torch.Tensor) -> torch.Tensor:
    """The band's query side, reversed: rows 0 .. W - 2 of blocks 1 .. nb - 1 -> (B * (nb - 1), h, W - 1, ...)."""
    return _batch(t[:, 1:, :, :-1].flip(3))


def _band_keys(t: torch.Tensor) -> torch.Tensor:
    """The band's key side, reversed: rows 1 .. W - 1 of blocks 0 .. nb - 2 -> (B * (nb - 1), h, W - 1, ...)."""
    return _batch(t[:, :-1, :, 1:].flip(3))


def _windowed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, S, hd), lse (B, H, S)) of sliding-window causal attention, both in the
    accumulation dtype (module docstring)."""
    acc, b, seq_len = accumulation_dtype(q), q.shape[0], q.shape[-2]
    length = -(-seq_len // window) * window
    qf, kf, vf = (_fold(_padded(t, length), window) for t in (q, k, v))  # (B, nb, h, W, hd)
    nb = qf.shape[1]
    out, lse = block_forward(_batch(qf), _batch(kf), _batch(vf), causal=True)
    out = out.to(acc).view(b, nb, *out.shape[1:])
    lse = lse.view(b, nb, *lse.shape[1:])
    if window == 1:  # a query sees its own key only: no band
        return _unfold(out)[..., :seq_len, :], _unfold(lse)[..., :seq_len]
    band_out, band_lse = block_forward(_band_queries(qf), _band_keys(kf), _band_keys(vf), causal=True)
    # Back in order, in place of rows 0 .. W - 2 of blocks 1 ..; no earlier key elsewhere.
    shape = (b, nb - 1, *band_lse.shape[1:])
    full_lse = torch.full_like(lse, float("-inf"))
    full_lse[:, 1:, :, :-1] = band_lse.view(shape).flip(3)
    full_out = torch.zeros_like(out)
    full_out[:, 1:, :, :-1] = band_out.view(*shape, -1).flip(3)
    merged = torch.logaddexp(lse, full_lse)
    out = torch.exp(lse - merged).unsqueeze(-1) * out + torch.exp(full_lse - merged).unsqueeze(-1) * full_out
    return _unfold(out)[..., :seq_len, :], _unfold(merged)[..., :seq_len]


def _windowed_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `_windowed_forward` from the whole output and log-sum-exp (sinks merged):
    each block's kernel backward, summed in the accumulation dtype."""
    acc, seq_len = accumulation_dtype(q), q.shape[-2]
    length = -(-seq_len // window) * window
    # Padded rows have a zero gradient and output: whatever their log-sum-exp, they add nothing.
    gf, qf, kf, vf, of = (_fold(_padded(t, length), window) for t in (grad, q, k, v, out))
    lf = _fold(F.pad(lse, (0, length - seq_len)).unsqueeze(-1), window).squeeze(-1)  # (B, nb, H, W)
    dq, dk, dv = block_backward(_batch(gf), _batch(qf), _batch(kf), _batch(vf), _batch(of), _batch(lf).contiguous(),
                                causal=True)
    dq, dk, dv = (t.to(acc).view(qf.shape[0], qf.shape[1], *t.shape[1:]) for t in (dq, dk, dv))
    if window == 1:
        return tuple(_unfold(t)[..., :seq_len, :].to(x.dtype) for t, x in ((dq, q), (dk, k), (dv, v)))
    band_lse = _batch(lf[:, 1:, :, :-1].flip(3)).contiguous()
    bq, bk, bv = block_backward(_band_queries(gf), _band_queries(qf), _band_keys(kf), _band_keys(vf),
                                _band_queries(of), band_lse, causal=True)
    shape = (qf.shape[0], qf.shape[1] - 1)
    dq[:, 1:, :, :-1] += bq.to(acc).view(*shape, *bq.shape[1:]).flip(3)
    dk[:, :-1, :, 1:] += bk.to(acc).view(*shape, *bk.shape[1:]).flip(3)
    dv[:, :-1, :, 1:] += bv.to(acc).view(*shape, *bv.shape[1:]).flip(3)
    return tuple(_unfold(t)[..., :seq_len, :].to(x.dtype) for t, x in ((dq, q), (dk, k), (dv, v)))


# ---- the custom operator -----------------------------------------------------------------------


@torch.library.custom_op("torchmoe::sink_attention", mutates_args=())
def _sink_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, S, hd) in q's dtype, lse (B, H, S) with the sinks merged, in the accumulation
    dtype): `sink_attention` with `window` 0 for plain causal attention."""
    acc = accumulation_dtype(q)
    if window:
        out, lse = _windowed_forward(q, k, v, window)
    else:
        out, lse = block_forward(q, k, v, causal=True)
        out = out.to(acc)
    merged = torch.logaddexp(lse, sinks.to(acc).view(1, -1, 1))
    out = torch.exp(lse - merged).unsqueeze(-1) * out
    # The output in (B, S, H, hd) memory order, as the fake kernel promises (the output
    # projection's input is then a free view of it), and the log-sum-exp contiguous, as CUDA's
    # kernels read it.
    return heads_inner(out.to(q.dtype)), merged.contiguous()


@_sink_forward.register_fake
def _(q, k, v, sinks, window):
    b, h, s, hd = q.shape
    return q.new_empty(b, s, h, hd).transpose(1, 2), q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q))


@torch.library.custom_op("torchmoe::sink_attention_backward", mutates_args=())
def _sink_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Gradients [dq, dk, dv, dsinks] of `sink_attention` for the output gradient `grad`."""
    acc = accumulation_dtype(q)
    rowsum = (grad.to(acc) * out.to(acc)).sum(-1)  # (B, H, S): D, the kernels' own
    dsinks = -(torch.exp(sinks.to(acc).view(1, -1, 1) - lse) * rowsum).sum((0, 2))
    if window:
        dq, dk, dv = _windowed_backward(grad, q, k, v, out, lse, window)
    else:
        dq, dk, dv = block_backward(grad, q, k, v, out, lse, causal=True)
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
