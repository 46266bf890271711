"""Muon's share of a rank's memory and step: its state, its Newton-Schulz FLOPs, its gathers.

    cost = muon_cost(args, dims, cfg.optimizer, units)   # units: the rank's FSDP units (PP)

Pure arithmetic over `ModelArgs` and the layout (no torch), mirroring `optim.muon_groups`
(which parameters are Muon's) and `optim.muon_distributed` (what a step gathers):

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
- The step's transient memory (`step_peak_bytes`): `optim.muon` orthogonalises one
  parameter at a time (an expert stack in one batched NS), so the peak is that of its largest
  parameter. Its NS holds at once, at the last matmul of an iteration (X' = a X + H X), the
  whole input, X and X' (r x c each), G and H (r x r each) and the norm, all in ns_dtype:

      peak(param) = p x stored                 the Nesterov update (grad.lerp(buf)), with nesterov
                  + b x count x r x c          a DTensor's whole input, held by `orthogonalize`
                                               through the NS: the gathered copy, or the cast to
                                               ns_dtype (0 when neither: it aliases the update; 0
                                               for a plain tensor, whose cast NS frees once it
                                               has normalised it)
                  + b x count x (2 r c + 2 r^2 + 1)   NS's X, X', G, H and each matrix's norm
                  + b x the previous parameter's stored elements   its result (``ortho``), which
                                               the step's loop holds until the next one's returns

  (p: bytes of the parameters' dtype; count: whole matrices, `_matrices`). The gather before it
  holds less (the ns_dtype shard and the whole output, one more whole copy for a shard of a
  matrix's dim 1) and so does the slice after it (input, result and a contiguous copy).
- For the pipeline split (`ns_flops_per_token`): each FSDP unit's NS FLOPs per step on one rank,
  spread over the step's local tokens in `ModelArgs.layer_flops_per_token`'s units (whole-model
  FLOPs per token, of which a rank runs 1/tp): ``ns x tp / tokens``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.dtypes import DTYPE_BYTES
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.config.job_config import Training
from torchmoe.plan.layout import ParamSpec, expert_fsdp_shard_dim, local_shape, param_specs, shard_numel
from torchmoe.plan.parallel_dims import ParallelDims

__all__ = ["MuonCost", "is_muon", "muon_cost", "ns_flops", "ns_flops_per_token", "optimizer_state_elements",
           "step_peak_bytes"]

ADAMW_STATES = 2  # exp_avg, exp_avg_sq
MUON_STATES = 1  # momentum_buffer


def _has_matrices(spec: ParamSpec) -> bool:
    return len(spec.shape) == (3 if spec.expert else 2)


def is_muon(spec: ParamSpec, cfg: OptimizerConfig) -> bool:
    """Whether Muon optimizes `spec` under `cfg` (`optim.muon_groups.muon_split`'s rule)."""
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


def _is_dtensor(spec: ParamSpec, dims: ParallelDims) -> bool:
    """Whether the trainer makes `spec` a DTensor: FSDP/HSDP or DDP (FSDP's ``replicate``), TP,
    or EP's experts."""
    return dims.mp_policy_enabled or dims.tp_enabled or (spec.expert and dims.ep_enabled)


def _muon_specs(args: ModelArgs, cfg: OptimizerConfig, units: Iterable[str] | None) -> Iterator[ParamSpec]:
    """Muon's parameters among the FSDP `units` (``ParamSpec.fsdp_unit`` names; None: every unit)."""
    keep = None if units is None else set(units)
    return (s for s in param_specs(args) if (keep is None or s.fsdp_unit in keep) and is_muon(s, cfg))


def muon_cost(args: ModelArgs, dims: ParallelDims, cfg: OptimizerConfig, units: Iterable[str] | None = None) -> MuonCost:
    """Muon's NS FLOPs, stored elements and gathers on one rank holding the FSDP `units`
    (``ParamSpec.fsdp_unit`` names; None: every unit)."""
    b = DTYPE_BYTES[cfg.ns_dtype]
    flops, stored, gathers = 0, 0, []
    for spec in _muon_specs(args, cfg, units):
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


def step_peak_bytes(args: ModelArgs, dims: ParallelDims, cfg: OptimizerConfig | None, param_bytes: int,
                    units: Iterable[str] | None = None) -> int:
    """Peak transient bytes of Muon's step on one rank holding `units` (module docstring): its
    largest parameter's Nesterov update, whole ns_dtype input and NS temporaries; 0 without Muon
    (`cfg` None: AdamW).

    Args:
        param_bytes: bytes per element of the parameters (and so of their gradients and buffers).
    """
    if cfg is None or cfg.name != "Muon":
        return 0
    b = DTYPE_BYTES[cfg.ns_dtype]
    peak = previous = 0
    for spec in _muon_specs(args, cfg, units):
        count, fsdp, tp = _matrices(spec, dims)
        r, c = sorted(spec.shape[-2:])
        # A DTensor's gather or cast makes a whole input `orthogonalize` holds through the NS.
        fresh = _is_dtensor(spec, dims) and (fsdp is not None or tp is not None or b != param_bytes)
        update = param_bytes * shard_numel(spec, dims) if cfg.nesterov else 0
        peak = max(peak, previous + update + b * count * ((fresh + 2) * r * c + 2 * r * r + 1))
        previous = b * shard_numel(spec, dims)  # its result, still bound while the next one's NS runs
    return peak


def ns_flops_per_token(args: ModelArgs, dims: ParallelDims, training_cfg: Training,
                       cfg: OptimizerConfig | None) -> dict[str, int]:
    """Per FSDP unit, its NS FLOPs per step on one rank over the step's local tokens, in whole-model
    FLOPs per token like `ModelArgs.layer_flops_per_token` (a rank runs 1/tp of those): what the
    pipeline split adds to each unit's time. Empty without Muon (`cfg` None: AdamW)."""
    if cfg is None or cfg.name != "Muon":
        return {}
    t = training_cfg
    accumulation = t.global_batch_size // (t.local_batch_size * dims.dp) if t.global_batch_size > 0 else 1
    tokens = accumulation * t.local_batch_size * t.seq_len // dims.cp
    flops: dict[str, int] = {}
    for spec in _muon_specs(args, cfg, None):
        count = _matrices(spec, dims)[0]
        flops[spec.fsdp_unit] = flops.get(spec.fsdp_unit, 0) + count * ns_flops(*spec.shape[-2:], cfg.ns_steps)
    return {unit: f * dims.tp // tokens for unit, f in flops.items()}
