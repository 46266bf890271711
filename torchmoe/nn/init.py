"""Layout-independent weight initialisation: every layout that starts from one seed holds the same
full weights, bit for bit in fp32, on CPU or CUDA.

    python -c "import torch; from torchmoe.models.llama4 import FLAVORS, Transformer; \\
        m = Transformer(FLAVORS['tiny']); m.init_weights(seed=0); print(m.output.weight.std())"

A model declares per parameter how its values are drawn (`TruncNormal`, `Normal`, `Constant`, `Uniform`),
keyed by the parameter's name; `init_parameters` applies the declarations. The full values of a
parameter depend on (seed, its name, its distribution) alone:

- The full tensor is seen as rows: all dims but the last flattened into one (a 1-D tensor's
  elements are rows of one value). Rows are drawn in chunks of `rows_per_chunk(shape)` rows
  (~1 M values), a number computed from the full shape only.
- Chunk c comes from a CPU `torch.Generator` seeded with a stable hash of (seed, name, c), so it
  is the same wherever it is drawn, and the same on CPU and CUDA (drawn on the host, then copied).
  Drawing per chunk matters for `trunc_normal_`, whose values depend on how many are drawn at once.
- A rank draws only the chunks holding rows of its shard (its box in the full tensor, from the
  DTensor's mesh and placements), keeps its columns and copies them into its local tensor. A plain
  tensor is the one-rank case: its shard is the whole tensor.

Cost: an FSDP rank draws about its share of rows (rounded up to whole chunks). A rank holding a
column shard (TP ``Shard(1)``, e.g. ``wo`` and ``w2``) draws every row of its row range and keeps
its columns: tp times its share. Row shards of 3-D expert weights (EP ``Shard(0)``, FSDP on the
hidden dim) are rows of the flattened view, so a rank draws only the chunks of its experts' rows.
Parameters of at most one chunk are drawn whole by every rank holding part of them: for bench256
(largest parameter 1 M values) every rank draws the whole model, 15 M values in ~0.2 s on one core.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchmoe import _torch_private as private

# Values per drawn chunk: large enough that per-chunk overhead (a generator, a slice) is noise,
# small enough (4 MiB of fp32) that a rank with a small shard draws little beyond it.
CHUNK_VALUES = 1 << 20
# FSDP's placement of a dim sharded twice (TP, then FSDP on the same dim).
_STRIDED_SHARD = private.strided_shard_type()


@dataclass(frozen=True)
class TruncNormal:
    """``nn.init.trunc_normal_``: normal(mean, std) truncated to [a, b] (absolute bounds, as torch)."""

    std: float
    mean: float = 0.0
    a: float = -2.0
    b: float = 2.0

    def sample_(self, out: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.trunc_normal_(out, mean=self.mean, std=self.std, a=self.a, b=self.b, generator=generator)


@dataclass(frozen=True)
class Normal:
    """``nn.init.normal_``: normal(mean, std)."""

    std: float
    mean: float = 0.0

    def sample_(self, out: torch.Tensor, generator: torch.Generator) -> None:
        out.normal_(self.mean, self.std, generator=generator)


@dataclass(frozen=True)
class Constant:
    """Every value equal to `value` (ones for norm weights); nothing is drawn."""

    value: float


@dataclass(frozen=True)
class Uniform:
    """``uniform_(-bound, bound)``: PEFT's LoRA A init, ``kaiming_uniform_(a=sqrt(5))``, is
    ``Uniform(1 / sqrt(fan_in))``."""

    bound: float

    def sample_(self, out: torch.Tensor, generator: torch.Generator) -> None:
        out.uniform_(-self.bound, self.bound, generator=generator)


ONES = Constant(1.0)
ParamInit = TruncNormal | Normal | Constant | Uniform


def prefixed(prefix: str, inits: dict[str, ParamInit]) -> dict[str, ParamInit]:
    """A submodule's declarations under its name in the parent module."""
    return {f"{prefix}.{name}": init for name, init in inits.items()}


def init_parameters(module: nn.Module, inits: dict[str, ParamInit], *, seed: int) -> None:
    """Fill every parameter of `module` from its declaration in `inits`, in place.

    Args:
        module: materialised (``to_empty``) parameters, plain tensors or DTensors of any layout.
        inits: parameter name (relative to `module`, without wrapper prefixes such as activation
            checkpointing's or torch.compile's) -> its distribution. Must name every parameter.
        seed: the job's seed (``training.seed``).
    """
    params = {name: module.get_parameter(name) for name in inits}
    undeclared = {id(p) for p in module.parameters()} - {id(p) for p in params.values()}
    if undeclared:
        names = [n for n, p in module.named_parameters() if id(p) in undeclared]
        raise ValueError(f"parameters without a declared initialisation: {names}")
    fill_parameters(module, inits, seed=seed)


def fill_parameters(module: nn.Module, inits: dict[str, ParamInit], *, seed: int) -> None:
    """Fill the parameters `inits` names (some of `module`'s, e.g. its LoRA adapters after the
    base weights were loaded) as `init_parameters` does, in place."""
    with torch.no_grad():
        for name, init in inits.items():
            local, global_shape, offset = shard_box(module.get_parameter(name))
            fill_shard_(local, init, seed=seed, name=name, global_shape=global_shape, offset=offset)


def shard_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's local tensor of `param`, the full shape, and the local tensor's offset in it.

    A DTensor's shard must be one box of the full tensor (a contiguous range per dim). It is for
    every ``Shard`` / ``Replicate`` composition and for ``_StridedShard`` as FSDP makes it over TP
    or EP (sharding the already-sharded dim again); other strided layouts are refused.
    """
    if not isinstance(param, DTensor):
        return param, tuple(param.shape), (0,) * param.dim()
    mesh, placements = param.device_mesh, param.placements
    check_box_layout(placements, mesh.shape)
    local = param.to_local()
    shape, offset = private.local_shape_and_offset(param.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"local shard {tuple(local.shape)} is not the expected {tuple(shape)} of "
                         f"{tuple(param.shape)} under {placements}")
    return local, tuple(param.shape), tuple(offset)


def check_box_layout(placements, mesh_shape: tuple[int, ...]) -> None:
    """Refuse placements whose local shard is strided in the full tensor.

    ``_StridedShard(d, split_factor=k)`` on a mesh dim followed by plain ``Shard(d)`` on later mesh
    dims of total size k (FSDP over a TP/EP-sharded dim) gives each rank one contiguous range of
    dim d; anything else along d (a strided shard applied after another shard) is a strided set.
    """
    for i, p in enumerate(placements):
        if not isinstance(p, _STRIDED_SHARD):
            continue
        others = [j for j, q in enumerate(placements)
                  if j != i and isinstance(q, (Shard, _STRIDED_SHARD)) and q.dim == p.dim]
        if any(j < i or isinstance(placements[j], _STRIDED_SHARD) for j in others) or (
                math.prod(mesh_shape[j] for j in others) != p.split_factor):
            raise ValueError(f"layout-independent init needs a contiguous shard per dim, not {placements}")


def rows_per_chunk(shape: tuple[int, ...]) -> int:
    """Rows drawn together for a parameter of full `shape`: about `CHUNK_VALUES` values."""
    row = shape[-1] if len(shape) > 1 else 1
    return max(1, CHUNK_VALUES // max(row, 1))


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """A stable 63-bit generator seed for chunk `chunk` of parameter `name` (not Python's salted
    `hash`, so every process and every run agrees)."""
    digest = hashlib.blake2b(f"{seed}\x00{name}\x00{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def fill_shard_(local: torch.Tensor, init: ParamInit, *, seed: int, name: str, global_shape: tuple[int, ...],
                offset: tuple[int, ...]) -> None:
    """Write into `local` its part of parameter `name`'s full values.

    Args:
        local: the shard, any device and float dtype, located at `offset` in the full tensor of
            `global_shape` (the whole tensor: offset zeros, ``local.shape == global_shape``).
    """
    if local.numel() == 0:
        return
    if isinstance(init, Constant):
        local.fill_(init.value)
        return
    lead, row_len = (global_shape[:-1], global_shape[-1]) if len(global_shape) > 1 else (global_shape, 1)
    lead_offset, lead_local = offset[: len(lead)], local.shape[: len(lead)]
    cols = slice(offset[-1], offset[-1] + local.shape[-1]) if len(global_shape) > 1 else slice(0, 1)
    rows = _flat_rows(lead, lead_offset, lead_local)  # (local rows,) increasing full-tensor row ids
    local_rows = local.view(rows.numel(), -1)  # (local rows, local columns), a view: writes land in `local`
    n_rows, per_chunk = torch.Size(lead).numel(), rows_per_chunk(global_shape)
    chunk_of = rows // per_chunk
    chunks = torch.unique_consecutive(chunk_of)
    starts = torch.searchsorted(chunk_of, chunks).tolist() + [rows.numel()]
    for c, start, end in zip(chunks.tolist(), starts, starts[1:]):
        first = c * per_chunk
        drawn = torch.empty(min(per_chunk, n_rows - first), row_len, dtype=torch.float32)
        init.sample_(drawn, torch.Generator().manual_seed(chunk_seed(seed, name, c)))
        local_rows[start:end].copy_(drawn[:, cols].index_select(0, rows[start:end] - first))


def _flat_rows(lead: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    """Row-major flat indices (in the full `lead` shape) of the box `offset` + `size`, increasing.
    E.g. lead (4, 6), offset (1, 2), size (2, 3): rows 8, 9, 10, 14, 15, 16."""
    index = torch.zeros((), dtype=torch.int64)
    for full, start, n in zip(lead, offset, size):
        index = index.unsqueeze(-1) * full + torch.arange(start, start + n)
    return index.reshape(-1)
