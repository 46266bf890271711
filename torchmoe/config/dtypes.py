"""The floating dtypes a config names, and the bytes of one element of each.

    DTYPE_BYTES["bfloat16"]   # 2: what the planner counts
    torchmoe.nn.dtypes.torch_dtype("bfloat16")   # the torch.dtype that runs (above torch's line)

One table for every key that names a dtype (training.dtype, training.mixed_precision_param,
training.mixed_precision_reduce, checkpoint.export_dtype, `torchmoe convert --dtype`); each key
accepts the subset of it listed beside its check in `validate.py`. Pure data: the planner counts
bytes with it without importing torch.
"""

from __future__ import annotations

__all__ = ["DTYPE_BYTES"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
