"""Float8 linears train end to end on CPU, emulated (`float8.emulate`): the tensorwise and the
rowwise recipes, one process, from one seed checkpoint per family (Llama 4, Qwen3-MoE,
DeepSeek-V3 and gpt-oss tiny), against its fp32 run.

Emulation casts to float8 (e4m3 forward: 3 mantissa bits, relative rounding up to 2^-4 = 6 %
per element; e5m2 gradients) and scales exactly as on a GPU, then multiplies in fp32. The loss
is a mean over 512 tokens, so the rounding largely averages out: observed (tiny, 5 steps) up to
3.5e-4 of the fp32 loss and 3.1e-3 of its gradient norm (both recipes); the bounds are 2e-3 and
1.5e-2.

    python -m pytest -q tests/integration/test_float8_train.py
"""

from __future__ import annotations

import pytest

from tests.helpers import seed_checkpoint, start_from, train_tiny_here
from tests.launch import metrics_by_step

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.integration
JOB = ["--training.local_batch_size", "8"]


FAMILIES = {"llama4": [], "qwen3": ["--model.name", "qwen3"], "deepseek_v3": ["--model.name", "deepseek_v3"],
            "gpt_oss": ["--model.name", "gpt_oss"]}
# Qwen3 with one recipe: what it changes (per-head norms, no shared expert) is not a linear, and
# the recipes differ only in their scales (20 s a run, emulated). DeepSeek-V3 with the other: its
# latent attention's linears (wkv_a, 40 features wide in tiny, stays high precision). gpt-oss with
# tensorwise: its attention projections' biases, added after the float8 matmuls.
CASES = [("llama4", "tensorwise"), ("llama4", "rowwise"), ("qwen3", "tensorwise"), ("deepseek_v3", "rowwise"),
         ("gpt_oss", "tensorwise")]
_FP32: dict = {}


def _fp32(family: str, root) -> tuple:
    """The family's seed checkpoint and fp32 curve, made once per module."""
    if family not in _FP32:
        seed = seed_checkpoint(root / f"seed_{family}", FAMILIES[family])
        folder = start_from(seed, root / f"fp32_{family}")
        train_tiny_here(folder, [*JOB, *FAMILIES[family]])
        _FP32[family] = seed, metrics_by_step(folder)
    return _FP32[family]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("float8")


@pytest.mark.parametrize(("family", "recipe"), CASES)
def test_emulated_float8_tracks_the_fp32_curve(root, tmp_path, family, recipe):
    seed, reference = _fp32(family, root)
    folder = start_from(seed, tmp_path / recipe)
    train_tiny_here(folder, [*JOB, *FAMILIES[family], "--float8.enable", "true", "--float8.emulate", "true",
                             "--float8.recipe_name", recipe])
    got = metrics_by_step(folder)
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4, 5]
    assert got[1]["loss"] != reference[1]["loss"]  # float8 really ran
    for step, ref in reference.items():
        assert got[step]["loss"] == pytest.approx(ref["loss"], rel=2e-3), (recipe, step)
        assert got[step]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1.5e-2), (recipe, step)
