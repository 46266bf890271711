"""Run the CLI in a subprocess: one process or a torchrun world; read its metrics.

    from tests.launch import read_metrics, run_train
    run_train(["--config", "configs/debug_model.toml", "--training.steps", "5"], dump_folder="outputs/t", nproc=2)
    read_metrics("outputs/t")[-1]["loss"]

For tests and benchmarks that drive `torchmoe` end to end on one machine. With `nproc > 1` the
command runs under `python -m torch.distributed.run --nproc_per_node=N` on a free local port
(CPU ranks talk over gloo). The child gets a clean launcher environment: no torchrun worker
variables inherited from the caller, and `OMP_NUM_THREADS` per rank (1 by default, which makes
fp32 CPU runs reproducible bit for bit).
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests import fork_server
from torchmoe.config.files.nesting import json_loads

__all__ = ["LaunchError", "Lighthouse", "ReplicaGroup", "cli_command", "cli_env", "free_port", "metrics_by_step",
           "read_metrics", "run_cli", "run_command", "run_replica_groups", "run_train", "torchrun_worker"]

Arg = str | os.PathLike
# Set by torchrun for its workers; a launcher that inherited them would look like one.
_WORKER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


class LaunchError(RuntimeError):
    """The command exited with another status than expected; the message holds its output's tail."""

    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.proc = proc
        super().__init__(f"{' '.join(map(str, proc.args))}\nexited {proc.returncode}:\n"
                         f"{(proc.stdout or '')[-3000:]}\n{(proc.stderr or '')[-6000:]}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for torchrun's rendezvous), below
    the kernel's ephemeral range. The port is free only until the launcher binds it: a port from
    the ephemeral range (what binding port 0 gives) is also what the kernel hands every outgoing
    connection and every port-0 listener (gloo opens dozens per world), and a concurrent test's
    world took one before torchrun bound it (EADDRINUSE in CI). Below that range only another
    `free_port` can take it: a random pick among some 12,000 ports."""
    low = _ephemeral_low()
    while True:
        port = random.randrange(max(1024, low - 12768), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: another pick
                continue
            return port


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (ip_local_port_range; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_WARM_RANK = Path(__file__).with_name("warm_rank.py")


def cli_command(args: Sequence[Arg], *, nproc: int = 1, warm: bool = False) -> list[str]:
    """argv of `torchmoe ARGS`: `python -m torchmoe ...`, or under torchrun with `nproc` ranks.

    `warm` (in the test session, a fork server running): torchrun's workers are
    `tests/warm_rank.py`, each a child of the warm interpreter that stands for `python -u -m
    torchmoe` (with `cli_env`'s environment, which says where the server listens). Off by default:
    ranks that start within milliseconds of each other broke two tests' timing (docs/testing.md)."""
    if nproc == 1:
        return [sys.executable, "-m", "torchmoe", *map(str, args)]
    # --standalone: the rendezvous store binds a port the OS picks as it listens. A port found
    # free beforehand (`free_port`) stays free only until then: seconds of imports later, one of
    # gloo's many connections had taken it (EADDRINUSE).
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *torchrun_worker(warm=warm), *map(str, args)]


def torchrun_worker(*, warm: bool = False) -> list[str]:
    """What torchrun runs as each worker for `torchmoe ARGS` (ARGS follow): `-m torchmoe`, or with
    `warm` in the test session (a fork server running) `tests/warm_rank.py` (see `cli_command`)."""
    return [str(_WARM_RANK)] if warm and fork_server.active() is not None else ["-m", "torchmoe"]


def cli_env(*, threads: int | None = 1) -> dict[str, str]:
    """This process's environment minus torchrun's worker variables, with `OMP_NUM_THREADS=threads`
    per rank (None keeps the caller's setting) and unbuffered output; in the test session, where
    torchrun's warm workers find the fork server (`cli_command`)."""
    env = {k: v for k, v in os.environ.items() if k not in _WORKER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    server = fork_server.active()
    if server is not None:
        env[fork_server.RANKS_VAR] = server.ranks
    return env


def run_cli(args: Sequence[Arg], *, nproc: int = 1, threads: int | None = 1, timeout: float | None = None,
            expect: int | None = 0) -> subprocess.CompletedProcess[str]:
    """Run `torchmoe ARGS` (see `cli_command`, `cli_env`) and capture its output as text. In the
    test session one process runs as a child of the warm fork server where it can
    (`tests.fork_server`), else in a subprocess.

    Args:
        expect: the exit status to require, else `LaunchError`; None accepts any.
        timeout: seconds before `subprocess.TimeoutExpired`; None waits for ever.
    """
    proc = run_command(cli_command(args, nproc=nproc), cli_env(threads=threads), timeout=timeout)
    if expect is not None and proc.returncode != expect:
        raise LaunchError(proc)
    return proc


def run_command(argv: Sequence[str], env: Mapping[str, str], *, timeout: float | None = None,
                ) -> subprocess.CompletedProcess[str]:
    """`argv` (a `cli_command`) with `env`, in this process's cwd, its output captured as text:
    by the warm fork server where it serves a one-process `python -m torchmoe`, else in a
    subprocess."""
    server = fork_server.active()
    proc = server.run(argv, env, timeout=timeout) if server is not None and server.serves(argv, env) else None
    if proc is None:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def run_train(args: Sequence[Arg], *, dump_folder: Arg, nproc: int = 1, threads: int | None = 1,
              timeout: float | None = None, expect: int | None = 0) -> subprocess.CompletedProcess[str]:
    """`torchmoe train ARGS --job.dump_folder DUMP_FOLDER` through `run_cli`; its metrics are then
    in `read_metrics(dump_folder)`."""
    return run_cli(["train", *args, "--job.dump_folder", dump_folder], nproc=nproc, threads=threads,
                   timeout=timeout, expect=expect)


def read_metrics(dump_folder: Arg) -> list[dict]:
    """The records of `<dump_folder>/metrics.jsonl` in the order written (a resumed run appends)."""
    text = (Path(dump_folder) / "metrics.jsonl").read_text()
    return [json_loads(line) for line in text.splitlines()]


def metrics_by_step(dump_folder: Arg) -> dict[int, dict]:
    """step -> its record of `<dump_folder>/metrics.jsonl` (the last one written for that step)."""
    return {r["step"]: r for r in read_metrics(dump_folder)}


# ---- fault-tolerant replica groups (`[fault_tolerance]`) on one machine -------------------------


class Lighthouse:
    """`torchmoe lighthouse FLAGS` in a subprocess on a free port (a group silent for 1 s is out
    of the next quorum, unless `flags` say otherwise); `url` is what every group's
    TORCHFT_LIGHTHOUSE gets."""

    def __init__(self, log: Arg, *flags: str) -> None:
        defaults = ["--bind", "[::]:0", "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "1000"]
        self.proc = subprocess.Popen(cli_command(["lighthouse", *defaults, *flags]), env=cli_env(),
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
        line = self.proc.stdout.readline()  # "lighthouse listening on http://HOST:PORT ..."
        port = re.search(r"http://\S+:(\d+) ", line)
        if port is None:
            raise RuntimeError(f"the lighthouse did not start: {line!r}; see {log}")
        self.url = f"http://localhost:{port.group(1)}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class ReplicaGroup:
    """One replica group: `torchmoe train ARGS` under torchrun with `nproc` ranks, its launcher in
    a session of its own (torchrun starts each rank in another: `kill` finds them), writing to
    `<out>/replica_<id>/` and its output to `<out>/group<id><tag>.log`."""

    def __init__(self, replica_id: int, args: Sequence[Arg], out: Arg, lighthouse: Lighthouse, *, nproc: int = 2,
                 tag: str = "") -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.metrics = out / f"replica_{replica_id}" / "metrics.jsonl"
        self.log = out / f"group{replica_id}{tag}.log"
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cli_command(["train", *args, "--fault_tolerance.replica_id", str(replica_id), "--job.dump_folder", out],
                        nproc=nproc),
            env={**cli_env(), "TORCHFT_LIGHTHOUSE": lighthouse.url}, stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT, start_new_session=True)

    def records(self) -> list[dict]:
        """The group's metrics records so far (whole lines only)."""
        if not self.metrics.exists():
            return []
        return [json_loads(line) for line in self.metrics.read_text().splitlines() if line.endswith("}")]

    def last_step(self) -> int:
        records = self.records()
        return records[-1]["step"] if records else 0

    def wait_for(self, done: Callable[[list[dict]], bool], what: str, timeout: float = 300) -> float:
        """Poll the metrics every 50 ms until `done(records)`; the seconds it took.

        Raises:
            RuntimeError: the group exited first, or `timeout` passed (with the log's tail).
        """
        start = time.monotonic()
        while not done(self.records()):
            if self.proc.poll() is not None or time.monotonic() - start > timeout:
                why = f"exited {self.proc.returncode}" if self.proc.poll() is not None else "timed out"
                raise RuntimeError(f"{what}: the group {why}\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return time.monotonic() - start

    def kill(self) -> None:
        """SIGKILL to every rank, then the launcher: none trains another step. (A signal to the
        launcher's session alone left the ranks training until they noticed it gone, a step or
        two later.)"""
        for pid in descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile
                pass
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def finish(self, timeout: float = 300) -> None:
        """Wait for the group to end; `RuntimeError` (with the log's tail) unless it exits 0."""
        if self.proc.wait(timeout=timeout) != 0:
            raise RuntimeError(f"the group exited {self.proc.returncode}\n{self.log.read_text()[-5000:]}")


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...), read from Linux's /proc: torchrun starts
    each worker in a session of its own, out of reach of a signal to the launcher's."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:  # ended meanwhile
            continue
        if stat:  # "pid (name) state ppid ...": the name may hold spaces and parentheses
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def run_replica_groups(args: Sequence[Arg], out: Arg, *lighthouse_flags: str, groups: int = 2) -> list[ReplicaGroup]:
    """Train `groups` replica groups of `torchmoe train ARGS` (which enable fault tolerance) to
    the end, with a lighthouse of their own (`lighthouse_flags`, its log in `out`); the groups.

    Raises:
        RuntimeError: a group exited with an error (`ReplicaGroup.finish`).
    """
    Path(out).mkdir(parents=True, exist_ok=True)
    lighthouse = Lighthouse(Path(out) / "lighthouse.log", *lighthouse_flags)
    try:
        started = [ReplicaGroup(g, args, out, lighthouse) for g in range(groups)]
        for group in started:
            group.finish()
    finally:
        lighthouse.close()
    return started
