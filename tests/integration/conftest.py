"""Fixtures the integration tests share."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A Hugging Face folder of a freshly initialised tiny model (one model.safetensors)."""
    from torchmoe.hf import save_model
    from torchmoe.models.llama4 import FLAVORS, Transformer

    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed=0)
    folder = tmp_path_factory.mktemp("hf")
    save_model(model, folder)
    return folder


# The `torchmoe` logger as the tests found it, before any test or fixture of this tier ran.
_TORCHMOE_LOG = logging.getLogger("torchmoe")
_PRISTINE_LOG = (list(_TORCHMOE_LOG.handlers), _TORCHMOE_LOG.level, _TORCHMOE_LOG.propagate)


@pytest.fixture(autouse=True)
def _restore_torchmoe_logging():
    """Tests and fixtures (module-scoped ones too) that run `torchmoe.cli.main` in this process get
    the CLI's logging setup (its own stderr handler, no propagation to the root logger); undo it
    after every test, or pytest's log capture would miss the `torchmoe` records of later tests."""
    yield
    _TORCHMOE_LOG.handlers[:], _TORCHMOE_LOG.level, _TORCHMOE_LOG.propagate = _PRISTINE_LOG
