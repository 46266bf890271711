"""Chat SFT jobs on tiny random Hugging Face checkpoints (`tests.any_checkpoint`) with the chat
fixtures' tokenizers (`tests.chat_fixtures`): what the loss tests and the layout parity of the
masked loss train, in process; and such a checkpoint as a release ships it (`chat_checkpoint`).

    job = chat_job(hf_folder, tokenizer_folder, chat_file, dump_folder, "--training.steps", "2")
    trainer = Trainer(job)
    folder = chat_checkpoint("qwen3", tmp_path / "qwen3")   # weights, tokenizer, generation settings
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    from torchmoe.components.folder_model import with_folder_model
    from torchmoe.config import load_job_config

    set_keys: set[str] = set()
    cfg = load_job_config([
        "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", str(hf),
        "--model.tokenizer_path", str(tokenizer), "--training.dataset", "chat", "--training.dataset_path", str(data),
        "--training.seq_len", "48", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
        "--training.steps", "1", "--training.mixed_precision_param", "float32", "--training.max_norm", "0",
        "--lr_scheduler.warmup_steps", "0", "--job.dump_folder", str(dump), "--checkpoint.enable", "false",
        "--metrics.log_freq", "1", *flags], set_keys=set_keys)
    return with_folder_model(cfg, set_keys=set_keys)


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
