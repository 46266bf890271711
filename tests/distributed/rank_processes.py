"""Ranks as separate processes, for the failure tests: started by hand (as SLURM's srun starts
them: no torchrun agent watches them, rank 0 hosts the rendezvous store) or under torchrun, each
running `tests/distributed/failing_rank.py` (`torchmoe train` with a fault injected on one rank).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers import REPO
from tests.launch import cli_env, free_port

WORKER = str(Path(__file__).with_name("failing_rank.py"))


def _env(**extra: str) -> dict[str, str]:
    return {**cli_env(), "PYTHONPATH": str(REPO), **extra}


def wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[list[str], list[float]]:
    """Outputs (stdout and stderr together) and exit times (`time.time()`) of `procs`; kills
    them all if any runs past `timeout`."""
    outs, ends = [""] * len(procs), [float("inf")] * len(procs)

    def reap(i: int) -> None:
        outs[i] = procs[i].stdout.read()
        procs[i].wait()
        ends[i] = time.time()

    readers = [threading.Thread(target=reap, args=(i,)) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    for t in readers:
        t.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.kill()
    for t in readers:
        t.join()
    return outs, ends


def start_ranks(job: list[str], case: str, out: Path, args: list[str], world: int = 2,
                **env: str) -> list[subprocess.Popen]:
    """`world` ranks of `torchmoe train JOB ARGS` with `case` injected, started by hand as srun
    does: no torchrun agent watches them."""
    port = str(free_port())
    return [subprocess.Popen(
        [sys.executable, WORKER, case, str(out), "--", "train", *job, *args, "--job.dump_folder", str(out)],
        env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]


def torchrun(job: list[str], case: str, out: Path, args: list[str], **env: str) -> subprocess.Popen:
    """`torchmoe train JOB ARGS` with `case` injected, 2 ranks under torchrun (`env` added to
    the environment)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           WORKER, case, str(out), "--", "train", *job, *args, "--job.dump_folder", str(out)]
    return subprocess.Popen(cmd, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def torchrun_summary(out: str) -> tuple[str, str]:
    """(what the ranks printed, torchrun's failure summary after it)."""
    ranks, _, summary = out.partition("ChildFailedError:")
    return ranks, summary


def root_cause(out: str) -> str:
    """The last entry of torchrun's summary, the bottom of the screen: its first failed rank."""
    return torchrun_summary(out)[1].rpartition("Root Cause (first observed failure):")[2]
