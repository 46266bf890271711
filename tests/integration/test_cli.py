"""`python -m torchmoe` end to end on bad input: exit status 2, one message, no traceback; and --help.

    python -m pytest -q -m integration tests/integration/test_cli.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEBUG = str(REPO / "configs" / "debug_model.toml")

pytestmark = pytest.mark.integration


def _torchmoe(*args: str) -> subprocess.CompletedProcess[str]:
    # A clean launcher environment: these runs must not look like torchrun workers.
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "torchmoe", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def _assert_user_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("error:") == 1, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


def test_unknown_toml_key_suggests_closest(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[training]\nstesp = 5\n")
    _assert_user_error(_torchmoe("train", "--config", path), "training.stesp = 5", "did you mean training.steps?")


def test_wrong_toml_type(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[parallelism]\ntensor_parallel_degree = "2"\n')
    _assert_user_error(_torchmoe("train", "--config", path), 'parallelism.tensor_parallel_degree = "2"',
                       "expected an integer", "tensor_parallel_degree = 2")


def test_bad_degrees_show_arithmetic() -> None:
    result = _torchmoe("train", "--config", DEBUG, "--dry-run", "--world-size", "16",
                       "--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree=4", "--parallelism.tensor_parallel_degree", "3")
    _assert_user_error(result, "dp_replicate(2) * dp_shard(4) * cp(1) * tp(3) * pp(1) = 24 != WORLD_SIZE(16)",
                       "fix:")


def test_missing_config_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    _assert_user_error(_torchmoe("train", "--config", missing), f'--config = "{missing}"', "file not found",
                       "configs/debug_model.toml")


def test_malformed_toml_shows_line(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[training]\nsteps = 5\nseq_len = = 7\n")
    _assert_user_error(_torchmoe("train", "--config", path), "malformed TOML", "line 3")


def test_unknown_flag_suggests_closest() -> None:
    _assert_user_error(_torchmoe("train", "--config", DEBUG, "--parallelism.tensor_paralel_degree", "2"),
                       "--parallelism.tensor_paralel_degree", "did you mean --parallelism.tensor_parallel_degree?")


def test_unknown_subcommand() -> None:
    _assert_user_error(_torchmoe("trian"), 'subcommand = "trian"', "did you mean `torchmoe train`?")


@pytest.mark.parametrize(("args", "specific"), [
    (("train", "--config", DEBUG, "--help"), "(default: ./outputs/debug)"),  # defaults come from the TOML
    (("--help",), "subcommands:"),
])
def test_help_lists_every_option(args: tuple[str, ...], specific: str) -> None:
    result = _torchmoe(*args)
    assert result.returncode == 0, result.stderr
    assert "--parallelism.tensor_parallel_degree" in result.stdout
    assert "Tensor-parallel degree" in result.stdout
    assert "--dry-run" in result.stdout and "--world-size" in result.stdout
    assert specific in result.stdout
