"""The job's process groups: which backend carries which tensors, and how long a collective may wait.

    python -c "from torchmoe.distributed.process_groups import backend_spec; \\
        print(backend_spec('cuda', host_collectives=True))"

Backends. CPU jobs use gloo. CUDA jobs use NCCL, which refuses host tensors; when some collective
runs on host tensors (FSDP CPU offload: sharded gradients live on the host, so clipping reduces
host norms over the mesh's groups), every group gets gloo beside NCCL (``cuda:nccl,cpu:gloo``)
and each collective goes to the backend of its tensors' device. Only then: a gloo backend in each
of a large job's many groups costs connections and start-up time.

Timeouts. Every group starts with `[comm] init_timeout_seconds`, long enough for loading, compile
and the first step. After the first step the groups the training step uses (the default group
and the device mesh's) get the short `train_timeout_seconds`, so a stuck rank fails the job
quickly. Checkpoint groups (`checkpoints.checkpoint`) keep a timeout of their own: a save's gather
waits for the slowest rank's write, routinely minutes longer than the fastest's at scale.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from torchmoe import _torch_private as private

__all__ = ["backend_spec", "device_backend", "set_timeout"]


def backend_spec(device_type: str, *, host_collectives: bool) -> str:
    """The `init_process_group` backend for a job on `device_type` ('cpu' or 'cuda').

    Args:
        host_collectives: some collective runs on host tensors while training on CUDA.
    """
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"


def device_backend(device_type: str, group: dist.ProcessGroup | None = None) -> str:
    """The backend that carries `device_type` tensors in `group` (the default group when None):
    'nccl', 'gloo', ... ('' when the group has none for that device)."""
    # The expanded form names every device: "gloo" is "cpu:gloo,cuda:gloo", "nccl" "cuda:nccl".
    backends = dict(part.split(":", 1) for part in dist.get_backend_config(group).split(","))
    return backends.get(device_type, "")


def set_timeout(seconds: int, groups: Iterable[dist.ProcessGroup | None], device: torch.device) -> None:
    """Give `groups` (None: the default group) a collective timeout of `seconds`, once every rank
    has got here: a barrier first, so that no rank still waits in a collective that was issued
    under the previous timeout when its peers shorten theirs, and on CUDA a device sync so that
    no collective is still queued."""
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timeout = timedelta(seconds=seconds)
    for group in dict.fromkeys(groups):  # a group may be several meshes' (views share groups)
        private.set_group_timeout(timeout, group)  # torch offers no public setter
