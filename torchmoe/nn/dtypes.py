"""The torch.dtype of a dtype a config names (`torchmoe.config.dtypes.DTYPE_BYTES`).

    torch_dtype("bfloat16")   # torch.bfloat16
"""

from __future__ import annotations

import torch

from torchmoe.config.dtypes import DTYPE_BYTES

__all__ = ["torch_dtype"]

_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}


def torch_dtype(name: str) -> torch.dtype:
    """The torch.dtype named `name`, one of `DTYPE_BYTES` (the config's validation checked it)."""
    return _TORCH_DTYPES[name]
