"""Document sources: ordered corpora of text documents, read lazily.

    from torchmoe.data import build_documents
    docs = build_documents(job_config.training)   # training.dataset picks the source
    for text in docs.iter_from(1000): ...         # documents 1000, 1001, ...; 0..999 not tokenized

Three sources, chosen by `training.dataset`:
- `python_docs` (default): the Python standard library's own sources, offline everywhere.
- `local`: `.txt` / `.jsonl` / `.parquet` files named by `training.dataset_path`.
- `hf`: a Hugging Face hub dataset, streamed.
Every source yields the same documents in the same order on every pass and every rank; the
packer (`dataloader.py`) relies on that to shard by data-parallel rank and to resume.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchmoe.config.errors import ConfigError

if TYPE_CHECKING:
    from torchmoe.config.job_config import Training

__all__ = [
    "DataConfigError",
    "Documents",
    "InMemoryDocuments",
    "FileDocuments",
    "HFDocuments",
    "python_docs_files",
    "local_files",
    "build_documents",
]

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")


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

    def __iter__(self) -> Iterator[str]:
        return self.iter_from(0)


class InMemoryDocuments(Documents):
    """A fixed list of strings (tests, small experiments)."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)

    def __repr__(self) -> str:
        return f"InMemoryDocuments({len(self.texts)} texts)"

    def iter_from(self, start: int = 0) -> Iterator[str]:
        return iter(self.texts[start:])


class FileDocuments(Documents):
    """Documents from files, in the given order.

    `.jsonl` files hold one document per non-blank line (the string at `text_field`), `.parquet`
    files one per row (column `text_field`, via pyarrow), and any other file is one document
    (its UTF-8 text; undecodable bytes become U+FFFD so every machine reads the same string).
    A null text is an empty document, so document indices always count rows.

    Args:
        files: the files, already in their deterministic order.
        text_field: the JSON key / parquet column holding the text.
    """

    def __init__(self, files: Sequence[Path], *, text_field: str = "text") -> None:
        self.files = [Path(f) for f in files]
        self.text_field = text_field

    def __repr__(self) -> str:
        where = f", first {self.files[0]}" if self.files else ""
        return f"FileDocuments({len(self.files)} files{where})"

    def iter_from(self, start: int = 0) -> Iterator[str]:
        skip = start
        for file in self.files:
            if skip:
                count = _count_documents(file)
                if skip >= count:
                    skip -= count
                    continue
            yield from self._read(file, skip)
            skip = 0

    def _read(self, file: Path, skip: int) -> Iterator[str]:
        if file.suffix == ".jsonl":
            yield from _read_jsonl(file, self.text_field, skip)
        elif file.suffix == ".parquet":
            yield from _read_parquet(file, self.text_field, skip)
        else:
            yield file.read_bytes().decode("utf-8", errors="replace")


def _count_documents(file: Path) -> int:
    """Documents in `file`, found without parsing them (line count, parquet metadata)."""
    if file.suffix == ".jsonl":
        with file.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if file.suffix == ".parquet":
        return _parquet_file(file).metadata.num_rows
    return 1


def _read_jsonl(file: Path, text_field: str, skip: int) -> Iterator[str]:
    with file.open("rb") as f:
        index = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            index += 1
            if index <= skip:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataConfigError("training.dataset_path", str(file), f"{file}:{line_no} is not JSON ({e.msg})",
                                      "fix or remove that line: .jsonl files hold one JSON object per line") from None
            if not isinstance(row, dict) or text_field not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise DataConfigError(
                    "training.dataset_text_field", text_field,
                    f"{file}:{line_no} has no such field (found {keys})",
                    "set it to the key that holds the text",
                )  # fmt: skip
            yield _as_text(row[text_field], f"{file}:{line_no}", text_field)


def _parquet_file(file: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataConfigError(
            "training.dataset_path", str(file), "reading .parquet files needs pyarrow",
            "pip install 'torchmoe[data]'",
        ) from e  # fmt: skip
    return pq.ParquetFile(file)


def _read_parquet(file: Path, text_field: str, skip: int) -> Iterator[str]:
    pf = _parquet_file(file)
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise DataConfigError(
            "training.dataset_text_field", text_field, f"{file} has no such column (found {columns})",
            "set it to the column that holds the text",
        )  # fmt: skip
    row = 0
    # One row group at a time bounds memory; whole groups before `skip` are never read.
    for group in range(pf.metadata.num_row_groups):
        rows = pf.metadata.row_group(group).num_rows
        if row + rows <= skip:
            row += rows
            continue
        texts = pf.read_row_group(group, columns=[text_field]).column(0).to_pylist()
        for i in range(max(skip - row, 0), rows):
            yield _as_text(texts[i], f"{file} row {row + i}", text_field)
        row += rows


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
    """

    def __init__(
        self, name: str, config: str | None = None, *, split: str = "train", text_field: str = "text"
    ) -> None:
        # Fail when the job is built, not at the first batch.
        if importlib.util.find_spec("datasets") is None:
            raise DataConfigError(
                "training.dataset", "hf", "streaming hub datasets needs the 'datasets' package",
                "pip install 'torchmoe[data]'",
            )  # fmt: skip
        self.name = name
        self.config = config
        self.split = split
        self.text_field = text_field

    def __repr__(self) -> str:
        return f"HFDocuments({self.name!r}, {self.config!r}, split={self.split!r})"

    @classmethod
    def from_spec(cls, spec: str, *, split: str = "train", text_field: str = "text") -> HFDocuments:
        """From `training.dataset_path`: `"name"` or `"name:config"` (an existing local path is
        taken whole, even if it holds a colon)."""
        if not spec:
            raise DataConfigError(
                "training.dataset_path", spec, 'dataset = "hf" needs a hub dataset',
                "set it to 'name' or 'name:config', e.g. 'allenai/c4:en'",
            )  # fmt: skip
        if os.path.exists(spec) or ":" not in spec:
            return cls(spec, None, split=split, text_field=text_field)
        name, _, config = spec.partition(":")
        return cls(name, config or None, split=split, text_field=text_field)

    def iter_from(self, start: int = 0) -> Iterator[str]:
        import datasets

        stream = datasets.load_dataset(self.name, self.config, split=self.split, streaming=True)
        if start:
            stream = stream.skip(start)
        for i, row in enumerate(stream, start=start):
            if self.text_field not in row:
                raise DataConfigError(
                    "training.dataset_text_field", self.text_field,
                    f"row {i} of hub dataset {self.name!r} has no such field (found {sorted(row)})",
                    "set it to the field that holds the text",
                )  # fmt: skip
            yield _as_text(row[self.text_field], f"row {i} of hub dataset {self.name!r}", self.text_field)


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


def local_files(dataset_path: str) -> list[Path]:
    """The `.txt`/`.jsonl`/`.parquet` files named by `training.dataset_path`, sorted.

    `dataset_path` is a file, a folder (searched recursively) or a glob (`**` allowed).

    Raises:
        DataConfigError: nothing usable matches; the message names the path and what to give.
    """
    wanted = "/".join(LOCAL_SUFFIXES)
    fix = f"point it at a {wanted} file, a folder holding such files, or a glob like 'data/*.jsonl'"
    if not dataset_path:
        raise DataConfigError("training.dataset_path", dataset_path, 'dataset = "local" needs files', fix)
    path = Path(dataset_path)
    if path.is_file():
        if path.suffix not in LOCAL_SUFFIXES:
            raise DataConfigError(
                "training.dataset_path", dataset_path, f"unsupported file type {path.suffix!r}", fix
            )
        return [path]
    if path.is_dir():
        candidates = [p for p in path.rglob("*") if p.is_file()]
    else:
        candidates = [Path(p) for p in glob.glob(dataset_path, recursive=True) if os.path.isfile(p)]
    files = sorted((p for p in candidates if p.suffix in LOCAL_SUFFIXES), key=lambda p: p.as_posix())
    if not files:
        what = "this folder holds" if path.is_dir() else "this path or glob matches"
        raise DataConfigError("training.dataset_path", dataset_path, f"{what} no {wanted} files", fix)
    return files


def build_documents(training: Training) -> Documents:
    """The document source that `training.dataset` names (see `Training` in job_config)."""
    kind = training.dataset
    if kind == "python_docs":
        return FileDocuments(python_docs_files())
    if kind == "local":
        return FileDocuments(local_files(training.dataset_path), text_field=training.dataset_text_field)
    if kind == "hf":
        return HFDocuments.from_spec(
            training.dataset_path, split=training.dataset_split, text_field=training.dataset_text_field
        )
    raise DataConfigError(
        "training.dataset", kind, "unknown dataset", "use 'python_docs', 'local' or 'hf'"
    )
