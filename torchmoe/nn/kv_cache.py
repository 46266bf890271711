"""What each attention layer keeps of the tokens a model has seen, for decoding one token at a time.

    cache = KVCache()
    logits = model(prompt, cache=cache)            # prefill: positions [0, n)
    logits = model(next_token, cache=cache)        # then one position at a time

Each attention layer appends what it keeps of its new positions (`append`, by layer name) and
attends over the earlier ones as the prefix `nn.attention.causal_attention` takes (from the first
new query's chunk start, or from 0): the same kernels and merge as training's context
parallelism, so decoding gives the logits of the full forward. Grouped-query attention keeps its
keys and values; DeepSeek's latent attention only its latent and shared rotated key
(`models.decoder.latent_attention`), from which it computes attention without per-head keys. The
model advances `length` once per forward, after every layer appended. A layer keeps only the
positions its attention can still see: from `keep_from` on, which never goes back (a sliding
window's start, a chunk's), so gpt-oss's window layers hold about twice their window, not the whole
context. Storage grows by doubling what is kept (amortised copies).
"""

from __future__ import annotations

import math

import torch

__all__ = ["KVCache"]


class KVCache:
    """Per layer, the tensors it keeps of every position seen so far, each (..., length, d).

    Attributes:
        length: positions cached (the global position of the next token).
    """

    def __init__(self) -> None:
        self.length = 0
        self._kept: dict[str, tuple[torch.Tensor, ...]] = {}
        self._first: dict[str, int] = {}  # per layer, the position its storage starts at

    def append(self, layer: str, *new: torch.Tensor, keep_from: int) -> tuple[torch.Tensor, ...]:
        """Store layer `layer`'s tensors of the positions ``[length, length + n)`` (each
        (..., n, d): grouped-query attention's keys and values (B, Hkv, n, hd), or latent
        attention's one (B, 1, n, r + rope)); return the same tensors' positions
        ``[keep_from, length)``, each (..., length - keep_from, d): the prefix the new queries see
        before their own positions. Positions before `keep_from` are never asked for again (it
        does not decrease from one call to the next): they may go."""
        n = new[0].shape[-2]
        if layer not in self._kept:
            self._kept[layer] = tuple(t.new_empty(*t.shape[:-2], max(16, 2 * n), t.shape[-1]) for t in new)
            self._first[layer] = self.length
        kept, first = self._kept[layer], self._first[layer]
        if self.length + n - first > kept[0].shape[-2]:  # full: a new store of twice what stays
            stay = self.length - keep_from
            size = max(16, 2 * (stay + n))
            kept = tuple(torch.cat([t[..., keep_from - first:self.length - first, :],
                                    t.new_empty(*t.shape[:-2], size - stay, t.shape[-1])], dim=-2) for t in kept)
            self._kept[layer], self._first[layer], first = kept, keep_from, keep_from
        for store, t in zip(kept, new):
            store[..., self.length - first:self.length - first + n, :] = t
        return tuple(store[..., keep_from - first:self.length - first, :] for store in kept)

    def advance(self, n: int) -> None:
        """The forward that appended `n` positions in every layer is done."""
        self.length += n

    def bytes_per_position(self) -> dict[str, int]:
        """Per layer, the bytes one cached position takes (every row of the batch): what decoding
        a long context holds per token."""
        return {layer: sum(math.prod(t.shape[:-2]) * t.shape[-1] * t.element_size() for t in kept)
                for layer, kept in self._kept.items()}
