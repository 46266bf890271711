"""A warm interpreter for the tests' `python -m torchmoe ...` runs: one parent per pytest worker
that has imported torch and torchmoe's stack once, forking a child per command.

    server = ForkServer.start(base_env)      # the parent: `python tests/fork_server.py FD`
    proc = server.run(argv, env, timeout=60)  # a subprocess.CompletedProcess, as subprocess.run

A fresh `python -m torchmoe` spends about 3.2 s of CPU importing torch and the stack before it
does anything; a forked child starts with them imported. The child then becomes what a fresh
interpreter would be: the caller's stdin, its own stdout and stderr pipes (rebuilt as Python
builds them, unbuffered under PYTHONUNBUFFERED), the caller's cwd as `sys.path[0]` (as `-m` puts
it), the command's environment and argv, default signal handlers (the parent installs none), no
logging configured (the parent configures none), Python's `random` reseeded (`os.fork` does it),
and `torchmoe.__main__` run by `runpy` as `-m` runs it, with a normal interpreter exit (threads
joined, atexit handlers, buffers flushed): the same exit status and output.

What it cannot be, and what therefore goes to a real subprocess (`serves` says no): a command
whose environment differs from the parent's in a variable a module may read as it is imported
(only `RUNTIME_VARS` may differ: torchmoe's own, the launcher's rank variables, read when the
command runs); and anything that needs a fresh interpreter (what a command imports, import-time
warnings: those tests start `python -m torchmoe` themselves). torchrun worlds never come here.

Safety of forking: the parent runs no torch op, starts no thread and no process group; it checks
that it has one OS thread (so no OpenMP or intra-op pool either) before every fork, and stops
serving (the caller falls back to subprocesses) if an import ever started one.

Which modules the parent imports is learnt, not listed: each child reports the `torch` and
`torchmoe` modules it imported, and the parent imports them before the next fork. The entry
point is only ever reached by its module name, `torchmoe.__main__`.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# Variables torchmoe and the launcher protocol read while the command runs (never at import): a
# child may have its own. Any other difference from the parent's environment (PYTHONPATH, TORCH_*,
# HF_*, WANDB_*, OMP_NUM_THREADS, ...) could change what an import did, so it gets a subprocess.
RUNTIME_VARS = ("TORCHMOE_", "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_", "TORCHFT_LIGHTHOUSE", "SLURM_", "PYTEST_", "COLUMNS", "LINES")
_WARM_PREFIXES = ("torch", "torchmoe")  # modules the parent may import ahead (learnt from its children)
_PR_SET_PDEATHSIG = 1
_MAX_MSG = 1 << 20


def _send(sock: socket.socket, obj, fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.sendall(payload)


def _recv(sock: socket.socket, *, nfds: int = 0):
    """One message (and `nfds` file descriptors); None at end of stream."""
    chunks, fds = b"", []
    while len(chunks) < 4 or len(chunks) < 4 + struct.unpack("!I", chunks[:4])[0]:
        if nfds and not fds:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, nfds)
        else:
            data = sock.recv(_MAX_MSG)
        if not data:
            return None
        chunks += data
    return json.loads(chunks[4:]), fds


def _differs(env: Mapping[str, str], base: Mapping[str, str]) -> list[str]:
    """The variables that differ between `env` and `base` and are not `RUNTIME_VARS`."""
    keys = set(env) | set(base)
    return sorted(k for k in keys if env.get(k) != base.get(k) and not k.startswith(RUNTIME_VARS))


class ForkServer:
    """The client side: a parent process over a socket pair, one command at a time."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, base_env: dict[str, str]) -> None:
        self.proc, self.sock, self.base_env = proc, sock, base_env
        self.forked, self.child_cpu = 0, 0.0  # children run, and their CPU seconds (for measurements)

    @classmethod
    def start(cls, base_env: Mapping[str, str]) -> ForkServer:
        """The parent, with environment `base_env` (what the children's may differ from only in
        `RUNTIME_VARS`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], env=dict(base_env),
                                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        return cls(proc, ours, dict(base_env))

    def serves(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether `argv` is `python -m torchmoe ...` with an environment a child can have."""
        return (self.proc.poll() is None and list(argv[:3]) == [sys.executable, "-m", "torchmoe"]
                and not _differs(env, self.base_env))

    def run(self, argv: Sequence[str], env: Mapping[str, str], *, timeout: float | None = None,
            ) -> subprocess.CompletedProcess[str] | None:
        """`subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)` by a
        forked child (`serves(argv, env)` must hold); None if the parent no longer serves."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            _send(self.sock, {"argv": list(argv[3:]), "env": dict(env), "cwd": os.getcwd()}, [0, out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        reply = _recv(self.sock)
        if reply is None:  # it stopped serving (a thread appeared): the caller starts a subprocess
            os.close(out_r)
            os.close(err_r)
            return None
        pid = reply[0]["pid"]
        self.forked += 1
        try:
            with os.fdopen(out_r, encoding="utf-8", errors="replace") as out, \
                    os.fdopen(err_r, encoding="utf-8", errors="replace") as err:
                stdout, stderr = _read_both(out, err, pid, timeout, argv)
        finally:
            done = _recv(self.sock)  # the status, also after a timeout's kill: the next command's reply follows
        if done is None:
            raise RuntimeError(f"the fork server exited {self.proc.wait()}")
        self.child_cpu += done[0]["cpu"]
        return subprocess.CompletedProcess(list(argv), done[0]["status"], stdout, stderr)

    def close(self) -> None:
        self.sock.close()  # the parent exits at end of stream
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _read_both(out: io.TextIOBase, err: io.TextIOBase, pid: int, timeout: float | None,
               argv: Sequence[str]) -> tuple[str, str]:
    """Both pipes read to their end (each on a thread, as `communicate` does); the child killed
    and `subprocess.TimeoutExpired` raised after `timeout` seconds."""
    texts = {"out": "", "err": ""}

    def drain(name: str, stream: io.TextIOBase) -> None:
        texts[name] = stream.read()

    readers = [threading.Thread(target=drain, args=(name, stream), daemon=True)
               for name, stream in (("out", out), ("err", err))]
    for reader in readers:
        reader.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for reader in readers:
        reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    if any(reader.is_alive() for reader in readers):
        os.kill(pid, signal.SIGKILL)  # as subprocess.run does on a timeout
        for reader in readers:
            reader.join()
        raise subprocess.TimeoutExpired(list(argv), timeout, texts["out"], texts["err"])
    return texts["out"], texts["err"]


_base_env: dict[str, str] | None = None
_server: ForkServer | None = None


def enable(base_env: Mapping[str, str]) -> None:
    """Let `active` start a parent with `base_env` when first asked (the test session does, in
    every pytest worker; benchmarks never do: they time real processes)."""
    global _base_env
    _base_env = dict(base_env)


def active() -> ForkServer | None:
    """This process's fork server (started on first use), or None where none is enabled."""
    global _server
    if _server is None and _base_env is not None:
        _server = ForkServer.start(_base_env)
    return _server


def shutdown() -> None:
    """End this process's parent, if it started one."""
    global _server, _base_env
    if _server is not None:
        _server.close()
    _server, _base_env = None, None


# ---- the parent --------------------------------------------------------------------------------


def _threads() -> int:
    """OS threads of this process (Python's and any OpenMP or intra-op pool's)."""
    return len(os.listdir("/proc/self/task"))


def _warm(modules: Sequence[str]) -> None:
    """Import `modules` (torch's and torchmoe's that a child imported) here, once for all later
    children; `torchmoe.__main__` itself never (it runs the command)."""
    for name in modules:
        if name.startswith(_WARM_PREFIXES) and name != "torchmoe.__main__" and name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a child imports it itself, as a fresh process would
                pass


def _serve(sock: socket.socket) -> dict | None:
    """Serve commands until the client closes the socket (then None); in a forked child, its
    request (with the descriptors it got in "fds")."""
    import torch  # noqa: F401 - the import every command pays, paid once here

    _warm(["torchmoe.distributed.interruption"])
    while True:
        got = _recv(sock, nfds=3)
        if got is None:
            return None
        request, fds = got
        if _threads() != 1:
            sys.stderr.write(f"fork server: {_threads()} threads after warm imports; not forking\n")
            return None  # the client sees the end of stream and falls back to subprocesses
        sys.stdout.flush()
        sys.stderr.flush()
        report_r, report_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            sock.close()
            os.close(report_r)
            return {**request, "fds": fds, "report": report_w}
        os.close(report_w)
        for fd in fds:
            os.close(fd)
        _send(sock, {"pid": pid})
        with os.fdopen(report_r) as report:
            modules = report.read().split()
        _, status, usage = os.wait4(pid, 0)
        _send(sock, {"status": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime})
        _warm(modules)


def _std_stream(fd: int, *, unbuffered: bool, stderr: bool) -> io.TextIOWrapper:
    """Python's own sys.stdout/sys.stderr for `fd`: line-buffered stderr, write-through when
    PYTHONUNBUFFERED is set, stderr's backslash escapes."""
    raw = io.FileIO(fd, "w", closefd=False)
    buffered = raw if unbuffered else io.BufferedWriter(raw)
    encoding = os.environ.get("PYTHONIOENCODING") or None
    return io.TextIOWrapper(buffered, encoding=encoding, errors="backslashreplace" if stderr else None,
                            line_buffering=stderr or (not unbuffered and os.isatty(fd)), write_through=unbuffered)


def _become(request: dict) -> None:
    """Turn this forked child into `python -m torchmoe ARGV` started with the request's
    stdin/stdout/stderr, environment and cwd."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # no orphan if the parent dies
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = _std_stream(1, unbuffered=unbuffered, stderr=False)
    sys.stderr = sys.__stderr__ = _std_stream(2, unbuffered=unbuffered, stderr=True)
    sys.path[0] = os.getcwd()  # as `python -m` puts it (this script put tests/ there)
    sys.argv = ["-m", *request["argv"]]
    report = request["report"]

    def tell_modules() -> None:
        names = " ".join(name for name in sys.modules if name.startswith(_WARM_PREFIXES))
        with os.fdopen(report, "w") as out:
            out.write(names)

    import atexit

    atexit.register(tell_modules)


def main() -> dict | None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    return _serve(sock)


if __name__ == "__main__":
    child = main()
    if child is not None:
        import runpy

        _become(child)
        del child
        runpy.run_module("torchmoe", run_name="__main__", alter_sys=True)
