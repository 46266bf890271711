"""The largest pre-softmax logit of each attention head: what QK-Clip (Kimi K2's MuonClip) watches.

    python -m pytest -q tests/unit/test_qk_clip.py

A head's logits are ``q_i . k_j * hd^-0.5`` (the kernels' default scale; a layer's own scaling of
its queries, YaRN's or temperature tuning's, is already in q) over the pairs its softmax sees: the
key at or before the query, from the query's window start on: its document's start under document
masking, its chunk's start on a chunked layer, ``i - window + 1`` on a sliding-window layer, else
the row's start. The fused kernels return no logits, so they are computed again beside the
attention, without autograd, in blocks of queries: at most `BLOCK_ELEMENTS` fp32 scores at a time,
never the whole (S x S) matrix. The window starts are built on the device from the batch's document
tables (`nn.document_attention`): nothing is read on the host.
"""

from __future__ import annotations

import torch

from torchmoe.nn.document_attention import DocumentSegments

__all__ = ["BLOCK_ELEMENTS", "head_logit_max", "window_starts"]

# The scores of one block of queries: (B, H, queries, keys) fp32 elements (256 MiB).
BLOCK_ELEMENTS = 1 << 26


@torch.no_grad()
def head_logit_max(q: torch.Tensor, k: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """Each head's largest logit over the rows and the pairs its softmax sees.

    Args:
        q: (B, H, S, hd) queries as the kernel gets them; k: (B, Hkv, S, hd) keys (Hkv divides H:
            query head h reads key head h // (H / Hkv)).
        starts: (B, S) or (1, S) int64: the first key position each query sees (`window_starts`);
            None: the row's start (plain causal attention).
    Returns:
        (H,) fp32.
    """
    bsz, heads, seq_len, hd = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # Query heads grouped under their key head: the keys are read once per group, never repeated.
    queries = q.float().reshape(bsz, kv_heads, group, seq_len, hd) * hd ** -0.5
    keys = k.float().unsqueeze(2)  # (B, Hkv, 1, S, hd)
    positions = torch.arange(seq_len, device=q.device)
    block = max(1, min(seq_len, BLOCK_ELEMENTS // max(1, bsz * heads * seq_len)))
    best = torch.full((kv_heads, group), float("-inf"), device=q.device)
    for first in range(0, seq_len, block):
        last = min(seq_len, first + block)
        # (B, Hkv, G, queries, keys up to the block's last query)
        scores = queries[..., first:last, :] @ keys[..., :last, :].transpose(-1, -2)
        key_pos, query_pos = positions[:last], positions[first:last]
        hidden = key_pos.view(1, 1, -1) > query_pos.view(1, -1, 1)  # (1, queries, keys)
        if starts is not None:
            hidden = hidden | (key_pos.view(1, 1, -1) < starts[:, first:last, None])
        scores.masked_fill_(hidden.unsqueeze(1).unsqueeze(1), float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)))
    return best.reshape(heads)


def window_starts(seq_len: int, device: torch.device, *, chunk: int | None = None, window: int | None = None,
                  documents: DocumentSegments | None = None) -> torch.Tensor | None:
    """The first key position each query of whole rows of `seq_len` sees: (B, S) under document
    masking, else (1, S) int64; None for plain causal attention over the row.

    Args:
        chunk: the layer's chunk length (chunks start at its multiples); None: no chunks.
        window: a sliding window of that many keys, the query's own included; None: none.
        documents: the micro-batch's tables (their window starts hold the chunks' as well).
    """
    chunk = chunk if chunk is not None and chunk < seq_len else None
    positions = torch.arange(seq_len, device=device).view(1, -1)
    starts = None
    if documents is not None:
        _, table = documents.table(chunk, 0, window)
        # A row's segment query offsets are sorted: a query's window starts at the last one at or before it.
        offsets = table.queries.to(device=device, dtype=torch.int64)
        index = torch.searchsorted(offsets, positions.expand(offsets.shape[0], -1), right=True) - 1
        starts = offsets.gather(1, index)
    elif chunk is not None:
        starts = positions // chunk * chunk
    if window is not None:
        slid = (positions - window + 1).clamp(min=0)
        starts = slid if starts is None else torch.maximum(starts, slid)
    return starts
