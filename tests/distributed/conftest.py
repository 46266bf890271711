"""Fixtures of the distributed parity tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import BALANCE, seed_checkpoint, start_from, train_tiny
from tests.launch import metrics_by_step


@pytest.fixture(scope="session")
def seed(tmp_path_factory) -> Path:
    """The step-0 folder of a seed checkpoint of `TINY_JOB`, written once (runs only copy it)."""
    return seed_checkpoint(tmp_path_factory.mktemp("seed"))


@pytest.fixture(scope="session")
def balance_reference(seed, tmp_path_factory) -> dict[int, dict]:
    """step -> metrics of the single-process run the EP and PP layouts reproduce: `seed`, the
    whole global batch as one micro-batch, the `BALANCE` MoE settings."""
    folder = start_from(seed, tmp_path_factory.mktemp("single_balance"))
    train_tiny(folder, ["--training.local_batch_size", "8", *BALANCE])
    return metrics_by_step(folder)
