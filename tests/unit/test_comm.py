"""`[comm]`: the process group's init timeout, the training timeout after the first step, and
the NCCL flight recorder's buffer.

    python -m pytest -q tests/unit/test_comm.py
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from torchmoe.config.job_config import Comm
from torchmoe.trainer import _init_distributed, _set_train_timeout


def test_init_process_group_gets_the_init_timeout(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    assert _init_distributed(torch.device("cpu"), Comm(init_timeout_seconds=42), tmp_path) == 2
    assert seen["timeout"] == timedelta(seconds=42) and seen["backend"] == "gloo"


def test_train_timeout_reaches_every_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=300))
    try:
        dist.new_group([0])  # like the DeviceMesh's groups
        timeouts = lambda: [pg._get_backend(torch.device("cpu")).options._timeout for pg in c10d._world.pg_map]
        assert timeouts()[0] == timedelta(seconds=300)
        _set_train_timeout(Comm(train_timeout_seconds=7))
        assert timeouts() == [timedelta(seconds=7)] * 2
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("key", ["init_timeout_seconds", "train_timeout_seconds", "trace_buf_size"])
def test_torchtitan_comm_keys_load_from_toml(tmp_path, key):
    from torchmoe.config.loader import load_job_config

    path = tmp_path / "job.toml"
    path.write_text(f"[comm]\n{key} = 123\n")
    assert getattr(load_job_config(["--config", str(path)]).comm, key) == 123
