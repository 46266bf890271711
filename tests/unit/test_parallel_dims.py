"""The pure rank layout: groups, coordinates and views for hand-checked layouts.

    python -m pytest -q tests/unit/test_parallel_dims.py
"""

from __future__ import annotations

import pytest

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Parallelism
from torchmoe.plan.parallel_dims import ALL_NAMES, MESH_DIMS, ParallelDims, mesh_layout


def dims(world_size: int, **degrees: int) -> ParallelDims:
    full = dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1) | degrees
    return ParallelDims(**full, world_size=world_size)


def groups(d: ParallelDims) -> dict[str, list[list[int]]]:
    layout = d.layout()
    return {name: layout[name].groups(d.world_size) for name in ALL_NAMES}


def test_pp2_dp_shard2_tp2():
    g = groups(dims(8, pp=2, dp_shard=2, tp=2))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["cp"] == g["dp_replicate"] == [[r] for r in range(8)]
    # Views without cp / dp_replicate reduce to dp_shard; ep == 1 makes efsdp the dense FSDP group.
    assert g["dp_shard_cp"] == g["batch"] == g["loss"] == g["efsdp"] == g["dp_shard"]
    assert g["ep"] == [[r] for r in range(8)]


def test_hsdp_dp_replicate2_dp_shard2():
    g = groups(dims(4, dp_replicate=2, dp_shard=2))
    assert g["dp_replicate"] == [[0, 2], [1, 3]]
    assert g["dp_shard"] == g["dp_shard_cp"] == [[0, 1], [2, 3]]
    assert g["batch"] == g["loss"] == [[0, 1, 2, 3]]


def test_cp_views():
    g = groups(dims(8, dp_shard=2, cp=2, tp=2))
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp_shard_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["loss"] == g["dp_shard_cp"]
    assert g["batch"] == g["dp_shard"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_ep_spans_tp_first():
    # ep4 over dp_shard4 x tp2: each EP group is 2 TP groups (innermost ranks), efsdp the rest.
    g = groups(dims(8, dp_shard=4, tp=2, ep=4))
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["efsdp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_ep_inside_tp_and_across_cp():
    g = groups(dims(8, dp_shard=2, tp=4, ep=2))
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["efsdp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    g = groups(dims(8, dp_shard=2, cp=2, tp=2, ep=4))
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # tp then cp
    assert g["efsdp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("degrees", [
    dict(dp_shard=4, tp=2, ep=4),
    dict(dp_shard=2, tp=4, ep=2),
    dict(dp_replicate=2, dp_shard=2, tp=2, ep=2),
    dict(pp=2, dp_shard=2, cp=2, tp=2, ep=8),
    dict(dp_shard=4, tp=2, ep=1),
])
def test_efsdp_is_complement_of_ep_in_expert_region(degrees):
    world = 1
    for d in MESH_DIMS:
        world *= degrees.get(d, 1)
    d = dims(world, **degrees)
    layout = d.layout()
    assert layout["efsdp"].size == d.efsdp and layout["ep"].size == d.ep
    for rank in range(world):
        ep, efsdp = layout["ep"].group(rank), layout["efsdp"].group(rank)
        assert set(ep) & set(efsdp) == {rank}
        # ep x efsdp tiles the expert region: dp_shard x cp x tp under EP, dp_shard x cp without.
        product = {x for e in ep for x in layout["efsdp"].group(e)}
        region = set(layout["dp_shard_cp"].group(rank))
        if d.ep_enabled:
            region = {x for r in region for x in layout["tp"].group(r)}
        assert product == region and len(product) == d.ep * d.efsdp


def test_every_name_partitions_the_world():
    d = dims(16, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4)
    for name, layout in d.layout().items():
        gs = layout.groups(16)
        assert sorted(r for g in gs for r in g) == list(range(16)), name
        assert all(len(g) == layout.size for g in gs), name


def test_coordinates_match_row_major_rank_numbering():
    d = dims(16, pp=2, dp_replicate=2, dp_shard=2, tp=2)
    layout = d.layout()
    for rank in range(16):
        coords = [layout[n].coordinate(rank) for n in MESH_DIMS]
        rebuilt = 0
        for n, c in zip(MESH_DIMS, coords):
            rebuilt = rebuilt * getattr(d, n) + c
        assert rebuilt == rank
        for name in ALL_NAMES:
            assert layout[name].group(rank)[layout[name].coordinate(rank)] == rank
            assert list(layout[name].members(rank)) == layout[name].group(rank)  # the lazy form agrees


def test_views_are_row_major_over_their_dims():
    layout = dims(16, dp_replicate=2, dp_shard=2, cp=2, tp=2).layout()
    # rank 13 = (dp_replicate 1, dp_shard 1, cp 0, tp 1)
    assert layout["loss"].group(13) == [1, 3, 5, 7, 9, 11, 13, 15]
    assert layout["loss"].coordinate(13) == 6  # (1 * 2 + 1) * 2 + 0
    assert layout["batch"].group(13) == [1, 5, 9, 13]
    assert layout["batch"].coordinate(13) == 3


def test_large_world_is_cheap():
    layout = mesh_layout(dict(pp=1, dp_replicate=1, dp_shard=128, cp=1, tp=8, ep=8))
    assert layout["dp_shard"].group(1023) == list(range(7, 1024, 8))
    assert layout["ep"].group(1023) == list(range(1016, 1024))
    assert layout["efsdp"].size == 128


def test_properties():
    d = dims(64, dp_replicate=2, dp_shard=4, tp=8, ep=8)
    assert (d.dp, d.dp_shard_cp, d.efsdp, d.etp) == (8, 4, 4, 1)
    assert d.hsdp_enabled and d.fsdp_enabled and d.ep_enabled and not d.moe_tp_enabled
    assert d.dense_fsdp_dims == ("dp_replicate", "dp_shard_cp")
    assert d.expert_fsdp_dims == ("dp_replicate", "efsdp")
    d = dims(16, dp_shard=2, tp=8)
    assert d.moe_tp_enabled and d.etp == 8 and d.efsdp == 2
    assert dims(4, dp_replicate=4).ddp_enabled
    d = dims(8, tp=4, ep=2, dp_shard=2)
    assert d.efsdp == 4  # dp_shard(2) * tp(4) / ep(2)
    d = dims(4, tp=4, ep=2)
    assert d.efsdp == 2 and d.fsdp_enabled and d.dp_shard_cp == 1  # experts still need FSDP


def test_from_config_resolves_fill():
    d = ParallelDims.from_config(Parallelism(tensor_parallel_degree=8, expert_parallel_degree=8), 1024)
    assert (d.dp_shard, d.tp, d.ep, d.efsdp) == (128, 8, 8, 128)


def test_errors_show_the_arithmetic():
    arithmetic = r"dp_replicate\(2\) \* dp_shard\(4\) \* cp\(1\) \* tp\(3\) \* pp\(1\) = 24 != WORLD_SIZE\(16\)"
    with pytest.raises(ConfigError, match=arithmetic):
        dims(16, dp_replicate=2, dp_shard=4, tp=3)
    with pytest.raises(ConfigError, match=r"dp_shard\(4\) \* cp\(1\) \* tp\(2\) = 8"):
        dims(8, dp_shard=4, tp=2, ep=3)
    with pytest.raises(ValueError, match="resolved"):
        dims(8, dp_shard=-1, tp=2)
