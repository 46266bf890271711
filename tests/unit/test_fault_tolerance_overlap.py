"""Fault tolerance's step crosses groups as little as HSDP and never blocks the host inside the
backward: FSDP's all-reduce hooks on a fake torchft Manager (`tests.replica_fakes`), on real FSDP
units in a one-rank world against HSDP's own all-reduce.

    python -m pytest -q tests/unit/test_fault_tolerance_overlap.py

  - the layouts are compared once per quorum, before the forward (asynchronous quorum: at the first
    crossing), and the hooks read nothing on the host; a new quorum, or a step that did not
    commit, compares again;
  - N micro-batches cross groups once per step (one collective per FSDP unit) and give HSDP's
    gradients bit for bit: fp32, pure bf16 parameters with fp32 reduction, and bf16 reduction;
    the hooks' buffers (fp32 under bf16 parameters) are held until their backward is over.

(The semi-synchronous syncs: tests/unit/test_semi_sync.py.)
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tests.helpers import HostReads, leave_world
from tests.replica_fakes import LAYOUT, OTHER, FakeManager, peer, replica_groups
from torchmoe.config.errors import ConfigError

# Bytes of the two small collectives of a step of `replica_groups` (group_size 2, positions of
# 3 numbers): the layouts (int64: present, committed, codes) and `reduce`'s (float64: loss, then
# a row per group of header, hook calls and elements, position).
COMPARE_BYTES = 2 * (2 + len(LAYOUT.codes())) * 8
SMALL_BYTES = (1 + 2 * (2 + len(LAYOUT.codes()) + 2 + 3)) * 8


def _hooked_step(groups, shards: list[torch.Tensor], *, commit: bool = True) -> dict:
    """One step of one micro-batch whose FSDP units reduced `shards`; returns its report."""
    groups.begin_step()
    groups.set_requires_all_reduce(True)
    for unit, shard in enumerate(shards):
        groups._average_in_backward(unit, shard)
    groups.reduce(torch.tensor(1.0), None, lambda: pytest.fail("averaged after the backward too"), [1.0, 2.0, 3.0])
    assert groups.commit(1) == commit
    return groups.take_report()


@pytest.mark.parametrize("async_quorum", [False, True])
def test_layouts_are_compared_once_per_quorum_and_the_hooks_read_nothing_else(async_quorum: bool) -> None:
    """The first hook of a quorum's first step compares the layouts (one read on the host); the
    hooks of its later steps read nothing and cross only the gradients."""
    manager = FakeManager(peer(LAYOUT, 1, hook=(2.0, 6.0)))
    groups = replica_groups(manager, async_quorum=async_quorum)
    groups.attached = True  # as `attach` leaves it: FSDP's hooks call `_average_in_backward`
    grad_bytes = 6 * 4
    for quorum, compares in ((1, True), (1, False), (1, False), (2, True), (2, False)):
        manager._quorum_id = quorum
        groups.begin_step()
        shard = torch.full((4,), 2.0)
        reads = HostReads()
        with reads.counting():
            groups.set_requires_all_reduce(True)
            groups._average_in_backward(0, shard)  # the peer's shard is zeros here: the mean is half
            groups._average_in_backward(1, torch.ones(2))
        assert dict(reads.counts) == ({"tolist": 1} if compares else {}), (quorum, reads.counts)
        assert shard.tolist() == [1.0] * 4
        loss, _ = groups.reduce(torch.tensor(1.0), None, lambda: pytest.fail("averaged twice"), [1.0, 2.0, 3.0])
        assert loss.item() == 2.0 and groups.commit(1)
        report = groups.take_report()  # the layouts, the two units, the small collective
        assert report["ft_collectives"] == 3 + compares
        assert report["ft_bytes"] == compares * COMPARE_BYTES + grad_bytes + SMALL_BYTES
    # A step that does not commit (it may have failed in the comparison): the next one compares.
    manager.commits = False
    assert _hooked_step(groups, [torch.ones(4), torch.ones(2)], commit=False)["ft_collectives"] == 3
    manager.commits = True
    report = _hooked_step(groups, [torch.ones(4), torch.ones(2)])
    assert report["ft_collectives"] == 4 and report["ft_bytes"] == COMPARE_BYTES + grad_bytes + SMALL_BYTES


@pytest.mark.parametrize("attached", [True, False])
def test_a_group_of_another_layout_in_a_new_quorum_stops_before_any_gradient_crosses(attached: bool) -> None:
    """The comparison is the first collective of the quorum's first step, whether FSDP's hooks
    average the gradients (its first hook) or they are averaged after the backward (`reduce`):
    groups of the two kinds line up."""
    manager = FakeManager(peer(LAYOUT, 1, hook=(float(attached), 3.0 * attached)))
    groups = replica_groups(manager)
    groups.attached = attached

    def step() -> None:
        groups.begin_step()
        if attached:
            groups.set_requires_all_reduce(True)
            groups._average_in_backward(0, torch.ones(3))
        groups.reduce(torch.tensor(1.0), None, lambda: [torch.ones(3)], [1.0, 2.0, 3.0])
        assert groups.commit(1)

    step()
    assert groups.take_report()["ft_collectives"] == 3  # the layouts, the gradients, the small collective
    # Another quorum, with a group of another layout that committed more steps here: this one is
    # the later of the two, and stops.
    manager.other, manager._quorum_id = peer(OTHER, 1, committed=5), 2
    with pytest.raises(ConfigError, match="replica group 1 runs llama4/debugmodel"):
        step()
    assert groups.take_report()["ft_collectives"] == 1  # the comparison only


def test_groups_whose_hooks_crossed_other_buffers_stop() -> None:
    groups = replica_groups(FakeManager(peer(LAYOUT, 1, hook=(1.0, 4.0))))
    groups.attached = True
    groups.begin_step()
    groups.set_requires_all_reduce(True)
    groups._average_in_backward(0, torch.ones(4))
    groups._average_in_backward(1, torch.ones(2))
    with pytest.raises(RuntimeError, match="group 1 reduced 1 gradient buffers of 4 elements.*this group 2 of 6"):
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])


def test_a_unit_that_reduced_in_an_earlier_micro_batch_but_not_the_last_is_an_error() -> None:
    groups = replica_groups(FakeManager(peer(LAYOUT, 1)))
    groups.attached = True
    groups.begin_step()
    groups.set_requires_all_reduce(False)
    groups._average_in_backward(0, torch.ones(4))
    groups._average_in_backward(1, torch.ones(2))
    groups.set_requires_all_reduce(True)
    groups._average_in_backward(1, torch.ones(2))
    with pytest.raises(RuntimeError, match=r"FSDP units \[0\] reduced gradients in an earlier micro-batch"):
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])


def test_torchfts_manager_keeps_its_quorums_id() -> None:
    """`fault_tolerance._quorum_id` reads torchft's private ``Manager._quorum_id``: set at the
    start, and by the quorum's thread whenever the lighthouse gives another id."""
    from torchft.manager import Manager

    assert "self._quorum_id = -1" in inspect.getsource(Manager.__init__)
    assert "self._quorum_id = quorum_id" in inspect.getsource(Manager._async_quorum)


# ---- real FSDP units in a one-rank world -------------------------------------------------------


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    leave_world()


def _sharded(model: nn.Sequential, mesh, mp: MixedPrecisionPolicy) -> nn.Sequential:
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def _micro_batches(model: nn.Module, n: int, before_each) -> None:
    """`n` micro-batches' forward and backward, `before_each(last)` before each."""
    inputs = torch.randn(n, 4, 8, generator=torch.Generator().manual_seed(1))
    for i in range(n):
        before_each(i == n - 1)
        model(inputs[i].to(next(model.parameters()).dtype)).float().square().sum().backward()


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(("param_dtype", "reduce_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_micro_batches_cross_groups_once_per_step_with_hsdps_gradients(world, n: int, param_dtype, reduce_dtype):
    """FSDP units of `param_dtype` parameters reducing in `reduce_dtype`, with their hooks on a
    peer that sent this rank's own gradients (so the mean is them), against HSDP (replicate 1 x
    shard 1) deferring its all-reduce to the last micro-batch: equal gradients, to the bit, and
    one collective per unit and step. The hooks' buffers are in the reduce dtype and held until
    the end of their backward."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)).to(param_dtype)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    hsdp = _sharded(copy.deepcopy(model), init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")), mp)
    _micro_batches(hsdp, n, hsdp.set_requires_all_reduce)
    ft = _sharded(model, init_device_mesh("cpu", (1,)), mp)
    groups = replica_groups(FakeManager(peer(LAYOUT, 1, hook=(3.0, 484.0), gradients=torch.clone)))
    assert groups.attach([ft])
    held = []

    def before_each(last: bool) -> None:
        held.append([(buffer.dtype, buffer.numel()) for buffer, _ in groups._held])
        groups.set_requires_all_reduce(last)
        assert groups._held == []  # let go once the backward that used them is over

    groups.begin_step()
    _micro_batches(ft, n, before_each)
    held.append([(buffer.dtype, buffer.numel()) for buffer, _ in groups._held])
    groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    assert groups.commit(1)
    units = [(reduce_dtype, 16 * 4 + 4), (reduce_dtype, 16 * 16 + 16), (reduce_dtype, 8 * 16 + 16)]  # backward order
    assert held == [[], *[units] * n]
    for (name, got), want in zip(ft.named_parameters(), hsdp.parameters(), strict=True):
        assert got.grad.dtype == param_dtype and torch.equal(got.grad.to_local(), want.grad.to_local()), name
    report = groups.take_report()
    grad_bytes = 484 * torch.finfo(reduce_dtype).bits // 8
    assert (report["ft_collectives"], report["ft_bytes"]) == (3 + 2, COMPARE_BYTES + grad_bytes + SMALL_BYTES)
