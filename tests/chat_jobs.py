"""Chat SFT jobs on tiny random Hugging Face checkpoints (`tests.any_checkpoint`) with the chat
fixtures' tokenizers (`tests.chat_fixtures`): what the loss tests and the layout parity of the
masked loss train, in process.

    job = chat_job(hf_folder, tokenizer_folder, chat_file, dump_folder, "--training.steps", "2")
    trainer = Trainer(job)
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.chat_fixtures import CONVERSATIONS

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
