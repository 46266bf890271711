"""What autograd keeps for the backward while a function runs: the measure the planner's activation
model (`plan.activations`) is checked against, and the attention benchmark reports.

    nbytes = saved_bytes(lambda: block(x, freqs), exclude=model.parameters())
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["saved_bytes"]


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs (a view counts its whole
    storage, once), except those of `exclude` (a model's parameters and buffers: state, not
    activations)."""
    own = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for ptr, n in storages.items() if ptr not in own)
