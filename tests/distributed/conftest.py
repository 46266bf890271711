"""Fixtures of the distributed parity tests."""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import BALANCE, MUON, seed_checkpoint, start_from, train_tiny
from tests.launch import metrics_by_step


def shared_folder(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder `build` fills once per test session, whichever pytest-xdist worker asks first
    (the others wait on a lock and read it): under xdist, session fixtures are per worker, and
    the EP, PP and force-balance modules, on either worker, need the same seed and reference.
    Readers only read or copy it."""
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # a worker's own folder: share its parent, the session's
        root = root.parent
    folder, done = root / "shared" / name, root / "shared" / f"{name}.done"
    folder.parent.mkdir(exist_ok=True)
    with open(root / "shared" / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed building it left a part
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def seed(tmp_path_factory) -> Path:
    """The step-0 folder of a seed checkpoint of `TINY_JOB`, written once (runs only copy it)."""
    return shared_folder(tmp_path_factory, "seed", seed_checkpoint) / "checkpoint" / "step-0"


@pytest.fixture(scope="session")
def balance_reference(seed, tmp_path_factory) -> dict[int, dict]:
    """step -> metrics of the single-process run the EP and PP layouts reproduce: `seed`, the
    whole global batch as one micro-batch, the `BALANCE` MoE settings (run once per session)."""
    def train(folder: Path) -> None:
        train_tiny(start_from(seed, folder), ["--training.local_batch_size", "8", *BALANCE])

    return metrics_by_step(shared_folder(tmp_path_factory, "single_balance", train))


@pytest.fixture(scope="session")
def muon_reference(seed, tmp_path_factory) -> Path:
    """The dump folder of the single-process Muon run every layout suite's `muon_*` jobs
    reproduce: `balance_reference`'s job with `MUON` (20 steps), saving at step 10 too (for the
    resume tests). Run once per session."""
    def train(folder: Path) -> None:
        train_tiny(start_from(seed, folder), ["--training.local_batch_size", "8", *BALANCE, *MUON,
                                              "--checkpoint.interval", "10"])

    return shared_folder(tmp_path_factory, "single_muon", train)
