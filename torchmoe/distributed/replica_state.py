"""What replica groups tell each other besides gradients (`distributed.fault_tolerance`): the
layout each runs, where each group's rows stand, and the live state a recovering group takes.

    layout = GroupLayout(model="llama4/debugmodel float32", degrees={"dp_shard": 2, ...}, ...)
    layout.codes()                      # fixed-length ints: rides in every step's first collective
    GroupLayout.from_codes(codes, known_models)   # a peer's, to name it in an error
    table = RowPositions(group_size=3, width=len(encode_position(loader.state_dict())))
    table.commit({1: position})         # group 1's position after a committed step

Everything here is plain tensors and numbers: what crosses groups is loaded with
``weights_only=True`` and never runs code.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchmoe.config.wording import counted

# The degrees a layout is made of, in the order its codes carry them.
DEGREES = ("pp", "dp_shard", "cp", "tp", "ep")


def model_code(model: str) -> int:
    """A stable 31-bit code of a model's text form (`GroupLayout.model`)."""
    return zlib.crc32(model.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class GroupLayout:
    """What must be equal in every replica group for their collectives to line up and their
    rows to mean the same: the model, the group's ranks and degrees, and the batch.

    Args:
        model: family, flavor and every setting that changes a parameter or its dtype, as text
            (e.g. "llama4/debugmodel, float32").
        degrees: the group's parallel degrees (`DEGREES`).
        ranks: ranks in one group.
        seq_len, local_batch_size, global_batch_size: the `[training]` batch.
    """

    model: str
    degrees: Mapping[str, int]
    ranks: int
    seq_len: int
    local_batch_size: int
    global_batch_size: int

    def codes(self) -> list[int]:
        """The layout as `len(DEGREES) + 5` ints, each exact (the model as `model_code`)."""
        return [self.ranks, *(int(self.degrees[d]) for d in DEGREES), self.seq_len, self.local_batch_size,
                self.global_batch_size, model_code(self.model)]

    @classmethod
    def from_codes(cls, codes: Sequence[int], known_models: Sequence[str] = ()) -> GroupLayout:
        """The layout `codes` gives; its model named from `known_models` when one has its code."""
        ranks, *rest = (int(c) for c in codes)
        degrees = dict(zip(DEGREES, rest[:len(DEGREES)]))
        seq_len, local, global_, code = rest[len(DEGREES):]
        model = next((m for m in known_models if model_code(m) == code), f"a model of code {code:#x}")
        return cls(model=model, degrees=degrees, ranks=ranks, seq_len=seq_len, local_batch_size=local,
                   global_batch_size=global_)

    def describe(self) -> str:
        degrees = ", ".join(f"{d} {self.degrees[d]}" for d in DEGREES)
        return (f"{self.model} on {counted(self.ranks, 'rank')} ({degrees}), seq_len {self.seq_len}, local batch "
                f"{self.local_batch_size}, global batch {self.global_batch_size}")


class RowPositions:
    """Every group's row position (this rank's rows of it) after the last committed step that
    held the group's gradients: what a recovering group continues from.

    A position is the loader's state flattened to float64 numbers (`encode_position`), each an
    exact integer below 2**53; one row per group, ``[known, *position]``. The table lives in
    memory: it rides in each step's small collective (`ReplicaGroups.reduce`), goes to a
    recovering group with the live state, and is saved with this group's checkpoints (a fixed
    shape: what a resumed process loads into), so nothing is written per step.
    """

    def __init__(self, group_size: int, width: int) -> None:
        self.table = torch.zeros(group_size, 1 + width, dtype=torch.float64)

    def commit(self, present: Mapping[int, Sequence[float]]) -> None:
        """Record the positions of the groups whose gradients a committed step held."""
        for group, position in present.items():
            self.table[group] = torch.tensor([1.0, *position], dtype=torch.float64)

    def get(self, group: int) -> list[float] | None:
        row = self.table[group].tolist()
        return row[1:] if row[0] == 1.0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"table": self.table}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        table = torch.as_tensor(state["table"], dtype=torch.float64)
        if table.shape != self.table.shape:
            raise ValueError(f"a row-position table of shape {tuple(table.shape)}, this rank's is "
                             f"{tuple(self.table.shape)}")
        self.table.copy_(table)


def encode_position(state: Mapping[str, Any]) -> list[float]:
    """A loader's `state_dict` (``step``, ``rows``, optional ``source_rows``) as numbers: the
    step, then every row entry, then the per-source counts."""
    out = [float(state["step"]), *state["rows"].flatten().double().tolist()]
    if "source_rows" in state:
        out += state["source_rows"].double().tolist()
    return out


def decode_position(numbers: Sequence[float], like: Mapping[str, Any]) -> dict[str, Any]:
    """`encode_position`'s numbers back in the form of `like` (this rank's own loader state: the
    same layout, so the same shapes)."""
    rows = like["rows"]
    n = rows.numel()
    out: dict[str, Any] = {"step": int(numbers[0]),
                           "rows": torch.tensor(numbers[1:1 + n], dtype=torch.float64).long().view_as(rows),
                           "split": like["split"]}
    if "source_rows" in like:
        out["source_rows"] = torch.tensor(numbers[1 + n:], dtype=torch.float64).long()
    return out


def local_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` (a flat or nested dict) with every DTensor replaced by its local shard."""
    return {k: local_tensors(v) if isinstance(v, Mapping) else v.to_local() if isinstance(v, DTensor) else v
            for k, v in state.items()}


def like(template: Mapping[str, Any], received: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """`received` (from `local_tensors` on a peer with the same layout) in `template`'s form: each
    local shard wrapped as the DTensor `template` holds at its key.

    Raises:
        ValueError: the keys or shapes differ (the groups do not run the same layout; the
            layouts are compared before, so this is a defect).
    """
    if set(template) != set(received):
        missing, extra = sorted(set(template) - set(received)), sorted(set(received) - set(template))
        raise ValueError(f"the peer's state differs at {path or 'the top'}: missing {missing[:3]}, extra {extra[:3]}")
    out = {}
    for key, mine in template.items():
        theirs, where = received[key], f"{path}{key}"
        if isinstance(mine, Mapping):
            out[key] = like(mine, theirs, f"{where}.")
        elif isinstance(mine, torch.Tensor):
            local = mine.to_local() if isinstance(mine, DTensor) else mine
            if not isinstance(theirs, torch.Tensor) or tuple(theirs.shape) != tuple(local.shape):
                shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs).__name__
                raise ValueError(f"the peer's {where} is {shape}, this rank's {tuple(local.shape)}")
            theirs = theirs.to(local.device)
            out[key] = DTensor.from_local(theirs, mine.device_mesh, mine.placements, shape=mine.shape,
                                          stride=mine.stride(), run_check=False) if isinstance(mine, DTensor) else theirs
        else:
            out[key] = theirs
    return out
