"""Weighted mixtures of data sources (`training.dataset_mix`): which source each batch row reads.

    sources = parse_mix(["web=0.7:local:web/*.jsonl", "code=0.3:tokens:/data/code"])
    schedule = MixSchedule([s.weight for s in sources], seed=0)
    schedule.sources(step=12, rows=range(0, 8), global_rows=8)   # (8,) int64: a source per row

Each entry of `training.dataset_mix` is ``[NAME=]WEIGHT:DATASET[:PATH]``: a weight (any positive
number; they are normalised), a `training.dataset` kind and its `dataset_path` (everything after
the second colon, so hub specs like ``allenai/c4:en`` keep theirs).

Row j of global batch t (draw n = t * G + j) reads from the source whose share of [0, 1) holds
``u_n = frac(offset + n * (sqrt(5) - 1) / 2)``, a Weyl sequence with a seed-chosen offset: the
same seed gives the same sources for every (step, row), whatever the layout, and since the
sequence is equidistributed with low discrepancy, the sources' shares of any N consecutive rows
are within O(log N / N) of the weights (no drift, unlike independent draws). Each source keeps
its own position per row, so a source's data order does not depend on the other sources.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from torchmoe.config.datasets import split_mix_entry
from torchmoe.data.documents import DataConfigError

if TYPE_CHECKING:
    from torchmoe.config.job_config import Training

__all__ = ["MixSource", "MixSchedule", "parse_mix", "source_settings"]

KEY = "training.dataset_mix"
_FORM = "each entry is [NAME=]WEIGHT:DATASET[:PATH], e.g. \"web=0.7:local:data/web/*.jsonl\""
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class MixSource:
    """One source of a mixture."""

    name: str
    """Its name in metrics (``tokens/NAME``); default ``source<i>``."""
    weight: float
    """Its share of the rows, before normalisation."""
    dataset: str
    """A `training.dataset` kind."""
    dataset_path: str
    """Its `training.dataset_path`."""
    entry: str
    """The entry as written, for messages."""


def parse_mix(entries: list[str]) -> list[MixSource]:
    """The sources of `training.dataset_mix`.

    Raises:
        DataConfigError: an entry of the wrong form, a weight that is not a positive number, or
            two sources of one name.
    """
    sources: list[MixSource] = []
    for i, entry in enumerate(entries):
        name, weight_text, dataset, path = split_mix_entry(entry, i)
        try:
            weight = float(weight_text)
        except ValueError:
            raise DataConfigError(KEY, entry, f"{weight_text!r} is not a weight", _FORM) from None
        if not (math.isfinite(weight) and weight > 0):
            raise DataConfigError(KEY, entry, f"the weight {weight_text} is not a positive number",
                                  "give every source a weight > 0 (they are normalised), or remove it")
        if not dataset or not _NAME.fullmatch(name):
            raise DataConfigError(KEY, entry, "is not of the form [NAME=]WEIGHT:DATASET[:PATH] (a NAME holds "
                                  "letters, digits, '_', '.' and '-')", _FORM)
        if any(s.name == name for s in sources):
            raise DataConfigError(KEY, entry, f"a second source named {name!r}", "give each source its own name")
        sources.append(MixSource(name, weight, dataset, path, entry))
    return sources


class MixSchedule:
    """Which source each row of each global batch reads (see the module docstring).

    Args:
        weights: each source's weight (positive).
        seed: `training.seed`; it picks the sequence's offset.
    """

    def __init__(self, weights: list[float], seed: int) -> None:
        # Scaled by the largest first: the sum of weights near the float maximum (1e308 + 1e308)
        # is inf, which made every share 0 but the last.
        scaled = np.array(weights, dtype=np.float64) / max(weights)
        self.bounds = np.cumsum(scaled / scaled.sum())  # (S,) upper ends of the shares
        self.bounds[-1] = 1.0
        self.offset = (seed * _GOLDEN * _GOLDEN) % 1.0  # another irrational step, so seeds give far-apart offsets

    def sources(self, step: int, rows: range, global_rows: int) -> np.ndarray:
        """(len(rows),) int64: the source of each of `rows` in global batch `step` (0-based) of
        `global_rows` rows."""
        n = np.arange(rows.start, rows.stop, dtype=np.float64) + float(step) * global_rows
        u = (self.offset + n * _GOLDEN) % 1.0
        return np.searchsorted(self.bounds, u, side="right").clip(max=len(self.bounds) - 1)

    def counts(self, step: int, global_rows: int) -> np.ndarray:
        """(S,) int64: how many rows of global batch `step` each source fills."""
        return np.bincount(self.sources(step, range(global_rows), global_rows), minlength=len(self.bounds))


def source_settings(training: Training) -> list[tuple[MixSource, Training]]:
    """Each source of `training.dataset_mix` with the `[training]` settings that read it alone (its
    dataset and path; the text field, split and the rest shared). Empty without a mixture."""
    return [(source, dataclasses.replace(training, dataset=source.dataset, dataset_path=source.dataset_path,
                                         dataset_mix=[]))
            for source in parse_mix(training.dataset_mix)]
