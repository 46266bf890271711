"""The folder locks' choices and the heartbeat lock's rules, in this process (the runs that hold
and refuse folders are tests/integration/test_run_safety.py's)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from torchmoe.config.errors import ConfigError
from torchmoe.config.files import folder_owners
from torchmoe.config.files.paths import UserPath
from torchmoe.run_folders import run_lock
from torchmoe.run_folders.run_lock import OWNER_NAME, lock_folders, node_local_flock

# /proc/self/mountinfo lines: id parent major:minor root point options [optional...] - type source super
MOUNTS = """\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
30 22 0:40 / /lustre rw,relatime - lustre 10.0.0.1@o2ib:/fs rw,localflock,lazystatfs
31 22 0:41 / /lustre2 rw,relatime - lustre 10.0.0.2@o2ib:/fs rw,flock,lazystatfs
32 22 0:42 / /nfs rw,relatime shared:5 - nfs4 server:/export rw,vers=4.2,local_lock=none
33 22 0:43 / /nfs/v3 rw,relatime - nfs server:/old rw,vers=3,nolock
34 22 0:44 / /buckets rw,nosuid - fuse.s3fs s3fs rw,user_id=0
35 22 0:45 / /gluster rw - fuse.glusterfs gluster:/vol rw
36 22 0:46 / /nfs/home\\040dir rw - nfs server:/home rw,local_lock=all
37 22 0:47 / /beegfs rw - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf
"""


@pytest.mark.parametrize(("folder", "local"), [
    ("/home/me/run", None),
    ("/lustre/runs/a", "lustre mount /lustre with localflock: locks per node"),
    ("/lustre2/runs/a", None),
    ("/nfs/runs", None),
    ("/nfs/v3/runs", "nfs mount /nfs/v3 with nolock: locks per node"),  # the longest mount point wins
    ("/buckets/b/run", "fuse.s3fs mount /buckets: flock kept per node"),
    ("/gluster/run", None),
    ("/nfs/home dir/run", "nfs mount /nfs/home dir with local_lock=all: locks per node"),
    ("/beegfs/x", "beegfs mount /beegfs: locks per node unless tuneUseGlobalFileLocks"),
])
def test_mounts_whose_flock_locks_one_node_only(tmp_path, monkeypatch, folder, local):
    (tmp_path / "mountinfo").write_text(MOUNTS)
    monkeypatch.setattr(run_lock, "_MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(Path, "resolve", lambda self, strict=False: self)  # the folders are not here
    assert node_local_flock(Path(folder)) == local


def _owner(folder: Path, age_s: float = 0.0, **holder) -> Path:
    """An owner file of another run, its modification time `age_s` ago (negative: in the future),
    which nothing may read: liveness is the file's bytes changing, by the reader's clock."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / OWNER_NAME
    path.write_text(json.dumps({"host": "node-b", "pid": 77, "since": "2026-12-01 10:00:00", "command": "torchmoe train",
                                "token": "theirs", "beat": 0, **holder}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _lock(folder: Path):
    return lock_folders([UserPath("job.dump_folder", str(folder), str(folder), "")], "heartbeat")


@pytest.fixture
def quick(monkeypatch):
    """Heartbeats every 0.05 s, dead after 1 s unchanged; no file watched before."""
    monkeypatch.setattr(folder_owners, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(folder_owners, "STALE_S", 1.0)
    monkeypatch.setattr(folder_owners, "_UNCHANGED", {})


@contextlib.contextmanager
def _beating(path: Path, period_s: float = 0.05):
    """Another host's holder beating `path` (its counter rewritten in place) every `period_s`
    while the block runs, its modification time held still where it is (as an NFS client's
    attribute cache shows it, or a clock behind: what no reader may go by)."""
    stop = threading.Event()
    stamp = os.stat(path).st_mtime

    def beat() -> None:
        record = json.loads(path.read_text())
        while not stop.wait(period_s):
            record["beat"] += 1
            with open(path, "r+b") as f:
                f.write(json.dumps(record).encode())
            os.utime(path, (stamp, stamp))

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("age_s", [0.0, 3600.0, -3600.0 * 24 * 365])
def test_another_hosts_beating_holder_is_refused_whatever_its_time_stamp(tmp_path, quick, age_s):
    """It beats while we watch: a live holder, whether its file looks fresh, an hour stale (what a
    time-based judgement took over) or a year ahead. The fix says which file clears a dead lock."""
    path = _owner(tmp_path, age_s)
    started_at = time.monotonic()
    with _beating(path), pytest.raises(ConfigError) as err:
        _lock(tmp_path)
    assert time.monotonic() - started_at < folder_owners.STALE_S  # the first beat settled it
    message = str(err.value)
    assert "is in use by another run: pid 77 on node-b since 2026-12-01 10:00:00 (torchmoe train)" in message
    assert (f"fix: wait for it to end or stop it, or give this run a folder of its own for job.dump_folder; a lock "
            f"that no live run holds is cleared by deleting {path}, once you are sure no run uses {tmp_path}") in message
    assert json.loads(path.read_text())["token"] == "theirs"


@pytest.mark.parametrize("age_s", [5.0, 0.0, -3600.0 * 24 * 365])
def test_another_hosts_still_owner_file_is_taken_over_after_the_window(tmp_path, quick, caplog, age_s):
    """Unchanged for STALE_S by this host's clock: dead, whatever its time stamp says (a file dated
    a year ahead, from a clock running ahead or crafted, held the folder for ever; a fresh-looking
    one, e.g. touched through an attribute cache, is dead too when its bytes never move)."""
    caplog.set_level(logging.INFO)
    _owner(tmp_path, age_s)
    started_at = time.monotonic()
    locks = _lock(tmp_path)
    assert time.monotonic() - started_at >= folder_owners.STALE_S  # watched for the whole window first
    mine = json.loads((tmp_path / OWNER_NAME).read_text())
    assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname() and mine["token"] != "theirs"
    assert f"took over {tmp_path} from pid 77 on node-b" in caplog.text
    assert "whose owner file stayed unchanged for 1 s by this host's clock" in caplog.text
    before = mine["beat"]
    time.sleep(0.3)
    assert json.loads((tmp_path / OWNER_NAME).read_text())["beat"] > before  # beating: its counter moves
    locks.release()
    assert not (tmp_path / OWNER_NAME).exists()


@pytest.mark.parametrize("content", [b"garbage \x00\xff", b"", b"[1, 2]", b'{"host": "node-b"}'])
def test_an_owner_file_without_a_holder_record_is_taken_over_once_it_stays_still(tmp_path, quick, caplog, content):
    """"not a lock file" and never taken over before: an owner file of unexpected content held the
    folder for ever. It is watched like any; still for the window, it is taken over, with a word."""
    (tmp_path / OWNER_NAME).write_bytes(content)
    locks = _lock(tmp_path)
    assert json.loads((tmp_path / OWNER_NAME).read_text())["pid"] == os.getpid()
    assert f"took over {tmp_path} from a process that has not said who it is" in caplog.text
    locks.release()


def test_an_owner_file_of_unexpected_content_that_changes_is_refused(tmp_path, quick):
    path = tmp_path / OWNER_NAME
    path.write_text("0")
    stop = threading.Event()

    def scribble() -> None:
        n = 0
        while not stop.wait(0.05):
            n += 1
            path.write_text(str(n))

    thread = threading.Thread(target=scribble, daemon=True)
    thread.start()
    try:
        with pytest.raises(ConfigError, match=r"(?s)in use by another run: a process that has not said who it is .*"
                                              rf"cleared by deleting {re.escape(str(path))}"):
            _lock(tmp_path)
    finally:
        stop.set()
        thread.join()


def test_a_live_local_pid_that_does_not_beat_holds_nothing(tmp_path, quick, caplog):
    """A record naming a process of this host that lives (pid 1, with its true start time: what a
    stranger can read in /proc) but never beats: the pid alone no longer makes a holder."""
    host, boot = socket.gethostname(), folder_owners.boot_id()
    _owner(tmp_path, host=host, boot=boot, pid=1, started=folder_owners.started(1))
    locks = _lock(tmp_path)
    assert json.loads((tmp_path / OWNER_NAME).read_text())["pid"] == os.getpid()
    assert "stayed unchanged" in caplog.text
    locks.release()


def test_this_hosts_dead_or_reused_pid_is_taken_over_at_once(tmp_path, caplog):
    """On this host the pid tells (no waiting): a pid that runs no process, or that now runs
    another process than the one that took the lock (its start time differs)."""
    host, boot = socket.gethostname(), folder_owners.boot_id()
    for pid, started in ((2**22 + 12345, "1"), (os.getpid(), "0")):  # gone; ours, but not started then
        _owner(tmp_path, host=host, boot=boot, pid=pid, started=started)
        started_at = time.monotonic()
        locks = _lock(tmp_path)
        assert time.monotonic() - started_at < 1.0
        assert json.loads((tmp_path / OWNER_NAME).read_text())["token"] != "theirs"
        assert f"from pid {pid} on {host} since 2026-12-01 10:00:00 (torchmoe train), which no longer runs" in caplog.text
        locks.release()


def test_an_owner_name_that_is_not_a_file_is_never_followed_nor_removed(tmp_path, quick):
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    os.utime(target, (0, 0))  # stale, were it followed
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / OWNER_NAME
    path.symlink_to(target)
    with pytest.raises(ConfigError) as err:
        _lock(tmp_path / "run")
    assert "something that is not a lock file (a lrwxrwxrwx named .torchmoe.owner, which torchmoe never follows " \
           "nor removes)" in str(err.value)
    assert f"; delete {path} once you are sure no run uses {tmp_path / 'run'}" in str(err.value)
    assert path.is_symlink() and target.read_text() == "{}"


def test_commands_that_honour_the_locks_say_how_to_clear_them(tmp_path, quick):
    """`refuse_held` (plan --out, report, eval --out, prepare-data, a dry run): a beating holder is
    refused naming the file that clears a dead one; a still one holds nothing once watched."""
    path = _owner(tmp_path / "run", age_s=-3600.0)
    with _beating(path), pytest.raises(ConfigError) as err:
        folder_owners.refuse_held("--out", str(tmp_path / "run" / "plan.toml"), tmp_path / "run" / "plan.toml")
    assert f"is inside {tmp_path / 'run'}, which a live run holds (pid 77 on node-b" in str(err.value)
    assert f"cleared by deleting {path}" in str(err.value)
    folder_owners.refuse_held("--out", "x", tmp_path / "run" / "plan.toml")  # no beat now: dead after the window
    assert path.exists()  # looked at, never removed


def test_flock_that_fails_for_another_reason_is_a_path_error(tmp_path, monkeypatch):
    """ENOSYS/ENOLCK/EOPNOTSUPP mean "no flock here" (the heartbeat instead); any other error of
    flock is the folder's fault, named."""
    import errno
    import fcntl

    def failing(fd, op):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fcntl, "flock", failing)
    with pytest.raises(ConfigError, match="Input/output error"):
        lock_folders([UserPath("job.dump_folder", str(tmp_path), str(tmp_path), "fix it")])


def test_a_release_during_a_beat_never_reads_as_a_takeover(monkeypatch):
    """The heartbeat thread beating while its holder releases (its file then removed): the
    release waits for the beat, and the next beat no longer sees that holder. Before, a beat of a
    holder released meanwhile found its file gone, took that for a takeover and ended the process
    with exit 2 (a CI worker crashed so)."""
    import threading

    heartbeat = run_lock._Heartbeat()
    exits: list[int] = []
    monkeypatch.setattr(run_lock.os, "_exit", exits.append)
    beating, go = threading.Event(), threading.Event()

    class Owner:
        folder = path = Path("/nonexistent")
        released = False

        def beat(self) -> bool:
            beating.set()
            go.wait(5)
            return not self.released  # its file gone once released

    owner = Owner()
    heartbeat._held.add(owner)
    beat = threading.Thread(target=heartbeat.beat_once)
    beat.start()
    assert beating.wait(5)
    release = threading.Thread(target=lambda: (heartbeat.discard(owner), setattr(owner, "released", True)))
    release.start()
    release.join(0.3)
    assert release.is_alive()  # waiting for the beat in progress
    go.set()
    beat.join(5)
    release.join(5)
    heartbeat.beat_once()  # the next beat: the released holder is not beaten
    assert owner.released and exits == []
