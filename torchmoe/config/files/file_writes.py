"""Writing the files a run owns: never through a symbolic link, never half-written, and one line
for why a write failed.

    write_file(dump / "config.toml", text)      # a new temporary file beside it, renamed over the name
    fd = open_append(dump / "metrics.jsonl")    # a symbolic link there: OSError (ELOOP)
    append(fd, line, path)                       # whole or not at all (a full disk cuts it back off)
    os_cause(err), write_fault(err)              # "No space left on device", out of DCP's exceptions too

A name the run writes may hold a symbolic link someone else made (to another run's file, or out of
the folder): a plain ``open(path, "w")`` writes through it. A rename replaces the link itself, and
``O_NOFOLLOW`` refuses it; the checks before a run (`preflight.files`) refuse such a link at start
with one message, these keep a link that appears later from being followed.

A write cut short by a full disk raises an `OSError` that names no file (``write()`` knows only a
descriptor): the errors raised here name the file, so that the net of `config.files.paths` can say
which key's folder is full.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["append", "open_append", "os_cause", "os_error", "write_fault", "write_file"]

_NAME_MAX = 255  # bytes in one name: Linux's file systems (ext4, xfs, btrfs, Lustre, NFS)


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
    suffix = f".tmp-{os.getpid()}"
    # A legal name of up to NAME_MAX (255) bytes leaves no room for the suffix: the temporary
    # name keeps as much of it as fits (whole characters). Else a legal output name failed on
    # its temporary's, after the work that made the output was done.
    stem = os.fsencode(path.name)[:_NAME_MAX - 1 - len(suffix)].decode(errors="ignore")
    tmp = path.with_name(f".{stem}{suffix}")
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


def open_append(path: str | os.PathLike) -> int:
    """A descriptor of `path` opened to append (created if missing); a symbolic link there is refused.

    Raises:
        OSError: what the OS says (``Too many levels of symbolic links`` for a link).
    """
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)


def append(fd: int, data: bytes, path: str | os.PathLike) -> None:
    """Append `data` to the file `fd` (opened by `open_append` on `path`) whole or not at all: a
    write cut short (a full disk) is cut back off the file, so that it holds only whole records
    and a later append does not continue a torn one.

    Raises:
        OSError: what the OS says, naming `path`.
    """
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as err:
        os.ftruncate(fd, start)  # frees what was written: it works on a full disk
        raise os_error(err, path) from None


def os_cause(err: BaseException) -> OSError | None:
    """The `OSError` behind a failed write, wherever it is in `err`: `err` itself, its cause or
    context (torch's zip writer raises a RuntimeError from the OSError of a full disk), or a rank's
    failure of a DCP `CheckpointException`; None when there is none (a bug, not the filesystem)."""
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
    if isinstance(failures, dict):
        return next((cause for exc, _ in failures.values() if (cause := os_cause(exc)) is not None), None)
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def write_fault(err: BaseException) -> str:
    """One line for a failed write: the OS's reason (`os_cause`: a full disk, permissions) with the
    file it names, for every rank of a DCP `CheckpointException`; else the exception's type and
    first line."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        return "; ".join(dict.fromkeys(write_fault(exc) for exc, _ in failures.values()))
    cause = os_cause(err)
    if cause is not None:
        return cause.strerror + (f": {cause.filename}" if cause.filename else "")
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
