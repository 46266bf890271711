"""Writing the files a run owns: never through a symbolic link, never half-written.

    write_file(dump / "config.toml", text)      # a new temporary file beside it, renamed over the name
    with open_append(dump / "metrics.jsonl") as f: ...   # a symbolic link there: OSError (ELOOP)

A name the run writes may hold a symbolic link someone else made (to another run's file, or out of
the folder): a plain ``open(path, "w")`` writes through it. A rename replaces the link itself, and
``O_NOFOLLOW`` refuses it; the checks before a run (`preflight.files`) refuse such a link at start
with one message, these keep a link that appears later from being followed.

A write cut short by a full disk raises an `OSError` that names no file (``write()`` knows only a
descriptor): the errors raised here name the file, so that the net of `config.paths` can say
which key's folder is full.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

__all__ = ["open_append", "os_error", "write_file"]


def os_error(err: OSError, path: str | os.PathLike) -> OSError:
    """`err`, naming `path` when it names no file."""
    if err.filename is not None:
        return err
    return OSError(err.errno, err.strerror, os.fspath(path))


def write_file(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace `path` by a file holding `data`: written to a temporary file created beside it
    (exclusively: never through a link), synced, then renamed over `path`. A reader sees the old
    file or the new one, and a failure (a full disk) leaves the old one and no temporary file.

    Raises:
        OSError: what the OS says, naming `path` (or the temporary file's folder).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        try:
            view = memoryview(payload)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise os_error(err, path) from None


def open_append(path: str | os.PathLike) -> TextIO:
    """`path` opened to append UTF-8 text (created if missing); a symbolic link there is refused.

    Raises:
        OSError: what the OS says (``Too many levels of symbolic links`` for a link).
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a", encoding="utf-8")
