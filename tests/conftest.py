"""Fixtures of every tier."""

from __future__ import annotations

import logging

import pytest

# The `torchmoe` logger as the tests found it, before any test or fixture ran.
_TORCHMOE_LOG = logging.getLogger("torchmoe")
_PRISTINE_LOG = (list(_TORCHMOE_LOG.handlers), _TORCHMOE_LOG.level, _TORCHMOE_LOG.propagate)


@pytest.fixture(autouse=True)
def _restore_torchmoe_logging():
    """Tests and fixtures (module-scoped ones too) that run `torchmoe.cli.main` in this process get
    the CLI's logging setup (its own stderr handler, no propagation to the root logger); undo it
    after every test, or pytest's log capture would miss the `torchmoe` records of later tests."""
    yield
    _TORCHMOE_LOG.handlers[:], _TORCHMOE_LOG.level, _TORCHMOE_LOG.propagate = _PRISTINE_LOG
