"""A torchrun worker of the test session: `python -u tests/warm_rank.py ARGS` stands for
`python -u -m torchmoe ARGS`, whose process the pytest worker's fork server forks from its warm
interpreter (`tests/fork_server.py`) instead of importing torch and the stack again (about 3 s of
CPU a rank; `tests.launch.cli_command(..., warm=True)` puts it under torchrun).

This process stays torchrun's worker: the child writes to its stdin, stdout and stderr, runs with
its environment and cwd in a session of its own, and this process exits as the child did (the
same status, or killed by the same signal), so torchrun sees what it would have seen. The signals
torchrun sends its workers (SIGTERM, SIGINT, ...) are passed on to the child; a SIGKILL of this
process (a test killing a replica group) closes its connection, and the fork server kills the
child. Where the fork server cannot serve (none in this session, an environment that differs in
what an import may read: `fork_server.RUNTIME_VARS`), this process becomes the real thing: it
execs `python -u -m torchmoe ARGS`.

It imports nothing but the standard library and `fork_server`'s messages (its directory is
`sys.path[0]`).
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from fork_server import RANKS_VAR, _recv, _send

# What torchrun (or a test) may send a worker, passed on to the child.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _unbuffered() -> bool:
    """Whether this interpreter runs with `-u` (as torchrun starts a worker): its stdout writes
    through."""
    return sys.stdout.write_through


def _ask(args: list[str]) -> tuple[socket.socket, int] | None:
    """The connection to the fork server and the pid of the child it forked for `args`; None
    where it cannot serve."""
    name = os.environ.get(RANKS_VAR)
    if not name:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
        _send(sock, {"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "unbuffered": _unbuffered()},
              [0, 1, 2])
        reply = _recv(sock)
    except OSError:  # the fork server is gone (its session ended)
        reply = None
    if reply is None or "pid" not in reply[0]:
        sock.close()
        return None
    return sock, reply[0]["pid"]


def main(args: list[str]) -> None:
    served = _ask(args)
    if served is None:
        os.execv(sys.executable, [sys.executable, *(["-u"] if _unbuffered() else []), "-m", "torchmoe", *args])
    sock, pid = served
    for sig in _FORWARDED:
        signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    done = _recv(sock)  # the child's exit (signals in between are handled and the wait goes on)
    status = done[0]["status"] if done is not None else 1  # None: the fork server died, and so did the child
    if status < 0:  # killed by a signal: so is this process
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
