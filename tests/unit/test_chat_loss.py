"""Chat SFT's loss through the trainer: the mean over the global batch's targets, as transformers
computes it with the same tokens ignored, whatever the micro-batching; a row without targets
adds nothing; document masking takes the chat rows' own document starts.

    python -m pytest -q tests/unit/test_chat_loss.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.any_checkpoint import reference_model, save_checkpoint
from tests.chat_fixtures import CHATML_SPECIALS, HARMONY, HARMONY_SPECIALS, chatml, deepseek, tokenizer_folder
from tests.chat_jobs import chat_job, write_chat_file
from torchmoe.data.micro_batches import IGNORE, MicroBatch
from torchmoe.training.loop import Trainer

# (family, tokenizer, training.loss_on): templates with and without generation markers.
CASES = [("qwen3", "chatml_marked", "assistant"), ("qwen3", "chatml", "assistant"),
         ("deepseek_v3", "deepseek_marked", "assistant"), ("deepseek_v3", "deepseek", "all"),
         ("gpt_oss", "harmony", "last")]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_loss")
    return {
        "qwen3": save_checkpoint("qwen3", root / "qwen3"),
        "deepseek_v3": save_checkpoint("deepseek_v3", root / "deepseek_v3"),
        "gpt_oss": save_checkpoint("gpt_oss", root / "gpt_oss"),
        "chatml_marked": chatml(root / "chatml_marked", marked=True),
        "chatml": chatml(root / "chatml", marked=False),
        "deepseek_marked": deepseek(root / "deepseek_marked", marked=True),
        "deepseek": deepseek(root / "deepseek", marked=False),
        "harmony": tokenizer_folder(root / "harmony", HARMONY, HARMONY_SPECIALS, eos="<|return|>"),
        "data": write_chat_file(root / "chat.jsonl"),
    }


def _trainer(world, family: str, tokenizer: str, dump: Path, *flags: str) -> Trainer:
    trainer = Trainer(chat_job(world[family], world[tokenizer], world["data"], dump, *flags))
    trainer.load_initial_state()
    return trainer


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,tokenizer,loss_on", CASES)
def test_first_step_loss_is_transformers_loss_with_the_same_labels_ignored(world, tmp_path, family, tokenizer,
                                                                            loss_on):
    """Two micro-batches of packed conversations: the step's loss is transformers' mean cross
    entropy over every target of the global batch (labels -100 elsewhere), within 1e-5."""
    trainer = _trainer(world, family, tokenizer, tmp_path, "--training.loss_on", loss_on)
    batch = trainer.dataloader.next_batch()
    assert len(batch) == 2 and 0 < sum(mb.supervised for mb in batch) < sum(mb[1].numel() for mb in batch)
    hf = reference_model(family)
    with torch.no_grad():
        logits = torch.cat([hf(inputs).logits for inputs, _ in batch])
    labels = torch.cat([labels for _, labels in batch])
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    got = trainer.train_step(batch).loss
    assert got == pytest.approx(want.item(), rel=1e-5, abs=0)
    # The micro-batches hold different counts: a mean of their means would differ (or be NaN).
    assert batch[0].supervised != batch[1].supervised


def test_gradient_accumulation_gives_the_one_micro_batch_step(world, tmp_path):
    """Global batch 4: one micro-batch of 4 rows or two of 2 (different target counts each):
    the same loss, gradients and norm (1e-5)."""
    one = _trainer(world, "qwen3", "chatml", tmp_path / "one", "--training.local_batch_size", "4")
    two = _trainer(world, "qwen3", "chatml", tmp_path / "two")
    results = [t.train_step(t.dataloader.next_batch()) for t in (one, two)]
    assert results[1].loss == pytest.approx(results[0].loss, rel=1e-5)
    assert results[1].grad_norm == pytest.approx(results[0].grad_norm, rel=1e-5)


def test_a_micro_batch_without_targets_adds_nothing_and_a_step_without_any_is_zero(world, tmp_path):
    """A micro-batch whose labels are all ignored leaves the step's loss and gradients as they
    are without it; a step whose global count is 0 has loss 0 and zero gradients (no NaN). (The
    router's load-balancing loss, off here, is over every token, targets or not.)"""
    trainer = _trainer(world, "qwen3", "chatml", tmp_path, "--model.aux_loss_coeff", "0")
    first, second = trainer.dataloader.next_batch()
    empty = MicroBatch(second[0], torch.full_like(second[1], IGNORE), second.starts, 0)
    alone = trainer.forward_backward([first])
    want = _grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    with_empty = trainer.forward_backward([first, empty])
    torch.testing.assert_close(with_empty, alone, rtol=1e-6, atol=0)
    for name, grad in _grads(trainer).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=0, msg=name)
    trainer.optimizer.zero_grad(set_to_none=True)
    assert trainer.forward_backward([empty, empty]).tolist() == [0.0]
    assert all((g == 0).all() for g in _grads(trainer).values())


def test_document_masking_takes_the_chat_rows_document_starts(world, tmp_path):
    """With document masking each packed conversation attends to itself only, though ChatML's
    EOS (<|im_end|>) ends every turn inside it: the loss is transformers' on each conversation
    alone (the rows cut at the loader's starts), within 1e-5."""
    trainer = _trainer(world, "qwen3", "chatml", tmp_path, "--training.document_masking", "true")
    batch = trainer.dataloader.next_batch()
    hf = reference_model("qwen3")
    total, count = 0.0, 0
    with torch.no_grad():
        for mb in batch:
            for row in range(mb[0].shape[0]):
                starts = mb.starts[row]
                for start in sorted(set(starts.tolist())):
                    cols = (starts == start).nonzero().flatten()
                    logits = hf(mb[0][row, cols][None]).logits[0]
                    labels = mb[1][row, cols]
                    total += F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE).item()
                    count += int((labels != IGNORE).sum())
    assert count == sum(mb.supervised for mb in batch)
    assert max(len(set(mb.starts[r].tolist())) for mb in batch for r in range(2)) >= 2  # rows pack conversations
    assert trainer.train_step(batch).loss == pytest.approx(total / count, rel=1e-5)


def test_validation_is_the_masked_mean_over_the_validation_targets(world, tmp_path):
    """Validation (and so `torchmoe eval`) on chat data: the mean over the targets of its
    batches, transformers' with the same labels ignored (1e-5), not over every token."""
    trainer = _trainer(world, "qwen3", "chatml", tmp_path, "--validation.enable", "true",
                       "--validation.dataset", "chat",
                       "--validation.dataset_path", str(world["data"]), "--validation.local_batch_size", "2",
                       "--validation.seq_len", "48", "--validation.steps", "2")
    loader = trainer.validation.loader()
    batches = [mb for _ in range(2) for mb in loader.next_batch()]
    hf = reference_model("qwen3")
    with torch.no_grad():
        logits = torch.cat([hf(inputs).logits for inputs, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    assert (labels == IGNORE).any()
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    assert trainer.validate() == pytest.approx(want.item(), rel=1e-5)
