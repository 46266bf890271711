"""Where each document of a data file lies, found once per file and cached in the run's folder.

    spans = line_spans(Path("web.jsonl"), cache=dump / "data_index")   # (n, 2): offset, length

A `.jsonl` file's documents are its non-blank lines; `line_spans` finds them with one pass of
numpy over the bytes, after which any document is one seek away. The index is saved as a `.npy`
file (never a pickle) named by the file's path, size, modification time and inode, so an edited
file gets a new index. Every rank may build and save it at once: each writes a temporary file and
renames it over the name, so the last rename wins with the same contents.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from torchmoe.config.file_writes import write_file

__all__ = ["INDEX_FOLDER", "cached_index", "line_spans"]

INDEX_FOLDER = "data_index"
"""The folder under job.dump_folder that keeps the data files' indexes."""

_CHUNK = 1 << 24
_WHITESPACE = b" \t\n\r\x0b\x0c"


def cached_index(file: Path, kind: str, build: Callable[[], np.ndarray], cache: Path | None) -> np.ndarray:
    """`build()` for `file`, loaded from `cache` when this version of the file was indexed before.

    `kind` tells indexes of one file apart (it holds e.g. the text field). A cached index that
    cannot be read is built again; one that cannot be written is only kept in memory (a
    read-only dump folder must not stop training).
    """
    if cache is None:
        return build()
    st = os.stat(file)
    ident = f"{Path(file).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{kind}"
    path = cache / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.npy"
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError):  # none yet, or cut short: build it again
        pass
    index = build()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with _npy_bytes(index) as data:
            write_file(path, data)
    except OSError:
        pass
    return index


class _npy_bytes:
    """`np.save`'s bytes of an array (a context manager, so the buffer is freed after the write)."""

    def __init__(self, array: np.ndarray) -> None:
        import io

        self._buffer = io.BytesIO()
        np.save(self._buffer, array, allow_pickle=False)

    def __enter__(self) -> bytes:
        return self._buffer.getvalue()

    def __exit__(self, *exc: object) -> None:
        self._buffer.close()


def line_spans(file: Path) -> np.ndarray:
    """(n, 2) int64: offset and length (without the newline) of each non-blank line of `file`.

    A line is blank when it is empty or only whitespace; a last line without a newline counts.
    """
    spans: list[np.ndarray] = []
    offset = 0  # of the chunk in the file
    line_start = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            ends = offset + np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10)
            starts = np.concatenate([[line_start], ends[:-1] + 1]) if len(ends) else np.zeros(0, np.int64)
            spans.append(np.stack([starts, ends - starts], axis=1))
            if len(ends):
                line_start = int(ends[-1]) + 1
            offset += len(chunk)
    if offset > line_start:
        spans.append(np.array([[line_start, offset - line_start]], np.int64))
    table = np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)
    return table[_not_blank(file, table)].astype(np.int64)


def _not_blank(file: Path, table: np.ndarray) -> np.ndarray:
    """(n,) bool: which lines of `table` hold more than whitespace. Only lines that start with
    whitespace (or are empty) can be blank, so only those are read again."""
    keep = table[:, 1] > 0
    if not keep.any():
        return keep
    with open(file, "rb") as f:
        for i in np.flatnonzero(keep):
            start, length = table[i]
            f.seek(start)
            head = f.read(1)
            if head in _WHITESPACE:  # rare: read the whole line
                f.seek(start)
                keep[i] = bool(f.read(length).strip(_WHITESPACE))
    return keep
