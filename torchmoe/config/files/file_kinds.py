"""What a path is when it is not a regular file, and reading a file only when it is one.

    file_kind(os.lstat(path).st_mode)   # "named pipe", "character device", ... or None (regular)
    data = read_regular(path)           # NotARegularFile for a pipe, device or socket
    data = read_regular(path, limit=1 << 20)  # TooLarge beyond 1 MiB

A named pipe opened to read waits for a writer for ever (a crafted ``.distcp`` or
``.metadata`` hung a load), and a device is read as if it were data (``/dev/zero`` never ends):
a file torchmoe reads as data must be a regular file, and one it replaces must be one too
(`output_files`).
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

__all__ = ["NotARegularFile", "TooLarge", "check_regular", "file_kind", "is_plain_name", "read_regular", "regular_fd"]

_KINDS = ((stat.S_ISDIR, "folder"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link"))


class NotARegularFile(ValueError):
    """A file read as data is something else (a named pipe, a device, a socket), in one sentence."""


class TooLarge(ValueError):
    """A file read whole holds more bytes than its reader's bound: `size` of `limit`."""

    def __init__(self, path: str | os.PathLike, size: int, limit: int) -> None:
        super().__init__(f"{Path(path).name} holds {size:,} bytes, more than the {limit:,} read at once")
        self.size, self.limit = size, limit


def is_plain_name(name: str) -> bool:
    """Whether `name`, read from a folder's own index (a DCP `.metadata`, an HF weight map),
    names a file of that folder: no separator, not ``.`` or ``..`` (the writers record plain
    names; anything else was altered or crafted to reach out of the folder)."""
    return name not in ("", ".", "..") and os.path.basename(name) == name


def file_kind(mode: int) -> str | None:
    """What `mode` (an `os.stat` result's) is, or None for a regular file."""
    return None if stat.S_ISREG(mode) else next((name for test, name in _KINDS if test(mode)), "special file")


def regular_fd(path: str | os.PathLike) -> int:
    """A descriptor of `path` (links followed) opened to read, once it is known to be a regular
    file (a named pipe is never opened: that would wait for a writer).

    Raises:
        OSError: what the OS says (`IsADirectoryError` for a folder, as a read would).
        NotARegularFile: it is something else, naming its file name and kind.
    """
    with _regular(path) as f:
        return os.dup(f.fileno())


def _regular(path: str | os.PathLike) -> io.FileIO:
    # Looked at before it is opened (an open of a named pipe waits for a writer), then opened
    # through `io.open` as pathlib reads (tests patch it to deny a read; one open, one audit
    # event), then looked at again: what was opened is what was looked at.
    check_regular(path)
    f = io.open(path, "rb", buffering=0)
    try:
        _check_kind(path, os.fstat(f.fileno()).st_mode)
    except (OSError, NotARegularFile):
        f.close()
        raise
    return f


def check_regular(path: str | os.PathLike) -> None:
    """`path` (links followed) is a regular file, looked at without opening it: before a reader
    that opens it itself (safetensors).

    Raises:
        OSError: what the OS says (`IsADirectoryError` for a folder).
        NotARegularFile: it is something else.
    """
    _check_kind(path, os.stat(path).st_mode)


def _check_kind(path: str | os.PathLike, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(21, "Is a directory", os.fspath(path))  # the OS's words, as a read says
    kind = file_kind(mode)
    if kind is not None:
        raise NotARegularFile(f"{Path(path).name} is a {kind}, not a regular file")


def read_regular(path: str | os.PathLike, *, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path` (`regular_fd`'s errors otherwise); with `limit`, at
    most that many (`TooLarge` for a file that holds more, found before it is read)."""
    with _regular(path) as f:
        if limit is None:
            return f.readall()
        size = os.fstat(f.fileno()).st_size
        chunks, read = [], 0
        while size <= limit and read <= limit and (chunk := f.read(limit + 1 - read)):  # one that grows meanwhile
            chunks.append(chunk)
            read += len(chunk)
        if size > limit or read > limit:
            raise TooLarge(path, max(size, read), limit)
        return b"".join(chunks)
