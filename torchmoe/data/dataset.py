"""Document sources: ordered corpora of text documents, read lazily.

    from torchmoe.data import build_documents
    docs = build_documents(job_config.training)   # training.dataset picks the source
    for text in docs.iter_from(1000): ...         # documents 1000, 1001, ...; 0..999 not read

The sources, chosen by `training.dataset`:
- `python_docs` (default): the Python standard library's own sources, offline everywhere.
- `local`: files named by `training.dataset_path`: `.jsonl` / `.json` / `.parquet` rows, and any
  other text file (`.txt`, source code, Markdown, no suffix: UTF-8 without NUL bytes) as one
  document each.
- `hf`: a Hugging Face hub dataset, streamed (`hub_documents.py`).
- `chat`: conversations (`chat.py`), rendered by the model's chat template and packed whole.
- torchtitan's names: `c4` / `c4_validation` (allenai/c4 "en", streamed) and `c4_test` (its test
  corpus, `tests/assets/c4_test` of a torchtitan checkout); `dataset_path` moves either.
Every source yields the same documents in the same order on every pass and every rank; the
packer (`dataloader.py`) relies on that to resume, and reads one row's share per batch row
(`Documents.split`): files by contiguous ranges of their bytes (`documents.py`), each document
read alone by a seek, hub datasets by rows (`datasets` splits them, by shard when it can).
"""

from __future__ import annotations

import bisect
import json
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import path_faults
from torchmoe.config.files.text import SURROGATE_FIX, NotUTF8, lone_surrogate, utf8_text
from torchmoe.config.wording import counted
from torchmoe.data.dataset_kinds import check_kind
from torchmoe.data.documents import DataConfigError, Documents, SizedDocuments, text_part
from torchmoe.data.file_index import LINES, START, Indexing, IndexKind, line_spans, shared_indexes, with_starts
from torchmoe.data.file_listing import local_files
from torchmoe.data.hub_documents import HFDocuments, as_text
from torchmoe.data.read_bounds import GROUPS_FIX, check_row, parquet_file, read_whole
from torchmoe.data.token_shards import TokenShards

if TYPE_CHECKING:
    from torchmoe.config.job_config import Training

__all__ = [
    "DataConfigError",
    "Documents",
    "InMemoryDocuments",
    "FileDocuments",
    "python_docs_files",
    "build_documents",
]

# torchtitan v0.2.2's dataset names: c4 and c4_validation stream allenai/c4 ("en") from the hub,
# c4_test reads its test corpus (a .json file of 2K documents) from a torchtitan checkout.
C4_SPLITS = {"c4": "train", "c4_validation": "validation"}
C4_HUB = "allenai/c4"
C4_TEST_PATH = "tests/assets/c4_test"


class InMemoryDocuments(SizedDocuments):
    """A fixed list of strings (tests, small experiments); sizes are their UTF-8 bytes."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        self.source = ("training.dataset", repr(self))

    def __repr__(self) -> str:
        return f"InMemoryDocuments({len(self.texts)} texts)"

    def sizes(self) -> np.ndarray:
        return np.array([len(text.encode("utf-8")) for text in self.texts], dtype=np.int64)

    def read(self, index: int) -> str:
        return self.texts[index]


class FileDocuments(SizedDocuments):
    """Documents from files, in the given order, each read alone (a seek).

    `.jsonl` files hold one document per non-blank line (the string at `text_field`), found once
    by `file_index.line_spans`; `.json` files an array of objects (or lines, like .jsonl);
    `.parquet` files one per row (column `text_field`, via pyarrow); any other file is one
    document (its text), of which a part reads only its bytes. Text must be UTF-8: a file that is
    not (binary, or another encoding) is a `DataConfigError` naming it, as is one that cannot be
    read or parsed. A null text is an empty document, so document indices always count rows.

    Args:
        files: the files, already in their deterministic order.
        text_field: the JSON key / parquet column holding the text.
        key: the setting that named the files, for messages; `value` its value.
        index_cache: the folder that keeps each file's index between runs (`file_index`); None
            keeps them in memory.
    """

    def __init__(self, files: Sequence[Path], *, text_field: str = "text", key: str = "training.dataset_path",
                 value: str = "", index_cache: Path | None = None) -> None:
        self.files = [Path(f) for f in files]
        self.text_field = text_field
        self.key = key
        self.source = (key, value or (str(self.files[0]) if self.files else ""))
        self.index_cache = index_cache
        self._open: tuple[Path, Any] | None = None  # the last .json array or parquet row group read

    def __repr__(self) -> str:
        where = f", first {self.files[0]}" if self.files else ""
        return f"FileDocuments({counted(len(self.files), 'file')}{where})"

    @property
    def indexed(self) -> bool:
        """Whether cutting the corpus into rows needs an index of some file's documents (a pass
        over all its bytes): .jsonl, .json and .parquet files; text files need only their sizes."""
        return any(_kind(file) != "text" for file in self.files)

    @cached_property
    def _tables(self) -> list[np.ndarray]:
        """Per file, (n, 3+) int64: each document's (offset, size, ..., start): a .jsonl line's
        bytes (and its line number), a .json or .parquet row's text bytes (offset: its row), a
        text file's bytes; start the sum of the sizes before it in the file (`with_starts`).
        Memory-mapped from the index cache, each file's built by one rank (`file_index`)."""
        return shared_indexes(self.files, lambda file: self._faults(file, self._indexing, file), self.index_cache)

    @cached_property
    def _first(self) -> np.ndarray:
        """(files + 1,) int64: index of each file's first document, and the count last."""
        return np.concatenate([[0], np.cumsum([len(t) for t in self._tables])]).astype(np.int64)

    @cached_property
    def _base(self) -> np.ndarray:
        """(files + 1,) int64: where each file's documents start in the corpus, and its size last."""
        ends = [int(t[-1, START] + t[-1, 1]) if len(t) else 0 for t in self._tables]
        return np.concatenate([[0], np.cumsum(ends)]).astype(np.int64)

    def sizes(self) -> np.ndarray:
        return np.concatenate([t[:, 1] for t in self._tables]) if self.files else np.zeros(0, np.int64)

    # The corpus's starts, from the files' own (no (N,) array in memory: a row reads its range's).

    def count(self) -> int:
        return int(self._first[-1])

    def total_size(self) -> int:
        return int(self._base[-1])

    def first_from(self, offset: int) -> int:
        # Every file before the last one starting before `offset` has all its documents before
        # it, every file after that one none; in that one, a binary search of its own starts.
        f = int(np.searchsorted(self._base, offset)) - 1
        if f < 0:
            return 0
        if f >= len(self.files):
            return self.count()
        # bisect, not np.searchsorted: that copies a strided column whole (every page of the index)
        return int(self._first[f]) + bisect.bisect_left(self._tables[f][:, START], offset - int(self._base[f]))

    def starts_of(self, lo: int, hi: int) -> np.ndarray:
        pieces, doc = [], lo
        while doc < min(hi + 1, self.count()):
            f = int(np.searchsorted(self._first, doc, side="right")) - 1
            first, stop = int(self._first[f]), min(int(self._first[f + 1]), hi + 1)
            pieces.append(int(self._base[f]) + np.asarray(self._tables[f][doc - first:stop - first, START]))
            doc = stop
        if hi == self.count():
            pieces.append(np.array([self.total_size()], np.int64))
        return np.concatenate(pieces).astype(np.int64)

    def read(self, index: int) -> str:
        f, row = self._find(index)
        return self._faults(self.files[f], self._read, f, row)

    def read_part(self, index: int, part: int, parts: int) -> str:
        file = self.files[self._find(index)[0]]
        if _kind(file) != "text":
            return super().read_part(index, part, parts)
        return self._faults(file, self._read_text_part, file, part, parts)

    def locate(self, index: int) -> str:
        """Document `index`: ``file``, ``file:line`` (.jsonl), ``file[i]`` (a .json array) or
        ``file row i`` (.parquet)."""
        f, row = self._find(index)
        file, kind = self.files[f], _kind(self.files[f])
        if kind == "lines":
            return f"{file}:{self._tables[f][row, 2]}"
        if kind == "array":
            return f"{file}[{row}]"
        if kind == "parquet":
            return f"{file} row {row}"
        return str(file)

    def _find(self, index: int) -> tuple[int, int]:
        """The index of the file holding document `index`, and the document's row in it."""
        f = int(np.searchsorted(self._first, index, side="right")) - 1
        return f, index - int(self._first[f])

    def _faults(self, file: Path, fn: Callable[..., Any], *args: Any) -> Any:
        # Deleted since it was listed, a folder, no permission, an I/O error: what the OS says.
        with path_faults(self.key, str(file), "fix its permissions, or remove it from the dataset",
                         error=DataConfigError):
            return fn(*args)

    def _indexing(self, file: Path) -> Indexing:
        """How the table of `file` is found (`_tables`); its faults named as a `DataConfigError`."""
        kind = _kind(file)
        if kind == "lines":
            return Indexing(lambda: self._faults(file, line_spans, file), LINES)
        if kind in ("array", "parquet"):
            build = lambda: with_starts(_row_sizes(self._rows_of(file, kind)))  # noqa: E731
            return Indexing(lambda: self._faults(file, build), IndexKind(f"{kind}:{self.text_field}:v2", 3, rows=True))
        return Indexing(lambda: self._faults(file, _text_table, file))

    def _rows_of(self, file: Path, kind: str) -> Iterator[str]:
        """The text of every row of a .json array or .parquet file, in order."""
        if kind == "array":
            rows = self._json_array(file)
            return (_row_text(row, self.text_field, f"{file}[{i}]", self.source) for i, row in enumerate(rows))
        pf = parquet_file(file, self.key)
        _parquet_column(pf, file, self.text_field)
        return (text for group in range(pf.metadata.num_row_groups)
                for text in self._parquet_group(file, pf, group))

    def _read(self, f: int, row: int) -> str:
        file = self.files[f]
        kind = _kind(file)
        if kind == "text":
            return _utf8(file.read_bytes(), file, str(file), self.key)
        if kind == "lines":
            offset, length, line_number, _ = self._tables[f][row].tolist()
            where = f"{file}:{line_number}"
            check_row(length, where, key=self.key, value=str(file),
                      fix="split the document into several rows (or a .txt file, read in parts), or remove it")
            with file.open("rb") as f:
                f.seek(offset)
                line = f.read(length)
            # A long line is held as bytes, then as text, then parsed, never twice at once.
            text, line = _utf8(line, file, where, self.key, nul=False), None
            try:
                parsed, text = json_loads(text), None
            except json.JSONDecodeError as e:
                raise DataConfigError(self.key, str(file), f"{where} is not JSON ({e.msg})",
                                      "fix or remove that line: .jsonl files hold one JSON object per line") from None
            return _row_text(parsed, self.text_field, where, self.source)
        if kind == "array":
            return _row_text(self._json_array(file)[row], self.text_field, f"{file}[{row}]", self.source)
        return self._parquet_row(file, row)

    def _read_text_part(self, file: Path, part: int, parts: int) -> str:
        """Part `part` of `parts` of a text file: only its bytes (and a newline's search) are read."""
        size = os.stat(file).st_size
        with file.open("rb") as f:

            def read(offset: int, n: int) -> bytes:
                f.seek(offset)
                return f.read(n)

            start, end = text_part(read, size, part, parts)
            where = str(file) if start == 0 else f"{file} (the part from byte {start})"
            return _utf8(read(start, end - start), file, where, self.key)

    def _json_array(self, file: Path) -> list[Any]:
        """The rows of a .json array file, parsed once and kept while it is read."""
        if self._open is None or self._open[0] != file:
            try:
                data = read_whole(file, key=self.key, value=str(file), fix="fix its permissions, or remove it from "
                                  "the dataset", large_fix="write its rows as .jsonl, one a line, which is read a "
                                  "row at a time")
                rows = json_loads(_utf8(data, file, str(file), self.key, nul=False))
            except json.JSONDecodeError as e:
                raise DataConfigError(self.key, str(file), f"is not JSON ({e.msg} at line {e.lineno})",
                                      "fix the file: a JSON array of objects, or one object per line") from None
            if not isinstance(rows, list):
                raise DataConfigError(self.key, str(file), f"holds a JSON {type(rows).__name__}, not an array",
                                      "fix the file: a JSON array of objects, or one object per line")
            self._open = (file, rows)
        return self._open[1]

    def _parquet_row(self, file: Path, row: int) -> str:
        """Row `row` of a .parquet file: its row group is read (and kept while it is read)."""
        pf = parquet_file(file, self.key)
        start = 0
        for group in range(pf.metadata.num_row_groups):
            end = start + pf.metadata.row_group(group).num_rows
            if row < end:
                if self._open is None or self._open[0] != (file, group):
                    self._open = ((file, group), self._parquet_group(file, pf, group))
                return self._open[1][row - start]
            start = end
        raise IndexError(row)

    def _parquet_group(self, file: Path, pf: Any, group: int) -> list[str]:
        """The texts of one row group, checked (`as_text`)."""
        first = sum(pf.metadata.row_group(g).num_rows for g in range(group))
        rows = pf.metadata.row_group(group).num_rows
        check_row(pf.metadata.row_group(group).total_byte_size, f"{file} row group {group} (rows {first} to "
                  f"{first + rows - 1})", key=self.key, value=str(file), fix=GROUPS_FIX)
        texts = pf.read_row_group(group, columns=[self.text_field]).column(0).to_pylist()
        return [as_text(text, f"{file} row {first + i}", self.text_field) for i, text in enumerate(texts)]


def _kind(file: Path) -> str:
    """How a file holds documents: "lines" (.jsonl, or a .json of lines), "array" (a .json
    array), "parquet", or "text" (the whole file is one)."""
    if file.suffix == ".jsonl":
        return "lines"
    if file.suffix == ".json":
        with file.open("rb") as f:
            return "array" if f.read(4096).lstrip().startswith(b"[") else "lines"
    if file.suffix == ".parquet":
        return "parquet"
    return "text"


def _text_table(file: Path) -> np.ndarray:
    """(1, 3) int64: a text file's one document: offset 0, its size, start 0."""
    with open(file, "rb") as f:  # opened, not only stat'ed: an unreadable file fails here, named
        return np.array([[0, os.fstat(f.fileno()).st_size, 0]], dtype=np.int64)


def _row_sizes(texts: Iterator[str]) -> np.ndarray:
    """(n, 2) int64: (row, UTF-8 bytes) of each text."""
    sizes = np.fromiter((len(text.encode("utf-8")) for text in texts), dtype=np.int64)
    return np.stack([np.arange(len(sizes), dtype=np.int64), sizes], axis=1)


def _row_text(row: Any, text_field: str, where: str, source: tuple[str, str]) -> str:
    """The text of one JSON row (an object holding `text_field`; `source` the setting that named
    its file, and its value)."""
    if not isinstance(row, dict) or text_field not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataConfigError("training.dataset_text_field", text_field, f"{where} has no such field (found {keys})",
                              "set it to the key that holds the text")
    text = as_text(row[text_field], where, text_field)
    if (problem := lone_surrogate(text)) is not None:
        raise DataConfigError(*source, f"{where}: its {text_field} {problem}", f"fix the row: {SURROGATE_FIX}")
    return text


def _parquet_column(pf: Any, file: Path, text_field: str) -> None:
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise DataConfigError(
            "training.dataset_text_field", text_field, f"{file} has no such column (found {columns})",
            "set it to the column that holds the text",
        )  # fmt: skip


def _utf8(data: bytes, file: Path, where: str, key: str, *, nul: bool = True) -> str:
    """`data` (read from `file`, at `where`: the file or file:line; `key` named it) as text;
    `nul` as in `utf8_text` (False for JSON)."""
    try:
        return utf8_text(data, nul=nul)
    except NotUTF8 as e:
        raise DataConfigError(key, str(file), f"{where} {e.problem}",
                              f"{e.fix(file)}; or remove it from the dataset") from None


_MACHINE_DIRS = ("site-packages", "dist-packages", "__pycache__")
_TEST_DIRS = ("test", "tests", "idle_test")


def python_docs_files(stdlib: str | Path | None = None) -> list[Path]:
    """The `.py` files of the standard library, in the `python_docs` order.

    The stdlib's own modules come first (~12 MB on CPython 3.11), then its test suite
    (~19 MB more): some distributions ship Python without the test suite, and putting it last
    keeps the first pass identical there up to that point. Within each part files are sorted by
    path relative to the stdlib root, so the order does not depend on the install location or
    the file system. Installed packages and machine-specific files (`_sysconfigdata*`,
    `config-*/`) are excluded, and so are the test suite's encoding samples: files that are not
    plain UTF-8 (a byte order mark, Latin-1, KOI8-R: 6 on CPython 3.11, e.g.
    `test/tokenizedata/bad_coding2.py`), which the corpus reader refuses as a user's file
    (`config.files.text`) and which would stop the default job where a row reaches one.

    Args:
        stdlib: the stdlib folder; default `sysconfig.get_paths()["stdlib"]`.
    """
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    modules: list[tuple[str, Path]] = []
    tests: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _MACHINE_DIRS and not d.startswith("config-")]
        rel_dir = Path(dirpath).relative_to(root)
        part = tests if any(p in _TEST_DIRS for p in rel_dir.parts) else modules
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                part.append(((rel_dir / name).as_posix(), Path(dirpath) / name))
    return [path for _, path in sorted(modules)] + [path for _, path in sorted(tests) if _plain_utf8(path)]


def _plain_utf8(path: Path) -> bool:
    try:
        utf8_text(path.read_bytes())
    except NotUTF8:
        return False
    return True


def build_documents(training: Training, *, key: str = "training.dataset_path",
                    index_cache: Path | None = None, check_digests: bool = True) -> Documents:
    """The document source that `training.dataset` names (see `Training` in job_config); `key`
    names its path in messages (``validation.dataset_path`` for the validation data);
    `index_cache` keeps the files' document indexes (`FileDocuments`); `check_digests=False`
    leaves token shards' digests to the caller (`TokenShards.check_digests`)."""
    kind = training.dataset
    check_kind(kind, training.dataset_path, key=key)  # shards read as text, text as shards: before any read
    files = lambda path: FileDocuments(  # noqa: E731
        local_files(path, key=key, extensions=training.dataset_extensions), text_field=training.dataset_text_field,
        key=key, value=path, index_cache=index_cache,
    )
    if kind == "python_docs":
        return FileDocuments(python_docs_files(), key="training.dataset", value=kind)
    if kind == "local":
        return files(training.dataset_path)
    if kind == "tokens":
        if not training.dataset_path:
            raise DataConfigError(key, "", 'dataset = "tokens" needs a folder', "point it at the OUT_DIR of "
                                  "`torchmoe prepare-data`")
        return TokenShards(training.dataset_path, key=key, check_digests=check_digests)
    if kind == "chat":
        from torchmoe.data.chat.chat import chat_corpus  # lazily: only chat data needs jinja2 (templates)

        return chat_corpus(training, key=key)
    if kind == "hf":
        return HFDocuments.from_spec(
            training.dataset_path, split=training.dataset_split, text_field=training.dataset_text_field, key=key
        )
    if kind in C4_SPLITS:  # torchtitan's loader: dataset_path replaces the hub id, config "en" stays
        return HFDocuments.from_spec(f"{training.dataset_path or C4_HUB}:en", split=C4_SPLITS[kind],
                                     text_field=training.dataset_text_field, key=key)
    if kind == "c4_test":
        path = training.dataset_path or C4_TEST_PATH
        if not Path(path).exists():
            raise DataConfigError(
                "training.dataset", kind, f"reads torchtitan's test corpus from {path} (relative to the working "
                "folder), which does not exist",
                "run from a torchtitan checkout, or set training.dataset_path to a copy of its tests/assets/c4_test",
            )  # fmt: skip
        return files(path)
    raise DataConfigError(
        "training.dataset", kind, "unknown dataset", "use 'python_docs', 'local', 'tokens', 'hf' or 'chat'"
    )
