"""`weights.finite`: which tensors hold NaN or inf, found fast and exactly."""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.checkpoints.checkpoint_state import ModelWrapper
from torchmoe.weights.finite import NonFiniteValues, nonfinite_names


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


def test_a_reader_refuses_values_beyond_the_bound_naming_each_tensor() -> None:
    """What a reader of weights checks: finite, and within ±2^16 (6e37 passed the finite check).
    The bound itself and anything inside it load; NaN is named as NaN; integers are skipped."""
    import pytest

    from torchmoe.weights.finite import WEIGHT_BOUND, refuse_bad_values
    from torchmoe.weights.weight_files import UnreadableWeights

    assert WEIGHT_BOUND == 65536.0
    good = {"norm": torch.full((4,), WEIGHT_BOUND), "bias": torch.tensor([-WEIGHT_BOUND, 3.0], dtype=torch.bfloat16),
            "ints": torch.tensor([2**40])}
    refuse_bad_values(good, key="k", path="p")
    bad = {**good, "sinks": torch.tensor([0.5, -3e38]), "w": torch.tensor([1.0, 6e37], dtype=torch.bfloat16),
           "expert_bias": torch.tensor([65537.0])}
    with pytest.raises(UnreadableWeights) as err:
        refuse_bad_values(bad, key="checkpoint.initial_load_path", path="ckpt", names={"w": "model.w"})
    assert str(err.value).startswith('checkpoint.initial_load_path = "ckpt": the weights hold values beyond ±65,536, '
                                     "which no trained model reaches (largest |value|: sinks (3e+38), model.w "
                                     "(6.01e+37), expert_bias (6.55e+04)): the files are damaged or crafted"), err.value
    with pytest.raises(UnreadableWeights, match=r"the weights hold NaN or inf in w: they came in"):
        refuse_bad_values({**bad, "w": torch.tensor([float("nan"), 1.0])}, key="k", path="p")
