"""Chat SFT jobs on tiny random Hugging Face checkpoints (`tests.any_checkpoint`) with the chat
fixtures' tokenizers (`tests.chat_fixtures`): what the loss tests and the layout parity of the
masked loss train, in process; such a checkpoint as a release ships it (`chat_checkpoint`); and a
brute-force count of what their MoE routers did with the data tokens (`RouterTaps`), which the
trainer's statistics must equal.

    job = chat_job(hf_folder, tokenizer_folder, chat_file, dump_folder, "--training.steps", "2")
    trainer = Trainer(job)
    folder = chat_checkpoint("qwen3", tmp_path / "qwen3")   # weights, tokenizer, generation settings
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tests.any_checkpoint import save_checkpoint
from tests.chat_fixtures import CONVERSATIONS, HARMONY, HARMONY_SPECIALS, chatml, deepseek, tokenizer_folder

# Conversations of several lengths (a row packs a few; some have one target token only, one none).
CHAT_ROWS = [{"messages": c} for c in CONVERSATIONS] * 3 + [
    {"prompt": "two plus two", "completion": "four"},
    {"messages": [{"role": "user", "content": "nothing to answer"}]},
] * 2


def write_chat_file(path: Path, rows: list[dict] = CHAT_ROWS) -> Path:
    """`rows` as a .jsonl chat file at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def chat_job(hf: Path, tokenizer: Path, data: Path, dump: Path, *flags: str):
    """The job that fine-tunes the checkpoint in `hf` on the chat file `data` (fp32, global batch
    4 x 48 tokens, two micro-batches per step, no checkpoints), its model built from the folder
    as `torchmoe train` builds it; `flags` override."""
    from torchmoe.config import load_job_config
    from torchmoe.weight_sources.folder_model import with_folder_model

    set_keys: set[str] = set()
    cfg = load_job_config([
        "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", str(hf),
        "--model.tokenizer_path", str(tokenizer), "--training.dataset", "chat", "--training.dataset_path", str(data),
        "--training.seq_len", "48", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
        "--training.steps", "1", "--training.mixed_precision_param", "float32", "--training.max_norm", "0",
        "--lr_scheduler.warmup_steps", "0", "--job.dump_folder", str(dump), "--checkpoint.enable", "false",
        "--metrics.log_freq", "1", *flags], set_keys=set_keys)
    return with_folder_model(cfg, set_keys=set_keys)


def data_mask(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, S) bool: every position of each row but its trailing run of `eos_id`, a chat window's
    padding, told from the token ids alone (the fixtures' conversations end in a newline, never
    in EOS): the tests' own reading of which tokens are data, independent of the loader's."""
    positions = torch.arange(inputs.shape[-1])
    last = torch.where(inputs != eos_id, positions, -1).max(dim=-1).values  # (B,) the last data token
    return positions <= last[:, None]


class RouterTaps:
    """While inside, every MoE router call of `model` (a `Transformer`), in call order: its block's
    name and the router's own outputs, (T, k) top-k experts, (T, E) scores and (T, E) logits.

        with RouterTaps(trainer.model) as taps:
            trainer.train_step(batch)
        stats = taps.statistics([data_mask(inputs, eos) for inputs, _ in batch], top_k)
    """

    def __init__(self, model) -> None:
        self.routers = {name: block.moe.router for name, block in model.layers.items() if block.moe_enabled}
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> RouterTaps:
        self.calls = []
        self._handles = [router.register_forward_hook(functools.partial(self._tap, name))
                         for name, router in self.routers.items()]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _tap(self, name: str, _module, _args, outputs) -> None:
        _, selected, scores, logits = outputs
        self.calls.append((name, selected.detach().clone(), scores.detach().clone(), logits.detach().clone()))

    def statistics(self, masks: list[torch.Tensor], top_k: int, step: int = 0) -> dict[str, dict[str, torch.Tensor]]:
        """Brute force over the calls of step `step` (counted from 0; each step one forward per
        micro-batch, every MoE block once, in order), `masks` each of its micro-batches' (B, S)
        data tokens: per block, `counts` (E,) of the data
        tokens' routed copies and `all_counts` of every token's (padding too); `balance` the
        sequence-wise balance loss summed over the rows, each row's over its own data tokens
        alone (`f_e = E / (k * S_b) * copies`, `P_e` the mean normalised score); `squares` the
        z-loss's logsumexp(logits)^2 summed over the data tokens."""
        per_step = len(masks) * len(self.routers)
        calls = self.calls[step * per_step:(step + 1) * per_step]
        assert len(calls) == per_step, (len(self.calls), len(masks))
        stats: dict[str, dict[str, torch.Tensor]] = {}
        for i, (name, selected, scores, logits) in enumerate(calls):
            real = masks[i // len(self.routers)]
            experts = scores.shape[-1]
            layer = stats.setdefault(name, {"counts": torch.zeros(experts), "all_counts": torch.zeros(experts),
                                            "balance": torch.zeros(()), "squares": torch.zeros(())})
            data = real.flatten()
            layer["counts"] += torch.bincount(selected[data].flatten(), minlength=experts)
            layer["all_counts"] += torch.bincount(selected.flatten(), minlength=experts)
            layer["squares"] += torch.logsumexp(logits[data], dim=-1).pow(2).sum()
            rows = real.shape[0]
            row_scores = scores.view(rows, -1, experts)
            for b, (row, row_real) in enumerate(zip(selected.view(rows, -1, top_k), real)):  # each row's data alone
                n = int(row_real.sum())
                if n:
                    f = torch.bincount(row[row_real].flatten(), minlength=experts) * experts / (top_k * n)
                    probs = row_scores[b][row_real] / row_scores[b][row_real].sum(-1, keepdim=True)
                    layer["balance"] += (f * probs.mean(0)).sum()
        return stats


# Each family's chat tokenizer (the fixtures' template after the family's own) and its special
# tokens as a release's configs name them: (make the folder, bos, eos, pad).
FAMILY_TOKENIZERS = {
    "qwen3": (lambda f: chatml(f, marked=False), "<|endoftext|>", "<|im_end|>", "<|endoftext|>"),
    "llama4": (lambda f: chatml(f, marked=True), "<|im_start|>", "<|im_end|>", "<|endoftext|>"),
    "deepseek_v3": (lambda f: deepseek(f, marked=True), "<bos>", "<eos>", "<eos>"),
    "gpt_oss": (lambda f: tokenizer_folder(f, HARMONY, HARMONY_SPECIALS, eos="<|return|>"), "<|start|>", "<|return|>",
                "<|endoftext|>"),
}


def chat_checkpoint(family: str, folder: Path) -> Path:
    """`tests.any_checkpoint`'s tiny checkpoint of `family` (sizes of no flavor) as a release ships
    it: the family's chat tokenizer files beside the weights, config.json naming the special
    tokens' ids and the dtype as transformers 4 spelled it (`torch_dtype`, bfloat16: the weights
    are float32, which transformers 5's `dtype` says and reads), keeping transformers' other
    fields (`router_aux_loss_coef`...), and a generation_config.json of a chat release (two stop
    ids, sampling defaults)."""
    make, *specials = FAMILY_TOKENIZERS[family]
    tokenizer = make(folder.parent / f"{folder.name}-tokenizer")
    bos, eos, pad = (Tokenizer.from_file(str(tokenizer / "tokenizer.json")).token_to_id(t) for t in specials)
    # torch_dtype: as transformers 4 wrote the dtype (the releases' spelling), beside transformers 5's.
    save_checkpoint(family, folder, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, torch_dtype="bfloat16")
    generation = {"bos_token_id": bos, "eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": True,
                  "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder
