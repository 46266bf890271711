"""The test session's warm torchrun workers (`tests/warm_rank.py`, served by `tests/fork_server.py`)
are the command they stand for: the same output and exit status, signals passed on, a kill of
the worker ending its child, and a fresh interpreter where the fork server cannot serve.

    python -m pytest -q tests/integration/test_warm_ranks.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import fork_server
from tests.launch import cli_env, descendants, torchrun_worker

pytestmark = pytest.mark.integration

WARM_RANK = str(Path(__file__).parents[1] / "warm_rank.py")
# A command that fails at once with a message (exit 2), and one that serves until a signal.
BAD_FLAG = ["train", "--training.stepz", "3"]
LIGHTHOUSE = ["lighthouse", "--bind", "[::]:0"]


def _server() -> fork_server.ForkServer:
    server = fork_server.active()
    if server is None:
        pytest.skip("no fork server in this session (TORCHMOE_FORK_SERVER=0)")
    return server


def _children_of_server(server: fork_server.ForkServer) -> set[int]:
    return set(descendants(server.proc.pid))


def test_a_warm_worker_says_and_exits_what_a_fresh_interpreter_does() -> None:
    """The same stdout, stderr and status as `python -u -m torchmoe ARGS`."""
    _server()
    assert torchrun_worker(warm=True) == [WARM_RANK]
    env = cli_env()
    warm = subprocess.run([sys.executable, "-u", WARM_RANK, *BAD_FLAG], env=env, capture_output=True, text=True,
                          timeout=120)
    cold = subprocess.run([sys.executable, "-u", "-m", "torchmoe", *BAD_FLAG], env=env, capture_output=True,
                          text=True, timeout=120)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert warm.returncode == 2 and "training.stepz" in warm.stderr


def test_an_environment_the_server_cannot_give_gets_a_fresh_interpreter() -> None:
    """A variable an import may read (here PYTHONPATH) differs from the fork server's: the worker
    execs `python -u -m torchmoe` itself, and the server forks nothing."""
    server = _server()
    others = _children_of_server(server)
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = _start_lighthouse(env)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        forked = _children_of_server(server) - others
    finally:
        proc.kill()
        proc.wait()
    assert cmdline[:4] == [sys.executable.encode(), b"-u", b"-m", b"torchmoe"] and not forked, (cmdline, forked)


def _start_lighthouse(env: dict[str, str] | None = None) -> subprocess.Popen:
    """`torchmoe lighthouse` through a warm worker, once it listens."""
    proc = subprocess.Popen([sys.executable, "-u", WARM_RANK, *LIGHTHOUSE], env=env or cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    assert line.startswith("lighthouse listening on "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_to_the_worker_reaches_its_child(sig: signal.Signals) -> None:
    """torchrun stops its workers with SIGTERM: the child gets it and stops as the lighthouse
    does (exit 0), and so does the worker."""
    _server()
    proc = _start_lighthouse()
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()


def test_a_killed_worker_takes_its_child_with_it() -> None:
    """SIGKILL to the worker (a test killing a replica group's processes): the fork server kills
    its child at once."""
    server = _server()
    others = _children_of_server(server)
    proc = _start_lighthouse()
    (child,) = _children_of_server(server) - others
    assert os.getsid(child) == child  # a session of its own, as torchrun starts a worker
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while child in _children_of_server(server):
        assert time.monotonic() < deadline, "the child outlived its killed worker"
        time.sleep(0.02)
