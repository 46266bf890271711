"""Joining the launched world: the process groups, and their collectives' timeouts."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe.config.job_config import Comm, Parallelism
from torchmoe.config.launch_env import launch_int
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.distributed.process_groups import backend_spec, set_timeout


def init_distributed(device: torch.device, comm_cfg: Comm, parallelism_cfg: Parallelism, dump_folder: Path) -> int:
    """Join the launched world (torchrun sets WORLD_SIZE) with the `[comm]` init timeout, a gloo
    backend beside NCCL when host tensors are reduced (`process_groups.backend_spec`), and the
    NCCL flight recorder (its buffer, and where it dumps on a timeout); returns the world size."""
    world_size = launch_int("WORLD_SIZE", 1)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # Read by NCCL process groups when they are created; a user's own setting wins.
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(comm_cfg.trace_buf_size))
            if comm_cfg.trace_buf_size > 0:
                traces = dump_folder / comm_cfg.save_traces_folder
                traces.mkdir(parents=True, exist_ok=True)
                os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
                # NCCL appends the rank to this prefix.
                os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(traces / comm_cfg.save_traces_file_prefix))
        # FSDP CPU offload keeps sharded gradients on the host: clipping reduces them there.
        backend = backend_spec(device.type, host_collectives=parallelism_cfg.fsdp_cpu_offload)
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None,
                                timeout=timedelta(seconds=comm_cfg.init_timeout_seconds))
    return world_size


def collective_timeout(mesh: ParallelMesh, seconds: int, device: torch.device) -> None:
    """Every group of `mesh` (and the default one) times collectives out after `seconds`."""
    set_timeout(seconds, [None, *mesh.groups()], device)
