"""One run owns its dump folder: an advisory file lock held for the run's lifetime.

    lock = lock_dump_folder(Path(job.dump_folder))   # collective; ConfigError if another run holds it
    ...                                               # train, save, prune
    lock.release()                                    # or just exit: the kernel releases it

Two jobs (or the orphaned workers of a torchrun whose agent was killed with -9) writing one dump
folder would prune each other's checkpoints in progress. Rank 0 takes an exclusive `flock` on
`<dump_folder>/.torchmoe.lock` and writes who holds it (host, pid, start time, command) into the
file; a second run is refused with exit 2 naming that holder. The kernel drops the lock when
the holding process ends, however it ends, so a crashed run never leaves it stuck.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist

from torchmoe.config.errors import ConfigError

__all__ = ["LOCK_NAME", "DumpFolderLock", "lock_dump_folder"]

LOCK_NAME = ".torchmoe.lock"


# This process's locks: folder -> [descriptor, holders]. A flock belongs to one open file, so a
# second Trainer of the same process (tests, notebooks) shares the first one's instead of being
# refused by its own process.
_HELD: dict[Path, list[int]] = {}


class DumpFolderLock:
    """One holder's share of this process's lock on a dump folder (rank 0), or nothing."""

    def __init__(self, folder: Path | None) -> None:
        self._folder = folder

    def release(self) -> None:
        if self._folder is None:
            return
        held = _HELD[self._folder]
        held[1] -= 1
        if held[1] == 0:
            os.close(held[0])  # closing the descriptor drops the flock
            del _HELD[self._folder]
        self._folder = None


def _acquire(folder: Path) -> tuple[Path | None, str | None]:
    """(the folder now held by this process, None), or (None, the other holder's description)."""
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
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        os.close(fd)
        return None, _describe(holder)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
          "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd, None


def _describe(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"


def lock_dump_folder(folder: Path) -> DumpFolderLock:
    """Take `folder` for this run; collective under a process group (rank 0 locks, every rank
    learns the outcome).

    Raises:
        ConfigError: another live run holds the folder (on every rank).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    held, holder = _acquire(folder) if rank == 0 else (None, None)
    if dist.is_initialized():
        box = [holder]
        dist.broadcast_object_list(box, src=0)
        holder = box[0]
    if holder is not None:
        raise ConfigError("job.dump_folder", str(folder), f"is in use by another run: {holder}",
                          "wait for it to end or stop it, or give this run its own job.dump_folder")
    return DumpFolderLock(held)
