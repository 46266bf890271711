"""Chat rows from files and saved datasets, each read alone, and what each row says.

    rows = chat_rows("data/chat/*.jsonl", key="training.dataset_path")
    rows.count(), rows.read(12), rows.locate(12)      # a row, and "data/chat/a.jsonl:13"
    conversation(rows.read(12), rows.locate(12))      # its messages, tools and first target

Rows come from `.jsonl` (one per non-blank line, found once by `file_index.line_spans`, each
read by a seek), `.json` (an array of rows, or lines), `.parquet` (one per row, a row group read
at a time) files named by a file, a folder or a glob (`file_listing.local_files`' rules), or from a
folder written by `datasets`' `save_to_disk` (read offline with `load_from_disk`; of a
DatasetDict, the split `training.dataset_split`).

A row is conversational, as TRL reads it: ``{"messages": [{"role", "content"}, ...]}``, or
``{"prompt": ..., "completion": ...}`` where each is a list of messages or a string (a string
prompt is the user's message, a string completion the assistant's). A row's ``tools`` go to the
template with it.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import path_faults
from torchmoe.config.files.text import SURROGATE_FIX, NotUTF8, lone_surrogate, utf8_text
from torchmoe.data.chat.chat_masks import Conversation
from torchmoe.data.errors import DataConfigError, shown_json
from torchmoe.data.file_index import line_spans
from torchmoe.data.file_listing import local_files
from torchmoe.data.read_bounds import GROUPS_FIX, check_regular, check_row, parquet_file, read_whole

__all__ = ["ChatRows", "chat_rows", "conversation"]

ROW_FORMS = '{"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "completion": ...}'
_SAVED = ("dataset_info.json", "state.json")  # what `Dataset.save_to_disk` writes beside its .arrow files
_SAVED_DICT = "dataset_dict.json"  # `DatasetDict.save_to_disk`'s
_LARGE_ROW_FIX = "split the conversation into shorter ones, or remove it"


class _Source(ABC):
    """Rows of one file or saved dataset."""

    @abstractmethod
    def count(self) -> int:
        """How many rows it holds."""

    @abstractmethod
    def read(self, row: int) -> Any:
        """Row `row`, parsed."""

    @abstractmethod
    def locate(self, row: int) -> str:
        """Where row `row` is, for messages."""


class _JsonLines(_Source):
    def __init__(self, file: Path, key: str) -> None:
        self.file, self.key = file, key

    @cached_property
    def _spans(self) -> Any:
        """(n, 4) int64: each non-blank line's offset, length, line number and start."""
        return line_spans(self.file)

    def count(self) -> int:
        return len(self._spans)

    def read(self, row: int) -> Any:
        offset, length = int(self._spans[row, 0]), int(self._spans[row, 1])
        check_row(length, self.locate(row), key=self.key, value=str(self.file), fix=_LARGE_ROW_FIX)
        with self.file.open("rb") as f:
            f.seek(offset)
            return _parse(f.read(length), self.file, self.locate(row), self.key)

    def locate(self, row: int) -> str:
        return f"{self.file}:{int(self._spans[row, 2])}"


class _JsonArray(_Source):
    def __init__(self, file: Path, key: str) -> None:
        self.file, self.key = file, key

    @cached_property
    def _rows(self) -> list[Any]:
        data = read_whole(self.file, key=self.key, value=str(self.file), fix="fix its permissions, or remove it",
                          large_fix="write its rows as .jsonl, one a line, which is read a row at a time")
        rows = _parse(data, self.file, str(self.file), self.key)
        if not isinstance(rows, list):
            raise DataConfigError(self.key, str(self.file), f"holds a JSON {type(rows).__name__}, not an array",
                                  "write a JSON array of rows, or one row per line")
        return rows

    def count(self) -> int:
        return len(self._rows)

    def read(self, row: int) -> Any:
        return self._rows[row]

    def locate(self, row: int) -> str:
        return f"{self.file}[{row}]"


class _Parquet(_Source):
    def __init__(self, file: Path, key: str) -> None:
        self.file, self.key = file, key
        self._group: tuple[int, list[dict[str, Any]]] | None = None  # the row group read last

    @cached_property
    def _pf(self) -> Any:
        return parquet_file(self.file, self.key)

    @cached_property
    def _firsts(self) -> list[int]:
        """Each row group's first row, and the row count last."""
        sizes = [self._pf.metadata.row_group(g).num_rows for g in range(self._pf.metadata.num_row_groups)]
        return [sum(sizes[:g]) for g in range(len(sizes) + 1)]

    def count(self) -> int:
        return self._firsts[-1]

    def read(self, row: int) -> Any:
        group = next(g for g in range(len(self._firsts) - 1) if row < self._firsts[g + 1])
        if self._group is None or self._group[0] != group:
            check_row(self._pf.metadata.row_group(group).total_byte_size, f"{self.file} row group {group} (rows "
                      f"{self._firsts[group]} to {self._firsts[group + 1] - 1})", key=self.key, value=str(self.file),
                      fix=GROUPS_FIX)
            self._group = (group, self._pf.read_row_group(group).to_pylist())
        return self._group[1][row - self._firsts[group]]

    def locate(self, row: int) -> str:
        return f"{self.file} row {row}"


class _Saved(_Source):
    """A dataset written by `save_to_disk` (memory-mapped arrow files; a row read alone)."""

    def __init__(self, folder: Path, split: str, key: str) -> None:
        try:
            import datasets
        except ImportError as e:
            raise DataConfigError(key, str(folder), "reading a saved Hugging Face dataset needs the 'datasets' "
                                  "package", "pip install 'torchmoe[data]'") from e
        for parent, _, names in os.walk(folder):  # datasets would open a named pipe among them, and wait
            for name in sorted(names):
                check_regular(Path(parent) / name, key=key, value=str(folder))
        try:
            data = datasets.load_from_disk(str(folder))
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds for a folder it cannot read
            raise DataConfigError(key, str(folder), f"datasets cannot load it ({type(e).__name__}: {e})",
                                  "point it at a folder written by save_to_disk") from None
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise DataConfigError("training.dataset_split", split, f"{folder} holds the splits {sorted(data)}",
                                      "set training.dataset_split to one of them")
            data = data[split]
        self.data, self.folder, self.split = data, folder, split

    def count(self) -> int:
        return len(self.data)

    def read(self, row: int) -> Any:
        return self.data[row]

    def locate(self, row: int) -> str:
        return f"row {row} of the saved dataset {self.folder}"


def _parse(data: bytes, file: Path, where: str, key: str) -> Any:
    try:
        return json_loads(utf8_text(data, nul=False))
    except NotUTF8 as e:
        raise DataConfigError(key, str(file), f"{where} {e.problem}", f"{e.fix(file)}; or remove it") from None
    except json.JSONDecodeError as e:
        raise DataConfigError(key, str(file), f"{where} is not JSON ({e.msg})",
                              "fix or remove it: chat rows are JSON objects, one per line in .jsonl") from None


class ChatRows:
    """Every chat row of a dataset path, in order: its files' (sorted) rows, or a saved dataset's.

    Args:
        sources: the files' or the dataset's row readers, in order.
        key: the setting that named them, for messages; `value` its value.
    """

    def __init__(self, sources: Sequence[_Source], *, key: str, value: str) -> None:
        self.sources = list(sources)
        self.key, self.value = key, value

    def __repr__(self) -> str:
        return f"ChatRows({self.value!r})"

    @cached_property
    def _firsts(self) -> list[int]:
        """Each source's first row, and the row count last."""
        counts = [self._faults(source.count) for source in self.sources]
        return [sum(counts[:i]) for i in range(len(counts) + 1)]

    def count(self) -> int:
        return self._firsts[-1]

    def read(self, index: int) -> Any:
        source, row = self._find(index)
        return self._faults(source.read, row)

    def locate(self, index: int) -> str:
        source, row = self._find(index)
        return source.locate(row)

    def _find(self, index: int) -> tuple[_Source, int]:
        s = next(s for s in range(len(self.sources)) if index < self._firsts[s + 1])
        return self.sources[s], index - self._firsts[s]

    def _faults(self, fn: Any, *args: Any) -> Any:
        # A file deleted or unreadable since it was listed: what the OS says.
        with path_faults(self.key, self.value, "fix its permissions, or remove it from the dataset",
                         error=DataConfigError):
            return fn(*args)


def chat_rows(path: str, *, key: str = "training.dataset_path", extensions: Sequence[str] = (),
              split: str = "train") -> ChatRows:
    """The chat rows at `path` (the setting `key`): a saved dataset's folder, or .jsonl, .json
    and .parquet files (a file, a folder or a glob; `extensions` as `training.dataset_extensions`).

    Raises:
        DataConfigError: nothing readable there, or a file that holds no chat rows by its suffix.
    """
    folder = Path(path)
    if folder.is_dir() and ((folder / _SAVED_DICT).is_file() or all((folder / n).is_file() for n in _SAVED)):
        return ChatRows([_Saved(folder, split, key)], key=key, value=path)
    sources: list[_Source] = []
    for file in local_files(path, key=key, extensions=extensions):
        if file.suffix == ".jsonl":
            sources.append(_JsonLines(file, key))
        elif file.suffix == ".json":
            with file.open("rb") as f:
                array = f.read(4096).lstrip().startswith(b"[")
            sources.append(_JsonArray(file, key) if array else _JsonLines(file, key))
        elif file.suffix == ".parquet":
            sources.append(_Parquet(file, key))
        else:
            raise DataConfigError(key, path, f"holds {file}, which is not a file of chat rows",
                                  "give .jsonl, .json or .parquet files of rows " + ROW_FORMS + ", a folder "
                                  "written by datasets' save_to_disk, or set training.dataset_extensions = "
                                  '[".jsonl"] to read only those in a folder')
    return ChatRows(sources, key=key, value=path)


def conversation(row: Any, where: str, source: tuple[str, str]) -> Conversation:
    """What chat row `row` (found at `where`; `source` the dataset setting and its value) says.

    Raises:
        DataConfigError: the row is not one of the two forms, a message is not a dict with a role,
            a content is neither text nor a list of parts, the tools are not a list of JSON
            schemas, or a string holds a lone surrogate (JSON's "\\ud800": no text).
    """
    if isinstance(row, dict):  # arrow-backed rows hold every column, None where a row has none
        row = {key: value for key, value in row.items() if value is not None}
    if not isinstance(row, dict) or not ("messages" in row or {"prompt", "completion"} <= row.keys()):
        found = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataConfigError(*source, f"{where} is not a chat row (found {found})", f"write each row as {ROW_FORMS}")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise DataConfigError(*source, f"{where}: its tools are {shown_json(tools)}, not a list of JSON schemas",
                              'write them as [{"type": "function", "function": {"name": ..., ...}}, ...], or leave '
                              "tools out")
    _no_surrogates({"tools": tools}, where, source)
    if "messages" in row:
        return Conversation(_messages(row["messages"], "messages", where, source), tools)
    prompt = _messages(row["prompt"], "prompt", where, source, role="user")
    completion = _messages(row["completion"], "completion", where, source, role="assistant")
    return Conversation(prompt + completion, tools, first_target=len(prompt))


def _messages(value: Any, field: str, where: str, source: tuple[str, str], role: str = "") -> list[dict[str, Any]]:
    """The messages of a row's `field`; a string is one message of `role` (prompt/completion only)."""
    if isinstance(value, str) and role:
        value = [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise DataConfigError(*source, f"{where}: its {field} is {type(value).__name__ if value else 'empty'}, not a "
                              "list of messages" + (" or a string" if role else ""),
                              f"write it as [{{\"role\": ..., \"content\": ...}}, ...]")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataConfigError(*source, f"{where}: {field}[{i}] is not a message (a dict with a role)",
                                  'write each message as {"role": ..., "content": ...}')
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            # A template writes it as Python writes it: True, 0.1, {'a': 1}, none of which the data says.
            raise DataConfigError(*source, f"{where}: {field}[{i}].content is {shown_json(content)}, not text (a string) "
                                  'or a list of content parts ([{"type": "text", "text": ...}])',
                                  f"write it as a string: {json.dumps(json.dumps(content, default=str))}")
    _no_surrogates({field: value}, where, source)
    # A field that is None is absent (as transformers takes it): arrow-backed rows give every field.
    return [{key: item for key, item in message.items() if item is not None} for message in value]


def _no_surrogates(value: Any, where: str, source: tuple[str, str], path: str = "") -> None:
    """Refuse a string of `value` (at `path` in the row) holding a lone surrogate (`lone_surrogate`)."""
    if isinstance(value, str):
        if (problem := lone_surrogate(value)) is not None:
            raise DataConfigError(*source, f"{where}: {path} {problem}", f"fix the row: {SURROGATE_FIX}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_surrogates(item, where, source, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _no_surrogates(item, where, source, f"{path}[{i}]")
