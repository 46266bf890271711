"""Document sources: ordered corpora of text documents, read lazily.

    from torchmoe.data import build_documents
    docs = build_documents(job_config.training)   # training.dataset picks the source
    for text in docs.iter_from(1000): ...         # documents 1000, 1001, ...; 0..999 not tokenized

The sources, chosen by `training.dataset`:
- `python_docs` (default): the Python standard library's own sources, offline everywhere.
- `local`: `.txt` / `.jsonl` / `.json` / `.parquet` files named by `training.dataset_path`.
- `hf`: a Hugging Face hub dataset, streamed.
- torchtitan's names: `c4` / `c4_validation` (allenai/c4 "en", streamed) and `c4_test` (its test
  corpus, `tests/assets/c4_test` of a torchtitan checkout); `dataset_path` moves either.
Every source yields the same documents in the same order on every pass and every rank; the
packer (`dataloader.py`) relies on that to resume, and reads one sub-corpus per batch row:

    row = docs.split(j, G)                        # sub-corpus j of G: documents j, j+G, j+2G, ...
    for text in row.iter_from(k): ...             # document j + k*G of docs, then j + (k+1)*G, ...

Each source reads as little as it can for its sub-corpora: `.txt` files that are not in it are
never opened, `.parquet` row groups without one of its rows never read, `.jsonl` lines of other
sub-corpora scanned but not parsed; hub datasets are split by `datasets` itself (by shard when
it can). Nothing outside a sub-corpus is ever tokenized.
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import json
import logging
import os
import stat
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchmoe.config.errors import ConfigError
from torchmoe.config.paths import path_faults
from torchmoe.config.text import NotUTF8, utf8_text

if TYPE_CHECKING:
    from torchmoe.config.job_config import Training

__all__ = [
    "DataConfigError",
    "Documents",
    "InMemoryDocuments",
    "StridedDocuments",
    "FileDocuments",
    "HFDocuments",
    "HFSubCorpus",
    "python_docs_files",
    "local_files",
    "build_documents",
]

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
# torchtitan v0.2.2's dataset names: c4 and c4_validation stream allenai/c4 ("en") from the hub,
# c4_test reads its test corpus (a .json file of 2K documents) from a torchtitan checkout.
C4_SPLITS = {"c4": "train", "c4_validation": "validation"}
C4_HUB = "allenai/c4"
C4_TEST_PATH = "tests/assets/c4_test"


class DataConfigError(ConfigError, ValueError):
    """A data or tokenizer setting that cannot work: missing files, fields or packages.

    The CLI reports it like any `ConfigError` (one message, exit status 2); it is also a
    `ValueError` for code that uses the data pipeline as a library.
    """


class Documents(ABC):
    """An ordered corpus: document i is the same text on every pass, rank and machine."""

    @abstractmethod
    def iter_from(self, start: int = 0) -> Iterator[str]:
        """Documents `start`, `start + 1`, ... to the end of one pass.

        Skipping the first `start` documents may re-read them from storage, but never hands
        them to a tokenizer: that is what keeps resuming cheap.
        """

    def iter_strided(self, start: int, step: int) -> Iterator[str]:
        """Documents `start`, `start + step`, `start + 2*step`, ... to the end of one pass.

        The default reads every document from `start` on and drops the others; sources that
        can skip more cheaply (without parsing, or without reading at all) override it.
        """
        return itertools.islice(self.iter_from(start), 0, None, step)

    def split(self, index: int, count: int) -> Documents:
        """Sub-corpus `index` of `count` disjoint ones that together hold every document.

        The default is the strided view: documents `index, index + count, index + 2*count, ...`
        (`iter_from(k)` of the view starts at document `index + k*count`). It depends only on
        `count`, so it is the same whichever process reads it.

        Raises:
            ValueError: not `0 <= index < count` (a caller bug).
        """
        _check_split(index, count)
        return self if count == 1 else StridedDocuments(self, index, count)

    def locate(self, index: int) -> str:
        """Where document `index` comes from, for messages (a file, ``file:line``, a row)."""
        return f"document {index}"

    def __iter__(self) -> Iterator[str]:
        return self.iter_from(0)


def _check_split(index: int, count: int) -> None:
    if not 0 <= index < count:
        raise ValueError(f"sub-corpus {index} is not in [0, count={count})")


class StridedDocuments(Documents):
    """Documents `index, index + count, ...` of `parent` (`Documents.split`)."""

    def __init__(self, parent: Documents, index: int, count: int) -> None:
        self.parent = parent
        self.index = index
        self.count = count

    def __repr__(self) -> str:
        return f"documents {self.index}, {self.index + self.count}, ... of {self.parent!r}"

    def iter_from(self, start: int = 0) -> Iterator[str]:
        return self.parent.iter_strided(self.index + start * self.count, self.count)

    def locate(self, index: int) -> str:
        return self.parent.locate(self.index + index * self.count)


class InMemoryDocuments(Documents):
    """A fixed list of strings (tests, small experiments)."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)

    def __repr__(self) -> str:
        return f"InMemoryDocuments({len(self.texts)} texts)"

    def iter_from(self, start: int = 0) -> Iterator[str]:
        return iter(self.texts[start:])

    def iter_strided(self, start: int, step: int) -> Iterator[str]:
        return iter(self.texts[start::step])


class FileDocuments(Documents):
    """Documents from files, in the given order.

    `.jsonl` files hold one document per non-blank line (the string at `text_field`), `.parquet`
    files one per row (column `text_field`, via pyarrow), and any other file is one document
    (its text). Text must be UTF-8: a file that is not (binary, or another encoding) is a
    `DataConfigError` naming it, as is one that cannot be read or parsed. A null text is an
    empty document, so document indices always count rows.

    Args:
        files: the files, already in their deterministic order.
        text_field: the JSON key / parquet column holding the text.
        key: the setting that named the files, for messages.
    """

    def __init__(self, files: Sequence[Path], *, text_field: str = "text", key: str = "training.dataset_path") -> None:
        self.files = [Path(f) for f in files]
        self.text_field = text_field
        self.key = key

    def __repr__(self) -> str:
        where = f", first {self.files[0]}" if self.files else ""
        return f"FileDocuments({len(self.files)} files{where})"

    def iter_from(self, start: int = 0) -> Iterator[str]:
        return self.iter_strided(start, 1)

    def iter_strided(self, start: int, step: int) -> Iterator[str]:
        """Documents `start`, `start + step`, ... parsing only those (see the module docstring)."""
        return (text for _, text in self._located(start, step))

    def locate(self, index: int) -> str:
        """The file of document `index`: ``file``, ``file:line`` (.jsonl), ``file[i]`` (a .json
        array) or ``file row i`` (.parquet); reads the files before it as `iter_from` does."""
        return next(self._located(index, 1), (f"document {index}", ""))[0]

    def _located(self, start: int, step: int) -> Iterator[tuple[str, str]]:
        """(where, text) of documents `start`, `start + step`, ..."""
        first = 0  # index of the current file's first document
        for file in self.files:
            # `start - first` >= 0 is the wanted document's index inside this file.
            count = yield from self._read(file, start - first, step)
            end = first + count
            if start < end:  # move on to the first wanted document after this file
                start += (end - start + step - 1) // step * step
            first = end

    def _read(self, file: Path, first: int, step: int) -> Generator[tuple[str, str], None, int]:
        """Yields (where, text) of the documents `first, first + step, ...` of `file`; returns how
        many it holds."""
        # Deleted since it was listed, a folder, no permission, an I/O error: what the OS says.
        with path_faults(self.key, str(file), "fix its permissions, or remove it from the dataset",
                         error=DataConfigError):
            if file.suffix == ".jsonl":
                return (yield from _read_jsonl(file, self.text_field, first, step, self.key))
            if file.suffix == ".json":
                return (yield from _read_json(file, self.text_field, first, step, self.key))
            if file.suffix == ".parquet":
                return (yield from _read_parquet(file, self.text_field, first, step, self.key))
            if first == 0:  # one document per file: other sub-corpora never open it
                yield str(file), _utf8(file.read_bytes(), file, str(file), self.key)
            return 1


def _read_jsonl(file: Path, text_field: str, first: int, step: int,
                key: str) -> Generator[tuple[str, str], None, int]:
    """(where, text) of documents `first, first + step, ...` of a .jsonl file; returns its
    document count.

    Every line is scanned (document boundaries are newlines, so there is no index to seek by),
    but only the wanted ones are parsed as JSON.
    """
    index = -1  # of the current document (non-blank line)
    line_no = 0  # not enumerate(): its reused result tuple would keep the last line alive
    with file.open("rb") as f:
        for line in f:
            line_no += 1
            if not line or line.isspace():  # not strip(): a copy of a long line
                continue
            index += 1
            if index < first or (index - first) % step:
                continue
            where = f"{file}:{line_no}"
            # A long line is held as bytes, then as text, then parsed, never twice at once, and
            # none of them while its document is packed.
            text, line = _utf8(line, file, where, key, nul=False), None
            try:
                row, text = json.loads(text), None
            except json.JSONDecodeError as e:
                raise DataConfigError(key, str(file), f"{where} is not JSON ({e.msg})",
                                      "fix or remove that line: .jsonl files hold one JSON object per line") from None
            yield where, _row_text(row, text_field, where)
    return index + 1


def _read_json(file: Path, text_field: str, first: int, step: int,
               key: str) -> Generator[tuple[str, str], None, int]:
    """(where, text) of documents `first, first + step, ...` of a .json file: an array of objects
    (read whole), or one object per line like .jsonl (both are what `datasets`' json loader reads)."""
    with file.open("rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return (yield from _read_jsonl(file, text_field, first, step, key))
    try:
        rows = json.loads(_utf8(file.read_bytes(), file, str(file), key, nul=False))
    except json.JSONDecodeError as e:
        raise DataConfigError(key, str(file), f"is not JSON ({e.msg} at line {e.lineno})",
                              "fix the file: a JSON array of objects, or one object per line") from None
    for index in range(first, len(rows), step):
        yield f"{file}[{index}]", _row_text(rows[index], text_field, f"{file}[{index}]")
    return len(rows)


def _row_text(row: Any, text_field: str, where: str) -> str:
    """The text of one JSON row (an object holding `text_field`)."""
    if not isinstance(row, dict) or text_field not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataConfigError("training.dataset_text_field", text_field, f"{where} has no such field (found {keys})",
                              "set it to the key that holds the text")
    return _as_text(row[text_field], where, text_field)


def _parquet_file(file: Path, key: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataConfigError(
            key, str(file), "reading .parquet files needs pyarrow",
            "pip install 'torchmoe[data]'",
        ) from e  # fmt: skip
    try:
        return pq.ParquetFile(file)
    except ValueError as e:  # pyarrow's ArrowInvalid: not a parquet file, or a truncated one
        raise DataConfigError(key, str(file), f"is not a readable .parquet file ({e})",
                              "replace it with a valid parquet file, or remove it from the dataset") from None


def _utf8(data: bytes, file: Path, where: str, key: str, *, nul: bool = True) -> str:
    """`data` (read from `file`, at `where`: the file or file:line; `key` named it) as text;
    `nul` as in `utf8_text` (False for JSON)."""
    try:
        return utf8_text(data, nul=nul)
    except NotUTF8 as e:
        raise DataConfigError(key, str(file), f"{where} {e.problem}",
                              f"{e.fix(file)}; or remove it from the dataset") from None


def _read_parquet(file: Path, text_field: str, first: int, step: int,
                  key: str) -> Generator[tuple[str, str], None, int]:
    """(where, text) of rows `first, first + step, ...` of a .parquet file; returns its row count.

    Reads only the row groups that hold a wanted row, one at a time (bounded memory); the
    count comes from the file's metadata.
    """
    pf = _parquet_file(file, key)
    rows = pf.metadata.num_rows
    if first >= rows:
        return rows
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise DataConfigError(
            "training.dataset_text_field", text_field, f"{file} has no such column (found {columns})",
            "set it to the column that holds the text",
        )  # fmt: skip
    wanted = first  # the next wanted row
    group_start = 0
    for group in range(pf.metadata.num_row_groups):
        group_end = group_start + pf.metadata.row_group(group).num_rows
        if wanted < group_end:
            texts = pf.read_row_group(group, columns=[text_field]).column(0).to_pylist()
            for row in range(wanted, group_end, step):
                yield f"{file} row {row}", _as_text(texts[row - group_start], f"{file} row {row}", text_field)
            wanted += (group_end - wanted + step - 1) // step * step
        group_start = group_end
    return rows


def _as_text(value: Any, where: str, field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataConfigError(
            "training.dataset_text_field", field, f"{where} holds {type(value).__name__}, not a string",
            "set it to the field that holds the text",
        )  # fmt: skip
    return value


class HFDocuments(Documents):
    """A Hugging Face dataset, streamed with `datasets.load_dataset(..., streaming=True)`.

    `name` is anything `load_dataset` accepts as its first argument: a hub id
    (`allenai/c4`) or a local folder of data files. The stream is never shuffled, so its order
    is the dataset's own. Resuming at document k streams past the first k rows (no
    tokenization, but they are downloaded/read again).

    `split(j, G)` is `datasets.distributed.split_dataset_by_node(stream, rank=j, world_size=G)`:
    when the dataset has a multiple of G shards (files), sub-corpus j is shards j, j+G, ... and
    reads nothing else; otherwise it keeps rows j, j+G, ... of the whole stream. `key` is the
    setting that named the dataset, for messages.
    """

    def __init__(
        self, name: str, config: str | None = None, *, split: str = "train", text_field: str = "text",
        key: str = "training.dataset_path",
    ) -> None:
        # Fail when the job is built, not at the first batch.
        if importlib.util.find_spec("datasets") is None:
            raise DataConfigError(
                "training.dataset", "hf", "streaming hub datasets needs the 'datasets' package",
                "pip install 'torchmoe[data]'",
            )  # fmt: skip
        self.name = name
        self.config = config
        self.split_name = split
        self.text_field = text_field
        self.key = key

    def __repr__(self) -> str:
        return f"HFDocuments({self.name!r}, {self.config!r}, split={self.split_name!r})"

    @classmethod
    def from_spec(cls, spec: str, *, split: str = "train", text_field: str = "text",
                  key: str = "training.dataset_path") -> HFDocuments:
        """From `training.dataset_path` (the setting `key`): `"name"` or `"name:config"` (an
        existing local path is taken whole, even if it holds a colon)."""
        if not spec:
            raise DataConfigError(
                key, spec, 'dataset = "hf" needs a hub dataset',
                "set it to 'name' or 'name:config', e.g. 'allenai/c4:en'",
            )  # fmt: skip
        if os.path.exists(spec) or ":" not in spec:
            return cls(spec, None, split=split, text_field=text_field, key=key)
        name, _, config = spec.partition(":")
        return cls(name, config or None, split=split, text_field=text_field, key=key)

    @cached_property
    def stream(self) -> Any:
        """The `datasets.IterableDataset`, resolved once (its data files) and shared by every
        sub-corpus of this process."""
        import datasets

        with self._loading():
            return datasets.load_dataset(self.name, self.config, split=self.split_name, streaming=True)

    @contextmanager
    def _loading(self) -> Iterator[None]:
        """`datasets` raises a dozen exception types for a dataset it cannot resolve or read (no
        such dataset, config or split, no data files, a corrupt file, no network): each is the
        user's to fix, so each becomes one message naming the dataset."""
        hub_logger = logging.getLogger("datasets")  # it also logs such errors itself, as ERROR
        level = hub_logger.level
        hub_logger.setLevel(logging.CRITICAL)
        try:
            yield
        except DataConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - see above
            spec = self.name + (f":{self.config}" if self.config else "")
            raise DataConfigError(
                self.key, spec, f"the hub dataset cannot be read ({type(e).__name__}: {e})",
                "check the dataset name and config ('name' or 'name:config'), the split "
                "(training.dataset_split), its files, and the network or the datasets cache",
            ) from None
        finally:
            hub_logger.setLevel(level)

    def iter_from(self, start: int = 0) -> Iterator[str]:
        return self._rows(self.stream.skip(start) if start else self.stream, start, "")

    def split(self, index: int, count: int) -> Documents:
        _check_split(index, count)
        return self if count == 1 else HFSubCorpus(self, index, count)

    def locate(self, index: int, where: str = "") -> str:
        """Row `index` (of `where`: a sub-corpus) of the hub dataset."""
        return f"row {index}{where} of hub dataset {self.name!r}"

    def _rows(self, stream: Any, start: int, where: str) -> Iterator[str]:
        """The text of each row of `stream`, whose first row is row `start` of `where`."""
        rows = iter(stream)
        for i in itertools.count(start):
            with self._loading():  # reading a row reads (and may fail on) the dataset's files
                row = next(rows, None)
            if row is None:
                return
            if self.text_field not in row:
                raise DataConfigError(
                    "training.dataset_text_field", self.text_field,
                    f"{self.locate(i, where)} has no such field (found {sorted(row)})",
                    "set it to the field that holds the text",
                )  # fmt: skip
            yield _as_text(row[self.text_field], self.locate(i, where), self.text_field)


class HFSubCorpus(Documents):
    """Sub-corpus `index` of `count` of a hub dataset (`HFDocuments.split`)."""

    def __init__(self, parent: HFDocuments, index: int, count: int) -> None:
        self.parent = parent
        self.index = index
        self.count = count

    def __repr__(self) -> str:
        return f"split_dataset_by_node(rank={self.index}, world_size={self.count}) of {self.parent!r}"

    def iter_from(self, start: int = 0) -> Iterator[str]:
        from datasets.distributed import split_dataset_by_node

        part = split_dataset_by_node(self.parent.stream, rank=self.index, world_size=self.count)
        # islice, not part.skip(): on a split by examples, datasets applies skip() to the whole
        # stream before keeping 1 row in `count`, which would start at the wrong row.
        rows = itertools.islice(part, start, None)
        return self.parent._rows(rows, start, self._where)

    def locate(self, index: int) -> str:
        return self.parent.locate(index, self._where)

    @property
    def _where(self) -> str:
        return f" of sub-corpus {self.index}/{self.count}"


# Directories that differ between machines with the same Python (installed packages, build
# configuration, bytecode caches); never read.
_MACHINE_DIRS = ("site-packages", "dist-packages", "__pycache__")
_TEST_DIRS = ("test", "tests", "idle_test")


def python_docs_files(stdlib: str | Path | None = None) -> list[Path]:
    """The `.py` files of the standard library, in the `python_docs` order.

    The stdlib's own modules come first (~12 MB on CPython 3.11), then its test suite
    (~19 MB more): some distributions ship Python without the test suite, and putting it last
    keeps the first pass identical there up to that point. Within each part files are sorted by
    path relative to the stdlib root, so the order does not depend on the install location or
    the file system. Installed packages and machine-specific files (`_sysconfigdata*`,
    `config-*/`) are excluded.

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
    return [path for _, path in sorted(modules)] + [path for _, path in sorted(tests)]


def local_files(dataset_path: str, *, key: str = "training.dataset_path") -> list[Path]:
    """The `.txt`/`.jsonl`/`.json`/`.parquet` files named by `dataset_path` (the setting `key`), sorted.

    `dataset_path` is a file, a folder (searched recursively) or a glob (`**` allowed).

    Raises:
        DataConfigError: nothing usable matches, or the OS refuses the path or a file or folder
            under it (missing, a path through a file, a name too long, a symbolic link to
            nothing, no permission: its reason); the message names the path and what to give.
    """
    wanted = "/".join(LOCAL_SUFFIXES)
    fix = f"point it at a {wanted} file, a folder holding such files, or a glob like 'data/*.jsonl'"
    if not dataset_path:
        raise DataConfigError(key, dataset_path, 'dataset = "local" needs files', fix)
    path = Path(dataset_path)
    with path_faults(key, dataset_path, fix, error=DataConfigError):
        if glob.has_magic(dataset_path):  # glob.glob passes over what it cannot read: its matches are stat'ed below
            candidates, what = [Path(p) for p in glob.glob(dataset_path, recursive=True)], "this glob matches"
        elif stat.S_ISDIR(os.stat(path).st_mode):
            candidates, what = _files_under(path), "this folder holds"
        elif path.suffix not in LOCAL_SUFFIXES:
            raise DataConfigError(key, dataset_path, f"unsupported file type {path.suffix!r}", fix)
        else:
            return [path]
        files = sorted((p for p in candidates if p.suffix in LOCAL_SUFFIXES and not stat.S_ISDIR(os.stat(p).st_mode)),
                       key=lambda p: p.as_posix())
    if not files:
        raise DataConfigError(key, dataset_path, f"{what} no {wanted} files", fix)
    return files


def _files_under(folder: Path) -> list[Path]:
    """Every entry under `folder` that is not a folder, recursively, without following links to
    folders; a folder that cannot be listed raises (os.walk and Path.rglob would pass over it)."""

    def fail(err: OSError) -> None:
        raise err

    return [Path(parent) / name for parent, _, names in os.walk(folder, onerror=fail) for name in names]


def build_documents(training: Training, *, key: str = "training.dataset_path") -> Documents:
    """The document source that `training.dataset` names (see `Training` in job_config); `key`
    names its path in messages (``validation.dataset_path`` for the validation data)."""
    kind = training.dataset
    if kind == "python_docs":
        return FileDocuments(python_docs_files())
    if kind == "local":
        return FileDocuments(local_files(training.dataset_path, key=key), text_field=training.dataset_text_field,
                             key=key)
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
        return FileDocuments(local_files(path, key=key), text_field=training.dataset_text_field, key=key)
    raise DataConfigError(
        "training.dataset", kind, "unknown dataset", "use 'python_docs', 'local' or 'hf'"
    )
