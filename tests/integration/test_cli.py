"""`python -m torchmoe` end to end on bad input: exit status 2, one message, no traceback; and --help.

    python -m pytest -q -m integration tests/integration/test_cli.py
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, assert_user_error, write_toml
from tests.launch import run_cli
from torchmoe.commands import cli

pytestmark = pytest.mark.integration


def _torchmoe(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(args, timeout=120, expect=None)


def test_unknown_toml_key_suggests_closest(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[training]\nstesp = 5\n")
    assert_user_error(_torchmoe("train", "--config", path), "training.stesp = 5", "did you mean training.steps?")


def test_wrong_toml_type(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[parallelism]\ntensor_parallel_degree = "2"\n')
    assert_user_error(_torchmoe("train", "--config", path), 'parallelism.tensor_parallel_degree = "2"',
                      "expected an integer", "tensor_parallel_degree = 2")


def test_bad_degrees_show_arithmetic() -> None:
    result = _torchmoe("train", "--config", DEBUG_CONFIG, "--dry-run", "--world-size", "16",
                       "--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree=4", "--parallelism.tensor_parallel_degree", "3")
    assert_user_error(result, "dp_replicate(2) * dp_shard(4) * cp(1) * tp(3) * pp(1) = 24 != WORLD_SIZE(16)",
                      "fix:")


def test_missing_config_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    assert_user_error(_torchmoe("train", "--config", missing), f'--config = "{missing}"', "No such file or directory",
                      "configs/debug_model.toml")


def test_malformed_toml_shows_line(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[training]\nsteps = 5\nseq_len = = 7\n")
    assert_user_error(_torchmoe("train", "--config", path), "malformed TOML", "line 3")


def test_unknown_flag_suggests_closest() -> None:
    assert_user_error(_torchmoe("train", "--config", DEBUG_CONFIG, "--parallelism.tensor_paralel_degree", "2"),
                      "--parallelism.tensor_paralel_degree", "did you mean --parallelism.tensor_parallel_degree?")


@pytest.mark.parametrize(("flags", "key", "expected"), [
    (["--checkpoint.initial_load_path", "{missing}"], "checkpoint.initial_load_path",
     ("No such file or directory", "fix: point it at a DCP checkpoint folder")),
    (["--checkpoint.initial_load_path", "{missing}", "--checkpoint.initial_load_in_hf", "true"],
     "checkpoint.initial_load_path", ("No such file or directory", "fix: point it at a Hugging Face Llama 4 folder")),
    (["--model.tokenizer_path", "{missing}"], "model.tokenizer_path",
     ("No such file or directory", "fix: give a tokenizer")),
    (["--training.dataset", "local", "--training.dataset_path", "{missing}/*.jsonl"], "training.dataset_path",
     ("this glob matches no corpus files", "fix: point it at")),
], ids=["initial_load_path", "initial_load_in_hf", "tokenizer_path", "dataset_path"])
def test_path_to_nothing_names_key_value_and_fix(tmp_path: Path, flags: list[str], key: str,
                                                 expected: tuple[str, ...]) -> None:
    missing = str(tmp_path / "nope")
    result = _torchmoe("train", "--config", DEBUG_CONFIG, "--training.steps", "1",
                       *(flag.format(missing=missing) for flag in flags), "--job.dump_folder", str(tmp_path / "run"))
    assert_user_error(result, f'{key} = "{missing}', *expected)


def test_unknown_subcommand() -> None:
    assert_user_error(_torchmoe("trian"), 'subcommand = "trian"', "did you mean `torchmoe train`?")


def test_help_lists_every_option() -> None:
    result = _torchmoe("train", "--config", DEBUG_CONFIG, "--help")
    assert result.returncode == 0, result.stderr
    assert "--parallelism.tensor_parallel_degree" in result.stdout
    assert "Tensor-parallel degree" in result.stdout
    assert "--dry-run" in result.stdout and "--world-size" in result.stdout
    assert "(default: ./outputs/debug)" in result.stdout  # defaults come from the TOML


def test_top_level_help_is_the_subcommands() -> None:
    """One screen: each subcommand and what it does, and how to list its options (it printed the
    580 lines of train's before, under "Train a Llama 4 MoE model")."""
    result = _torchmoe("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) < 20 and lines[2] == "subcommands:", result.stdout
    assert [line.split()[0] for line in lines[3:3 + len(cli.SUBCOMMANDS)]] == list(cli.SUBCOMMANDS)
    assert "`torchmoe SUBCOMMAND --help` lists its options" in result.stdout and "--parallelism" not in result.stdout


@pytest.mark.parametrize("name", ["train", "generate", "eval", "convert", "plan", "report", "prepare-data"])
def test_each_subcommands_help_names_every_family(capsys, name: str) -> None:
    """No help says the families are Llama 4's alone; the config keys' help names them all."""
    assert cli.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "Llama 4 MoE" not in out and "Llama 4-style" not in out, out[:500]
    if name in ("train", "generate", "eval"):
        assert "'llama4' (Llama 4), 'qwen3' (Qwen3-MoE), 'deepseek_v3' (DeepSeek-V3, Kimi K2) or 'gpt_oss'" in " ".join(
            out.split()), out[:2000]
