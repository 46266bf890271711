"""`torchmoe train`, its dry run and `torchmoe plan` on Hugging Face checkpoints whose sizes match
no shipped flavor (`tests/any_checkpoint.py`): the folder's config.json is the model, and every
layout check reads it as it reads a flavor.

    python -m pytest -q tests/integration/test_any_checkpoint_cli.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.any_checkpoint import CONFIGS, ODD_SHAPES, reference_model, save_checkpoint
from torchmoe.commands import cli

FAMILIES = sorted(CONFIGS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("any")
    return {family: save_checkpoint(family, root / family) for family in FAMILIES}


def _job(folder: Path, tmp_path: Path) -> list[str]:
    """A job file that names no model: only the folder to start from (one step of 2 x 64 tokens)."""
    job = tmp_path / "job.toml"
    job.write_text(f'[training]\nlocal_batch_size = 2\nseq_len = 64\nsteps = 1\ndataset = "python_docs"\n'
                   f'[checkpoint]\nenable = false\ninitial_load_in_hf = true\ninitial_load_path = "{folder}"\n'
                   '[compile]\nenable = false\n[metrics]\nlog_freq = 1\nenable_tensorboard = false\n')
    return ["--config", str(job)]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_from_the_folder(family: str, folders: dict[str, Path], tmp_path: Path) -> None:
    """The job names no model; the run trains the folder's, and its config.toml reruns it (it names
    the folder's family, and the folder as the flavor)."""
    assert cli.main(["train", *_job(folders[family], tmp_path), "--job.dump_folder", str(tmp_path / "run")]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and 0 < record["loss"] < 20 and record["grad_norm"] > 0
    written = (tmp_path / "run" / "config.toml").read_text()
    assert f'name = "{family}"\nflavor = "{family}"' in written, written


@pytest.mark.parametrize("family", FAMILIES)
def test_the_dry_run_and_the_planner_size_the_folder_s_model(family: str, folders: dict[str, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A pipeline of one layer per stage beside EP 2 (6 ranks) is planned with the folder's
    parameter count (transformers' own), and `torchmoe plan` searches layouts for it."""
    job = _job(folders[family], tmp_path)
    assert cli.main(["train", *job, "--dry-run", "--world-size", "6", "--parallelism.pipeline_parallel_degree", "3",
                     "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "3",
                     "--job.dump_folder", str(tmp_path / "dry")]) == 0
    plan = json.loads((tmp_path / "dry" / "dry_run.json").read_text())
    assert plan["params_total"] == sum(p.numel() for p in reference_model(family).parameters())
    assert cli.main(["plan", *job, "--gpus", "8", "--hardware", "h100"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"plan: {family} on 8 x" in out and "fastest layouts" in out, out


def test_tensor_parallelism_is_checked_against_the_folder_s_heads(folders: dict[str, Path], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The folder's 6 query heads do not split over 4 TP ranks: the preflight says so, naming the
    model by its folder."""
    assert cli.main(["train", *_job(folders["qwen3"], tmp_path), "--dry-run", "--world-size", "4",
                     "--parallelism.tensor_parallel_degree", "4", "--job.dump_folder", str(tmp_path / "dry")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert ("error: parallelism.tensor_parallel_degree = 4: must divide the qwen3 flavor's n_heads (6); 6 % 4 = 2 "
            "fix: use a tensor_parallel_degree that divides every sharded dim of qwen3: 1, 2") in err, err


def test_eval_and_generate_read_the_folder_s_model(folders: dict[str, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`eval` and `generate --checkpoint` on the folder, with a job file of another model (the
    Llama 4 defaults): the folder decides, its loss is the one printed."""
    job = tmp_path / "job.toml"
    job.write_text('[training]\nlocal_batch_size = 2\nseq_len = 64\ndataset = "python_docs"\n')
    weights = ["--config", str(job), "--checkpoint", str(folders["deepseek_v3"])]
    assert cli.main(["eval", *weights, "--split", "train", "--batches", "1"]) == 0
    assert cli.main(["generate", *weights, "--prompt", "def f(", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "train loss " in out and f"weights {folders['deepseek_v3']}" in out, out


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_folder_of_any_expert_shape_trains_evaluates_and_generates_in_bf16(family: str, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A folder whose experts' hidden size is 20 under a model dim of 30 or 36 (`ODD_SHAPES`),
    in bf16 compute (the default): `train`, `eval` and `generate` crashed ("strides should be
    multiple of 16 bytes"). The step-1 loss is `eval`'s loss of the same batch on the folder, and
    `eval` and `generate` print what the per-expert loop (`--model.use_grouped_mm false`) prints."""
    folder = save_checkpoint(family, tmp_path / family, sizes=ODD_SHAPES[family])
    job = _job(folder, tmp_path)
    assert cli.main(["train", *job, "--job.dump_folder", str(tmp_path / "run")]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and 0 < record["loss"] < 20 and record["grad_norm"] > 0
    capsys.readouterr()
    printed = {}
    for loop in ([], ["--model.use_grouped_mm", "false"]):
        weights = [*job, "--checkpoint", str(folder), *loop]
        assert cli.main(["eval", *weights, "--split", "train", "--batches", "1"]) == 0
        assert cli.main(["generate", *weights, "--prompt", "def f(", "--max-new-tokens", "8"]) == 0
        printed[bool(loop)] = capsys.readouterr().out
    assert printed[False] == printed[True], printed
    loss = float(printed[False].split("train loss ")[1].split()[0])
    assert loss == pytest.approx(record["loss"], abs=1e-4), (loss, record["loss"])  # eval prints 6 decimals
