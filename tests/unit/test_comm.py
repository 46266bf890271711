"""`[comm]` and the process groups: the backend for each configuration, the init timeout, the
training timeout after the first step (the step's groups only; checkpoint groups keep theirs), and
the NCCL flight recorder's buffer.

    python -m pytest -q tests/unit/test_comm.py
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from torchmoe.checkpoints.checkpoint import checkpoint_timeout
from torchmoe.config.job_config import Checkpoint, Comm, Parallelism
from torchmoe.distributed.process_groups import backend_spec, device_backend, set_timeout
from torchmoe.training.world import init_distributed as _init_distributed


@pytest.mark.parametrize(("device", "offload", "spec"), [
    ("cpu", False, "gloo"),
    ("cpu", True, "gloo"),  # gloo carries host tensors already
    ("cuda", False, "nccl"),  # no host collective: no gloo connections in every group
    ("cuda", True, "cuda:nccl,cpu:gloo"),  # offloaded gradients: clipping reduces host norms
])
def test_backend_for_each_configuration(device, offload, spec):
    assert backend_spec(device, host_collectives=offload) == spec


@pytest.mark.parametrize(("offload", "spec"), [(False, "gloo"), (True, "gloo")])
def test_init_process_group_gets_the_backend_and_the_init_timeout(monkeypatch, tmp_path, offload, spec):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    world = _init_distributed(torch.device("cpu"), Comm(init_timeout_seconds=42), Parallelism(fsdp_cpu_offload=offload),
                              tmp_path)
    assert world == 2 and seen["timeout"] == timedelta(seconds=42) and seen["backend"] == spec


@pytest.mark.parametrize(("spec", "cpu", "cuda"), [
    ("gloo", "gloo", "gloo"), ("cpu:gloo,cuda:gloo", "gloo", "gloo"), ("nccl", "", "nccl"),
    ("cuda:nccl,cpu:gloo", "gloo", "nccl"),
])
def test_device_backend_reads_which_backend_carries_each_device(monkeypatch, spec, cpu, cuda):
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: str(BackendConfig(Backend(spec))))
    assert (device_backend("cpu"), device_backend("cuda")) == (cpu, cuda)


def test_train_timeout_reaches_the_given_groups_only(tmp_path):
    """The default group and the mesh's get the training timeout; a checkpoint group (created
    with its own) keeps it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=300))
    try:
        mesh_group = dist.new_group([0])  # like the DeviceMesh's groups
        checkpoint_group = dist.new_group([0], backend="gloo", timeout=timedelta(seconds=900))
        timeout = lambda pg: pg._get_backend(torch.device("cpu")).options._timeout
        default = c10d._get_default_group()
        set_timeout(7, [None, mesh_group, mesh_group], torch.device("cpu"))
        assert [timeout(pg) for pg in (default, mesh_group, checkpoint_group)] == \
            [timedelta(seconds=7), timedelta(seconds=7), timedelta(seconds=900)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("seconds", "expected"), [(-1, 300), (3600, 3600)])
def test_checkpoint_timeout_defaults_to_the_init_timeout(seconds, expected):
    assert checkpoint_timeout(Checkpoint(timeout_seconds=seconds), Comm(init_timeout_seconds=300)) == \
        timedelta(seconds=expected)


@pytest.mark.parametrize("key", ["init_timeout_seconds", "train_timeout_seconds", "trace_buf_size"])
def test_torchtitan_comm_keys_load_from_toml(tmp_path, key):
    from torchmoe.config.loader import load_job_config

    path = tmp_path / "job.toml"
    path.write_text(f"[comm]\n{key} = 123\n")
    assert getattr(load_job_config(["--config", str(path)]).comm, key) == 123
