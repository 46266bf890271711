"""The real DeviceMesh forms exactly the groups `mesh_layout` (and so the dry run) reports.

    python -m pytest -q tests/distributed/test_mesh_groups.py

Launches one CPU/gloo world of 8 ranks with torchrun; every rank builds the mesh for each layout
below and records, for every dim and view, its group members as the DeviceMesh sees them, the
members of the process group behind it, its local rank, and an all-reduce over that group (so
the groups are real and usable, not just bookkeeping). The test compares all of it with the pure
layout function.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record

WORLD = 8
# (label, degrees): pp2 x dp_shard2 x tp2; EP spanning TP (ep4 over dp_shard4 x tp2); MoE TP
# (ep1, tp2); HSDP with EP equal to TP; EP spanning TP and CP.
LAYOUTS = {
    "pp2_dps2_tp2": dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1),
    "dps4_tp2_ep4": dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=4),
    "dps4_tp2_moetp": dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=1),
    "dpr2_dps2_tp2_ep2": dict(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=2, ep=2),
    "dps2_cp2_tp2_ep4": dict(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=2, ep=4),
}


def _worker(out_dir: Path) -> None:
    """Runs on every torchrun rank: build each layout's mesh and dump what it formed."""
    import torch
    import torch.distributed as dist

    from torchmoe.distributed.mesh import build_mesh
    from torchmoe.plan.parallel_dims import ALL_NAMES, ParallelDims

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = {}
    for label, degrees in LAYOUTS.items():
        dims = ParallelDims(**degrees, world_size=WORLD)
        mesh = build_mesh(dims, "cpu")
        per_name = {}
        for name in ALL_NAMES:
            sub = mesh[name]
            value = torch.tensor([rank], dtype=torch.int64)
            dist.all_reduce(value, group=sub.get_group())
            per_name[name] = {
                "members": sub.mesh.tolist(),
                "pg_ranks": dist.get_process_group_ranks(sub.get_group()),
                "local_rank": sub.get_local_rank(),
                "allreduce_sum": int(value.item()),
            }
        # The 2-D meshes FSDP gets for HSDP: rows are replicas, columns the shard group.
        per_name["hsdp_dense"] = mesh[dims.dense_fsdp_dims].mesh.tolist()
        per_name["hsdp_expert"] = mesh[dims.expert_fsdp_dims].mesh.tolist()
        record[label] = per_name
    write_rank_record(out_dir, record)


@pytest.fixture(scope="module")
def mesh_records(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("mesh"), world=WORLD, timeout=180)


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_real_mesh_matches_layout(mesh_records, label):
    from torchmoe.plan.parallel_dims import ALL_NAMES, ParallelDims

    dims = ParallelDims(**LAYOUTS[label], world_size=WORLD)
    layout = dims.layout()
    for rank in range(WORLD):
        seen = mesh_records[rank][label]
        for name in ALL_NAMES:
            group = layout[name].group(rank)
            got = seen[name]
            assert got["members"] == group, (label, rank, name)
            assert got["pg_ranks"] == sorted(group), (label, rank, name)
            assert got["local_rank"] == layout[name].coordinate(rank), (label, rank, name)
            assert got["allreduce_sum"] == sum(group), (label, rank, name)


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_hsdp_meshes_are_replicas_of_shard_groups(mesh_records, label):
    from torchmoe.plan.parallel_dims import ParallelDims

    dims = ParallelDims(**LAYOUTS[label], world_size=WORLD)
    layout = dims.layout()
    for rank in range(WORLD):
        seen = mesh_records[rank][label]
        for key, shard in (("hsdp_dense", "dp_shard_cp"), ("hsdp_expert", "efsdp")):
            if dims.dp_replicate_enabled:
                # Row i: the shard group of replica i that lines up with this rank.
                replicas = layout["dp_replicate"].group(rank)
                assert seen[key] == [layout[shard].group(r) for r in replicas], (label, rank, key)
            else:
                assert seen[key] == layout[shard].group(rank), (label, rank, key)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
