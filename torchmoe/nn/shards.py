"""This rank's part of a tensor that may be a DTensor.

    local_shard(param)   # a DTensor's local shard, or a plain tensor as it is
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_shard"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """`t`'s local shard when it is a DTensor (what this rank holds and computes with), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t
