"""Keys and values of the tokens a model has seen, for decoding one token at a time.

    cache = KVCache()
    logits = model(prompt, cache=cache)            # prefill: positions [0, n)
    logits = model(next_token, cache=cache)        # then one position at a time

Each attention layer appends its new keys and values (`append`, by layer name) and attends over
them with the earlier ones as the prefix `nn.attention.causal_attention` takes (from the first
new query's chunk start, or from 0): the same kernels and merge as training's context
parallelism, so decoding gives the logits of the full forward. The model advances `length` once
per forward, after every layer appended. Storage grows by doubling (amortised copies).
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """Per layer, the keys and values (B, Hkv, length, hd) of every position seen so far.

    Attributes:
        length: positions cached (the global position of the next token).
    """

    def __init__(self) -> None:
        self.length = 0
        self._keys: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}

    def append(self, layer: str, k: torch.Tensor, v: torch.Tensor, *, keep_from: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s keys and values of the positions ``[length, length + n)`` (k, v:
        (B, Hkv, n, hd)); return those of ``[keep_from, length)``, (B, Hkv, length - keep_from, hd),
        the prefix the new queries see before their own positions."""
        n = k.shape[-2]
        if layer not in self._keys:
            shape = (*k.shape[:-2], max(16, 2 * n), k.shape[-1])
            self._keys[layer], self._values[layer] = k.new_empty(shape), v.new_empty(shape)
        keys, values = self._keys[layer], self._values[layer]
        if self.length + n > keys.shape[-2]:
            extra = max(keys.shape[-2], self.length + n - keys.shape[-2])
            keys, values = (torch.cat([t, t.new_empty(*t.shape[:-2], extra, t.shape[-1])], dim=-2) for t in (keys, values))
            self._keys[layer], self._values[layer] = keys, values
        keys[..., self.length:self.length + n, :] = k
        values[..., self.length:self.length + n, :] = v
        return keys[..., keep_from:self.length, :], values[..., keep_from:self.length, :]

    def advance(self, n: int) -> None:
        """The forward that appended `n` positions in every layer is done."""
        self.length += n
