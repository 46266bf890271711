"""The folder locks' choices and the heartbeat lock's rules, in this process (the runs that hold
and refuse folders are tests/integration/test_run_safety.py's)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from torchmoe.components import run_lock
from torchmoe.components.run_lock import OWNER_NAME, lock_folders, node_local_flock
from torchmoe.config import folder_owners
from torchmoe.config.errors import ConfigError
from torchmoe.config.paths import UserPath

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


def _owner(folder: Path, age_s: float, **holder) -> Path:
    """An owner file of another run, its heartbeat `age_s` old."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / OWNER_NAME
    path.write_text(json.dumps({"host": "node-b", "pid": 77, "since": "2026-12-01 10:00:00", "command": "torchmoe train",
                                "token": "theirs", **holder}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _lock(folder: Path):
    return lock_folders([UserPath("job.dump_folder", str(folder), str(folder), "")], "heartbeat")


@pytest.fixture
def quick(monkeypatch):
    """Heartbeats every 0.05 s, stale after 1 s."""
    monkeypatch.setattr(folder_owners, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(folder_owners, "STALE_S", 1.0)


def test_another_hosts_live_heartbeat_is_refused_naming_it(tmp_path, quick):
    _owner(tmp_path, age_s=0.2)
    with pytest.raises(ConfigError, match="is in use by another run: pid 77 on node-b since 2026-12-01 10:00:00"):
        _lock(tmp_path)
    assert json.loads((tmp_path / OWNER_NAME).read_text())["token"] == "theirs"


def test_another_hosts_stale_heartbeat_is_taken_over_after_it_stays_still(tmp_path, quick, caplog):
    _owner(tmp_path, age_s=5.0)
    started = time.monotonic()
    locks = _lock(tmp_path)
    assert time.monotonic() - started >= 2 * folder_owners.HEARTBEAT_S  # watched for two beats first
    mine = json.loads((tmp_path / OWNER_NAME).read_text())
    assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname() and mine["token"] != "theirs"
    assert "took over" in caplog.text and "pid 77 on node-b" in caplog.text
    before = (tmp_path / OWNER_NAME).stat().st_mtime
    time.sleep(0.3)
    assert (tmp_path / OWNER_NAME).stat().st_mtime > before  # beating
    locks.release()
    assert not (tmp_path / OWNER_NAME).exists()


def test_a_stale_looking_heartbeat_that_moves_is_a_live_holder(tmp_path, quick, monkeypatch):
    """Its clock apart from ours, the holder's file looks old; but it beats while we watch."""
    path = _owner(tmp_path, age_s=5.0)
    sleep = time.sleep

    def beat_meanwhile(seconds):
        os.utime(path, (time.time() - 4, time.time() - 4))
        sleep(seconds)

    monkeypatch.setattr(folder_owners.time, "sleep", beat_meanwhile)
    with pytest.raises(ConfigError, match="pid 77 on node-b"):
        _lock(tmp_path)


def test_this_hosts_dead_or_reused_pid_is_taken_over_at_once(tmp_path):
    """On this host the pid tells (no waiting): a pid that runs no process, or that now runs
    another process than the one that took the lock (its start time differs)."""
    host, boot = socket.gethostname(), folder_owners.boot_id()
    for pid, started in ((2**22 + 12345, "1"), (os.getpid(), "0")):  # gone; ours, but not started then
        _owner(tmp_path, age_s=0.0, host=host, boot=boot, pid=pid, started=started)
        locks = _lock(tmp_path)
        assert json.loads((tmp_path / OWNER_NAME).read_text())["token"] != "theirs"
        locks.release()


def test_an_owner_name_that_is_not_a_file_is_never_followed_nor_removed(tmp_path, quick):
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    os.utime(target, (0, 0))  # stale, were it followed
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / OWNER_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="something that is not a lock file"):
        _lock(tmp_path / "run")
    assert (tmp_path / "run" / OWNER_NAME).is_symlink() and target.read_text() == "{}"


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
