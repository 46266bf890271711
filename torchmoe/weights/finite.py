"""Nothing non-finite is written, and nothing non-finite or absurd comes in with the weights.

    require_finite(state, group=group)          # collective: NonFiniteValues on every rank, naming the tensors
    refuse_bad_values(state, key=..., path=...)  # a reader's: UnreadableWeights naming the folder and tensors

A NaN or inf in a weight stays there: training on it diverges at some later step (whose message
would blame the learning rate), an export carries it to whoever loads it. So every writer of
weights (checkpoint saves, the seed checkpoint, the Hugging Face export, `torchmoe convert` both
ways) checks the tensors it is about to write, and every reader of weights a user names
(`checkpoint.initial_load_path`, `convert`'s sources, `eval` and `generate`'s weights, a
checkpoint being resumed) checks what it read. Each check is one pass over the local tensors and
one host sync; under a process group the ranks exchange the names they found, so all of them
stop alike and the message names every tensor, wherever its bad shard lives.

A reader of weights a user names also bounds them: every value within ±`WEIGHT_BOUND` (2^16).
Finite is not enough: a crafted or damaged file holds 6e37 as easily as NaN (an MXFP4 scale byte
of 254, a gpt-oss sink of 3e38), and such a weight overflows the first bf16 or fp16 product it
enters, or silences every other token of a softmax. The bound is far above what training makes:
Adam and Muon move a weight by about the learning rate per step (lr 1e-3 needs 65 million steps
to go from 0 to 2^16), weight decay pulls it back, and checkpoints released in fp16 cannot exceed
65,504 at all. A run whose weights pass it has diverged: its checkpoint is refused with the
others (resuming it is not: `checkpoint.load_latest` checks the run's own state for NaN and inf
only).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from torchmoe.nn.shards import local_shard
from torchmoe.weights.weight_files import UnreadableWeights

__all__ = ["WEIGHT_BOUND", "NonFiniteValues", "nonfinite_names", "refuse_bad_values", "require_finite"]

WEIGHT_BOUND = 2.0**16
"""The largest |value| a weight read from a file a user names may hold (see the module's docstring)."""


class NonFiniteValues(ValueError):
    """Tensors about to be written (or just read) hold NaN or inf; `names` says which."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        super().__init__(f"NaN or inf in {self.shown}")


def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of every floating-point tensor in `state`: nested mappings, lists and
    `Stateful`s (through their state dict); a DTensor as this rank's shard."""
    if isinstance(state, Stateful):
        state = state.state_dict()
    if isinstance(state, Mapping):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}{key}.")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _tensors(value, f"{prefix}{i}.")
    elif isinstance(state, torch.Tensor) and state.is_floating_point():
        local = local_shard(state)
        if local.numel():
            yield prefix[:-1], local


def nonfinite_names(state: Any) -> list[str]:
    """Names of this rank's floating-point tensors in `state` holding NaN or inf, in order. A NaN
    or inf makes a tensor's sum non-finite, so the sums (one fast pass) pick the suspects, which
    an element-wise check then settles (a sum may overflow where no element does); one or two
    host syncs."""
    named = list(_tensors(state))
    if not named:
        return []
    # float32 sums (fp16/bf16 would overflow sooner); an fp64 sum beyond float32 is only a suspect.
    sums = torch.stack([t.sum(dtype=torch.float32 if t.element_size() < 8 else None).float() for _, t in named])
    suspects = [named[i] for i, finite in enumerate(sums.isfinite().tolist()) if not finite]
    if not suspects:
        return []
    bad = torch.stack([~torch.isfinite(t).all() for _, t in suspects]).tolist()
    return [name for (name, _), b in zip(suspects, bad) if b]


def require_finite(state: Any, *, group: dist.ProcessGroup | None = None) -> None:
    """Check `state` on every rank of `group` (collective under a process group).

    Raises:
        NonFiniteValues: on every rank, naming the tensors any rank found.
    """
    names = nonfinite_names(state)
    if dist.is_available() and dist.is_initialized():
        gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, names, group=group)
        names = list(dict.fromkeys(name for found in gathered for name in found))
    if names:
        raise NonFiniteValues(names)


def _peaks(state: Any) -> list[tuple[str, float]]:
    """(name, largest |value|) of this rank's floating-point tensors in `state`, NaN for a tensor
    holding one (aminmax passes a NaN on); one pass over each, one host sync."""
    named = list(_tensors(state))
    if not named:
        return []
    peaks = torch.stack([torch.stack(torch.aminmax(t)).float().abs().amax() for _, t in named]).tolist()
    return [(name, peak) for (name, _), peak in zip(named, peaks)]


def refuse_bad_values(state: Any, *, key: str, path: str | os.PathLike, names: Mapping[str, str] | None = None,
                      group: dist.ProcessGroup | None = None) -> None:
    """What a reader checks of the weights it read from `path` (the value of `key`): every value
    finite and within ±`WEIGHT_BOUND`. `names` maps state names to the names in the files
    (Hugging Face's). Collective under a process group, like `require_finite`.

    Raises:
        UnreadableWeights: naming `key`, `path` and the tensors: the values came with the weights.
    """
    bad = [(name, peak) for name, peak in _peaks(state) if not peak <= WEIGHT_BOUND]
    if dist.is_available() and dist.is_initialized():
        gathered: list[list[tuple[str, float]] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, bad, group=group)
        peaks: dict[str, float] = {}
        for name, peak in (found for rank in gathered for found in rank):  # a tensor's peak over its shards
            peaks[name] = peak if math.isnan(peak) or name not in peaks else max(peaks[name], peak)
        bad = list(peaks.items())
    stored = [((names or {}).get(name, name), peak) for name, peak in bad]
    nonfinite = [name for name, peak in stored if not math.isfinite(peak)]
    if nonfinite:
        raise UnreadableWeights(key, os.fspath(path), f"the weights hold {NonFiniteValues(nonfinite)}: they came "
                                "in with the weights, and training from them would diverge",
                                "point it at weights without NaN or inf (a copy saved before they appeared, or a "
                                "fresh download)")
    if stored:
        shown = ", ".join(f"{name} ({peak:.3g})" for name, peak in stored[:3])
        more = f" and {len(stored) - 3} more" if len(stored) > 3 else ""
        raise UnreadableWeights(key, os.fspath(path), f"the weights hold values beyond ±{WEIGHT_BOUND:,.0f}, which "
                                f"no trained model reaches (largest |value|: {shown}{more}): the files are damaged "
                                "or crafted, or the run that wrote them diverged",
                                "point it at weights within that bound (a copy saved before the run diverged, or "
                                "a fresh download); docs/checkpoints.md says why the bound holds")
