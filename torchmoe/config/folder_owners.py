"""Who owns a folder: the read side of the run locks (`components.run_lock` takes them), for the
commands that write a file or folder a user names (`torchmoe plan --out`, `report --out`, `eval
--out`, `prepare-data OUT_DIR`, a dry run's ``dry_run.json``), so that none writes into a folder a
live run holds.

    holder = live_holder(folder)           # "pid 41 on node-a since ... (torchmoe train ...)" or None
    held = held_folder(path)               # (the folder at or above `path` a live run holds, holder) or None
    refuse_held(key, value, path)          # ConfigError naming the holder and the key

A folder is held when its ``.torchmoe.lock`` is flocked by another process, or its
``.torchmoe.owner`` names a live holder (`owner_dead`). Nothing is created, taken or removed here;
a file in a lock file's place that is not a regular file (a link) is never followed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
from collections.abc import Collection
from pathlib import Path

from torchmoe.config.errors import ConfigError
from torchmoe.config.nesting import json_loads

__all__ = ["FOLDER_LOCKS", "HEARTBEAT_S", "LOCK_NAME", "LOCK_NAMES", "OWNER_NAME", "STALE_S", "boot_id",
           "describe_holder", "describe_lock_text", "held_folder", "live_holder", "owner_dead", "read_owner",
           "refuse_held", "started"]

LOCK_NAME = ".torchmoe.lock"
OWNER_NAME = ".torchmoe.owner"
LOCK_NAMES = (LOCK_NAME, OWNER_NAME)
"""The files a folder's lock keeps in it."""
FOLDER_LOCKS = ("auto", "flock", "heartbeat")
"""`job.folder_lock`'s values."""

HEARTBEAT_S = 10.0
"""How often a heartbeat lock's holder refreshes its owner file."""
STALE_S = 60.0
"""How old a heartbeat must be for its holder to count as dead (another host's)."""


def read_owner(path: Path) -> tuple[dict, float] | None:
    """The owner file's holder (what it says; {} while it is still being written or unreadable)
    and its modification time; None when there is none. A link or anything but a regular file
    in its place is a holder that says nothing (never followed, never removed)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return {"token": None, "odd": stat.filemode(st.st_mode)}, float("inf")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            text = os.read(fd, 65536).decode("utf-8", errors="replace")
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    try:
        owner = json_loads(text)
    except ValueError:
        owner = {}
    return (owner if isinstance(owner, dict) else {}), st.st_mtime


def owner_dead(path: Path, owner: dict, mtime: float) -> bool:
    """Whether the holder of `path` is gone: on this host (same boot), its pid no longer runs
    the process that took the lock; elsewhere, its heartbeat is older than `STALE_S` and does
    not move for two more beats."""
    if "odd" in owner:
        return False
    if owner.get("host") == socket.gethostname() and owner.get("boot") == boot_id() and isinstance(
            owner.get("pid"), int):
        now = started(owner["pid"])
        return now is None or now != owner.get("started")  # gone, or its pid reused since
    if time.time() - mtime <= STALE_S:
        return False
    time.sleep(2 * HEARTBEAT_S)
    again = read_owner(path)
    return again is not None and again[1] == mtime and again[0].get("token") == owner.get("token")


def started(pid: int) -> str | None:
    """When process `pid` started (Linux's /proc, in clock ticks since boot), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def describe_lock_text(holder: str) -> str:
    """`describe_holder` of a lock file's text."""
    try:
        return describe_holder(json_loads(holder))
    except ValueError:
        return describe_holder({})


def describe_holder(h: object) -> str:
    """One phrase for a lock's holder record: pid, host, since when and its command."""
    if isinstance(h, dict) and "odd" in h:
        return f"something that is not a lock file (a {h['odd']} named {OWNER_NAME}: remove it)"
    try:
        return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"  # type: ignore[index]
    except (KeyError, TypeError):
        return "a process that has not yet said who it is"


def live_holder(folder: Path) -> str | None:
    """The live run holding `folder`'s lock (its description), or None; looked at without
    taking the lock. The flock is probed with a shared lock for an instant: only a run's
    exclusive one refuses it (`run_lock` looks twice before calling a folder held, so a probe
    never refuses a run)."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # none (or a link in its place: never followed; a run refuses it at its start)
        fd = -1
    if fd >= 0:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return describe_lock_text(os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
                except OSError as err:  # no flock on this file system: its runs use the owner file
                    if err.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                        raise
        finally:
            os.close(fd)  # drops the shared lock
    owner_path = folder / OWNER_NAME
    owner = read_owner(owner_path)
    if owner is not None and not owner_dead(owner_path, *owner):
        return describe_holder(owner[0])
    return None


def held_folder(path: str | os.PathLike, mine: Collection[Path] = ()) -> tuple[Path, str] | None:
    """The nearest folder at or above `path` (its real location: links and ``..`` resolved)
    that a live run holds, with the holder's description; None when no live run holds any.

    Args:
        mine: real folders this process holds itself (skipped: not another run's).
    """
    real = Path(path).resolve()
    for folder in (real, *real.parents):
        if folder in mine:
            continue
        try:
            holder = live_holder(folder) if folder.is_dir() else None
        except OSError:  # a folder this user cannot look into holds no lock of theirs to honour
            continue
        if holder is not None:
            return folder, holder
    return None


def refuse_held(key: str, value: str, path: str | os.PathLike) -> None:
    """ConfigError (for `key` = `value`) when `path` is a folder a live run holds, or inside one."""
    held = held_folder(path)
    if held is None:
        return
    folder, holder = held
    where = "is" if folder == Path(path).resolve() else "is inside"
    raise ConfigError(key, value, f"{where} {folder}, which a live run holds ({holder}): no command writes into "
                      "another run's folders", "name a path outside that run's folders, or wait for the run to end")
