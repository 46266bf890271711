"""Parallel degrees and the rank layout they imply (the DeviceMesh built from it is
`torchmoe.distributed.mesh`'s).

    python -c "from torchmoe.plan.parallel_dims import ParallelDims as P; \\
        print(P(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1, world_size=8).layout()['tp'].groups())"

Ranks are numbered row-major over ``pp, dp_replicate, dp_shard, cp, tp`` (tp innermost, so a TP
group is a run of consecutive ranks: one node's fast interconnect). Every dim and view is a list
of axes ``(size, stride)`` over the global rank numbers, outermost first; a rank's group along
a dim is every rank that differs from it only along those axes. `mesh_layout` is the one place
that says so: the dry-run printer reads groups from it, and `torchmoe.distributed.mesh.build_mesh` checks the
real DeviceMesh against it on every rank, so what is printed is what runs.

Views (DESIGN §4):
    batch        dp_replicate x dp_shard          data loading (distinct samples)
    loss         dp_replicate x dp_shard x cp     loss and token-count reduction
    dp_shard_cp  dp_shard x cp                    FSDP of dense parameters
    ep           innermost ep ranks of the expert region          routed-expert sharding
    efsdp        the rest of the expert region                    FSDP of routed experts

The expert region is ``dp_shard x cp x tp`` when EP is on (EP borrows ranks from TP first, as the
innermost ranks, so an EP group stays inside a node as long as it can) and ``dp_shard x cp`` when
``ep == 1`` (then experts are tensor-parallel over tp, and efsdp coincides with dp_shard_cp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchmoe.config.degrees import resolve_degrees
from torchmoe.config.job_config import Parallelism

# The world mesh's dims, outermost first (DESIGN §4).
MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Views made by flattening adjacent world dims.
FLAT_VIEWS: dict[str, tuple[str, ...]] = {
    "batch": ("dp_replicate", "dp_shard"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}
# Every name `mesh_layout` and `ParallelMesh` answer to, in printing order.
ALL_NAMES: tuple[str, ...] = MESH_DIMS + ("dp_shard_cp", "ep", "efsdp", "batch", "loss")
# Degree keys as `config.degrees.resolve_degrees` returns them.
DEGREE_KEYS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


@dataclass(frozen=True)
class DimLayout:
    """Where one named dim or view lies in the rank space.

    Attributes:
        name: the dim or view name.
        sizes: sizes of its axes, outermost first (a world dim has one axis; views may have more).
        strides: the rank distance between neighbours along each axis.
    """

    name: str
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def size(self) -> int:
        """Ranks per group."""
        return math.prod(self.sizes)

    def coordinate(self, rank: int) -> int:
        """`rank`'s index within its group (its local rank on this dim)."""
        index = 0
        for size, stride in zip(self.sizes, self.strides):
            index = index * size + (rank // stride) % size
        return index

    def members(self, rank: int) -> GroupMembers:
        """`rank`'s group as a lazy sequence (each member computed on access): a group of a
        billion ranks costs nothing until it is listed."""
        return GroupMembers(self, rank)

    def member(self, rank: int, index: int) -> int:
        """The member of local rank `index` in `rank`'s group, in O(axes)."""
        member = rank - sum((rank // stride) % size * stride for size, stride in zip(self.sizes, self.strides))
        for size, stride in reversed(list(zip(self.sizes, self.strides))):  # the last axis varies fastest
            index, i = divmod(index, size)
            member += i * stride
        return member

    def group(self, rank: int) -> list[int]:
        """The ranks of `rank`'s group, in local-rank order."""
        base = rank - sum((rank // stride) % size * stride for size, stride in zip(self.sizes, self.strides))
        members = [base]
        for size, stride in zip(self.sizes, self.strides):
            members = [m + i * stride for m in members for i in range(size)]
        return members

    def groups(self, world_size: int) -> list[list[int]]:
        """Every group of the world, ordered by lowest rank (O(world_size))."""
        return [self.group(r) for r in range(world_size) if self.coordinate(r) == 0]


class GroupMembers(Sequence):
    """The ranks of one group in local-rank order, computed on access (`DimLayout.members`)."""

    def __init__(self, dim: DimLayout, rank: int) -> None:
        self.dim, self.rank = dim, rank

    def __len__(self) -> int:
        return self.dim.size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self.dim.member(self.rank, index % len(self))


def mesh_layout(degrees: Mapping[str, int]) -> dict[str, DimLayout]:
    """The rank layout of every world dim and view, for resolved degrees.

    Args:
        degrees: ``pp, dp_replicate, dp_shard, cp, tp, ep`` (dp_shard already resolved, not -1).
    Returns:
        ``{name: DimLayout}`` for every name in `ALL_NAMES`; size-1 dims are included.
    """
    sizes = [degrees[d] for d in MESH_DIMS]
    # Row-major strides: a dim's stride is the product of the sizes inside it.
    stride = {d: math.prod(sizes[i + 1 :]) for i, d in enumerate(MESH_DIMS)}
    layout = {d: DimLayout(d, (degrees[d],), (stride[d],)) for d in MESH_DIMS}
    for view, dims in FLAT_VIEWS.items():
        layout[view] = DimLayout(view, tuple(degrees[d] for d in dims), tuple(stride[d] for d in dims))
    # The expert region is contiguous in rank space (its dims are the innermost ones), so ep and
    # efsdp are single axes: ep the innermost ep ranks (above the etp ranks), efsdp the rest.
    ep, etp = degrees["ep"], expert_tp_degree(degrees)
    region = degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    layout["ep"] = DimLayout("ep", (ep,), (etp,))
    layout["efsdp"] = DimLayout("efsdp", (region // (ep * etp),), (ep * etp,))
    return layout


def expert_tp_degree(degrees: Mapping[str, int]) -> int:
    """TP degree of routed experts: tp when ``ep == 1`` (MoE TP), else 1 (EP borrows tp's ranks)."""
    return degrees["tp"] if degrees["ep"] == 1 else 1


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Resolved parallel degrees of a job on `world_size` ranks.

    Construct with `from_config` (resolves ``data_parallel_shard_degree = -1``) or directly with
    every degree; either way the degrees are checked against the world size.
    """

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world_size: int

    def __post_init__(self) -> None:
        # The same checks (and messages, with the arithmetic) as config validation, so a
        # ParallelDims built by hand can never hold a layout the config would have rejected.
        if resolve_degrees(_as_parallelism(self.degrees), self.world_size) != self.degrees:
            raise ValueError(f"ParallelDims takes resolved degrees, got dp_shard={self.dp_shard}; "
                             "use ParallelDims.from_config to resolve -1")

    @classmethod
    def from_config(cls, parallelism_cfg: Parallelism, world_size: int) -> ParallelDims:
        """From a `config.job_config.Parallelism` section, resolving -1 against `world_size`."""
        return cls(**resolve_degrees(parallelism_cfg, world_size), world_size=world_size)

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def degrees(self) -> dict[str, int]:
        """``{pp, dp_replicate, dp_shard, cp, tp, ep}``, as `mesh_layout` takes them."""
        return {k: getattr(self, k) for k in DEGREE_KEYS}

    @property
    def dp(self) -> int:
        """Data-parallel ranks: distinct batches (the `batch` view)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """FSDP group size of dense parameters."""
        return self.dp_shard * self.cp

    @property
    def etp(self) -> int:
        """TP degree of routed experts (tp under MoE TP, 1 under EP)."""
        return expert_tp_degree(self.degrees)

    @property
    def efsdp(self) -> int:
        """FSDP group size of routed experts: the expert region over ep (and etp).

        ``dp_shard * cp * tp / ep`` under EP; ``dp_shard * cp`` when ``ep == 1`` (the experts'
        TP ranks hold different shards, so they are not part of the FSDP group).
        """
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    # ---- what is on -----------------------------------------------------------------------

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def moe_tp_enabled(self) -> bool:
        """Routed experts are tensor-parallel (tp > 1 and no EP)."""
        return self.tp > 1 and self.ep == 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 is applied: some parameters have more than one shard holder.

        Dense parameters shard over dp_shard_cp and experts over efsdp; efsdp can exceed 1 with
        dp_shard_cp == 1 (EP smaller than the TP it borrows), and its replicas still need FSDP.
        """
        return self.dp_shard_cp > 1 or self.efsdp > 1

    @property
    def hsdp_enabled(self) -> bool:
        """FSDP within replicas plus replication across dp_replicate."""
        return self.fsdp_enabled and self.dp_replicate_enabled

    @property
    def ddp_enabled(self) -> bool:
        """Plain replication (no FSDP) across dp_replicate."""
        return self.dp_replicate_enabled and not self.fsdp_enabled

    @property
    def mp_policy_enabled(self) -> bool:
        """FSDP2/HSDP or DDP is applied, and with it a ``MixedPrecisionPolicy`` that casts the
        parameters to ``training.mixed_precision_param`` for compute (DDP's ``replicate`` is
        FSDP-based and casts too). Without one, the forward runs under ``torch.autocast``."""
        return self.fsdp_enabled or self.ddp_enabled

    @property
    def dense_fsdp_dims(self) -> tuple[str, ...]:
        """Mesh names to pass to ``fully_shard`` for dense parameters (2-D = HSDP)."""
        return ("dp_replicate", "dp_shard_cp") if self.dp_replicate_enabled else ("dp_shard_cp",)

    @property
    def expert_fsdp_dims(self) -> tuple[str, ...]:
        """Mesh names to pass to ``fully_shard`` for routed experts (2-D = HSDP)."""
        return ("dp_replicate", "efsdp") if self.dp_replicate_enabled else ("efsdp",)

    # ---- layout ---------------------------------------------------------------------------------

    def layout(self) -> dict[str, DimLayout]:
        """`mesh_layout` of these degrees."""
        return mesh_layout(self.degrees)


def _as_parallelism(degrees: Mapping[str, int]) -> Parallelism:
    """A `[parallelism]` section holding exactly these degrees."""
    return Parallelism(
        pipeline_parallel_degree=degrees["pp"],
        data_parallel_replicate_degree=degrees["dp_replicate"],
        data_parallel_shard_degree=degrees["dp_shard"],
        context_parallel_degree=degrees["cp"],
        tensor_parallel_degree=degrees["tp"],
        expert_parallel_degree=degrees["ep"],
    )
