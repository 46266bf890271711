"""The tokenizer's files beside exported Hugging Face weights, so the folder loads whole
(`AutoTokenizer.from_pretrained(folder)` as well as the model).

    copied = copy_tokenizer_files("path/to/tokenizer.json", out_dir)   # [] for the byte tokenizer

The files are those of the tokenizer the run trained with (`model.tokenizer_path`, or
`model.hf_assets_path` where that gave it): its tokenizer.json and, from the same folder, the
configs that name its special tokens and chat template. Copied byte for byte, never through a
symbolic link at the destination.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchmoe.config.files.file_writes import write_file

__all__ = ["TOKENIZER_FILES", "copy_tokenizer_files", "tokenizer_files"]

# What transformers reads for a fast tokenizer (tokenizer.model: a SentencePiece original).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja")


def tokenizer_files(tokenizer_path: str) -> dict[str, Path]:
    """The files of the tokenizer `tokenizer_path` (a tokenizer.json or its folder; "" is the byte
    tokenizer, which has none) by the name each has in a Hugging Face folder: its tokenizer.json
    and, from the same folder, those of `TOKENIZER_FILES` that exist."""
    if not tokenizer_path:
        return {}
    source = Path(tokenizer_path)
    folder, main = (source, source / "tokenizer.json") if source.is_dir() else (source.parent, source)
    paths = {name: main if name == "tokenizer.json" else folder / name for name in TOKENIZER_FILES}
    return {name: path for name, path in paths.items() if path.is_file()}


def copy_tokenizer_files(tokenizer_path: str, out_dir: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files of `tokenizer_path` (`tokenizer_files`) into `out_dir`; returns
    the names copied.

    Raises:
        OSError: a file cannot be read or written (the caller names the key).
    """
    copied = []
    for name, path in tokenizer_files(tokenizer_path).items():
        write_file(Path(out_dir) / name, path.read_bytes())
        copied.append(name)
    return copied
