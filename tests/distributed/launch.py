"""Run `torchmoe train` on CPU: one process, or a gloo world under torchrun; read its losses."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A tiny job: debugmodel, global batch 8 x 64 tokens, log every step, checkpoints on so the
# seed checkpoint is picked up; warmup 2 so the LR changes across the compared steps.
TINY_JOB = [
    "--config", str(REPO / "configs" / "debug_model.toml"),
    "--training.seq_len", "64", "--training.global_batch_size", "8", "--training.steps", "5",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
    "--checkpoint.enable", "true", "--checkpoint.interval", "1000",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(dump_folder: Path, args: list[str], *, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """`torchmoe train TINY_JOB + args` into `dump_folder`; raises with the output on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "torchmoe", "train"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "-m", "torchmoe", "train"]
    cmd += TINY_JOB + ["--job.dump_folder", str(dump_folder)] + args
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def losses(dump_folder: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl."""
    rows = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def start_from(checkpoint: Path, dump_folder: Path) -> Path:
    """Place a copy of `checkpoint` (a step-N folder) where a run in `dump_folder` resumes from."""
    target = dump_folder / "checkpoint" / checkpoint.name
    shutil.copytree(checkpoint, target)
    return dump_folder


def metrics(dump_folder: Path) -> dict[int, dict]:
    """step -> the whole metrics.jsonl record."""
    rows = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def seed_checkpoint(folder: Path, args: list[str] = ()) -> Path:
    """Write a seed checkpoint (one process) and return its step-0 folder."""
    run_train(folder, ["--checkpoint.create_seed_checkpoint", "true", *args])
    return folder / "checkpoint" / "step-0"
