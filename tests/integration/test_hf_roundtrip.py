"""Training from Hugging Face weights and saving Hugging Face weights, through `torchmoe train`.

    python -m pytest -q -m integration tests/integration/test_hf_roundtrip.py

`initial_load_in_hf` must start exactly from the folder's weights, and `last_save_in_hf` must
write a folder that transformers loads with the trained model's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers import DEBUG_CONFIG, empty_tiny_model  # noqa: E402
from tests.launch import read_metrics, run_train  # noqa: E402
from torchmoe.checkpoints.checkpoint_state import load_model_only  # noqa: E402
from torchmoe.hf import load_model, save_model  # noqa: E402
from torchmoe.models.llama4 import Transformer  # noqa: E402

# Three logged steps of the tiny flavor on 8 x 64 tokens. The aux-loss-free expert bias stays zero
# (load_balance_coeff 0): Hugging Face's Llama 4 has no such bias, and with a non-zero one the saved
# folder would route differently from the trained model.
TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "64",
        "--training.global_batch_size", "8", "--training.local_batch_size", "8", "--training.steps", "3",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--model.load_balance_coeff", "0",
        "--checkpoint.enable", "true"]

# In-process DCP loads here run without a process group, which DCP warns about on every call.
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _train(dump_folder: Path, flags: list[str]) -> None:
    run_train([*TINY, *flags], dump_folder=dump_folder, timeout=120)  # one thread: bit-reproducible fp32


def _losses(dump_folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(dump_folder)]


def _model_from_dcp(path: Path) -> Transformer:
    """A CPU tiny model holding the model weights of a torchmoe step-N checkpoint."""
    model = empty_tiny_model()
    load_model_only(path, [model])
    return model


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def test_train_from_hf_weights_and_save_hf(tmp_path: Path) -> None:
    # The Hugging Face folder holds the weights of seed 1 (from a seed checkpoint, so exactly what
    # a run of seed 1 initialises); the run loading it has seed 0, so only loading explains a match.
    _train(tmp_path / "seed", ["--training.seed", "1", "--checkpoint.create_seed_checkpoint", "true"])
    save_model(_model_from_dcp(tmp_path / "seed" / "checkpoint" / "step-0"), tmp_path / "hf_in")
    _train(tmp_path / "seed1", ["--training.seed", "1"])
    _train(tmp_path / "run", ["--training.seed", "0", "--checkpoint.initial_load_path", str(tmp_path / "hf_in"),
                              "--checkpoint.initial_load_in_hf", "true", "--checkpoint.last_save_in_hf", "true"])
    assert _losses(tmp_path / "run") == _losses(tmp_path / "seed1")  # the whole curve, bit for bit

    hf_out = tmp_path / "run" / "checkpoint" / "step-3-hf"
    trained = _model_from_dcp(tmp_path / "run" / "checkpoint" / "step-3")
    assert all(moe.expert_bias.abs().max() == 0 for moe in trained.moe_layers())
    ours = load_model(hf_out)
    theirs = transformers.Llama4ForCausalLM.from_pretrained(hf_out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(0))  # > chunk 64
    with torch.no_grad():
        want = trained(tokens)
        got_ours = ours(tokens)
        got_hf = theirs(tokens).logits
    assert torch.equal(got_ours, want)  # the same fp32 weights through the same code
    assert _max_rel_err(want, got_hf) <= 1e-5
