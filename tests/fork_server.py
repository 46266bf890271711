"""A warm interpreter for the tests' `python -m torchmoe ...` runs: one parent per pytest worker
that has imported torch and torchmoe's stack once, forking a child per command.

    server = ForkServer.start(base_env)      # the parent: `python tests/fork_server.py FD LISTENER_FD`
    proc = server.run(argv, env, timeout=60)  # a subprocess.CompletedProcess, as subprocess.run
    # torchrun's workers: `python -u tests/warm_rank.py ARGS`, with RANKS_VAR=server.ranks

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
warnings: those tests start `python -m torchmoe` themselves).

torchrun's workers come here too, through a listening socket of their own (abstract, named
`ForkServer.ranks`, bound before the parent starts so that no worker finds it missing):
`tests.launch.cli_command(..., warm=True)` makes each worker `tests/warm_rank.py`, a small process
that asks for a child standing for `python -u -m torchmoe ARGS` with its environment and its
stdin, stdout and stderr, forwards torchrun's signals to it and exits as it did (the same status,
or the same signal). The parent serves them and the test session at once (one loop over its
sockets, its children's pidfds and their report pipes), and kills a worker's child when the
worker's connection closes: a test that SIGKILLs a replica group's processes ends its ranks as
before. A worker's child runs in a session of its own, as torchrun starts each worker. What still
gets real workers: an environment that differs in more than `RUNTIME_VARS` (the worker then execs
`python -u -m torchmoe` itself), and every torchrun run that does not ask for them (docs/testing.md
says why).

Safety of forking: the parent runs no torch op, starts no thread and no process group; it checks
that it has one OS thread (so no OpenMP or intra-op pool either) before every fork, and stops
serving (the caller falls back to subprocesses) if an import ever started one. It freezes its
objects before each fork (`gc.freeze`, as Python's documentation advises for a server that forks):
the child's garbage collections (every run starts with a full one) skip what it inherited, instead
of walking hundreds of thousands of objects and copying every page that holds one.

Which modules the parent imports is learnt, not listed: each child reports the `torch` and
`torchmoe` modules it imported, and the parent imports them before the next fork. The entry
point is only ever reached by its module name, `torchmoe.__main__`.
"""

from __future__ import annotations

import ctypes
import gc
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
                "MASTER_PORT", "TORCHELASTIC_", "TORCHFT_LIGHTHOUSE", "SLURM_", "PYTEST_", "COLUMNS", "LINES",
                # the rest of what torchrun sets for a worker (NCCL's variable is read as its group starts)
                "GROUP_WORLD_SIZE", "ROLE_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# The variable that tells a torchrun worker of the test session where to ask for its child (`warm_rank.py`).
RANKS_VAR = "TORCHMOE_TEST_WARM_RANKS"
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

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, base_env: dict[str, str], ranks: str) -> None:
        self.proc, self.sock, self.base_env = proc, sock, base_env
        self.ranks = ranks  # the abstract socket torchrun's workers ask on (`warm_rank.py`, `RANKS_VAR`)
        self.forked, self.child_cpu = 0, 0.0  # children run, and their CPU seconds (for measurements)

    @classmethod
    def start(cls, base_env: Mapping[str, str]) -> ForkServer:
        """The parent, with environment `base_env` (what the children's may differ from only in
        `RUNTIME_VARS`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ranks = f"torchmoe-fork-server-{os.getpid()}-{os.urandom(4).hex()}"
        # Listening before the parent starts: a worker that asks at once is queued, not refused.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + ranks)  # abstract: no file to clean up, gone with its last holder
        listener.listen(64)
        fds = [theirs.fileno(), listener.fileno()]
        proc = subprocess.Popen([sys.executable, __file__, *map(str, fds)], env=dict(base_env), pass_fds=fds,
                                stdin=subprocess.DEVNULL)
        theirs.close()
        listener.close()
        return cls(proc, ours, dict(base_env), ranks)

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


class _Child:
    """A running child as the parent tracks it: its client's connection, and the names of the
    modules it imported, read from its report pipe as it writes them (a long report must not
    block it)."""

    def __init__(self, pid: int, conn: socket.socket, report: int) -> None:
        self.pid, self.conn, self.report, self.modules = pid, conn, report, b""

    def read_report(self, events, *, to_end: bool) -> None:
        """What the report pipe holds; closed at its end, or (`to_end`, the child has exited)
        whatever is there (a process the child started may hold the pipe open)."""
        if self.report < 0:
            return
        os.set_blocking(self.report, not to_end)
        try:
            while data := os.read(self.report, 1 << 16):
                self.modules += data
                if not to_end:
                    return
        except BlockingIOError:
            pass
        events.unregister(self.report)
        os.close(self.report)
        self.report = -1


def _close_all(events) -> None:
    """In a forked child: the parent's sockets, pidfds and pipes closed, and its selector."""
    for key in list(events.get_map().values()):
        key.fileobj.close() if isinstance(key.fileobj, socket.socket) else os.close(key.fileobj)
    events.close()


def _serve(sock: socket.socket, ranks: socket.socket) -> dict | None:
    """Serve commands until the test session's client closes its socket (then None); in a forked
    child, its request (with the descriptors it got in "fds").

    Two kinds of client, served at once: the test session's (`ForkServer.run`, one command at a
    time over `sock`) and torchrun's workers (`warm_rank.py`, one connection each on the
    listening socket `ranks`). A worker's connection closing while its child runs means the worker
    was killed: so is its child, as the rank it stands for would have been."""
    import selectors

    import torch  # noqa: F401 - the import every command pays, paid once here

    _warm(["torchmoe.distributed.interruption"])
    base_env = dict(os.environ)
    events = selectors.DefaultSelector()
    events.register(sock, selectors.EVENT_READ)
    events.register(ranks, selectors.EVENT_READ)
    running: dict[socket.socket, _Child] = {}  # a client's connection -> its child
    while True:
        for key, _ in events.select():
            if key.fileobj is ranks:
                events.register(ranks.accept()[0], selectors.EVENT_READ)
                continue
            if isinstance(key.data, _Child):
                child = key.data
                if key.fileobj == child.report:
                    child.read_report(events, to_end=False)
                    continue
                events.unregister(key.fileobj)  # the child's pidfd: it exited
                os.close(key.fileobj)
                child.read_report(events, to_end=True)
                _, status, usage = os.wait4(child.pid, 0)
                if running.get(child.conn) is child:
                    del running[child.conn]
                try:
                    _send(child.conn, {"status": os.waitstatus_to_exitcode(status),
                                       "cpu": usage.ru_utime + usage.ru_stime})
                except OSError:  # a killed worker's connection
                    pass
                _warm(child.modules.decode().split())
                continue
            conn = key.fileobj
            got = _recv(conn, nfds=3)
            if got is None:  # the client is gone
                events.unregister(conn)
                conn.close()
                if conn is sock:
                    return None
                if conn in running:  # its torchrun worker was killed: so is the rank
                    os.kill(running.pop(conn).pid, signal.SIGKILL)
                continue
            request, fds = got
            refused = _differs(request["env"], base_env) if conn is not sock else []
            if refused or _threads() != 1:
                for fd in fds:
                    os.close(fd)
                if conn is sock:  # the client sees the end of stream and falls back to subprocesses
                    sys.stderr.write(f"fork server: {_threads()} threads after warm imports; not forking\n")
                    return None
                _send(conn, {"refused": refused or ["a thread in the fork server"]})  # the worker execs python
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            gc.freeze()  # what the parent imported: no child's collection walks (and so copies) it
            report_r, report_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(report_r)
                worker = conn is not sock
                _close_all(events)
                return {**request, "fds": fds, "report": report_w, "worker": worker}
            os.close(report_w)
            for fd in fds:
                os.close(fd)
            running[conn] = child = _Child(pid, conn, report_r)
            events.register(os.pidfd_open(pid), selectors.EVENT_READ, child)
            events.register(report_r, selectors.EVENT_READ, child)
            _send(conn, {"pid": pid})


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
    if request["worker"]:
        os.setsid()  # a session of its own, as torchrun starts each worker
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = request.get("unbuffered", False) or bool(os.environ.get("PYTHONUNBUFFERED"))  # `python -u`
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
    return _serve(socket.socket(fileno=int(sys.argv[1])), socket.socket(fileno=int(sys.argv[2])))


if __name__ == "__main__":
    child = main()
    if child is not None:
        import runpy

        _become(child)
        del child
        runpy.run_module("torchmoe", run_name="__main__", alter_sys=True)
