"""The job's DeviceMeshes, built from the planned rank layout (`torchmoe.plan.parallel_dims`).

    mesh = build_mesh(ParallelDims.from_config(cfg.parallelism, world_size), "cuda")
    mesh["tp"], mesh["dp_shard_cp"], mesh["dp_replicate", "efsdp"]      # DeviceMeshes by name

`build_mesh` checks this rank's group along every name against the layout the dry run prints,
so what is printed is what runs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchmoe import _torch_private as private
from torchmoe.config.errors import ConfigError
from torchmoe.config.wording import counted
from torchmoe.plan.parallel_dims import ALL_NAMES, FLAT_VIEWS, MESH_DIMS, DimLayout, ParallelDims

__all__ = ["ParallelMesh", "build_mesh"]


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """Create the real DeviceMeshes (collective: every rank calls this, in the same order).

    The default process group must span `world_size` ranks (``init_device_mesh`` initialises
    it from the torchrun environment when it is not). Creates, in order: the world mesh over
    `MESH_DIMS` (size-1 dims included, so lookups never depend on the degrees), the flattened
    views, and the expert mesh ``(efsdp, ep)`` unflattened from the expert region. Then checks
    this rank's group along every name against `mesh_layout` and raises if they differ.
    """
    if dist.is_initialized() and dist.get_world_size() != dims.world_size:
        raise ConfigError("parallelism", dims.degrees,
                          f"degrees multiply to {dims.world_size} but the launched world has "
                          f"{counted(dist.get_world_size(), 'rank')}",
                          "launch as many ranks as the degrees multiply to")
    world = init_device_mesh(device_type, tuple(getattr(dims, d) for d in MESH_DIMS),
                             mesh_dim_names=MESH_DIMS)
    views = {name: private.flatten_mesh(world[dims], name) for name, dims in FLAT_VIEWS.items()}
    if dims.ep_enabled and dims.tp_enabled:
        region = private.flatten_mesh(world["dp_shard", "cp", "tp"], "dp_shard_cp_tp")
    else:
        # ep == 1 or tp == 1: the expert region is dp_shard x cp, already flattened. (With
        # ep == 1 the efsdp groups equal dp_shard_cp's but get their own process groups.)
        region = views["dp_shard_cp"]
    experts = private.unflatten_mesh(region, 0, (dims.efsdp, dims.ep), ("efsdp", "ep"))
    views["efsdp"], views["ep"] = experts["efsdp"], experts["ep"]
    mesh = ParallelMesh(world, views)
    mesh.check_against(dims.layout())
    return mesh


class ParallelMesh:
    """The job's DeviceMeshes, looked up by name.

    ``mesh["tp"]``, ``mesh["dp_shard_cp"]``, ``mesh["ep"]``, ``mesh["efsdp"]``, ``mesh["batch"]``,
    ``mesh["loss"]`` return 1-D DeviceMeshes; a tuple of names (``mesh["dp_replicate", "efsdp"]``)
    returns the n-D mesh over them (for HSDP), sharing the same process groups.
    """

    def __init__(self, world: DeviceMesh, views: dict[str, DeviceMesh]) -> None:
        self.world = world
        self._views = views

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str):
            return self.world[names] if names in MESH_DIMS else self._views[names]
        if all(n in MESH_DIMS for n in names):
            return self.world[names]
        # Views live beside the world mesh (not inside it), so join their 1-D meshes; this reuses
        # their process groups instead of creating new ones.
        return private.concatenate_meshes([self[n] for n in names])

    def groups(self) -> list[dist.ProcessGroup]:
        """The process group of every named dim and view, each once (views of one size share a
        world dim's group)."""
        return list(dict.fromkeys(self[name].get_group() for name in ALL_NAMES))

    def check_against(self, layout: Mapping[str, DimLayout]) -> None:
        """Raise if this rank's group along any name differs from `layout` (no communication)."""
        rank = self.world.get_rank()
        for name in ALL_NAMES:
            real = self[name].mesh.tolist()
            expected = layout[name].group(rank)
            if real != expected:
                raise RuntimeError(f"rank {rank}: DeviceMesh group of {name!r} is {real}, layout says {expected}")
