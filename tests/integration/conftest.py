"""Fixtures the integration tests share."""

from __future__ import annotations

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


@pytest.fixture(autouse=True)
def _restore_torchmoe_logging():
    """Tests that run `torchmoe.cli.main` in this process get the CLI's logging setup (its own
    stderr handler, no propagation to the root logger); undo it, or pytest's log capture would
    miss the `torchmoe` records of every later test."""
    import logging

    log = logging.getLogger("torchmoe")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]
