"""Where each document of a data file lies, found once per file and cached in the run's folder.

    spans = cached_index(file, "lines", lambda: line_spans(file), dump / "data_index")
    # (n, 3): offset, length, line number of each document (non-blank line)

A `.jsonl` file's documents are its non-blank lines; `line_spans` finds them with one pass of
numpy over the bytes, after which any document is one seek away. The index is saved as a `.npy`
file (never a pickle) named by the file's path, size, modification time and inode, so an edited
file gets a new index. Every rank may build and save it at once: each writes a temporary file and
renames it over the name, so the last rename wins with the same contents.
"""

from __future__ import annotations

import hashlib
import io
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
        write_file(path, _npy_bytes(index))
    except OSError:
        pass
    return index


def _npy_bytes(array: np.ndarray) -> bytes:
    """`np.save`'s bytes of an array (no pickle)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def line_spans(file: Path) -> np.ndarray:
    """(n, 3) int64: offset, length (without the newline) and 1-based line number of each
    non-blank line of `file`.

    A line is blank when it is empty or only whitespace; a last line without a newline counts.
    """
    spans: list[np.ndarray] = []
    firsts: list[np.ndarray] = []  # each line's first byte (0 for an empty line)
    offset = 0  # of the chunk in the file
    line_start, line_first = 0, None  # the line that runs into the next chunk, and its first byte
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            data = np.frombuffer(chunk, np.uint8)
            if line_first is None and line_start < offset + len(chunk):
                line_first = int(data[line_start - offset])
            ends = offset + np.flatnonzero(data == 10)
            if len(ends):
                starts = np.concatenate([[line_start], ends[:-1] + 1])
                spans.append(np.stack([starts, ends - starts], axis=1))
                inner = starts[1:] - offset  # the lines that start in this chunk (before its end)
                firsts.append(np.concatenate([[line_first if line_first is not None else 10], data[inner]]))
                line_start = int(ends[-1]) + 1
                line_first = int(data[line_start - offset]) if line_start < offset + len(chunk) else None
            offset += len(chunk)
    if offset > line_start:
        spans.append(np.array([[line_start, offset - line_start]], np.int64))
        firsts.append(np.array([line_first]))
    if not spans:
        return np.zeros((0, 3), np.int64)
    table = np.concatenate(spans)
    table = np.concatenate([table, np.arange(1, len(table) + 1)[:, None]], axis=1).astype(np.int64)
    return table[_not_blank(file, table, np.concatenate(firsts))]


def _not_blank(file: Path, table: np.ndarray, firsts: np.ndarray) -> np.ndarray:
    """(n,) bool: which lines of `table` (whose first bytes are `firsts`) hold more than
    whitespace. Only a non-empty line that starts with whitespace can be blank and still count
    as one, so only those are read again."""
    keep = table[:, 1] > 0
    maybe = keep & np.isin(firsts, np.frombuffer(_WHITESPACE, np.uint8))
    if maybe.any():
        with open(file, "rb") as f:
            for i in np.flatnonzero(maybe):  # rare: read the whole line
                start, length = table[i, :2]
                f.seek(start)
                keep[i] = bool(f.read(length).strip(_WHITESPACE))
    return keep
