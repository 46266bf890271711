"""Muon's share of a rank's memory and step: its state, its Newton-Schulz FLOPs, its gathers.

    cost = muon_cost(args, dims, cfg.optimizer, units)   # units: the rank's FSDP units (PP)

Pure arithmetic over `ModelArgs` and the layout (no torch), mirroring `components.muon_groups`
(which parameters are Muon's) and `components.muon_distributed` (what a step gathers):

- Muon's parameters (`is_muon`): every block matrix (attention and MLA projections, dense and
  shared-expert MLPs, the MTP projection), routed experts' ``(experts, out, in)`` stacks, the
  router gates with ``muon_router``; not the embedding, the output head, norms, biases, sinks.
  ``muon_params`` / ``adamw_params`` globs override the role as they do in the trainer.
- State: one ``momentum_buffer`` per Muon parameter, sharded like it; AdamW's ``exp_avg`` and
  ``exp_avg_sq`` for the rest (both in the parameters' dtype).
- Newton-Schulz, per whole matrix of r = min(out, in) rows (the wide orientation) and
  c = max(out, in) columns, each of ``ns_steps`` quintic iterations runs three matmuls:

      G = X X^T            (r x c)(c x r)   2 r^2 c
      H = b G + c G G      (r x r)(r x r)   2 r^3
      X = a X + H X        (r x r)(r x c)   2 r^2 c
      flops(matrix) = ns_steps x (4 r^2 c + 2 r^3)

  Every rank that holds a piece of a matrix runs its NS whole (the gather scheme): a dense
  matrix on every rank of its FSDP/TP group, the experts a rank holds after EP (and after
  FSDP of whole experts, which gathers nothing).
- Gathers, per rank and step: for each Muon parameter split n ways with P elements gathered,
  ``b x (n - 1) / n x P`` bytes received (b: bytes of ns_dtype), first over its FSDP dim
  (dp_shard_cp, or efsdp for experts sharded on their hidden dim), then over tp (etp for the
  MoE block's own matrices and the experts).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from dataclasses import dataclass

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.dtypes import DTYPE_BYTES
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.plan.layout import ParamSpec, expert_fsdp_shard_dim, local_shape, param_specs, shard_numel
from torchmoe.plan.parallel_dims import ParallelDims

__all__ = ["MuonCost", "is_muon", "muon_cost", "ns_flops", "optimizer_state_elements"]

ADAMW_STATES = 2  # exp_avg, exp_avg_sq
MUON_STATES = 1  # momentum_buffer


def _has_matrices(spec: ParamSpec) -> bool:
    return len(spec.shape) == (3 if spec.expert else 2)


def is_muon(spec: ParamSpec, cfg: OptimizerConfig) -> bool:
    """Whether Muon optimizes `spec` under `cfg` (`components.muon_groups.muon_split`'s rule)."""
    if any(fnmatch.fnmatchcase(spec.fqn, p) for p in cfg.adamw_params):
        return False
    if any(fnmatch.fnmatchcase(spec.fqn, p) for p in cfg.muon_params):
        return _has_matrices(spec)
    if spec.expert:
        return len(spec.shape) == 3  # (experts, out) biases are AdamW's
    if spec.fqn.endswith("router.gate.weight"):
        return cfg.muon_router
    return len(spec.shape) == 2 and spec.fqn not in ("tok_embeddings.weight", "output.weight")


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of `steps` quintic Newton-Schulz iterations on one (rows, cols) matrix."""
    r, c = min(rows, cols), max(rows, cols)
    return steps * (4 * r * r * c + 2 * r ** 3)


def optimizer_state_elements(specs: Iterable[ParamSpec], dims: ParallelDims, cfg: OptimizerConfig | None) -> int:
    """Optimizer-state elements one rank stores for `specs`: two per stored element under AdamW
    or Adam (`cfg` None too); under Muon one for its parameters and two for AdamW's."""
    muon = cfg is not None and cfg.name == "Muon"
    return sum(shard_numel(s, dims) * (MUON_STATES if muon and is_muon(s, cfg) else ADAMW_STATES) for s in specs)


@dataclass(frozen=True)
class MuonCost:
    """One rank's Muon work per step.

    Attributes:
        ns_flops: Newton-Schulz FLOPs (in ns_dtype).
        muon_stored: stored (sharded) elements of the Muon parameters, for the elementwise passes.
        gathers: (mesh dim, its ranks, all-gather output bytes) per gather, in order.
    """

    ns_flops: int
    muon_stored: int
    gathers: tuple[tuple[str, int, int], ...]

    @property
    def received_bytes(self) -> float:
        """Bytes this rank receives by the gathers: (n - 1) / n of each output."""
        return sum(out * (n - 1) / n for _, n, out in self.gathers)


def _matrices(spec: ParamSpec, dims: ParallelDims) -> tuple[int, tuple[str, int] | None, tuple[str, int] | None]:
    """(whole matrices this rank orthogonalises, the FSDP gather (dim, ranks), the TP gather)."""
    tp = dims.tp if spec.kind == "dense" else dims.etp
    tp_gather = ("tp", tp) if spec.tp_dim is not None and tp > 1 else None
    if not spec.expert:
        fsdp = ("dp_shard_cp", dims.dp_shard_cp) if dims.fsdp_enabled and dims.dp_shard_cp > 1 else None
        return 1, fsdp, tp_gather
    experts = local_shape(spec, dims)[0]
    if not dims.fsdp_enabled or dims.efsdp <= 1:
        return experts, None, tp_gather
    # FSDP of dim 0 (whole experts) leaves each rank its experts whole; of dim 1, gathered.
    shard_dim = expert_fsdp_shard_dim(experts, dims.efsdp) if dims.ep_enabled else 0
    if shard_dim == 0:
        return math.ceil(experts / dims.efsdp), None, tp_gather
    return experts, ("efsdp", dims.efsdp), tp_gather


def muon_cost(args: ModelArgs, dims: ParallelDims, cfg: OptimizerConfig, units: Iterable[str] | None = None) -> MuonCost:
    """Muon's NS FLOPs, stored elements and gathers on one rank holding the FSDP `units`
    (``ParamSpec.fsdp_unit`` names; None: every unit)."""
    keep = None if units is None else set(units)
    b = DTYPE_BYTES[cfg.ns_dtype]
    flops, stored, gathers = 0, 0, []
    for spec in param_specs(args):
        if (keep is not None and spec.fsdp_unit not in keep) or not is_muon(spec, cfg):
            continue
        count, fsdp, tp = _matrices(spec, dims)
        rows, cols = spec.shape[-2:]
        flops += count * ns_flops(rows, cols, cfg.ns_steps)
        stored += shard_numel(spec, dims)
        whole = count * rows * cols
        if fsdp:
            gathers.append((fsdp[0], fsdp[1], b * whole // (tp[1] if tp else 1)))
        if tp:
            gathers.append((tp[0], tp[1], b * whole))
    return MuonCost(flops, stored, tuple(gathers))
