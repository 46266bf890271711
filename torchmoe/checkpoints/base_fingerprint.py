"""A fingerprint of a LoRA run's frozen base (its parameters and the persistent buffers it starts
from: the expert biases), recorded in every checkpoint and compared at resume, so that adapters
are never continued (or exported) on a base other than the one they were trained on.

    fingerprint = BaseFingerprint()                       # state["base"]: saved with each checkpoint
    fingerprint.check(base_fingerprint(model, names, group), key=..., path=...)  # at start / resume

The fingerprint of a tensor is its dtype and the sum, modulo 2**64, of its elements' bit patterns
read as integers (an int32 for a float32, an int16 for a bfloat16). Integer addition is
associative, so the sum of the shards' sums is the whole tensor's whatever the layout (FSDP, EP,
TP, PP, any world size; a replicated shard is counted once): a resume under another layout
computes the same numbers. It costs one read of the weights this rank holds (memory speed, no
file is read again) and one gather of one number per tensor. Any changed value changes it, save
for a change that another in the same tensor cancels exactly; elements permuted within one
tensor go unseen (a fingerprint, not a cryptographic digest).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Replicate

from torchmoe.checkpoints.checkpoint_state import dist_on
from torchmoe.config.errors import ConfigError
from torchmoe.config.wording import counted

__all__ = ["BaseFingerprint", "base_fingerprint"]

logger = logging.getLogger(__name__)

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The base's buffers a fingerprint covers beside its parameters (the expert biases the base starts
# from). Checkpoints of LoRA runs from before they were covered (torchmoe of 2026-12-07) recorded
# parameters alone: against those, the buffers go uncompared.
_BUFFERS = ("expert_bias",)


def _counted(tensor: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `tensor` to add up, or None where another rank counts the same part
    (a DTensor replicated over a mesh dimension: the rank at coordinate 0 counts it)."""
    if not isinstance(tensor, DTensor):
        return tensor
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None or any(isinstance(p, Replicate) and c != 0 for p, c in zip(tensor.placements, coordinate)):
        return None
    return tensor.to_local()


def base_fingerprint(model: torch.nn.Module, names: Iterable[str],
                     group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """{name: "dtype:sum"} of the tensors `names` of `model` (whole-model names; this rank holds
    its shards or pipeline stages of them), the same on every rank (collective over `group`)."""
    t0 = time.perf_counter()
    wanted = set(names)
    state = {name: t for name, t in get_model_state_dict(model).items() if name in wanted}
    kinds: dict[str, tuple[str, bool]] = {}  # name -> (dtype, whether a DTensor: its shards' sums add up)
    sums = []
    for name, tensor in state.items():
        local = _counted(tensor)
        if local is None:
            continue
        bits = local.detach().view(_BITS[local.element_size()])
        sums.append(bits.sum(dtype=torch.int64))
        kinds[name] = (str(tensor.dtype).removeprefix("torch."), isinstance(tensor, DTensor))
    values = torch.stack(sums).tolist() if sums else []  # one device-to-host copy
    mine = {name: (*kind, value) for (name, kind), value in zip(kinds.items(), values)}
    everyone = [mine]
    if dist_on():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    found: dict[str, tuple[str, int]] = {}
    for held in everyone:
        for name, (dtype, sharded, value) in held.items():
            # A tensor held whole has the same value on every rank that holds it.
            total = found.get(name, (dtype, 0))[1] if sharded else 0
            found[name] = (dtype, (total + value + 2**63) % 2**64 - 2**63)  # wraps as int64 does
    logger.info("fingerprinted the base weights (%s) in %.3f s", counted(len(found), "tensor"), time.perf_counter() - t0)
    return {name: f"{dtype}:{value}" for name, (dtype, value) in sorted(found.items())}


class BaseFingerprint(Stateful):
    """The base's fingerprint in a checkpoint (`state["base"]`): what `check` took last is saved,
    what a resume loaded is `recorded` (None before one did), for `check` to compare."""

    # Checkpoints of LoRA runs from before fingerprints (torchmoe of 2026-12-06) hold none: they
    # resume, unchecked (`CheckpointManager.load_latest`).
    optional_in_checkpoints = True

    def __init__(self) -> None:
        self.current: dict[str, str] = {}
        self.recorded: dict[str, str] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"fingerprint": json.dumps(self.current, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recorded = json.loads(state_dict["fingerprint"])

    def check(self, found: dict[str, str], *, key: str, path: str, fix: str) -> None:
        """Take `found`, the fingerprint of the base as loaded now, as the run's; after a resume
        it must be the one the checkpoint recorded.

        Raises:
            ConfigError: (naming `key` and `path`, where the base came from) it differs.
        """
        compared = found
        if self.recorded is not None and not any(name.endswith(_BUFFERS) for name in self.recorded):
            compared = {name: value for name, value in found.items() if not name.endswith(_BUFFERS)}
        if self.recorded is not None and compared != self.recorded:
            differ = sorted(name for name in compared.keys() | self.recorded.keys()
                            if compared.get(name) != self.recorded.get(name))
            raise ConfigError(key, path, f"holds other base weights than the run's checkpoints were trained on "
                              f"({len(differ)} of {len(self.recorded)} tensors differ, e.g. {differ[0]}): "
                              "the adapters belong to another base", fix)
        self.current = found
