"""The training step in process (one rank, no process group): gradient accumulation and divergence.

    python -m pytest -q tests/unit/test_trainer.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import compute_dtypes
from torchmoe.config import load_job_config
from torchmoe.data.micro_batches import MicroBatch
from torchmoe.training.loop import Trainer
from torchmoe.weights.divergence import TrainingDiverged

REPO = Path(__file__).resolve().parents[2]


def _trainer(dump_folder: Path, *flags: str) -> Trainer:
    """A trainer of the tiny flavor on one global batch of 8 x 64 tokens, with the auxiliary losses on
    so that their scaling under accumulation is covered too."""
    cfg = load_job_config([
        "--config", str(REPO / "configs" / "debug_model.toml"), "--job.dump_folder", str(dump_folder),
        "--training.seq_len", "64", "--training.local_batch_size", "8", "--training.steps", "2",
        "--model.aux_loss_coeff", "0.01", "--model.z_loss_coeff", "0.001", *flags,
    ])
    return Trainer(cfg)


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in trainer.model.named_parameters()}


def test_accumulated_gradients_equal_one_big_batch(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    [(inputs, labels)] = trainer.dataloader.next_batch()  # (8, 64) each
    split = [MicroBatch(x, y) for x, y in zip(inputs.split(2), labels.split(2))]  # 4 micro-batches of 2 sequences

    loss_split = trainer.forward_backward(split)
    grads_split = _grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss_whole = trainer.forward_backward([MicroBatch(inputs, labels)])
    grads_whole = _grads(trainer)

    assert loss_split.item() == pytest.approx(loss_whole.item(), rel=1e-6)
    assert grads_split.keys() == grads_whole.keys() and len(grads_whole) > 0
    for name, whole in grads_whole.items():
        assert whole.abs().max() > 0, name  # every parameter, routed experts included, is trained
        # Only the summation order differs: agreement to fp32 rounding of the largest entries.
        torch.testing.assert_close(grads_split[name], whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_non_finite_loss_raises_before_stepping(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    with torch.no_grad():
        trainer.model.norm.weight.fill_(math.nan)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    with pytest.raises(TrainingDiverged, match="loss is nan at step 1"):
        trainer.train_step(trainer.dataloader.next_batch())

    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_process_computes_in_the_requested_dtype(tmp_path: Path, dtype: str) -> None:
    """No FSDP/DDP policy here: bf16 is honoured by autocast (before it, one process computed in
    fp32 whatever was asked), while weights, gradients and optimizer state stay fp32."""
    trainer = _trainer(tmp_path, "--training.mixed_precision_param", dtype)
    got = compute_dtypes(trainer)
    assert got["q_proj"] == got["experts"] == [f"torch.{dtype}"]
    assert got["params"] == got["grads"] == ["torch.float32"]
    assert trainer.compute_dtype == getattr(torch, dtype)  # what MFU's peak is looked up for
    trainer.optimizer.step()
    states = {v.dtype for state in trainer.optimizer.state.values() for k, v in state.items() if k != "step"}
    assert states == {torch.float32}


def test_pure_bf16_keeps_weights_gradients_and_optimizer_state_in_bf16(tmp_path: Path) -> None:
    """training.dtype = "bfloat16" on one process: every parameter, gradient and AdamW moment is
    bf16 and the blocks compute in bf16 without autocast; the buffers that must stay exact keep
    their dtype (router bias and token counts fp32, RoPE table complex64)."""
    trainer = _trainer(tmp_path, "--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16")
    assert trainer.model.autocast_dtype is None
    got = compute_dtypes(trainer)
    assert got["q_proj"] == got["experts"] == got["params"] == got["grads"] == ["torch.bfloat16"]
    trainer.optimizer.step()
    states = {k: {v.dtype for state in trainer.optimizer.state.values() for key, v in state.items() if key == k}
              for k in ("exp_avg", "exp_avg_sq")}
    assert states == {"exp_avg": {torch.bfloat16}, "exp_avg_sq": {torch.bfloat16}}
    buffers = {name.rpartition(".")[2]: b.dtype for name, b in trainer.model.named_buffers()}
    assert buffers == {"freqs_cis": torch.complex64, "expert_bias": torch.float32, "tokens_per_expert": torch.float32}
    assert torch.get_default_dtype() == torch.float32  # the model was built in bf16, the process left as it was
