"""`python -m torchmoe train` end to end on CPU: exact resume, gradient accumulation, metrics,
SIGTERM, torn checkpoints, divergence, and starting from a DCP checkpoint (the default job's
convergence: `test_readme_in_order.py`).

    python -m pytest -q -m integration tests/integration/test_train.py

Each run is one process with OMP_NUM_THREADS=1, so fp32 CPU results are reproducible bit for bit.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, start_from
from tests.launch import cli_command, cli_env, read_metrics, run_train
from torchmoe.config import load_job_config

# The tiny flavor on one global batch of 8 x 64 tokens per step, every step logged, warmup 2 so the LR
# changes across the compared steps, checkpoints on (every step-N folder below is complete).
TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "64", "--training.global_batch_size", "8",
        "--training.local_batch_size", "8", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
        "--checkpoint.enable", "true"]
SIX_STEPS = [*TINY, "--training.steps", "6", "--checkpoint.interval", "3"]

pytestmark = pytest.mark.integration


def train(dump_folder: Path, flags: list[str], *, returncode: int = 0) -> subprocess.CompletedProcess[str]:
    """Run `torchmoe train FLAGS` into `dump_folder` (one process, one thread: reproducible);
    fails the test on another exit status."""
    return run_train(flags, dump_folder=dump_folder, timeout=120, expect=returncode)


def checkpoints(dump_folder: Path) -> list[str]:
    """Names of the step entries of the checkpoint folder, complete or not (not its lock)."""
    return sorted(p.name for p in (dump_folder / "checkpoint").glob("step-*"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """Six steps without interruption; checkpoints at steps 3 and 6."""
    folder = tmp_path_factory.mktemp("full")
    train(folder, SIX_STEPS)
    assert [r["step"] for r in read_metrics(folder)] == [1, 2, 3, 4, 5, 6]
    assert checkpoints(folder) == ["step-3", "step-6"]
    return folder


def test_resume_continues_bitwise(full_run: Path, tmp_path: Path) -> None:
    folder = start_from(full_run / "checkpoint" / "step-3", tmp_path)
    train(folder, SIX_STEPS)
    resumed, reference = read_metrics(folder), read_metrics(full_run)[3:]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert resumed[0]["resumed_from"] == 3  # the report's mark
    assert all("resumed_from" not in r for r in resumed[1:] + read_metrics(full_run))
    for got, want in zip(resumed, reference):
        # Model, optimizer, LR schedule, data position and MoE router state all continue.
        for key in ("loss", "grad_norm", "lr", "tokens_per_expert"):
            assert got[key] == want[key], (got["step"], key)


def test_resume_logs_each_step_once(full_run: Path, tmp_path: Path) -> None:
    """A run killed after logging steps 4-6 but saving only step-3 logs 4-6 again on resume:
    metrics.jsonl keeps the new records, once each (a torn last line is dropped too)."""
    folder = start_from(full_run / "checkpoint" / "step-3", tmp_path)
    # The killed run's records of steps 4-6 are marked, so the kept ones can be told apart.
    before = [{**r, "loss": -1.0} if r["step"] > 3 else r for r in read_metrics(full_run)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before) + '{"step": 7, "lo')
    train(folder, SIX_STEPS)
    rows = read_metrics(folder)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[:3] == before[:3]
    assert [r["loss"] for r in rows[3:]] == [r["loss"] for r in read_metrics(full_run)[3:]]


def test_torn_checkpoints_are_never_loaded(full_run: Path, tmp_path: Path) -> None:
    """A save killed before its rename (step-6.tmp-*) and a step folder without its completion
    marker are skipped: the run resumes from step-3, then replaces both with its own step-6."""
    folder = start_from(full_run / "checkpoint" / "step-3", tmp_path)
    for name in ("step-6", "step-6.tmp-0badc0de"):
        torn = folder / "checkpoint" / name
        shutil.copytree(full_run / "checkpoint" / "step-6", torn)
        (torn / ".complete").unlink()
        (torn / ".metadata").write_text("torn")  # loading it would fail loudly
    proc = train(folder, SIX_STEPS)
    assert [r["step"] for r in read_metrics(folder)] == [4, 5, 6], proc.stderr
    assert checkpoints(folder) == ["step-3", "step-6"]
    assert (folder / "checkpoint" / "step-6" / ".complete").is_file()


def test_gradient_accumulation_matches_one_micro_batch(full_run: Path, tmp_path: Path) -> None:
    """Four micro-batches of 2 train as one of 8; logged every 4th step, metrics.jsonl still holds
    every step's loss, gradient norm and LR (the steps between logs in a short record)."""
    train(tmp_path, [*TINY, "--training.steps", "6", "--training.local_batch_size", "2", "--checkpoint.enable", "false",
                     "--metrics.log_freq", "4"])
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "tokens_per_sec" in r] == [1, 4, 6]  # first, 4th, last
    assert all(sorted(r) == ["elapsed_s", "grad_norm", "loss", "lr", "step"] for r in records if r["step"] in (2, 3, 5))
    for got, want in zip(records, read_metrics(full_run), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), got["step"]


def test_metrics_fields_and_resolved_config(full_run: Path) -> None:
    rows = read_metrics(full_run)
    for prev, row in zip([None, *rows], rows):
        assert 2.0 < row["loss"] < 8.0  # ln(512) = 6.2 at init for the 512-token vocabulary
        assert 0.0 < row["grad_norm"] < 100.0
        assert 0.0 < row["lr"] <= 3e-3  # optimizer.lr of debug_model.toml
        assert row["tokens_per_sec"] > 0 and row["tflops"] > 0
        assert row["mfu"] is None  # no known peak on CPU
        assert 0.05 < row["memory_gib"] < 16.0
        assert 1.0 <= row["moe_imbalance"] <= 8.0  # 8 experts: 1 = balanced, 8 = one takes all
        # 2 MoE layers x 8 experts; top-1 routes each of the 8 x 64 tokens once per layer.
        assert [sum(layer) for layer in row["tokens_per_expert"]] == [512, 512]
        if prev is not None:
            assert row["elapsed_s"] > prev["elapsed_s"]
    assert rows[1]["lr"] > rows[0]["lr"]  # warmup

    written = full_run / "config.toml"
    reloaded = load_job_config(["--config", str(written)])
    assert reloaded == load_job_config([*SIX_STEPS, "--job.dump_folder", str(full_run)])


def _sigterm_after_first_log(tmp_path: Path, flags: list[str]) -> str:
    """Start a 200-step run, SIGTERM it once a step is logged; returns its output (exit 0)."""
    cmd = cli_command(["train", *TINY, "--training.steps", "200", *flags, "--job.dump_folder", tmp_path])
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "metrics.jsonl").is_file() or not read_metrics(tmp_path):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, (tmp_path / "log.txt").read_text()
        finally:
            proc.kill()
    return (tmp_path / "log.txt").read_text()


def test_sigterm_saves_and_resume_finishes(tmp_path: Path) -> None:
    log = _sigterm_after_first_log(tmp_path, ["--checkpoint.interval", "1000"])
    stopped = read_metrics(tmp_path)[-1]["step"]
    assert f"received SIGTERM: stopping after step {stopped}" in log and f"saving checkpoint step-{stopped}" in log
    assert "(disabled)" not in log  # the async mode is no part of the message
    assert stopped < 200
    assert checkpoints(tmp_path) == [f"step-{stopped}"]
    assert (tmp_path / "checkpoint" / f"step-{stopped}" / ".complete").is_file()

    train(tmp_path, [*TINY, "--training.steps", str(stopped + 2)])
    assert [r["step"] for r in read_metrics(tmp_path)][-3:] == [stopped, stopped + 1, stopped + 2]
    assert checkpoints(tmp_path) == [f"step-{stopped}", f"step-{stopped + 2}"]


def test_sigterm_without_checkpointing_says_nothing_is_saved(tmp_path: Path) -> None:
    log = _sigterm_after_first_log(tmp_path, ["--checkpoint.enable", "false", "--lr_scheduler.warmup_steps", "500"])
    stopped = read_metrics(tmp_path)[-1]["step"]
    assert f"received SIGTERM: stopping after step {stopped}" in log
    assert f"checkpoint.enable is false: stopping at step {stopped} without a checkpoint" in log
    assert "saving a checkpoint" not in log and not (tmp_path / "checkpoint").exists()
    # A warmup longer than the run is allowed, with a warning.
    assert log.count("lr_scheduler.warmup_steps (500) >= training.steps (200)") == 1


def test_divergence_stops_with_one_message_and_no_checkpoint(tmp_path: Path) -> None:
    # lr 1e30 without clipping (nor weight decay: lr * weight_decay >= 1 is refused before training):
    # step 1 is fine, its update overflows the weights, step 2 is NaN.
    proc = train(tmp_path, [*TINY, "--training.steps", "4", "--checkpoint.interval", "1", "--optimizer.lr", "1e30",
                            "--optimizer.weight_decay", "0", "--training.max_norm", "0", "--lr_scheduler.warmup_steps",
                            "0"], returncode=1)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("error:") == 1 and "at step 2" in proc.stderr, proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert checkpoints(tmp_path) == ["step-1"]


def test_initial_load_path_starts_from_dcp_weights(tmp_path: Path) -> None:
    """Weights from a seed checkpoint of seed 1, loaded into a run of seed 0, give step 1 the
    loss of a run initialised with seed 1."""
    train(tmp_path / "seed", [*TINY, "--training.seed", "1", "--checkpoint.create_seed_checkpoint", "true"])
    train(tmp_path / "seed1", [*TINY, "--training.steps", "1", "--training.seed", "1"])
    train(tmp_path / "loaded", [*TINY, "--training.steps", "1", "--training.seed", "0",
                                "--checkpoint.initial_load_path", str(tmp_path / "seed" / "checkpoint" / "step-0")])
    assert read_metrics(tmp_path / "loaded")[0]["loss"] == read_metrics(tmp_path / "seed1")[0]["loss"]
