"""`tests.launch`'s process handling: what a replica group's `kill` reaches.

    python -m pytest -q tests/unit/test_launch.py
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.launch import descendants, free_port

# A launcher that starts a worker in a session of its own (as torchrun does), which starts
# another process; all of them wait.
_LAUNCHER = """
import subprocess, sys, time
worker = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
subprocess.Popen([sys.executable, "-c", worker], start_new_session=True)
time.sleep(60)
"""


def test_descendants_reach_workers_in_sessions_of_their_own() -> None:
    """A signal to the launcher's session misses a worker in another session; `descendants`
    finds it and what it started, so a replica group's `kill` stops every rank at once."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], start_new_session=True)
    found: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(found := descendants(launcher.pid)) < 2:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        worker, grandchild = found
        assert os.getsid(worker) == worker != os.getsid(launcher.pid)  # out of the launcher's session
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        os.kill(grandchild, 0)  # still alive: killing the launcher's session did not reach it
    finally:
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.kill()
        launcher.wait()


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    """A port-0 listener or an outgoing connection (gloo's, a concurrent test world's) can never
    take a port `free_port` gave torchrun before it binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports) and len(set(ports)) > 40
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
