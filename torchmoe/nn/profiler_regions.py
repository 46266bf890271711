"""Profiler labels for the parts of a training step whose op names alone are ambiguous.

    with region("attention"):
        ...  # shows as `torchmoe/attention` in traces; performance/step_breakdown.py reads it

A linear is a linear wherever it runs: the label says which part of the model ran it. The label
costs nothing when no profiler runs, and is left out of compiled graphs (torch.compile would
ignore it there anyway, with a warning per graph), so it never breaks a graph.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.profiler import record_function

from torchmoe import _torch_private as private

# Every label is PREFIX + one of REGIONS.
PREFIX = "torchmoe/"
REGIONS = ("attention", "routed_experts", "ffn", "router", "data", "optimizer")


def region(name: str) -> contextlib.AbstractContextManager:
    """A `record_function` labelled ``torchmoe/<name>`` while a profiler records, else a no-op.

    Args:
        name: one of `REGIONS`.
    """
    assert name in REGIONS, name
    if torch.compiler.is_compiling() or not private.profiler_enabled():
        return contextlib.nullcontext()
    return record_function(PREFIX + name)
