"""Who owns a folder: the read side of the run locks (`run_folders.run_lock` takes them), for the
commands that write a file or folder a user names (`torchmoe plan --out`, `report --out`, `eval
--out`, `prepare-data OUT_DIR`, a dry run's ``dry_run.json``), so that none writes into a folder a
live run holds.

    holder = live_holder(folder)           # Holder("pid 41 on node-a since ... (torchmoe train ...)", how to clear) or None
    held = held_folder(path)               # (the folder at or above `path` a live run holds, its Holder) or None
    refuse_held(key, value, path)          # ConfigError naming the holder, the key and how to clear the lock

A folder is held when its ``.torchmoe.lock`` is flocked by another process, or its
``.torchmoe.owner`` has a live holder (`owner_alive`). Nothing is created, taken or removed here;
a file in a lock file's place that is not a regular file (a link) is never followed.

**An owner file's holder lives when its file changes while the reader watches it, by the
reader's own clock** (`time.monotonic`): the holder rewrites its beat counter every
`HEARTBEAT_S`, and a reader that sees the same bytes for `STALE_S` calls it dead. No time stamp
of another host is compared with this host's clock: a clock running ahead, or a crafted file
dated in the future, would otherwise hold a folder for ever, and a modification time read
through NFS's attribute cache can be older than the file (a live holder taken over). The bytes
are read after `open`, which NFS revalidates (close-to-open consistency), and the holder
writes them with `fsync`. A holder on this host (same boot) whose pid no longer runs the process
that took the lock is dead at once; a file that holds no holder record (garbage, or an editor's
copy) is judged by the same watch, and taken over when it stays still. Every refusal says how to
clear a lock that no live run holds (`Holder.clear`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.nesting import json_loads

__all__ = ["FOLDER_LOCKS", "HEARTBEAT_S", "LOCK_NAME", "LOCK_NAMES", "OWNER_NAME", "STALE_S", "Holder", "Owner",
           "boot_id", "describe_holder", "describe_lock_text", "describe_owner", "flock_holder", "held_folder",
           "live_holder", "owner_alive", "read_owner", "refuse_held", "started"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".torchmoe.lock"
OWNER_NAME = ".torchmoe.owner"
LOCK_NAMES = (LOCK_NAME, OWNER_NAME)
"""The files a folder's lock keeps in it."""
FOLDER_LOCKS = ("auto", "flock", "heartbeat")
"""`job.folder_lock`'s values."""

HEARTBEAT_S = 2.0
"""How often a heartbeat lock's holder rewrites its owner file (its beat counter)."""
STALE_S = 60.0
"""How long a reader watches an owner file that does not change, by its own clock, before it
calls the holder dead: a holder may miss beats for this long (a loaded node, a slow file system)."""


@dataclass(frozen=True)
class Owner:
    """An owner file as read: its bytes, the holder record they hold ({} when they hold none:
    being written, garbage), and `odd`, the kind of what is there when it is no regular file."""

    raw: bytes
    record: dict
    odd: str | None = None


@dataclass(frozen=True)
class Holder:
    """Who holds a folder's lock (`who`), and how to clear the lock once no live run holds it
    (`clear`, a phrase for a message's fix)."""

    who: str
    clear: str


def read_owner(path: Path) -> Owner | None:
    """The owner file `path` as it is now; None when there is none. A link or anything but a
    regular file in its place is an `Owner` with `odd` set (never followed, never removed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:  # a link (ELOOP), or what cannot be opened to read: looked at, not followed
        try:
            mode = os.stat(path, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISREG(mode):
            raise err from None
        return Owner(b"", {}, stat.filemode(mode))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # a named pipe opened without blocking, a device: never read
            return Owner(b"", {}, stat.filemode(mode))
        raw = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        record = json_loads(raw.decode("utf-8", errors="replace"))
    except ValueError:
        record = {}
    return Owner(raw, record if isinstance(record, dict) else {})


def owner_alive(path: Path, seen: Owner) -> tuple[bool, Owner | None]:
    """Whether the holder of the owner file `path` (read as `seen`) lives, and the file as last
    read (None: it went away meanwhile, its holder released it). A holder on this host whose pid
    no longer runs the process that took the lock is dead at once; any other lives when its
    file's bytes change within `STALE_S` of this process's clock, and is dead when they do not
    (a wait of up to `STALE_S`)."""
    record = seen.record
    if record.get("host") == socket.gethostname() and record.get("boot") == boot_id() and isinstance(
            record.get("pid"), int):
        now = started(record["pid"])
        if now is None or now != record.get("started"):  # gone, or its pid reused since
            return False, seen
    # The watch starts when this process first saw these bytes (a run looks at a folder twice: as
    # a folder it may not write into, then as one it locks), never at a time the file states.
    key = os.path.abspath(path)
    bytes_seen, since = _UNCHANGED.get(key, (None, 0.0))
    if bytes_seen != seen.raw:
        since = time.monotonic()
        _UNCHANGED[key] = (seen.raw, since)
    deadline = since + STALE_S
    if time.monotonic() < deadline:
        logger.info("watching %s for up to %.0f s: does its holder (%s) still beat?", path,
                    deadline - time.monotonic(), describe_holder(record))
    while time.monotonic() < deadline:
        time.sleep(min(HEARTBEAT_S / 4, max(deadline - time.monotonic(), 0.0)))
        now_seen = read_owner(path)
        if now_seen is None:
            return False, None
        if now_seen.raw != seen.raw or now_seen.odd != seen.odd:
            _UNCHANGED.pop(key, None)
            return True, now_seen
    return False, seen


# Owner file (absolute path) -> (its bytes, when this process first saw them: `time.monotonic`).
_UNCHANGED: dict[str, tuple[bytes, float]] = {}


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
    try:
        return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"  # type: ignore[index]
    except (KeyError, TypeError):
        return "a process that has not said who it is (its owner file holds no holder record)"


def describe_owner(path: Path, owner: Owner) -> Holder:
    """The `Holder` of the owner file `path`, read as `owner`."""
    if owner.odd is not None:
        return Holder(f"something that is not a lock file (a {owner.odd} named {OWNER_NAME}, which torchmoe never "
                      "follows nor removes)", f"delete {path} once you are sure no run uses {path.parent}")
    return Holder(describe_holder(owner.record), f"a lock that no live run holds is cleared by deleting {path}, once "
                  f"you are sure no run uses {path.parent} (a dead holder's is also taken over by the next run "
                  f"after {STALE_S:.0f} s without a beat)")


def flock_holder(folder: Path, text: str) -> Holder:
    """The `Holder` of `folder`'s flock, whose lock file reads `text`."""
    who = describe_lock_text(text)
    return Holder(who, "the kernel keeps this lock only while its process lives: it goes when that process ends "
                  f"(deleting {folder / LOCK_NAME} would not stop it)")


def live_holder(folder: Path) -> Holder | None:
    """The live run holding `folder`'s lock, or None; looked at without taking the lock. The
    flock is probed with a shared lock for an instant: only a run's exclusive one refuses it
    (`run_lock` looks twice before calling a folder held, so a probe never refuses a run). An
    owner file is watched (`owner_alive`: up to `STALE_S` when its holder is dead)."""
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
                    return flock_holder(folder, os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
                except OSError as err:  # no flock on this file system: its runs use the owner file
                    if err.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                        raise
        finally:
            os.close(fd)  # drops the shared lock
    owner_path = folder / OWNER_NAME
    owner = read_owner(owner_path)
    if owner is None:
        return None
    if owner.odd is not None:
        return describe_owner(owner_path, owner)
    alive, latest = owner_alive(owner_path, owner)
    return describe_owner(owner_path, latest) if alive and latest is not None else None


def held_folder(path: str | os.PathLike, mine: Collection[Path] = ()) -> tuple[Path, Holder] | None:
    """The nearest folder at or above `path` (its real location: links and ``..`` resolved)
    that a live run holds, with its holder; None when no live run holds any.

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
    raise ConfigError(key, value, f"{where} {folder}, which a live run holds ({holder.who}): no command writes into "
                      "another run's folders", "name a path outside that run's folders, or wait for the run to end; "
                      f"{holder.clear}")
