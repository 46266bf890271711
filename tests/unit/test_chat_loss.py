"""Chat SFT's loss through the trainer: the mean over the global batch's targets, as transformers
computes it with the same tokens ignored, whatever the micro-batching; a row without targets
adds nothing; document masking, chat data's default, takes the chat rows' own document starts, and
each packed conversation's loss is transformers' on the conversation alone in every family; the
windows' padding takes no part in the MoE routers' statistics, balance losses or bias updates.

    python -m pytest -q tests/unit/test_chat_loss.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.any_checkpoint import reference_model, save_checkpoint
from tests.chat_fixtures import CHATML_SPECIALS, HARMONY, HARMONY_SPECIALS, chatml, deepseek, tokenizer_folder
from tests.chat_jobs import RouterTaps, chat_job, data_mask, write_chat_file
from tests.helpers import BALANCE
from tests.launch import metrics_by_step
from torchmoe.config.datasets import unmasked_examples_note
from torchmoe.data.micro_batches import IGNORE, MicroBatch
from torchmoe.training.console import opening
from torchmoe.training.loop import Trainer

# (family, tokenizer, training.loss_on): templates with and without generation markers.
CASES = [("qwen3", "chatml_marked", "assistant"), ("qwen3", "chatml", "assistant"),
         ("deepseek_v3", "deepseek_marked", "assistant"), ("deepseek_v3", "deepseek", "all"),
         ("gpt_oss", "harmony", "last")]


# Short exchanges of several lengths: a row of 96 tokens packs a few, each with targets.
SHORT_ROWS = [{"messages": [{"role": "user", "content": f"q{i} " + "ab" * (i % 4)},
                            {"role": "assistant", "content": "answer " + "xy" * (i % 3 + 1)}]} for i in range(12)]


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
        "short": write_chat_file(root / "short.jsonl", SHORT_ROWS),
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
    """Two micro-batches of packed conversations, document masking set off: the step's loss is
    transformers' mean cross entropy over every target of the global batch (labels -100
    elsewhere), each row run whole, within 1e-5."""
    trainer = _trainer(world, family, tokenizer, tmp_path, "--training.loss_on", loss_on,
                       "--training.document_masking", "false")
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


@pytest.mark.parametrize("balance", [[], BALANCE], ids=["default", "balance"])
def test_gradient_accumulation_gives_the_one_micro_batch_step(world, tmp_path, balance):
    """Global batch 4: one micro-batch of 4 rows or two of 2 (different target counts and data
    tokens each): the same loss, gradients and norm (1e-5), with the router's balance loss and
    z-loss on too (each over the data tokens: a mean per micro-batch would differ)."""
    one = _trainer(world, "qwen3", "chatml", tmp_path / "one", "--training.local_batch_size", "4", *balance)
    two = _trainer(world, "qwen3", "chatml", tmp_path / "two", *balance)
    results = [t.train_step(t.dataloader.next_batch()) for t in (one, two)]
    assert results[1].loss == pytest.approx(results[0].loss, rel=1e-5)
    assert results[1].grad_norm == pytest.approx(results[0].grad_norm, rel=1e-5)


def test_a_micro_batch_without_targets_adds_nothing_and_a_step_without_any_is_zero(world, tmp_path):
    """A micro-batch whose labels are all ignored leaves the step's loss and gradients as they
    are without it; a step whose global count is 0 has loss 0 and zero gradients (no NaN). (The
    router's load-balancing loss, off here, is over every data token, targets or not.)"""
    trainer = _trainer(world, "qwen3", "chatml", tmp_path, "--model.aux_loss_coeff", "0")
    first, second = trainer.dataloader.next_batch()
    empty = MicroBatch(second[0], torch.full_like(second[1], IGNORE), second.starts, 0, second.real)
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


# (family, tokenizer): Qwen3 (ChatML's EOS <|im_end|> ends every turn inside a conversation),
# DeepSeek-V3 (latent attention), gpt-oss (sinks, and a sliding window of 4 keys, shorter than
# any conversation).
MASKED = [("qwen3", "chatml", "assistant"), ("deepseek_v3", "deepseek_marked", "assistant"),
          ("gpt_oss", "harmony", "last")]


@pytest.mark.parametrize("family,tokenizer,loss_on", MASKED)
def test_each_packed_conversation_is_transformers_on_it_alone(world, tmp_path, family, tokenizer, loss_on):
    """Chat data masks documents by default: each packed conversation attends to itself only, so
    its logits in the trainer's forward are transformers' on the conversation alone (the rows cut
    at the loader's starts; 1e-5), and the step's loss is transformers' (every conversation's sum
    of target losses over the global count; rel 1e-5). Set off, the conversations after a row's
    first get other logits, and the run's opening lines say so."""
    rows = ("--training.dataset_path", str(world["short"]), "--training.seq_len", "96", "--training.loss_on", loss_on)
    trainer = _trainer(world, family, tokenizer, tmp_path, *rows)
    assert trainer.cfg.training.document_masking and unmasked_examples_note(trainer.cfg.training) is None
    batch = trainer.dataloader.next_batch()
    hf = reference_model(family)
    total, count, later, moved = 0.0, 0, 0, []
    with torch.no_grad():
        for mb in batch:
            masked_logits = trainer.model(*trainer._local_columns(mb[0], mb[1], mb.starts)[::2])
            unmasked_logits = trainer.model(mb[0])  # what the rows give with masking off: no tables
            for row in range(mb[0].shape[0]):
                starts = mb.starts[row]
                for start in sorted(set(starts.tolist())):
                    cols = (starts == start).nonzero().flatten()
                    logits = hf(mb[0][row, cols][None]).logits[0]
                    torch.testing.assert_close(masked_logits[row, cols], logits, rtol=1e-5, atol=1e-5)
                    labels = mb[1][row, cols]
                    total += F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE).item()
                    count += int((labels != IGNORE).sum())
                    if start:
                        later += int((labels != IGNORE).sum())
                        moved.append((unmasked_logits[row, cols] - logits).abs().max().item())
    assert count == sum(mb.supervised for mb in batch)
    assert later > 0.2 * count, (later, count)  # conversations packed after another's have targets
    assert min(moved) > 1e-3, moved
    assert trainer.train_step(batch).loss == pytest.approx(total / count, rel=1e-5)
    unmasked = dataclasses.replace(trainer.cfg, training=dataclasses.replace(trainer.cfg.training,
                                                                             document_masking=False))
    lines = opening(unmasked, trainer.model_args, step=0, global_batch_size=4, world_size=1, device_type="cpu",
                    dump_folder=tmp_path).splitlines()
    assert lines[-1] == ("training.document_masking = false: every chat example attends to the examples packed "
                         "before it in its batch row (the default for such data is true: each attends to itself "
                         "only)")


def test_validation_is_the_masked_mean_over_the_validation_targets(world, tmp_path):
    """Validation (and so `torchmoe eval`) on chat data: the mean over the targets of its
    batches, transformers' with the same labels ignored (1e-5), not over every token; what it
    covers (`torchmoe eval` prints it) is the batches' targets and the conversations holding one,
    counted here row by row (rows of 256 tokens: several conversations each)."""
    trainer = _trainer(world, "qwen3", "chatml", tmp_path, "--validation.enable", "true",
                       "--validation.dataset", "chat",
                       "--validation.dataset_path", str(world["data"]), "--validation.local_batch_size", "2",
                       "--validation.seq_len", "256", "--validation.steps", "2", "--training.document_masking",
                       "false")
    loader = trainer.validation.loader()
    batches = [mb for _ in range(2) for mb in loader.next_batch()]
    hf = reference_model("qwen3")
    with torch.no_grad():
        logits = torch.cat([hf(inputs).logits for inputs, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    assert (labels == IGNORE).any()
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    conversations = sum(bool((mb[1][row][mb.starts[row] == start] != IGNORE).any())
                        for mb in batches for row in range(mb[1].shape[0]) for start in set(mb.starts[row].tolist()))
    result = trainer.validate()
    assert result.loss == pytest.approx(want.item(), rel=1e-5)
    assert (result.batches, result.targets, result.documents) == (2, int((labels != IGNORE).sum()), conversations)
    assert conversations > len(batches) * 2  # rows of 256 tokens pack several conversations with targets


def test_padding_takes_no_part_in_the_routers_statistics(world, tmp_path):
    """Two steps of Qwen3-MoE chat SFT with the expert bias, the balance loss and the z-loss on,
    the windows' padding 25-50% of some rows: against a brute-force count over the data tokens
    (the trailing EOS run of each row is padding; the routers' own top-k, scores and logits
    tapped), each step's per-expert load in metrics.jsonl and its moe_imbalance, the expert biases
    after the steps, and each layer's balance loss (per row over its data tokens, the mean over
    the global batch's rows) and z-loss (the mean over the step's data tokens) as the step's
    micro-batches attach them. Counted over every token the loads differ: the fix is needed."""
    coeff = {name: float(BALANCE[BALANCE.index(f"--model.{name}") + 1])
             for name in ("load_balance_coeff", "aux_loss_coeff", "z_loss_coeff")}
    trainer = _trainer(world, "qwen3", "chatml", tmp_path, *BALANCE, "--training.steps", "2")
    eos, top_k = trainer.tokenizer.eos_id, trainer.model_args.top_k
    steps: list[list[MicroBatch]] = []
    draw = trainer.dataloader.next_batch
    trainer.dataloader.next_batch = lambda: steps.append(draw()) or steps[-1]
    moes = {name: block.moe for name, block in trainer.model.layers.items() if block.moe_enabled}
    attached: dict[str, list[float]] = {name: [] for name in moes}  # each call's share of the step's aux losses
    for name, moe in moes.items():
        moe.register_forward_hook(lambda m, args, out, name=name: attached[name].append(
            float(m.last_aux_loss) * m.aux_loss_grad_scale))
    biases = {name: torch.zeros(trainer.model_args.num_experts) for name in moes}
    with RouterTaps(trainer.model) as taps:
        trainer.fit()
    records = metrics_by_step(tmp_path)
    for step, batch in enumerate(steps, start=1):
        masks = [data_mask(inputs, eos) for inputs, _ in batch]
        assert all(torch.equal(mb.real, mask) for mb, mask in zip(batch, masks))  # the loader's mask is the data
        stats = taps.statistics(masks, top_k, step - 1)
        record = records[step]
        counts = torch.stack([layer["counts"] for layer in stats.values()])
        assert record["tokens_per_expert"] == counts.tolist(), step
        assert record["moe_imbalance"] == pytest.approx((counts.max(1).values / counts.mean(1)).mean().item(),
                                                        rel=1e-6)
        padded = torch.stack([layer["all_counts"] for layer in stats.values()])
        assert not torch.equal(padded, counts) and (padded.sum(1) > counts.sum(1)).all()  # without the fix
        rows, data = sum(mask.shape[0] for mask in masks), sum(int(mask.sum()) for mask in masks)
        assert 0 < data < rows * masks[0].shape[1]
        for name, layer in stats.items():
            want = coeff["aux_loss_coeff"] * layer["balance"] / rows + coeff["z_loss_coeff"] * layer["squares"] / data
            got = sum(attached[name][(step - 1) * len(batch):step * len(batch)])
            assert got == pytest.approx(want.item(), rel=1e-5), (step, name)
            delta = coeff["load_balance_coeff"] * torch.sign(layer["counts"].mean() - layer["counts"])
            biases[name] += delta - delta.mean()
    for name, bias in biases.items():
        torch.testing.assert_close(trainer.model.layers[name].moe.expert_bias, bias, rtol=1e-6, atol=1e-7)


def test_validation_runs_the_model_in_eval_mode(world, tmp_path):
    """Validation (and so `torchmoe eval`) of a LoRA run with dropout 0.5 and adapters that
    matter (B drawn off zero): no dropout mask is drawn (the RNG stays where training left it), the
    loss is the model's with its dropout at 0 (bit for bit), and training mode is back after it."""
    trainer = _trainer(world, "qwen3", "chatml", tmp_path, "--validation.enable", "true", "--validation.dataset", "chat",
                       "--validation.dataset_path", str(world["data"]), "--validation.local_batch_size", "2",
                       "--validation.seq_len", "48", "--validation.steps", "2", "--lora.enable", "true",
                       "--lora.targets", "attention", "--lora.dropout", "0.5")
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    state = torch.get_rng_state()
    loss = trainer.validate()
    assert torch.equal(torch.get_rng_state(), state) and trainer.model.training
    dropouts = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.5 for m in dropouts)
    for m in dropouts:
        m.p = 0.0
    assert trainer.validate() == loss
