"""One run owns every folder it writes into: a lock on each, held for the run's lifetime.

    lock = lock_folders(written, kind)   # collective; ConfigError if another run holds one of them
    ...                                  # train, save, prune
    lock.release()                       # or just exit

Two jobs (or the orphaned workers of a torchrun whose agent was killed with -9) writing one folder
would prune each other's checkpoints in progress, resume from each other's saves, and interleave
their metrics. Rank 0 locks every folder the run writes into (the dump folder, and the
checkpoint, TensorBoard, trace and snapshot folders it uses, which a key may put anywhere: an
absolute checkpoint folder shared by two dump folders is caught) and says who holds it (host,
pid, start time, command); a second run (or `torchmoe convert` into such a folder) is refused with
exit 2 naming that holder and the key whose folder it is. The lock is on the folder's real
location, so two names for one folder (a symbolic link, a ``..``) are the same lock, and its
file is never followed through a link.

Two kinds of lock (`job.folder_lock`):

- **flock** on ``<folder>/.torchmoe.lock``, which names the holder. The kernel (or the file
  system's lock manager) drops it when the holder ends, however it ends: a crashed run never
  leaves one stuck.
- **heartbeat**: an owner file ``<folder>/.torchmoe.owner`` created exclusively (``O_EXCL``,
  atomic on local, NFS, Lustre and GPFS file systems alike), naming the holder and a token of its
  own, with a beat counter that a thread of the holder rewrites every `HEARTBEAT_S` (through the
  descriptor that created it, with fsync), the file removed when it ends. Its holder lives while
  the file changes under a reader's eyes, by the reader's own clock (`folder_owners.owner_alive`:
  no other host's time stamp is ever compared with this one's, so a clock ahead or a file dated
  in the future holds nothing for ever). A file whose holder is dead is taken over: at once when
  the holder ran on this host (its pid is gone, or is another process now), otherwise once it
  stayed unchanged for `STALE_S` while this run watched; a file holding no holder record alike.
  A holder whose file was taken over (it was suspended, or its node cut off, past `STALE_S`)
  finds out at its next beat and ends at once, exit 2, before it writes another byte into a
  folder another run owns.

`auto` (the default) takes flock where it excludes across nodes, and the heartbeat where it
cannot: a file system that refuses flock (Lustre mounted without ``flock``: ENOSYS; NFSv3 without
a lock daemon: ENOLCK; EOPNOTSUPP), or a mount whose flock is node-local (`node_local_flock`:
Lustre's ``localflock``, NFS's ``local_lock=``/``nolock``, BeeGFS, FUSE mounts). It says once
which lock it uses, and why.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from torchmoe.config.errors import ConfigError
from torchmoe.config.files import folder_owners
from torchmoe.config.files.file_writes import os_error
from torchmoe.config.files.folder_owners import (
    FOLDER_LOCKS,
    LOCK_NAME,
    LOCK_NAMES,
    OWNER_NAME,
    Holder,
    Owner,
    boot_id,
    describe_holder,
    describe_owner,
    flock_holder,
    held_folder,
    owner_alive,
    read_owner,
    started,
)
from torchmoe.config.files.paths import UserPath, path_faults

__all__ = ["FOLDER_LOCKS", "LOCK_NAME", "LOCK_NAMES", "OWNER_NAME", "FolderLocks", "lock_folders",
           "node_local_flock"]

logger = logging.getLogger(__name__)

_MOUNTINFO = Path("/proc/self/mountinfo")

# flock's errors on a file system that has no (working) flock: its meaning, not a holder's.
_NO_FLOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP}


# This process's locks: real folder -> [lock, holders]. A flock belongs to one open file, so a
# second holder in the same process (one run locking a folder under two keys; tests, notebooks)
# shares the first one's instead of being refused by its own process.
_HELD: dict[Path, list] = {}
_said: set[str] = set()  # which lock kinds this process has said it uses


class FolderLocks:
    """This holder's share of this process's locks on the folders it writes (rank 0), or nothing."""

    def __init__(self, folders: list[Path]) -> None:
        self._folders = folders

    def release(self, *, remove: bool = False) -> None:
        """Drop the locks; `remove` also deletes each flock file this process no longer holds (for
        an output that should hold only what was written: `torchmoe convert`)."""
        for folder in self._folders:
            held = _HELD[folder]
            held[1] -= 1
            if held[1] == 0:
                held[0].release(remove=remove)
                del _HELD[folder]
        self._folders = []


class _Flock:
    """An flock held on a folder's lock file (its open descriptor)."""

    def __init__(self, folder: Path, fd: int) -> None:
        self.path, self.fd = folder / LOCK_NAME, fd

    def release(self, *, remove: bool) -> None:
        if remove:  # while still locked: whoever opens the old file next sees it gone (`_flock`)
            self.path.unlink(missing_ok=True)
        os.close(self.fd)  # closing the descriptor drops the flock


class _OwnerFile:
    """A heartbeat lock held: the owner file this process created (`fd`, open to write), beaten by
    `_Heartbeat`: its record's ``beat`` counts up."""

    def __init__(self, folder: Path, fd: int, record: dict) -> None:
        self.folder, self.path, self.fd, self.record = folder, folder / OWNER_NAME, fd, record
        self.token = record["token"]
        _HEARTBEAT.add(self)

    def beat(self) -> bool:
        """Write the next beat, if the file still is ours; False when another run took it over.
        Written through our own descriptor: a file taken over (renamed away, replaced) is never
        written over, the new holder's is left alone."""
        owner = read_owner(self.path)
        if owner is None or owner.record.get("token") != self.token:
            return False
        self.record["beat"] += 1
        _write_record(self.fd, self.record)
        return True

    def release(self, *, remove: bool) -> None:
        _HEARTBEAT.discard(self)
        owner = read_owner(self.path)
        if owner is not None and owner.record.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)


class _Heartbeat:
    """One daemon thread per process refreshing every held owner file every `HEARTBEAT_S`. A file
    found taken over ends the process (exit 2, one line): it no longer owns that folder."""

    def __init__(self) -> None:
        self._held: set[_OwnerFile] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # a new holder: beat now, at the period set now

    def add(self, owner: _OwnerFile) -> None:
        with self._lock:
            self._held.add(owner)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="torchmoe-folder-heartbeat", daemon=True)
                self._thread.start()
        self._wake.set()

    def discard(self, owner: _OwnerFile) -> None:
        with self._lock:
            self._held.discard(owner)

    def _run(self) -> None:
        while True:
            self._wake.wait(folder_owners.HEARTBEAT_S)
            self._wake.clear()
            # Beaten under the lock: a holder releasing meanwhile (`discard`, then its file
            # removed) waits for the beat, so a file gone because it was released is never taken
            # for one taken over (that ended a process after a good run: a CI worker crash).
            self.beat_once()

    def beat_once(self) -> None:
        """Refresh every held owner file; exit 2 on one taken over."""
        with self._lock:
            for owner in self._held:
                try:
                    ours = owner.beat()
                except OSError as err:  # the file system is away: the next beat tries again
                    logger.warning("could not refresh the lock of %s: %s", owner.folder, err)
                    continue
                if not ours:
                    holder = read_owner(owner.path)
                    who = describe_owner(owner.path, holder).who if holder else "nobody (its owner file is gone)"
                    stale = folder_owners.STALE_S
                    sys.stderr.write(f"error: the lock of {owner.folder} was taken over by another run, now held "
                                     f"by {who}: this run's heartbeat stopped for longer than {stale:.0f} s (was "
                                     "it suspended, or its node cut off?); stopping before writing more into a "
                                     "folder it no longer owns\n")
                    sys.stderr.flush()
                    os._exit(2)


_HEARTBEAT = _Heartbeat()


def _acquire(folder: Path, kind: str) -> tuple[Path | None, Holder | None]:
    """(the real folder, now held by this process, None), or (None, the other holder)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder = folder.resolve()
    if folder not in _HELD:
        lock, holder = _take(folder, kind)
        if lock is None:
            return None, holder
        _HELD[folder] = [lock, 0]
    _HELD[folder][1] += 1
    return folder, None


def _take(folder: Path, kind: str) -> tuple[_Flock | _OwnerFile | None, Holder | None]:
    """Lock `folder` with `kind`'s lock (auto: flock where it excludes across nodes)."""
    if kind == "auto":
        local = node_local_flock(folder)
        if local is None:
            try:
                return _flock(folder)
            except OSError as err:
                if err.errno not in _NO_FLOCK:
                    raise os_error(err, folder / LOCK_NAME) from None
                local = f"flock fails there: {os.strerror(err.errno)}"
        _say("heartbeat", f"owner files with a heartbeat ({folder}: {local})")
        return _owner_file(folder)
    if kind == "heartbeat":
        _say("heartbeat", "owner files with a heartbeat (job.folder_lock)")
        return _owner_file(folder)
    return _flock(folder)


def _say(kind: str, what: str) -> None:
    if kind not in _said:
        _said.add(kind)
        logger.info("folder locks: %s", what)


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": started(os.getpid()),
            "boot": boot_id(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}


def _flock(folder: Path) -> tuple[_Flock | None, Holder | None]:
    """(the flock held, None), or (None, the holder). OSError: flock itself failed."""
    path = folder / LOCK_NAME
    while True:
        # O_NOFOLLOW: a symbolic link in its place (to another run's lock, or out of the folder) is refused.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            taken = _exclusive(fd)
        except OSError:
            os.close(fd)
            raise
        if not taken:
            holder = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
            os.close(fd)
            return None, flock_holder(folder, holder)
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # a holder removed the file as it released it: lock the one that is there now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
    except OSError as err:  # a full disk: the lock holds, but who holds it cannot be said
        os.close(fd)
        raise os_error(err, path) from None
    return _Flock(folder, fd), None


def _exclusive(fd: int) -> bool:
    """Whether this process now holds `fd`'s flock. A refusal is tried again twice, moments
    apart: another command's `folder_owners.live_holder` holds a shared lock for an instant,
    and only a run's lasting lock is a holder."""
    for pause in (0.05, 0.2, 0.0):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(pause)
    return False


def _write_record(fd: int, record: dict) -> None:
    """`record` as the whole content of the owner file `fd`, on the disk (and the file server)
    before this returns: a reader on another node opens the file and reads these bytes."""
    data = json.dumps(record).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))  # the counter only grows: a no-op, unless the record shrank
    os.fsync(fd)


def _owner_file(folder: Path) -> tuple[_OwnerFile | None, Holder | None]:
    """(the owner file created, None), or (None, the live holder)."""
    path = folder / OWNER_NAME
    record = {**_me(), "token": uuid.uuid4().hex, "beat": 0}
    for _ in range(5):  # another run may take or free it between our steps: look again
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            owner = read_owner(path)
            if owner is None:
                continue  # removed meanwhile
            if owner.odd is not None:  # a link, a folder: never followed nor removed
                return None, describe_owner(path, owner)
            alive, latest = owner_alive(path, owner)
            if alive and latest is not None:
                return None, describe_owner(path, latest)
            if latest is not None:
                _remove_stale(path, latest)
            continue
        try:
            _write_record(fd, record)
        except OSError as err:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise os_error(err, path) from None
        return _OwnerFile(folder, fd, record), None
    owner = read_owner(path)
    return None, describe_owner(path, owner) if owner else Holder("a run that keeps taking and freeing it",
                                                                  "try again in a moment")


def _remove_stale(path: Path, watched: Owner) -> None:
    """Remove a dead holder's owner file, as watched, unless it changed since (a beat after we
    looked, or another file in its place: then it is put back)."""
    aside = path.with_name(f"{OWNER_NAME}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another run removed it first
    moved = read_owner(aside)
    if moved is not None and moved.raw != watched.raw:
        try:  # a live holder's, beating after we looked: back in place (never over a newer one)
            os.link(aside, path)
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)
        return  # nothing taken over: the caller looks again and finds that holder
    aside.unlink(missing_ok=True)
    record = watched.record
    local = record.get("host") == socket.gethostname() and record.get("boot") == boot_id()
    why = "which no longer runs" if local and isinstance(record.get("pid"), int) and \
        started(record["pid"]) != record.get("started") else \
        f"whose owner file stayed unchanged for {folder_owners.STALE_S:.0f} s by this host's clock"
    logger.warning("took over %s from %s, %s", path.parent, describe_holder(record), why)


def node_local_flock(folder: Path) -> str | None:
    """Why flock on `folder`'s mount excludes only the processes of one node (the mount options
    that say so), or None: Lustre's ``localflock``, NFS's ``local_lock=flock|all`` or ``nolock``,
    BeeGFS (global locks off by default) and FUSE mounts (flock kept by the kernel, unless the
    file system serves it: GlusterFS). From Linux's /proc/self/mountinfo; None where unknown."""
    mount = _mount_of(folder)
    if mount is None:
        return None
    point, fstype, options = mount
    where = f"{fstype} mount {point}"
    if fstype == "lustre" and "localflock" in options:
        return f"{where} with localflock: locks per node"
    if fstype in ("nfs", "nfs4") and ({"local_lock=flock", "local_lock=all", "nolock"} & options):
        return f"{where} with {', '.join(sorted({'local_lock=flock', 'local_lock=all', 'nolock'} & options))}: " \
               "locks per node"
    if fstype == "beegfs":
        return f"{where}: locks per node unless tuneUseGlobalFileLocks"
    if fstype.startswith("fuse") and fstype != "fuse.glusterfs":
        return f"{where}: flock kept per node"
    return None


def _mount_of(folder: Path) -> tuple[str, str, set[str]] | None:
    """(mount point, file system type, mount and super options) of the mount holding `folder`."""
    try:
        lines = _MOUNTINFO.read_text().splitlines()
    except OSError:
        return None
    best = None
    real = str(folder.resolve())
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            options = set(fields[5].split(",")) | set(fields[sep + 3].split(",") if len(fields) > sep + 3 else ())
            best = (point, fields[sep + 1], options)
    return best


def lock_folders(folders: Sequence[UserPath], kind: str = "auto") -> FolderLocks:
    """Take every folder of `folders` (each `path`, created if missing) for this run with `kind`'s
    lock (`job.folder_lock`); collective under a process group (rank 0 locks, every rank learns
    the outcome). Nothing is held when one of them is refused.

    Raises:
        ConfigError: another live process holds one of them (on every rank), naming its key.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    held: list[Path] = []
    refused: tuple[str, str, str, str] | None = None  # a ConfigError's key, value, problem and fix
    if rank == 0:
        for folder in folders:
            fix = f"wait for it to end or stop it, or give this run a folder of its own for {folder.key}"
            try:
                with path_faults(folder.key, folder.value, folder.fix):
                    # Looked at first, creating nothing: the folder, or one above it (a folder
                    # inside another run's, its checkpoint folder say, is that run's too).
                    other = held_folder(Path(folder.path), mine=_HELD)
                    real, holder = (None, None) if other else _acquire(Path(folder.path), kind)
            except ConfigError as err:  # said on every rank, not only here
                real, refused = None, (err.key, err.value, err.problem, err.fix)
            else:
                holder = holder or (other[1] if other is not None else None)
                if other is not None and other[0] != Path(folder.path).resolve():
                    refused = (folder.key, folder.value, f"is inside {other[0]}, which another run holds: "
                               f"{other[1].who}", f"{fix}; {other[1].clear}")
                elif real is None and holder is not None:
                    refused = (folder.key, folder.value, f"is in use by another run: {holder.who}",
                               f"{fix}; {holder.clear}")
            if real is None:
                FolderLocks(held).release()
                held = []
                break
            held.append(real)
    if dist.is_initialized():
        box = [refused]
        dist.broadcast_object_list(box, src=0)
        refused = box[0]
    if refused is not None:
        raise ConfigError(*refused)
    return FolderLocks(held)
