"""clip_grad_norm_ and build_optimizer with DTensor parameters on two different meshes (gloo).

    pytest -m distributed tests/distributed/test_clip_grad_norm.py
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.optim.optimizer import build_optimizer, clip_grad_norm_

pytestmark = pytest.mark.distributed
WORLD = 2


def _spawn(worker, tmp_path: Path) -> None:
    mp.spawn(_entry, args=(worker, str(tmp_path / "store")), nprocs=WORLD, join=True)


def _entry(rank: int, worker, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        worker(rank)
        # Both ranks finish before either tears gloo down: a rank leaving while its peer still
        # talks aborts the peer ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _full_tensors() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(param, grad) pairs, identical on every rank."""
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 6), (6,), (8, 2), (2, 4, 3)]
    return [(torch.randn(s, generator=g), torch.randn(s, generator=g) * 2) for s in shapes]


@functools.cache
def _meshes() -> tuple[DeviceMesh, DeviceMesh]:
    """Built once per process: every DeviceMesh makes process groups, and each extra group is
    one more gloo connection to tear down at exit (where gloo occasionally aborts)."""
    return DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp_shard",)), DeviceMesh("cpu", [1, 0], mesh_dim_names=("ep",))


def _dtensor_params() -> list[nn.Parameter]:
    """Like dense params on a dp_shard mesh and expert params on an ep mesh: two 1-D meshes
    over the same ranks in different orders, mixing Shard(0) and Replicate()."""
    dense, expert = _meshes()
    layout = [(dense, Shard(0)), (dense, Replicate()), (expert, Shard(0)), (expert, Replicate())]
    params = []
    for (p, grad), (mesh, placement) in zip(_full_tensors(), layout):
        param = nn.Parameter(distribute_tensor(p, mesh, [placement]))
        param.grad = distribute_tensor(grad, mesh, [placement])
        params.append(param)
    return params


def _holding(params: list[nn.Parameter]) -> nn.Module:
    """A module holding `params` as the optimizer's roles see them (`param_roles`): p0 and p2 as
    linear weights (decayed), p1 as a bias and p3 as a plain tensor (neither decayed)."""
    model = nn.Module()
    for i, (param, leaf) in enumerate(zip(params, ("weight", "bias", "weight", "tensor"))):
        owner = nn.Linear(1, 1, bias=False) if leaf == "weight" else nn.Module()
        setattr(owner, leaf, param)
        model.add_module(f"m{i}", owner)
    return model

def _check_clip(rank: int) -> None:
    ref = [nn.Parameter(p.clone()) for p, _ in _full_tensors()]
    for r, (_, grad) in zip(ref, _full_tensors()):
        r.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
    for foreach in (None, False):
        params = _dtensor_params()
        total = clip_grad_norm_(params, 1.0, foreach=foreach)
        assert not isinstance(total, DTensor)
        torch.testing.assert_close(total, expected)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad)


def _check_optimizer(rank: int) -> None:
    for implementation in ("foreach", "for-loop"):
        params = _dtensor_params()
        model = _holding(params)
        ref = _holding([nn.Parameter(p.clone()) for p, _ in _full_tensors()])
        for r, (_, grad) in zip(ref.parameters(), _full_tensors()):
            r.grad = grad.clone()
        cfg = OptimizerConfig(implementation=implementation)
        opt, ref_opt = build_optimizer(model, cfg), build_optimizer(ref, cfg)
        # Foreach kernels cannot take tensors of two meshes: one param group per mesh. (decay,
        # dense: p0), (no decay, dense: the bias p1), (decay, expert: p2), (no decay, expert: the
        # plain p3) against decay / no decay.
        assert len(opt.param_groups) == 4 and len(ref_opt.param_groups) == 2
        opt.step()
        ref_opt.step()
        for p, r in zip(params, ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), r.detach())


def _check_all(rank: int) -> None:
    _check_clip(rank)
    _check_optimizer(rank)


def test_clip_grad_norm_and_optimizer_across_meshes(tmp_path: Path) -> None:
    # One spawn for both checks: starting the workers is most of the cost.
    _spawn(_check_all, tmp_path)
