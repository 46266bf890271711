"""One table of the dtypes a config names: the planner's bytes and the torch.dtype that runs agree."""

import torch

from torchmoe.config.dtypes import DTYPE_BYTES
from torchmoe.config.validate import EXPORT_DTYPES, PARAM_DTYPES, REDUCE_DTYPES
from torchmoe.nn.dtypes import torch_dtype


def test_the_planner_counts_the_bytes_of_the_dtype_that_runs():
    assert {name: torch_dtype(name).itemsize for name in DTYPE_BYTES} == DTYPE_BYTES
    assert torch_dtype("bfloat16") is torch.bfloat16


def test_every_dtype_key_accepts_only_names_in_the_table():
    assert set(PARAM_DTYPES) | set(REDUCE_DTYPES) | set(EXPORT_DTYPES) <= set(DTYPE_BYTES)
