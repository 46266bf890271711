"""What the data pipeline reads of a user's file at once: only regular files, and within a bound.

    data = read_whole(path, key="model.tokenizer_path", value=folder, fix="...")  # a file parsed whole
    check_row(length, "data/chat.jsonl:12", key="training.dataset_path", value=path, fix="...")
    check_regular(path, key="training.dataset_path", value=path)                  # before another reader opens it
    pf = parquet_file(path, key="training.dataset_path")                          # pyarrow's reader of it

A named pipe in a data folder (a ``b.jsonl`` that is a FIFO) made a run wait for a writer for
ever, and a row or file of many gigabytes was read whole, then decoded and parsed, several times its
size in memory. Every file the pipeline parses whole (a .json array, tokenizer.json and its
configs, a chat template, a token-shards manifest) is read by `read_whole`, every row (a .jsonl
line, a parquet row group) is measured by `check_row` before it is read, and every file another
reader opens (numpy, pyarrow) is looked at by `check_regular` first. Each refusal is one
`DataConfigError` naming the file (and row), the bound and the fix.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from torchmoe.config.files.file_kinds import NotARegularFile, TooLarge
from torchmoe.config.files.file_kinds import check_regular as _check_regular
from torchmoe.config.files.file_kinds import read_regular
from torchmoe.config.files.paths import path_faults
from torchmoe.data.errors import DataConfigError

__all__ = ["GROUPS_FIX", "READ_BYTES", "TEMPLATE_BYTES", "check_regular", "check_row", "parquet_file", "read_whole"]

READ_BYTES = 1 << 28
"""The most bytes of one row (a .jsonl line, a parquet row group) or of one file parsed whole (a
.json array, tokenizer.json, its configs, manifest.json) read at once: 256 MiB, which Python then
holds several times over as text and parsed objects."""
TEMPLATE_BYTES = 1 << 20
"""The most bytes of a chat template file (1 MiB: the families' own are 5-30 KB)."""

GROUPS_FIX = "write the file with smaller row groups (pyarrow.parquet.write_table(..., row_group_size=N))"
"""What to do about a parquet row group beyond the bound."""
_NOT_REGULAR_FIX = "remove it, or replace it with the regular file it stands for"


def read_whole(path: str | os.PathLike, *, key: str, value: str, fix: str | None, large_fix: str = "",
               limit: int | None = None) -> bytes:
    """The bytes of the regular file `path`, found under the setting `key` = `value`.

    Args:
        fix: what to do when the OS refuses it (missing, no permission); None lets its `OSError`
            through, to a caller that names it.
        large_fix: what to do when it holds more than `limit` bytes (default `READ_BYTES`).

    Raises:
        DataConfigError: the OS refuses it, it is not a regular file (a named pipe, a device: never
            opened), or it is larger than the bound.
    """
    limit = READ_BYTES if limit is None else limit
    with path_faults(key, value, fix, error=DataConfigError) if fix is not None else nullcontext():
        try:
            return read_regular(path, limit=limit)
        except NotARegularFile as err:
            raise DataConfigError(key, value, f"{Path(path).parent}/{err}", _NOT_REGULAR_FIX) from None
        except TooLarge as err:
            raise DataConfigError(key, value, f"{path} holds {err.size:,} bytes, more than the {limit:,} "
                                  "torchmoe reads of one file at once (the bound)",
                                  large_fix or f"use a smaller {Path(path).name}") from None


def check_row(size: int, where: str, *, key: str, value: str, fix: str) -> None:
    """Refuse a row of `size` bytes (at `where`: ``file:line``, ``file row group g``) beyond `READ_BYTES`.

    Raises:
        DataConfigError: naming the row, its size, the bound and `fix`.
    """
    if size > READ_BYTES:
        raise DataConfigError(key, value, f"{where} holds {size:,} bytes, more than the {READ_BYTES:,} torchmoe "
                              "reads of one row at once (the bound)", fix)


def check_regular(path: str | os.PathLike, *, key: str, value: str) -> None:
    """`path` is a regular file (links followed), looked at without opening it, before a reader
    that opens it itself.

    Raises:
        DataConfigError: the OS refuses it, or it is a named pipe, device or socket.
    """
    with path_faults(key, value, _NOT_REGULAR_FIX, error=DataConfigError):
        try:
            _check_regular(path)
        except NotARegularFile as err:
            raise DataConfigError(key, value, f"{Path(path).parent}/{err}", _NOT_REGULAR_FIX) from None


def parquet_file(file: Path, key: str) -> Any:
    """pyarrow's reader of the .parquet file `file` (`key` named it): a `DataConfigError` without
    pyarrow, or for a file that is not parquet."""
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
