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


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The dump folder of a 2-step tiny run (seq 64) with its step-2 checkpoint."""
    from tests.helpers import DEBUG_CONFIG
    from tests.launch import run_cli

    folder = tmp_path_factory.mktemp("run")
    run_cli(["train", "--config", DEBUG_CONFIG, "--training.seq_len", "64", "--training.steps", "2",
             "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", folder], timeout=180)
    return folder

