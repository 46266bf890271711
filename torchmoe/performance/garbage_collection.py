"""Python's garbage collector at fixed steps only, never in the middle of one.

    gc_schedule = GarbageCollection(job_config.training.gc_freq)
    for step in ...:
        train_step(...); gc_schedule.step(step)
    gc_schedule.close()

A collection pass over a training process's many objects takes tens of milliseconds. Left to
Python it starts whenever allocations cross a threshold, i.e. at a random point inside some
step, where on several ranks it stalls every collective waiting for the slowest rank. With
`freq` > 0 automatic collection is off and a young-generation pass runs after every `freq`-th
step (cycles the training loop makes are short-lived); `freq` 0 leaves Python's own behaviour.
"""

from __future__ import annotations

import gc

__all__ = ["GarbageCollection"]


class GarbageCollection:
    """Collect garbage after every `freq`-th step only (0: Python's automatic collection)."""

    def __init__(self, freq: int) -> None:
        self.freq = freq
        if freq:
            gc.disable()
            gc.collect()  # what model building left, before the first step

    def step(self, step: int) -> None:
        """Call after training step `step` (1-based)."""
        if self.freq and step % self.freq == 0:
            gc.collect(1)

    def close(self) -> None:
        """Give collection back to Python (the process goes on, e.g. a test or a notebook)."""
        if self.freq:
            gc.enable()
