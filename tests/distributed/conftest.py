"""Fixtures of the distributed parity tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import seed_checkpoint


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """The step-0 folder of a seed checkpoint of `TINY_JOB`, written once per test module."""
    return seed_checkpoint(tmp_path_factory.mktemp("seed"))
