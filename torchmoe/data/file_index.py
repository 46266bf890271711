"""Where each document of a data file lies: found once per corpus, shared out between the ranks,
kept in the run's folder, and memory-mapped by every rank.

    tables = shared_indexes(files, indexing, dump / "data_index")   # collective under a group
    # per file, (n, c) int64: offset, length, ..., and start (`with_starts`) of each document

A `.jsonl` file's documents are its non-blank lines; `line_spans` finds them with one pass of
numpy over the bytes, after which any document is one seek away. The index is saved as a `.npy`
file (never a pickle) named by the file's path, size, modification time and inode, so an edited
file gets a new index.

**Each file read by one rank, one collective per corpus.** Under a process group (a training
run: every rank reads the same files, in the same order) rank r alone reads files r, r + N,
r + 2N, ... of the N ranks' corpus that have no index yet and writes their indexes; then one
`all_gather_object` tells every rank which were saved (and carries the one-row tables of plain
text files, which nobody else then opens), and each rank maps the saved indexes. A first run on N
ranks reads the corpus once, not N times, in about 1/N of the time one rank would take, and
waits on one collective, not one per file; each rank's pages of an index are only those its own
rows touch (its range's documents, and a binary search's few pages). Where an index cannot be
saved (a read-only dump folder), the saved file is not visible to a rank (a dump folder that is
not shared between nodes) or its file could not be indexed (a user error), each rank builds its
own in memory, as without a process group, and raises that error itself.

**Checked at the reader.** A saved index is a cache, and a file anyone can write: it is used only
if it is a regular file (a FIFO would block the read) holding a 2-D int64 array of the kind's
columns whose documents lie inside the data file as it is now, in order, each start the sum of
the sizes before it (`_fits`); anything else is built again. The builder checks every row; the
others check the header, and each document's bytes against the file's size when they read it
(`FileDocuments`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from torchmoe.config.files.file_writes import write_file

__all__ = ["INDEX_FOLDER", "LINES", "START", "IndexKind", "Indexing", "cached_index", "line_spans", "shared_indexes",
           "with_starts"]

logger = logging.getLogger(__name__)

INDEX_FOLDER = "data_index"
"""The folder under job.dump_folder that keeps the data files' indexes."""

START = -1
"""The column of an index that holds each document's start: the sizes before it in its file."""


@dataclass(frozen=True)
class IndexKind:
    """What an index holds: `name` tells the indexes of one file apart (and versions them),
    `columns` its width; `rows` True when column 0 counts rows (a .json array's, a parquet
    file's) rather than giving each document's byte offset."""

    name: str
    columns: int
    rows: bool = False


LINES = IndexKind("lines-v2", 4)
"""A .jsonl file's: offset, length, line number and start of each non-blank line (`line_spans`)."""

_CHUNK = 1 << 24
_WHITESPACE = b" \t\n\r\x0b\x0c"
# Rows checked at a time when the builder validates a saved index (a bounded slice in memory).
_CHECK_ROWS = 1 << 20


@dataclass(frozen=True)
class Indexing:
    """How one file's table is found: `build()` gives it; `kind` keeps it in the index cache, or
    None for a table too cheap to keep (a plain text file's one row), which crosses the ranks'
    collective instead."""

    build: Callable[[], np.ndarray]
    kind: IndexKind | None = None


def shared_indexes(files: Sequence[Path], indexing: Callable[[Path], Indexing], cache: Path | None) -> list[np.ndarray]:
    """The table of each of `files` (`indexing(file)` says how it is found), kept in `cache`
    (`cached_index`); under a process group each file indexed by one rank, rank r the files
    r, r + N, ..., and one `all_gather_object` in all (module docstring). Collective under a
    process group: every rank calls it for the same files.

    Raises:
        whatever `indexing` or a build raises for the first file that cannot be indexed, on
        every rank (each builds that file itself to raise it).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return [_table(file, indexing(file), cache) for file in files]
    rank = dist.get_rank()
    found: dict[int, np.ndarray | bool] = {}  # file number -> a table that travels, or whether its index is saved
    try:
        for i in range(rank, len(files), world):
            how = indexing(files[i])
            if how.kind is None:
                found[i] = how.build()
            elif cache is not None:
                found[i] = _saved_index(files[i], how, cache)
    except Exception:  # noqa: BLE001 - a file that cannot be indexed: every rank meets it below, in order, and raises
        pass  # the rest of this rank's share is left to each rank (the first fault comes first)
    shares: list[dict[int, np.ndarray | bool] | None] = [None] * world
    dist.all_gather_object(shares, found)
    for share in shares:
        found.update(share)
    tables = []
    for i, file in enumerate(files):
        done = found.get(i)
        if isinstance(done, np.ndarray):
            tables.append(done)
            continue
        how = indexing(file)
        mapped = _map_saved(file, how.kind, cache) if done else None
        tables.append(mapped if mapped is not None else _table(file, how, cache))
    return tables


def _table(file: Path, how: Indexing, cache: Path | None) -> np.ndarray:
    """The table of `file` found by this rank alone."""
    return how.build() if how.kind is None else cached_index(file, how.kind, how.build, cache)


def _saved_index(file: Path, how: Indexing, cache: Path) -> bool:
    """Whether `file`'s index is saved in `cache` (checked whole), after building it if it was not."""
    st = os.stat(file)
    path = _index_path(file, st, how.kind.name, cache)
    return _load(path, how.kind, st.st_size, whole=True) is not None or _save(path, how.build())


def _map_saved(file: Path, kind: IndexKind, cache: Path) -> np.ndarray | None:
    """`file`'s index that another rank saved in `cache`, memory-mapped; None (and a warning) when
    it cannot be read here."""
    st = os.stat(file)
    path = _index_path(file, st, kind.name, cache)
    index = _load(path, kind, st.st_size, whole=False)
    if index is None:
        logger.warning("the index of %s saved by another rank at %s cannot be read here: indexing it on this rank "
                       "too (job.dump_folder should be one folder that every node shares)", file, path)
    return index


def cached_index(file: Path, kind: IndexKind, build: Callable[[], np.ndarray], cache: Path | None) -> np.ndarray:
    """`build()` for `file` (an (n, kind.columns) int64 table: offset, size, ..., start),
    memory-mapped from `cache` when this version of the file was indexed before, else built and
    saved there; by this process alone (`shared_indexes` shares a corpus between ranks).

    An index that cannot be written is only kept in memory (a read-only dump folder must not stop
    training).
    """
    if cache is None:
        return build()
    st = os.stat(file)
    path, size = _index_path(file, st, kind.name, cache), st.st_size
    index = _load(path, kind, size, whole=True)
    if index is None:
        index = build()
        mapped = _load(path, kind, size, whole=False) if _save(path, index) else None
        index = index if mapped is None else mapped  # mapped like everyone's: the built table's memory goes
    return index


def _index_path(file: Path, st: os.stat_result, kind: str, cache: Path) -> Path:
    """Where the index of `file` (as `st` found it) is kept: named by its path, size,
    modification time, inode and `kind`."""
    ident = f"{Path(file).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{kind}"
    return cache / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.npy"


def _load(path: Path, kind: IndexKind, file_size: int, *, whole: bool) -> np.ndarray | None:
    """The index saved at `path`, memory-mapped, if it is a usable `kind` of index for a data file
    of `file_size` bytes (`_fits`: every row when `whole`, else the header); None otherwise."""
    try:
        if not stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode):
            return None  # a FIFO or device would block or never end; a link is not ours
        index = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):  # none yet, cut short, not a .npy
        return None
    return index if _fits(index, kind, file_size, whole=whole) else None


def _fits(index: np.ndarray, kind: IndexKind, file_size: int, *, whole: bool) -> bool:
    """Whether `index` is a `kind` of index of a file of `file_size` bytes: 2-D int64 of
    `kind.columns`; with `whole` every row checked too: sizes not negative, each start the sum
    of the sizes before it, and rows counted from 0 (`kind.rows`) or each document's bytes
    inside the file, in file order."""
    if index.dtype != np.int64 or index.ndim != 2 or index.shape[1] != kind.columns:
        return False
    if not whole:
        return True
    done, before, end = 0, 0, 0  # rows checked, the sum of their sizes, where the last one ends
    for lo in range(0, len(index), _CHECK_ROWS):
        rows = np.asarray(index[lo:lo + _CHECK_ROWS])
        offsets, sizes, starts = rows[:, 0], rows[:, 1], rows[:, START]
        if (sizes < 0).any() or not np.array_equal(starts, before + np.cumsum(sizes) - sizes):
            return False
        if kind.rows:
            if not np.array_equal(offsets, np.arange(done, done + len(rows))):
                return False
        else:
            ends = offsets + sizes
            if (offsets < 0).any() or (ends > file_size).any() or offsets[0] < end or (offsets[1:] < ends[:-1]).any():
                return False  # outside the file, or overlapping / out of order
            end = int(ends[-1])
        done, before = done + len(rows), before + int(sizes.sum())
    return True


def _save(path: Path, index: np.ndarray) -> bool:
    """Write `index` to `path` (atomically); whether that worked."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.save(buffer, index, allow_pickle=False)
        write_file(path, buffer.getvalue())
        return True
    except OSError as err:
        logger.warning("the document index of this data file cannot be saved (%s): kept in memory only", err)
        return False


def with_starts(table: np.ndarray) -> np.ndarray:
    """`table` ((n, c) int64, each document's size in column 1) with a last column: each
    document's start, the sum of the sizes before it in the file."""
    sizes = table[:, 1]
    starts = np.cumsum(sizes) - sizes
    return np.concatenate([table, starts[:, None]], axis=1).astype(np.int64)


def line_spans(file: Path) -> np.ndarray:
    """(n, 4) int64: offset, length (without the newline), 1-based line number and start
    (`with_starts`) of each non-blank line of `file`.

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
        return np.zeros((0, 4), np.int64)
    table = np.concatenate(spans)
    table = np.concatenate([table, np.arange(1, len(table) + 1)[:, None]], axis=1).astype(np.int64)
    return with_starts(table[_not_blank(file, table, np.concatenate(firsts))])


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
