"""`components.finite`: which tensors hold NaN or inf, found fast and exactly."""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.components.checkpoint import ModelWrapper
from torchmoe.components.finite import NonFiniteValues, nonfinite_names


def test_sums_pick_suspects_and_the_elements_settle_them() -> None:
    """A sum overflowing float32 (1e38 x 10, every element finite) is no finding; NaN, inf and
    -inf are, in fp32, bf16 and fp64, nested in dicts, lists and Statefuls; integers are skipped."""
    net = nn.Linear(3, 2)
    with torch.no_grad():
        net.bias[1] = float("-inf")
    state = {
        "large": torch.full((10,), 1e38),
        "bf16": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16),
        "fp64": [torch.zeros(2, dtype=torch.float64), torch.tensor([float("inf")], dtype=torch.float64)],
        "ints": torch.tensor([2**62]),
        "model": ModelWrapper(net),
    }
    assert nonfinite_names(state) == ["bf16", "fp64.1", "model.bias"]
    assert nonfinite_names({"large": state["large"], "ok": torch.ones(4)}) == []
    assert str(NonFiniteValues(["a", "b", "c", "d", "e"])) == "NaN or inf in a, b, c and 2 more"
