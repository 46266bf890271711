"""Signals before training: an interrupted start is one line and an exit status, never a traceback
or a death by signal.

    try:
        with interrupt_on_signals():  # first thing in `torchmoe.commands.cli.main`, before torch is imported
            ...                       # config, imports, dry run, building and loading the job
    except Interrupted as stop:       # the CLI: "[rank 1] interrupted by SIGTERM: stopped", exit 143
        ...

Until the training loop installs its own handlers (`Trainer.fit`: a signal then stops training
after the step, with a checkpoint), SIGTERM and SIGINT raise `Interrupted` in the main thread:
a scheduler's SIGTERM during the seconds of imports or the minutes of loading a checkpoint ends
the process at once and cleanly (locks released, nothing half-written: every save is atomic),
with exit status 128 + the signal's number, as a shell reports a signal. Python's default would
be a death by SIGTERM (no cleanup) or a `KeyboardInterrupt` traceback for Ctrl-C. The loop's
handlers hand back to these when it ends (an export after the last step is interrupted alike).

Multi-rank runs also default torch's C++ log level to errors (`TORCH_CPP_LOG_LEVEL`, read when
torch loads, so set here first; a user's own setting wins): when a peer or the rendezvous store
host dies, c10d logs a warning with a 20-line C++ stack trace before torchmoe's one-line message
(`torchmoe.distributed.failure`) says what happened.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Interrupted", "interrupt_on_signals", "leaving_for_failure", "report"]


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived before training (a BaseException: no `except Exception` on the
    way up takes it for an error of its own)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_status = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


# Set by `leaving_for_failure`; cleared when the next `interrupt_on_signals` begins.
_leaving = False


def leaving_for_failure() -> None:
    """This process is leaving for a failure already: from here on SIGTERM and SIGINT raise
    nothing, also in the CLI's outer handlers while it reports the failure (until another
    `interrupt_on_signals` begins: a process that runs several jobs, such as a test session).
    torchrun's agent sends SIGTERM to the survivors of a rank that died or failed; raised while
    a rank unwinds from the failure or prints it, it replaced the failure's one line with
    "interrupted by SIGTERM" or cut it off. The failure protocol's exit backstop ends the process
    whatever happens."""
    global _leaving
    _leaving = True


def _raise(signum: int, frame) -> None:
    if not _leaving:
        raise Interrupted(signum)


def report(stop: Interrupted) -> str:
    """Print the one line, ``[rank r] interrupted by SIGTERM: stopped`` (no rank in a one-process
    run), and return it."""
    rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") != "1" else None  # never raises
    line = f"[rank {rank}] {stop}: stopped" if rank is not None else f"{stop}: stopped"
    # One write with its newline: every rank shares the launcher's stderr, and print() writes the
    # text and the newline apart, so two ranks' lines could run together ("...stopped[rank 0] ...").
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return line


def _leave_if_interrupted(unraisable) -> None:
    """`sys.unraisablehook` while handlers are installed. A signal that lands inside a callback
    Python runs on its own (a weakref callback of the import machinery, a finalizer) raises
    `Interrupted` where nothing can catch it: Python reports it as "Exception ignored" and goes
    on. Such an interruption ends the process here, with its one line."""
    if isinstance(unraisable.exc_value, Interrupted):
        report(unraisable.exc_value)
        sys.stdout.flush()
        os._exit(unraisable.exc_value.exit_status)
    sys.__unraisablehook__(unraisable)


@contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Inside, SIGTERM and SIGINT raise `Interrupted`; the previous handlers come back after (a
    test calling the CLI in its own process keeps its Ctrl-C). Main thread only: handlers can only
    be installed there, and `main()` called from another thread keeps what it has."""
    if os.environ.get("WORLD_SIZE", "1") != "1":  # never raises: the CLI checks the value (`launch_env`)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _leaving
    _leaving = False  # a job run in this process before (a test's) left for its failure, not this one
    previous = {sig: signal.signal(sig, _raise) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _leave_if_interrupted
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)
