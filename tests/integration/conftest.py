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
