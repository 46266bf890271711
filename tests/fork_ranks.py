"""Run a rank script's ``_worker(out_dir)`` on N CPU ranks forked from one process that imported
torch, torchmoe's training stack and the script once: what `tests.helpers.run_rank_script`
starts for a world of more than one rank.

    python tests/fork_ranks.py SCRIPT OUT_DIR WORLD

torchrun starts N interpreters, each importing torch and the training stack (about 10 s of CPU
each, so some 40 s of an 8-rank world's start on 2 cores); forked ranks share one import. Each
rank gets the variables torchrun sets for a worker (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the rendezvous store, as a run without
torchrun's agent does) and dies with the launcher (PR_SET_PDEATHSIG), so a test's timeout leaves
no rank behind. The launcher exits 0 when every rank did; when one fails it kills the others and
exits 1 (the failing rank has printed its traceback, prefixed with its rank).

Forking is safe because the launcher has run no torch op and started no thread when it forks
(checked: one thread). Its objects are frozen first (`gc.freeze`): a rank's garbage collections
(a full one as each job starts) skip what the imports made, rather than walk it and copy every
page it lies on (about 15% of a 2-rank world's CPU). `torchmoe train` itself is never launched
this way: the CLI tests use torchrun.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from tests.launch import free_port

_PR_SET_PDEATHSIG = 1


def _rank(worker, out_dir: Path, rank: int, world: int, port: int) -> None:
    """A forked child: become rank `rank`, run the worker, exit with its outcome (never returns)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    status = 0
    try:
        worker(out_dir)
    except BaseException:  # noqa: BLE001 - any failure of the rank is reported, with its traceback
        sys.stderr.write("".join(f"[rank{rank}]: {line}\n" for line in traceback.format_exc().splitlines()))
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main() -> None:
    script, out_dir, world = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    spec = importlib.util.spec_from_file_location("rank_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    importlib.import_module("torchmoe.training.session")  # what every rank script runs, imported once for all ranks

    assert threading.active_count() == 1, "forking with threads running is unsafe"
    gc.freeze()  # the imports' objects: no rank's collection walks (and so copies) them
    port = free_port()  # rank 0 binds it for the store
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(module._worker, out_dir, rank, world, port)
        ranks[pid] = rank
    failed: tuple[int, int] | None = None
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            for other in ranks:  # its peers would wait for it until their timeout
                os.kill(other, signal.SIGKILL)
    if failed is not None:
        print(f"rank {failed[0]} exited with status {failed[1]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
