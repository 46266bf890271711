"""Document masking: attention that never crosses a document boundary inside a packed row.

    python -m pytest -q tests/unit/test_document_masking.py

A packed row holds several documents, each ended by EOS. `document_starts` gives every token the
row position where its document starts (a new one starts right after each EOS, and at the row's
first token). Positions stay global: RoPE and NoPE temperature tuning count from the row start,
as torchtitan's block-causal masking does; only what attention sees changes.

A query at position t sees the keys from its window start on, w(t) = its document's start, or
with chunks (iRoPE's chunked layers) the later of that and its chunk's start. The window start
only grows along the row, so the queries cut into segments of equal w, each a plain causal
attention over its own keys: the mask-free fused kernels of `nn.attention`, one call per
segment, never a mask tensor. Only a segment starting at the first query can have w before the
first position (context parallelism: a piece whose first document, or chunk, began in an earlier
piece): it sees those keys, a `prefix` the caller gathered, unmasked plus its own causally, merged
by log-sum-exp as `prefixed_causal_attention` does.

The segments depend on the data. `document_attention` is one custom operator (so torch.compile
traces one node with static shapes whatever the documents, and never recompiles for them; per-op
selective activation checkpointing saves it as it saves the fused kernels): its kernel reads the
boundaries on the host (on CUDA a synchronisation per layer) and loops over them. Autograd keeps
q, k, v, the prefix, the output, its fp32 log-sum-exp and the (B, n) int64 document starts.
"""

from __future__ import annotations

import torch

from torchmoe.nn.attention import (
    accumulation_dtype,
    block_backward,
    block_forward,
    prefixed_block_backward,
    prefixed_block_forward,
)

__all__ = ["DOCUMENT_ATTENTION", "document_attention", "document_starts"]


def document_starts(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, S) int64: for each token, the row position where its document starts. A document
    starts at the row's first token and right after every EOS. tokens: (B, S) int64 ids."""
    seq_len = tokens.shape[-1]
    positions = torch.arange(seq_len, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    return torch.where(starts, positions, 0).cummax(dim=-1).values


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor, *,
                       chunk: int | None = None, start: int = 0,
                       prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention within documents (and within chunks of `chunk` positions when given) of
    queries at positions ``[start, start + n)``, without a mask tensor (module docstring).

    Args:
        q: (B, H, n, hd) queries; k, v: (B, Hkv, n, hd) the keys and values at the same positions.
        documents: (B, n) int64, the global position where each query's document starts.
        chunk: chunk length (chunks start at multiples of it); None: documents only.
        start: the global position of the first query.
        prefix: (k, v), each (B, Hkv, m, hd): the keys and values at ``[start - m, start)``; it
            must reach back to every row's first window start. None: m = 0.
    Returns:
        (B, H, n, hd).
    """
    if prefix is None:
        empty = k.new_empty(*k.shape[:-2], 0, k.shape[-1])
        prefix = (empty, empty)
    return torch.ops.torchmoe.document_attention(q, *prefix, k, v, documents, start, chunk or 0)[0]


def _segments(documents: torch.Tensor, start: int, chunk: int, m: int) -> list[list[tuple[int, int, int]]]:
    """Per row, its segments as (first, end, prefix) local query indices and the prefix keys the
    first one sees (0 for every later one), read to the host in one transfer. documents: (B, n)."""
    positions = torch.arange(start, start + documents.shape[-1], device=documents.device)
    window = documents if not chunk else torch.maximum(documents, positions // chunk * chunk)
    offset = window - start  # (B, n): where each query's keys begin, relative to the first query
    cut = torch.ones_like(offset, dtype=torch.bool)
    cut[:, 1:] = offset[:, 1:] != offset[:, :-1]
    cuts, first = cut.nonzero().tolist(), offset[:, 0].tolist()
    if min(first) < -m:
        raise ValueError(f"document_attention: a window starts {-min(first)} positions before the queries, "
                         f"but the prefix holds {m}")
    rows: list[list[int]] = [[] for _ in first]
    for row, i in cuts:
        rows[row].append(i)
    n = documents.shape[-1]
    return [[(i, e, -first[row] if i == 0 else 0) for i, e in zip(idx, idx[1:] + [n])]
            for row, idx in enumerate(rows)]


@torch.library.custom_op("torchmoe::document_attention", mutates_args=())
def _document_forward(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, documents: torch.Tensor, start: int,
                      chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, n, hd) laid out like q, lse (B, H, n) fp32): `document_attention` (chunk 0:
    none) and the log-sum-exp of its scores (what the backward needs)."""
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q))
    m = k_prefix.shape[-2]
    for b, segments in enumerate(_segments(documents, start, chunk, m)):
        for i, e, h in segments:
            qs, ks, vs = (t[b:b + 1, :, i:e] for t in (q, k, v))
            if h:
                lse[b:b + 1, :, i:e] = prefixed_block_forward(qs, k_prefix[b:b + 1, :, m - h:],
                                                              v_prefix[b:b + 1, :, m - h:], ks, vs, out[b:b + 1, :, i:e])
            else:
                o, s = block_forward(qs, ks, vs, causal=True)
                out[b:b + 1, :, i:e], lse[b:b + 1, :, i:e] = o, s
    return out, lse


@_document_forward.register_fake
def _(q, k_prefix, v_prefix, k, v, documents, start, chunk):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q))


@torch.library.custom_op("torchmoe::document_attention_backward", mutates_args=())
def _document_backward(grad: torch.Tensor, q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor, start: int, chunk: int,
                       out: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor]:
    """Gradients [dq, dk_prefix, dv_prefix, dk, dv] of `document_attention` for the output
    gradient `grad` (B, H, n, hd), segment by segment from the forward's `out` and `lse`."""
    dq, dk_p, dv_p, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                              for t in (q, k_prefix, v_prefix, k, v))
    m = k_prefix.shape[-2]
    for b, segments in enumerate(_segments(documents, start, chunk, m)):
        for i, e, h in segments:
            rows = (slice(b, b + 1), slice(None), slice(i, e))
            gs, qs, ks, vs, os = (t[rows] for t in (grad, q, k, v, out))
            if h:
                old = (slice(b, b + 1), slice(None), slice(m - h, m))
                dk_p[old], dv_p[old], dk[rows], dv[rows] = prefixed_block_backward(
                    gs, qs, k_prefix[old], v_prefix[old], ks, vs, os, lse[rows], dq[rows])
            else:
                dq[rows], dk[rows], dv[rows] = block_backward(gs, qs, ks, vs, os, lse[rows], causal=True)
    return [dq, dk_p, dv_p, dk, dv]


@_document_backward.register_fake
def _(grad, q, k_prefix, v_prefix, k, v, documents, start, chunk, out, lse):
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k_prefix, v_prefix, k, v)]


def _setup_context(ctx, inputs, output) -> None:
    q, k_prefix, v_prefix, k, v, documents, start, chunk = inputs
    out, lse = output
    ctx.start, ctx.chunk = start, chunk
    ctx.save_for_backward(q, k_prefix, v_prefix, k, v, documents, out, lse)


def _backward(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
    # The log-sum-exp is an output for the backward's sake only: nothing differentiates it.
    q, k_prefix, v_prefix, k, v, documents, out, lse = ctx.saved_tensors
    grads = torch.ops.torchmoe.document_attention_backward(grad_out.contiguous(), q, k_prefix, v_prefix, k, v,
                                                           documents, ctx.start, ctx.chunk, out, lse)
    return (*grads, None, None, None)


_document_forward.register_autograd(_backward, setup_context=_setup_context)
# The operator as dispatch modes see it (selective activation checkpointing's policy saves it).
DOCUMENT_ATTENTION = torch.ops.torchmoe.document_attention.default
