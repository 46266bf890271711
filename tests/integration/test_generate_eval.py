"""`torchmoe eval` and `torchmoe generate` end to end on a run's checkpoints.

    python -m pytest -q -m integration tests/integration/test_generate_eval.py

The anchor: eval of a run's initial weights (here a Hugging Face folder of them) on the first
training batch is the loss the run logged at step 1, which training computed from the same
weights and rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG
from torchmoe import cli
from torchmoe.launch import read_metrics, run_cli

pytestmark = pytest.mark.integration

# The job of the `run_dir` fixture: the tiny flavor, one batch of 8 x 64 tokens per step (no
# accumulation), 2 steps, step-2 saved.
TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "64"]


def _tree(folder: Path) -> dict[str, int]:
    """Every file under `folder` with its modification time (ns)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def test_eval_of_the_initial_weights_on_the_first_batch_is_the_first_steps_loss(run_dir: Path, hf_dir: Path,
                                                                              tmp_path: Path) -> None:
    # hf_dir holds the tiny model initialised from seed 0: the weights run_dir's step 1 trained.
    before = _tree(run_dir)
    logged = read_metrics(run_dir)[0]
    assert logged["step"] == 1
    out = tmp_path / "eval.json"
    proc = run_cli(["eval", *TINY, "--job.dump_folder", run_dir, "--checkpoint", hf_dir, "--split", "train",
                    "--batches", "1", "--out", out], timeout=180)
    result = json.loads(out.read_text())
    assert result["loss"] == pytest.approx(logged["loss"], rel=1e-6, abs=0)
    assert result["checkpoint"] == str(hf_dir) and result["batches"] == 1
    assert result["perplexity"] == pytest.approx(math.exp(logged["loss"]), rel=1e-9)
    assert proc.stdout.startswith(f"train loss {result['loss']:.6f} ")
    assert _tree(run_dir) == before  # the run's folder is only read


def test_eval_reads_the_runs_newest_checkpoint_by_default(capsys, run_dir: Path) -> None:
    # step-2: two steps of training lowered the loss on the first batch.
    assert cli.main(["eval", *TINY, "--job.dump_folder", str(run_dir), "--split", "train", "--batches", "1"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1] == str(run_dir / "checkpoint" / "step-2")
    assert float(printed[2]) < read_metrics(run_dir)[0]["loss"] - 0.01


def test_generate_continues_the_prompt_reproducibly(capsys, run_dir: Path) -> None:
    flags = ["generate", *TINY, "--job.dump_folder", str(run_dir), "--prompt", "def parse(", "--max-new-tokens", "24",
             "--temperature", "0.9", "--top-p", "0.95", "--seed", "5"]
    assert cli.main(flags) == 0
    first = capsys.readouterr().out
    assert first.startswith("def parse(") and len(first) > len("def parse(\n")
    assert cli.main(flags) == 0
    assert capsys.readouterr().out == first


# The weights named without a job file: the model (and the rest of the job) is the run's own
# config.toml, or the Hugging Face folder's config.json; each as the job file's run gives it.
SOURCES = {"run_folder": ["--job.dump_folder", "{run}"], "step_folder": ["--checkpoint", "{run}/checkpoint/step-2"]}


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_runs_weights_need_no_job_file(capsys, run_dir: Path, source: str) -> None:
    weights = [f.format(run=run_dir) for f in SOURCES[source]]
    sample = ["--prompt", "def parse(", "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "5"]
    assert cli.main(["generate", *TINY, "--job.dump_folder", str(run_dir), *sample]) == 0
    expected = capsys.readouterr().out
    assert cli.main(["generate", *weights, *sample]) == 0
    out, err = capsys.readouterr()
    assert out == expected and "note:" not in err, err
    assert cli.main(["eval", *TINY, "--job.dump_folder", str(run_dir), "--split", "train", "--batches", "1"]) == 0
    expected = capsys.readouterr().out
    assert cli.main(["eval", *weights, "--split", "train", "--batches", "1"]) == 0
    assert capsys.readouterr().out == expected


def test_a_job_file_of_another_model_takes_the_weights_model(capsys, run_dir: Path, hf_dir: Path,
                                                             tmp_path: Path) -> None:
    """A job file of another flavor (bench256) or family (qwen3) beside tiny Llama 4 weights: the
    model is the weights' (their run's config.toml, the folder's config.json), said in one note,
    and the loss is the one the right job file gives; a --model.* flag is asked for by name and
    kept (then it does not fit the weights: one error naming it)."""
    text = Path(DEBUG_CONFIG).read_text()
    jobs = {"bench256": text.replace('flavor = "tiny"', 'flavor = "bench256"'),
            "qwen3": text.replace('name = "llama4"', 'name = "qwen3"')}
    for name, job in jobs.items():
        (tmp_path / f"{name}.toml").write_text(job)
    batch = ["--training.seq_len", "64", "--split", "train", "--batches", "1"]
    for weights, job, note in ((["--job.dump_folder", str(run_dir)], "bench256",
                                f'from {run_dir / "config.toml"}: model.flavor = "tiny"'),
                               (["--checkpoint", str(hf_dir), "--job.dump_folder", str(tmp_path / "none")], "qwen3",
                                f'from {hf_dir / "config.json"}: model.name = "llama4"')):
        assert cli.main(["eval", *TINY, *weights, *batch]) == 0
        expected = capsys.readouterr().out
        assert cli.main(["eval", "--config", str(tmp_path / f"{job}.toml"), *weights, *batch]) == 0
        out, err = capsys.readouterr()
        assert out == expected and out.startswith("train loss "), (out, err)
        assert err.count("note:") == 1 and f"the model is the weights' own, {note}" in err, err
    status = cli.main(["eval", "--config", str(tmp_path / "bench256.toml"), "--model.flavor", "bench256",
                       "--job.dump_folder", str(run_dir), *batch])
    err = capsys.readouterr().err
    assert status == 2 and err.count("error:") == 1 and 'model.flavor = "bench256": does not fit' in err, err


@pytest.mark.parametrize("flags, expected", [
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["generate", "--prompt", "x", "--top-p", "0"], "--top-p"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "--prompt", "x", "--max-new-tokens", "5000"], "model.max_seq_len"),
    (["generate", "--prompt", "x", "--seed", "two"], "--seed"),
    (["generate", "--prompt", "x", "--step", "9"], "no complete checkpoint step-9 in"),
    (["eval", "--step", "1"], "found: step-2"),
    (["generate", "--prompt"], "--prompt"),
    (["eval", "--split", "test"], "--split"),
    (["eval", "--batches", "0"], "--batches"),
    (["eval", "--checkpoint", "{run}/metrics.jsonl"], "neither a DCP checkpoint folder"),
    (["eval", "--checkpoint", "{run}/metrics.jsonl/x"], "neither a DCP checkpoint folder"),
    (["eval", "--checkpoint", "{run}/checkpoint/step-1", "--step", "1"], "not both"),
    (["eval", "--out", "{run}"], "--out"),
    (["eval", "--split", "train", "--training.dataset_mix", '["1:python_docs"]'], "dataset_mix"),
])
def test_bad_flags_are_one_message(capsys, run_dir: Path, flags: list[str], expected: str) -> None:
    command, *rest = flags
    argv = [command, *TINY, "--job.dump_folder", str(run_dir), *(f.format(run=run_dir) for f in rest)]
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and err.count("error:") == 1 and expected in err, err


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_without_a_job_file_nothing_runs(capsys, command: str) -> None:
    assert cli.main([command, "--prompt", "x"] if command == "generate" else [command]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--config" in err and "Traceback" not in err, err
