"""Which kind of corpus a dataset path holds, checked against the kind `training.dataset` names
before anything is read (`dataset.build_documents`, so before the model is built).

    check_kind("local", "data/tokens", key="training.dataset_path")   # DataConfigError: use "tokens"

A folder written by `torchmoe prepare-data` read as text (`local`, `hf`) failed late, when the run
indexed its `manifest.json` as a malformed JSON corpus; text read as token shards (`tokens`)
failed on the missing manifest with a fix that did not say the text is readable as it is. Each
is one message naming the dataset kind that reads the path.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from torchmoe.data.documents import DataConfigError
from torchmoe.data.token_shards import MANIFEST, PROGRESS

__all__ = ["ALWAYS_READ", "ROW_SUFFIXES", "check_kind", "is_text_file", "token_shards_folder"]

# Files whose rows are documents, and .txt files, are always read (a .txt file that is not UTF-8
# gets the reader's message naming its encoding and the fix); any other file that is text is one
# document.
ROW_SUFFIXES = (".jsonl", ".json", ".parquet")
ALWAYS_READ = (*ROW_SUFFIXES, ".txt")
# Bytes read to tell text from binary: git's rule (a NUL byte in the first 8 KiB is binary),
# plus that they decode as UTF-8.
_SNIFF_BYTES = 8192


def is_text_file(path: Path) -> bool:
    """Whether `path` looks like text: its first 8 KiB hold no NUL byte and decode as UTF-8 (a
    character cut by the 8 KiB boundary is fine). Raises OSError when it cannot be read."""
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        # Only an incomplete character at the very end: the next bytes complete it.
        return len(head) == _SNIFF_BYTES and err.start >= len(head) - 3 and err.reason == "unexpected end of data"
    return True


def token_shards_folder(path: str) -> Path | None:
    """The folder of a `torchmoe prepare-data` run (its manifest.json, or progress.json while it
    runs) that `path` names, or names a file or a glob in; None otherwise."""
    here = Path(path)
    for folder in (here, here.parent):
        if not glob.has_magic(str(folder)) and any((folder / name).is_file() for name in (MANIFEST, PROGRESS)):
            return folder
    return None


def _holds_text(path: str) -> bool:
    """Whether `path` is a corpus the text kinds read: a glob, a text file, or a folder holding
    one with a corpus file's suffix (at any depth: `file_listing.local_files`' rule)."""
    if glob.has_magic(path):
        return True
    here = Path(path)
    if here.is_file():
        return here.suffix in ALWAYS_READ or is_text_file(here)
    for _, _, names in os.walk(here):  # nothing to walk when it is missing or unreadable
        if any(name.endswith(ALWAYS_READ) for name in names):
            return True
    return False


def _read_with(kind: str, key: str) -> str:
    """How to read the path of `key` with dataset kind `kind`."""
    if key.endswith(".dataset_path"):
        setting = key.removesuffix("_path")
        return f'set {setting} = "{kind}" (--{setting} {kind})'
    return f"write its entry in {key} as [NAME=]WEIGHT:{kind}:PATH"  # a mixture names each source's kind


def check_kind(kind: str, path: str, *, key: str) -> None:
    """`path` (the setting `key`) must hold what dataset kind `kind` reads: token shards for
    "tokens", text for the others.

    Raises:
        DataConfigError: a prepare-data folder (or a file in one) read as text; a text corpus,
            or a file of a prepare-data folder, read as token shards.
    """
    if not path or kind == "python_docs":
        return
    shards = token_shards_folder(path)
    if kind != "tokens":
        if shards is not None:
            raise DataConfigError(key, path, f"is {'a file in ' if shards != Path(path) else ''}a folder of token "
                                  f"shards written by `torchmoe prepare-data` ({shards / MANIFEST}), which dataset "
                                  f'"{kind}" would read as text', _read_with("tokens", key)
                                  + (f", and point it at {shards}" if shards != Path(path) else ""))
        return
    if shards is not None and shards != Path(path):
        raise DataConfigError(key, path, f"is a file of the token shards in {shards}, not their folder",
                              f"point it at the folder: {shards}")
    if shards is None and _holds_text(path):
        raise DataConfigError(key, path, f'holds text, not the token shards dataset "tokens" reads (no {MANIFEST})',
                              f"{_read_with('local', key)} to read it as it is, or tokenize it once: torchmoe "
                              f"prepare-data {path} data/tokens, and point {key} at data/tokens")
