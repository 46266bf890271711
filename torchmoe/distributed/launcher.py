"""A torchrun worker whose launcher is gone stops within a second, without saving.

    watch_launcher()    # in every worker, at the start of `torchmoe train`

torchrun starts its workers in sessions of their own, so a `kill -9` of the launcher (or of its
process group: a job step cancelled the hard way, an OOM killer taking the agent) leaves them
running, orphaned: they would train on and write checkpoints that nobody asked for, into a run
the next launch resumes. A worker notices its parent is gone when it is re-parented (its parent
pid changes) and leaves at once with one line. Nothing is half-written: every checkpoint is
made visible only when complete, and the temporary folder of a save in flight is removed by the
next run. Only under torchrun (its worker environment): a process started from a shell keeps
running when the shell exits (``nohup``), as a user expects.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["watch_launcher"]

POLL_S = 0.5  # a dead launcher is noticed within this (plus the thread's scheduling)


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_launcher() -> threading.Thread | None:
    """Start the daemon thread that ends this process when its torchrun launcher dies; None when
    not a torchrun worker (or already watching)."""
    if not _launched_by_torchrun() or any(t.name == _THREAD for t in threading.enumerate()):
        return None
    thread = threading.Thread(target=_watch, args=(os.getppid(),), name=_THREAD, daemon=True)
    thread.start()
    return thread


_THREAD = "torchmoe-launcher-watch"


def _watch(launcher: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != launcher:
            rank = os.environ.get("RANK", "0")
            print(f"[rank {rank}] stopped: its launcher (torchrun, pid {launcher}) is gone; leaving without saving",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
