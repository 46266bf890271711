"""A source's passes over its data, said once a pass: every batch row of a process starts each
pass on its own (rows are packed independently), and one line a row said the same thing G times.

    passes = Passes()                                   # one per source on this process
    passes.start(epoch, lambda: "data repeats: ...")    # by each row as it starts pass `epoch`
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["Passes"]

logger = logging.getLogger(__name__)


class Passes:
    """The newest pass a batch row of one source on this process started."""

    def __init__(self) -> None:
        self.started = 0

    def start(self, epoch: int, line: Callable[[], str]) -> None:
        """A row starts pass `epoch`: the first row to start it logs `line()` (INFO), the others nothing."""
        if epoch > self.started:
            self.started = epoch
            logger.info("%s", line())
