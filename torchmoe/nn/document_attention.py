"""Document masking: attention that never crosses a document boundary inside a packed row.

    python -m pytest -q tests/unit/test_document_masking.py

A packed row holds several documents, each ended by EOS. `document_starts` gives every token the
row position where its document starts (a new one starts right after each EOS, and at the row's
first token). Positions stay global: RoPE and NoPE temperature tuning count from the row start,
as torchtitan's block-causal masking does; only what attention sees changes.

A query at position t sees the keys from its window start on, w(t) = its document's start, or
with chunks (iRoPE's chunked layers) the later of that and its chunk's start. The window start
only grows along the row, so the queries cut into segments of equal w, each a plain causal
attention over its own keys: `nn.segment_attention`, which takes them as cumulative lengths
(torch's public ``varlen_attn`` on flash; one fused-kernel call per segment elsewhere), never a
mask tensor. Only a row's first segment can have w before the first query (context parallelism:
a piece whose first document, or chunk, began in an earlier piece): it also sees those keys, a
`prefix` the caller gathered, packed before the row's own keys (the kernel's causal mask is
aligned bottom right, so the prefix is seen entirely).

gpt-oss's attention runs the same segments: its sliding window counts within each segment (the
kernel's window, so a query sees the W latest keys of its own document), and its sinks join each
segment's softmax (`nn.segment_attention`): every document is attended exactly as if alone. A
windowed call's prefix reaches back at most W - 1 keys, whatever its first document's start.

The segments depend on the data, and are computed once per micro-batch on the host, from the
token ids before they travel (`document_segments`, called by the trainer): one `SegmentTable` per
kind of attention call the model makes (`AttentionCall`: a chunk size or sliding window, and under
context parallelism each local piece with its prefix length), each row's cumulative offsets padded to a
common width, on the host for the per-segment kernels and on the device for ``varlen_attn``. A
layer adds its rows' offsets (one tensor operation) and reads nothing: no `nonzero`, `item` or
`tolist` of a device value in forward, backward or recomputation. The tables are a pytree (the
pipeline schedule splits their rows into micro-batches like the inputs'); FSDP leaves them where
they are (it moves tensors, lists and tuples to the device, not dataclasses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from torchmoe import _torch_private as private
from torchmoe.nn.segment_attention import packed, packed_with_prefix, segment_attention

__all__ = ["AttentionCall", "DocumentSegments", "SegmentTable", "document_attention", "document_segments",
           "document_starts", "whole_row_calls"]


def document_starts(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, S) int64: for each token, the row position where its document starts. A document
    starts at the row's first token and right after every EOS. tokens: (B, S) int64 ids."""
    seq_len = tokens.shape[-1]
    positions = torch.arange(seq_len, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    return torch.where(starts, positions, 0).cummax(dim=-1).values


@dataclass(frozen=True)
class AttentionCall:
    """One kind of attention call a layer makes: queries at global positions ``[start, start + n)``
    of every row, `m` keys before them passed as the prefix, windows cut at multiples of `chunk`
    (None: at documents only); `window`: a sliding window of that many keys within each segment
    (None: none), which bounds how far back the prefix must reach."""

    chunk: int | None
    start: int
    n: int
    m: int
    window: int | None = None


@dataclass
class SegmentTable:
    """The segments of one `AttentionCall` for B rows: per row, the cumulative offsets of its
    segments' queries within the row's n queries and of their keys within its m + n keys (prefix
    first), padded to a common width K by repeating the last offset (empty segments).

    Attributes:
        queries, keys: (B, K) int32 on the compute device (for ``varlen_attn``).
        host_queries, host_keys: the same values on the host (for the per-segment kernels).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    host_queries: torch.Tensor
    host_keys: torch.Tensor


@dataclass
class DocumentSegments:
    """Every segment table of one micro-batch, one per `AttentionCall` (in `calls`' order), for
    rows of `seq_len` tokens."""

    seq_len: int
    calls: tuple[AttentionCall, ...]
    tables: tuple[SegmentTable, ...]

    def table(self, chunk: int | None, start: int, window: int | None = None) -> tuple[AttentionCall, SegmentTable]:
        """The call and table of queries from `start` with chunks of `chunk` and a sliding
        `window`."""
        chunk, window = _effective_chunk(chunk, self.seq_len), _effective_chunk(window, self.seq_len)
        for call, table in zip(self.calls, self.tables):
            if (call.chunk, call.start, call.window) == (chunk, start, window):
                return call, table
        raise ValueError(f"document_attention: no segment table for chunk {chunk}, window {window} from position "
                         f"{start}; the batch has {[(c.chunk, c.window, c.start) for c in self.calls]}")


# The pipeline schedule splits a micro-batch's pytree leaves along dim 0 (the rows).
torch.export.register_dataclass(SegmentTable)
torch.export.register_dataclass(DocumentSegments)


def _effective_chunk(chunk: int | None, seq_len: int) -> int | None:
    """A chunk (or sliding window) no shorter than the row cuts nothing."""
    return chunk if chunk is not None and chunk < seq_len else None


def whole_row_calls(spans: Sequence[tuple[int | None, int | None]], seq_len: int) -> list[AttentionCall]:
    """The calls of layers attending within each (chunk, sliding window) of `spans`
    (`ModelArgs.attention_spans`) over whole rows (no context parallelism)."""
    return [AttentionCall(chunk, 0, seq_len, 0, window) for chunk, window in spans]


def document_segments(starts: torch.Tensor, calls: Sequence[AttentionCall], device: torch.device) -> DocumentSegments:
    """The segment tables of a micro-batch, built on the host.

    Args:
        starts: (B, S) int64 host tensor: `document_starts` of the whole rows.
        calls: every kind of attention call the model makes on this rank.
        device: where the model runs (the device tables go there from pinned memory, without
            blocking the host).
    Raises:
        ValueError: a call's prefix does not reach back to a row's first window start.
    """
    if starts.device.type != "cpu":
        raise ValueError("document_segments: the document starts must be a host tensor (built from the batch's "
                         "token ids before they travel to the device)")
    host = starts.numpy()
    seq_len = host.shape[-1]
    unique = tuple(dict.fromkeys(AttentionCall(_effective_chunk(c.chunk, seq_len), c.start, c.n, c.m,
                                               _effective_chunk(c.window, seq_len)) for c in calls))
    tables = []
    for call in unique:
        queries, keys = (torch.from_numpy(t) for t in _row_offsets(host, call))
        if device.type == "cpu":
            on_device = (queries, keys)
        else:
            on_device = tuple(t.pin_memory().to(device, non_blocking=True) for t in (queries, keys))
        for t in (*on_device, queries, keys):
            # The width K changes with the documents: one compiled graph serves every width.
            private.mark_dynamic(t, 1)
        tables.append(SegmentTable(*on_device, queries, keys))
    return DocumentSegments(seq_len, unique, tuple(tables))


def _row_offsets(starts: np.ndarray, call: AttentionCall) -> tuple[np.ndarray, np.ndarray]:
    """(B, K) int32 query and key offsets of `call`'s segments (`SegmentTable`) from the rows'
    document starts (B, S). Each row: an empty first segment over the prefix keys its first
    window (nor its sliding window) does not reach, then one segment per window."""
    lo, n, m = call.start, call.n, call.m
    window = starts[:, lo:lo + n]
    if call.chunk is not None:
        window = np.maximum(window, np.arange(lo, lo + n) // call.chunk * call.chunk)
    reach = lo - window[:, 0]  # prefix keys the row's first segment sees
    if call.window is not None:  # no query sees further back than its sliding window
        reach = np.minimum(reach, call.window - 1)
    if (reach > m).any():
        raise ValueError(f"document_attention: a window starts {int(reach.max())} positions before the queries at "
                         f"{lo}, but the prefix holds {m}")
    cut = np.ones_like(window, dtype=bool)
    cut[:, 1:] = window[:, 1:] != window[:, :-1]
    rows = [np.flatnonzero(row)[1:] for row in cut]  # each row's segment starts after its first
    # Width: [0, 0, starts..., n] padded to a power of two, so a few widths serve every batch.
    width = 1 << (max(len(r) for r in rows) + 2).bit_length()
    queries = np.full((len(rows), width), n, dtype=np.int32)
    keys = np.full((len(rows), width), m + n, dtype=np.int32)
    for b, firsts in enumerate(rows):
        queries[b, :2], keys[b, :2] = 0, (0, m - reach[b])
        queries[b, 2:2 + len(firsts)], keys[b, 2:2 + len(firsts)] = firsts, m + firsts
    return queries, keys


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: DocumentSegments, *,
                       chunk: int | None = None, start: int = 0,
                       prefix: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within documents (and within chunks of `chunk` positions when given) of
    queries at positions ``[start, start + n)``, without a mask tensor (module docstring).

    Args:
        q: (B, H, n, hd) queries; k, v: (B, Hkv, n, hd) the keys and values at the same positions.
        segments: the micro-batch's tables (`document_segments`); the one for (`chunk`, `start`)
            is used, and must have been built for n queries and this prefix.
        chunk: chunk length (chunks start at multiples of it); None: documents only.
        start: the global position of the first query.
        prefix: (k, v), each (B, Hkv, m, hd): the keys and values at ``[start - m, start)``; it
            must reach back to every row's first window start. None: m = 0.
        window: a sliding window of that many keys, counted within each document (gpt-oss).
        sinks: (H,) sink logits joined to each document's softmax (gpt-oss); None: none.
    Returns:
        (B, H, n, hd).
    """
    call, table = segments.table(chunk, start, window)
    b, heads, n, hd = q.shape
    m = prefix[0].shape[-2] if prefix is not None else 0
    if (call.n, call.m) != (n, m):
        raise ValueError(f"document_attention: the table for chunk {call.chunk} from position {start} was built for "
                         f"{call.n} queries after {call.m} prefix keys, but the call has {n} after {m}")
    if call.n < segments.seq_len:
        # A piece of the rows (context parallelism): its keys packed with their prefix, a copy
        # in every mode, so no gathered or exchanged buffer stays alive through a view of it.
        prefix = prefix or (k[..., :0, :], v[..., :0, :])
        k, v = (packed_with_prefix(p, t) for p, t in zip(prefix, (k, v)))
    else:
        k, v = packed(k), packed(v)
    cu = [_flat(rows, width) for rows, width in ((table.queries, n), (table.keys, m + n),
                                                 (table.host_queries, n), (table.host_keys, m + n))]
    out = segment_attention(packed(q), k, v, *cu, max_q=n, max_k=m + n, window=call.window, sinks=sinks)
    return out.view(b, n, heads, hd).transpose(1, 2)


def _flat(rows: torch.Tensor, width: int) -> torch.Tensor:
    """(B, K) per-row offsets -> (B * K,) offsets into the packed rows of `width` each (int32)."""
    shift = torch.arange(rows.shape[0], dtype=torch.int32, device=rows.device) * width
    return (rows + shift[:, None]).flatten()
