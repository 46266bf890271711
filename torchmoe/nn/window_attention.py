"""A span of causal queries over its keys, after a prefix of earlier keys and within a sliding
window, by the fused kernels of `nn.attention_kernels` (no mask tensor): the one primitive that
gpt-oss's attention (`nn.sink_attention`) and the segments of document masking
(`nn.segment_attention`) run, whole rows or context parallelism's pieces alike.

    python -m pytest -q tests/unit/test_sink_attention.py tests/unit/test_segment_attention.py

The span: n queries at the last n of m + n keys (the first m a prefix), aligned bottom right as
FlashAttention-2 aligns them: query i sits at key m + i and sees the keys from ``m + i - W + 1``
(W the window; none: from 0) to ``m + i``. Without a window that is a prefix block seen entirely
and a causal block, merged by their log-sum-exps (`attention_kernels.prefixed_block_forward`).

**Sliding window W.** The queries are cut into blocks of W; block j's queries see their own
block causally, and the keys of block j - 1 after their own offset (query i sees previous-block
offsets ``i + 1 .. W - 1``: a strictly upper triangle). Reversing both the queries ``0 .. W - 2``
and the keys ``1 .. W - 1`` of that band makes it a causal square of side W - 1, which the kernels
take as it is. So a windowed span is two causal kernel calls over blocks folded into the batch,
merged: work and memory linear in the length. A length that is not a multiple of W is padded with
zeros at the end (later positions, which no real query sees). A prefix is at most W - 1 keys that
any query sees (earlier ones are dropped): the span runs as m zero queries before its own, whose
rows are dropped (their gradient is zero, so they add nothing to the backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchmoe.nn.attention_kernels import (
    accumulation_dtype,
    block_backward,
    block_forward,
    prefixed_block_backward,
    prefixed_block_forward,
)

__all__ = ["span_backward", "span_forward"]


def _binding(window: int, m: int, n: int) -> int:
    """The window as the span applies it: 0 (none) when it is 0 or no query's keys exceed it."""
    return window if 0 < window < m + n else 0


def span_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The span's attention (module docstring).

    Args:
        q: (B, H, n, hd); k, v: (B, Hkv, m + n, hd), the prefix's keys first.
        window: W (0: none).
    Returns:
        (out (B, H, n, hd), lse (B, H, n) contiguous), both in the accumulation dtype.
    """
    acc, n = accumulation_dtype(q), q.shape[-2]
    m = k.shape[-2] - n
    width = _binding(window, m, n)
    if width:
        drop = max(0, m - (width - 1))  # prefix keys no query sees
        k, v = k[..., drop:, :], v[..., drop:, :]
        m -= drop
        out, lse = _windowed_forward(_front_padded(q, m), k, v, width)
        return out[..., m:, :], lse[..., m:].contiguous()
    if m:
        out = torch.empty(q.shape, dtype=acc, device=q.device)
        lse = prefixed_block_forward(q, k[..., :m, :], v[..., :m, :], k[..., m:, :], v[..., m:, :], out)
        return out, lse
    out, lse = block_forward(q, k, v, causal=True)
    return out.to(acc), lse


def span_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `span_forward`'s inputs (in their dtypes) for the output gradient `grad`,
    from the whole `out` and `lse` of the softmax they are part of (with sinks merged, say): each
    kernel's backward recomputes the probabilities from `lse`."""
    n = q.shape[-2]
    m = k.shape[-2] - n
    width = _binding(window, m, n)
    if width:
        drop = max(0, m - (width - 1))
        m -= drop
        padded = [_front_padded(t, m) for t in (grad, q, out)]
        dq, dk, dv = _windowed_backward(*padded[:2], k[..., drop:, :], v[..., drop:, :], padded[2],
                                        F.pad(lse, (m, 0)), width)
        if drop:  # the keys no query saw take no gradient
            dk, dv = (F.pad(t, (0, 0, drop, 0)) for t in (dk, dv))
        return dq[..., m:, :], dk, dv
    if m:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk_p, dv_p, dk_d, dv_d = prefixed_block_backward(grad, q, k[..., :m, :], v[..., :m, :], k[..., m:, :],
                                                         v[..., m:, :], out, lse, dq)
        return dq, torch.cat([dk_p, dk_d], dim=-2), torch.cat([dv_p, dv_d], dim=-2)
    return block_backward(grad, q, k, v, out, lse, causal=True)


def _front_padded(t: torch.Tensor, m: int) -> torch.Tensor:
    """(..., n, hd) with m zero rows before its own (itself when m = 0)."""
    return F.pad(t, (0, 0, m, 0)) if m else t


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
