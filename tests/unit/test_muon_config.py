"""The Muon keys of `[optimizer]`: read from TOML and flags, and refused with one message.

    python -m pytest -q tests/unit/test_muon_config.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from torchmoe.config import validate_sections
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import JobConfig
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.config.loader import load_job_config


def test_defaults_are_torch_muons() -> None:
    import torch

    cfg = OptimizerConfig()
    muon = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))])
    group = muon.param_groups[0]
    assert (cfg.momentum, cfg.nesterov, cfg.ns_steps, tuple(cfg.ns_coefficients), cfg.ns_eps, cfg.weight_decay) == (
        group["momentum"], group["nesterov"], group["ns_steps"], group["ns_coefficients"], group["eps"],
        group["weight_decay"])
    assert group["adjust_lr_fn"] is None and cfg.adjust_lr == "original"  # torch's None means "original"


def test_coefficients_from_toml_and_flags(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[optimizer]\nname = "Muon"\nns_coefficients = [3, -4.5, 2.0]\nmuon_params = ["output.weight"]\n')
    cfg = load_job_config(["--config", str(job)])
    assert cfg.optimizer.ns_coefficients == [3.0, -4.5, 2.0] and cfg.optimizer.muon_params == ["output.weight"]
    for flag in (["3.5", "-4", "2"], ["3.5,-4,2"]):
        cfg = load_job_config(["--optimizer.name", "Muon", "--optimizer.ns_coefficients", *flag])
        assert cfg.optimizer.ns_coefficients == [3.5, -4.0, 2.0]
    with pytest.raises(ConfigError) as err:
        load_job_config(["--optimizer.name", "Muon", "--optimizer.ns_coefficients", "3.5,x"])
    assert str(err.value) == ('--optimizer.ns_coefficients = "3.5,x": expected numbers\n'
                              "  fix: pass numbers, e.g. --optimizer.ns_coefficients 3.4445 -4.775 2.0315")
    job.write_text('[optimizer]\nns_coefficients = [3, "b", 2]\n')
    with pytest.raises(ConfigError, match=r"expected a list of numbers, e.g. \[3.4445, -4.775, 2.0315\], got list"):
        load_job_config(["--config", str(job)])


@pytest.mark.parametrize("key, value, message", [
    ("ns_steps", 0, "optimizer.ns_steps = 0: must lie in 1 .. 99 (torch.optim.Muon's range)\n"
                    "  fix: use 5, torch.optim.Muon's default"),
    ("ns_coefficients", [3.0, 1.0], "optimizer.ns_coefficients = [3.0, 1.0]: must be three finite numbers (a, b, c)\n"
                                    "  fix: use [3.4445, -4.775, 2.0315], torch.optim.Muon's default"),
    ("adjust_lr", "match_rms", 'optimizer.adjust_lr = "match_rms": not an allowed value\n'
                               '  fix: did you mean "match_rms_adamw"? Allowed: "original", "match_rms_adamw"'),
    ("ns_dtype", "float16", 'optimizer.ns_dtype = "float16": not an allowed value\n'
                            '  fix: did you mean "bfloat16"? Allowed: "bfloat16", "float32"'),
    *((
        "momentum", m, f"optimizer.momentum = {m}: must lie in [0, 1): the momentum buffer keeps momentum times its "
        "past each step, which at 1 never forgets a gradient and above 1 grows without bound\n"
        "  fix: typical: 0.95 (torch.optim.Muon's default)") for m in (-0.5, 1.0, 1.5, math.nan)),
    ("adamw_lr", 0.0, "optimizer.adamw_lr = 0.0: must be a finite number > 0\n  fix: set a positive value"),
    ("adamw_weight_decay", -0.5, "optimizer.adamw_weight_decay = -0.5: must be >= 0\n"
                                 "  fix: use 0 to disable, or -1 for optimizer.weight_decay"),
    ("muon_params", [" "], 'optimizer.muon_params = " ": is an empty pattern\n  fix: remove it, or name parameters, '
                           'e.g. "layers.*.moe.router.gate.weight"'),
])
def test_bad_muon_settings_are_one_message(key: str, value: object, message: str) -> None:
    cfg = JobConfig()
    cfg.optimizer.name = "Muon"
    setattr(cfg.optimizer, key, value)
    with pytest.raises(ConfigError) as err:
        validate_sections(cfg)
    assert str(err.value) == message


def test_a_key_of_another_section_is_suggested_before_a_muon_key() -> None:
    """`optimizer.steps` is training.steps put in the wrong section, not a misspelled ns_steps."""
    with pytest.raises(ConfigError) as err:
        load_job_config(["--optimizer.steps", "5"])
    assert err.value.fix == "did you mean --training.steps?"
