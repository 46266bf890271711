"""How a command ends when something failed: one message per error, and the exit status (DESIGN §3).

    2  a user error (`ConfigError`): one message naming the key, the value and the fix;
    1  training diverged (`TrainingDiverged`), one message naming the step;
    N  another rank failed (`PeerFailed`): one line here, that rank's status.

A `ConfigError` raised before running is the same on every rank, so rank 0 reports it for all
(`cli.main`); one raised while running may differ between ranks and is wrapped in
`RankSpecificError`, which every rank reports with its rank.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from torchmoe.config import ConfigError
from torchmoe.config.launch_env import tell_launcher

if TYPE_CHECKING:
    from torchmoe.distributed.failure import PeerFailed


class RankSpecificError(Exception):
    """A ConfigError raised while running, which may differ between ranks, so every rank reports it."""

    def __init__(self, err: ConfigError) -> None:
        super().__init__(str(err))
        self.err = err


@contextmanager
def rank_specific_errors() -> Iterator[None]:
    """Hold a command's running part: a `ConfigError` raised in it becomes a `RankSpecificError`."""
    try:
        yield
    except ConfigError as err:  # raised while running: it may differ between ranks
        raise RankSpecificError(err) from err


def report_error(err: Exception, rank: str | None) -> str:
    """Print `err` as the one message of a user error; returns its text (without the colour)."""
    prefix = f"[rank {rank}] " if rank is not None else ""
    # soft_wrap: never break the message (the arithmetic, paths) at the terminal width.
    Console(stderr=True, soft_wrap=True, highlight=False).print(
        f"{escape(prefix)}[bold red]error:[/] {escape(str(err))}")  # "[rank 1]" is not markup
    return f"{prefix}error: {err}"


def stopped_by_peer(err: PeerFailed) -> int:
    """Another rank failed and reports its error itself: one line here, its exit status; torchrun's
    summary of this rank names the failing rank's error too (`tell_launcher`)."""
    print(err, file=sys.stderr)
    tell_launcher(err.with_cause())
    leave_if_failed(err.exit_status)
    return err.exit_status


def leave_if_failed(status: int) -> None:
    """A rank that left a multi-rank run for a failure exits here, from the handler that reported
    it, before its frames are freed (`torchmoe.distributed.failure.leave_if_failed`). Only such
    a run imports that module: the CLI stays quick to answer without torch."""
    failure = sys.modules.get("torchmoe.distributed.failure")
    if failure is not None:
        failure.leave_if_failed(status)
