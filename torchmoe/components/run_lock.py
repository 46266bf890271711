"""One run owns every folder it writes into: an advisory file lock on each, held for the run's lifetime.

    lock = lock_folders(written)   # collective; ConfigError if another run holds one of them
    ...                            # train, save, prune
    lock.release()                 # or just exit: the kernel releases it

Two jobs (or the orphaned workers of a torchrun whose agent was killed with -9) writing one folder
would prune each other's checkpoints in progress, resume from each other's saves, and interleave
their metrics. Rank 0 takes an exclusive `flock` on `<folder>/.torchmoe.lock` of every folder the
run writes into (the dump folder, and the checkpoint, TensorBoard, trace and snapshot folders it
uses, which a key may put anywhere: an absolute checkpoint folder shared by two dump folders is
caught), and writes who holds it (host, pid, start time, command) into the file; a second run (or
`torchmoe convert` into such a folder) is refused with exit 2 naming that holder and the key whose
folder it is. The lock is on the folder's real location, so two names for one folder (a symbolic
link, a ``..``) are the same lock. The kernel drops a lock when the holding process ends, however
it ends, so a crashed run never leaves one stuck.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from torchmoe.config.errors import ConfigError
from torchmoe.config.file_writes import os_error
from torchmoe.config.paths import UserPath

__all__ = ["LOCK_NAME", "FolderLocks", "lock_folders"]

LOCK_NAME = ".torchmoe.lock"


# This process's locks: real folder -> [descriptor, holders]. A flock belongs to one open file, so
# a second holder in the same process (one run locking a folder under two keys; tests, notebooks)
# shares the first one's instead of being refused by its own process.
_HELD: dict[Path, list[int]] = {}


class FolderLocks:
    """This holder's share of this process's locks on the folders it writes (rank 0), or nothing."""

    def __init__(self, folders: list[Path]) -> None:
        self._folders = folders

    def release(self, *, remove: bool = False) -> None:
        """Drop the locks; `remove` also deletes each lock file this process no longer holds (for
        an output that should hold only what was written: `torchmoe convert`)."""
        for folder in self._folders:
            held = _HELD[folder]
            held[1] -= 1
            if held[1] == 0:
                if remove:  # while still locked: whoever opens the old file next sees it gone (`_try_lock`)
                    (folder / LOCK_NAME).unlink(missing_ok=True)
                os.close(held[0])  # closing the descriptor drops the flock
                del _HELD[folder]
        self._folders = []


def _acquire(folder: Path) -> tuple[Path | None, str | None]:
    """(the real folder, now held by this process, None), or (None, the other holder's description)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder = folder.resolve()
    if folder not in _HELD:
        fd, holder = _try_lock(folder)
        if fd is None:
            return None, holder
        _HELD[folder] = [fd, 0]
    _HELD[folder][1] += 1
    return folder, None


def _try_lock(folder: Path) -> tuple[int | None, str | None]:
    """(descriptor holding the lock, None), or (None, the holder's description)."""
    path = folder / LOCK_NAME
    while True:
        # O_NOFOLLOW: a symbolic link in its place (to another run's lock, or out of the folder) is refused.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
            os.close(fd)
            return None, _describe(holder)
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # a holder removed the file as it released it: lock the one that is there now
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
          "command": " ".join(sys.argv)}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError as err:  # a full disk: the lock holds, but who holds it cannot be said
        os.close(fd)
        raise os_error(err, path) from None
    return fd, None


def _describe(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"


def lock_folders(folders: Sequence[UserPath]) -> FolderLocks:
    """Take every folder of `folders` (each `path`, created if missing) for this run; collective
    under a process group (rank 0 locks, every rank learns the outcome). Nothing is held when one
    of them is refused.

    Raises:
        ConfigError: another live process holds one of them (on every rank), naming its key.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    held: list[Path] = []
    refused: tuple[str, str, str] | None = None
    if rank == 0:
        for folder in folders:
            real, holder = _acquire(Path(folder.path))
            if real is None:
                refused = (folder.key, folder.value, holder)
                FolderLocks(held).release()
                held = []
                break
            held.append(real)
    if dist.is_initialized():
        box = [refused]
        dist.broadcast_object_list(box, src=0)
        refused = box[0]
    if refused is not None:
        key, value, holder = refused
        raise ConfigError(key, value, f"is in use by another run: {holder}",
                          f"wait for it to end or stop it, or give this run a folder of its own for {key}")
    return FolderLocks(held)
