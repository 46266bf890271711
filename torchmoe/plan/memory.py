"""Per-rank memory estimate: parameters, gradients, optimizer state, FSDP buffers, activations.

    python -c "from torchmoe.plan.memory import estimate_memory; from torchmoe.models.llama4 import FLAVORS; \\
        from torchmoe.config.job_config import Training, ActivationCheckpoint, Parallelism; \\
        print(estimate_memory(FLAVORS['scout'], dict(pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=8, ep=1), \\
              Training(local_batch_size=1, seq_len=8192), ActivationCheckpoint(mode='full'), Parallelism()))"

Everything is counted per rank, after every sharding (see `plan.layout` for the rules), from
`ModelArgs` alone. With PP each pp rank holds different blocks and micro-batches, so every pp rank
is estimated and the fullest one reported. The total is a sum of peaks (parameters, optimizer
state, gradients, and the larger of transient FSDP buffers + peak activations and the optimizer
step's transients, which follow their release: Muon's, `plan.muon.step_peak_bytes`), an upper
bound: sharded gradients of late blocks appear only as early blocks' activations are freed.

Dtypes. Parameters, their gradients and AdamW's two moments are kept sharded in
``training.dtype``: p = 4 bytes each for fp32 (the "master" copy of mixed precision), 2 for pure
bf16. Matmuls compute in ``training.mixed_precision_param`` in every layout (bf16 whenever the
parameters are). Under FSDP2 (whenever `ParallelDims.fsdp_enabled`) each FSDP unit (one
transformer block, the embedding, final norm + output head) is all-gathered into an unsharded
copy in that dtype, and its unsharded gradients are produced in that dtype and cast to
``mixed_precision_reduce`` for the reduce-scatter; DDP casts its parameters the same way, so the
whole forward (the residual stream too) runs in it.
Other layouts (one rank, TP, EP or PP alone) with fp32 parameters run under ``torch.autocast``
(bf16 requested): it casts each matmul weight once per forward (a compute-dtype copy of every
matmul weight is alive through the forward, counted in ``fsdp_buffers``) and each matmul input at
every use, while the residual stream and norms stay fp32. Pure bf16 parameters need no autocast:
those layouts then compute like FSDP's, with a bf16 residual stream and no parameter copies.

    params       = p x sharded elements
    grads        = p x sharded elements          (sharded after reduce-scatter, cast back to p)
    optimizer    = 2p x sharded elements         (AdamW/Adam: exp_avg and exp_avg_sq)
                   Muon: p x its parameters' sharded elements (momentum_buffer) + 2p x the rest's
                   (AdamW's two moments; `plan.muon`)
    fsdp_buffers = compute-dtype copies of parameters: under FSDP
                   reshard after forward:  max_i (U_i + max(U_i-1, U_i+1) + G_i)
                   kept unsharded (PP's default, or "never"): sum_i U_i + max_i G_i
        over the rank's FSDP units i in execution order: unit i computes while its neighbour is
        prefetched (the next one in forward, the previous one in backward), and in backward holds
        its unsharded gradients. U_i = c x the unit's TP/EP-local elements, G_i = (c + r if r != c
        else c) x the same (the gradients, and their cast for the reduce-scatter); c / r = bytes
        of the compute / reduce dtype (c = p: the all-gather needs no cast, its output is still
        a copy). Under autocast: c x the rank's matmul weights (all but norms and an untied
        embedding); 0 without autocast (compute in the parameters' dtype).

With ``parallelism.fsdp_cpu_offload`` the sharded params, grads and optimizer state live in host
memory instead (reported as ``host``, not in the device total).

Activations (the bytes each block and the head save for backward, per token, under activation
checkpointing, and a pp rank's peak): `plan.activations`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.dtypes import DTYPE_BYTES
from torchmoe.config.job_config import ActivationCheckpoint, LoRA, Optimizer, Parallelism, Training
from torchmoe.plan.activations import ActivationModel, activation_bytes
from torchmoe.plan.layout import UnitSize, param_specs, shard_numel, unit_sizes
from torchmoe.plan.lora import adapter_specs
from torchmoe.plan.memo import memoised
from torchmoe.plan.muon import ADAMW_STATES, optimizer_state_elements, step_peak_bytes
from torchmoe.plan.parallel_dims import MESH_DIMS, ParallelDims
from torchmoe.plan.pipeline import (
    PipelineLayout,
    job_pipeline_layout,
)
from torchmoe.plan.pipeline import microbatches as pipeline_microbatches
from torchmoe.plan.pipeline import rank_param_specs, rank_units

GIB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes on one rank of pp rank `pp_rank` (device memory unless noted)."""

    pp_rank: int
    params: int
    grads: int
    optimizer: int
    fsdp_buffers: int
    activations: int
    host: int  # params, grads, optimizer state (and its step) offloaded to CPU memory (not in `total`)
    optimizer_step: int = 0  # the step's transient peak, once backward has freed the two above

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + max(self.fsdp_buffers + self.activations, self.optimizer_step)

    def gib(self) -> dict[str, float]:
        """The breakdown in GiB: the fields, and the total."""
        fields = ("params", "grads", "optimizer", "fsdp_buffers", "activations", "optimizer_step", "host", "total")
        return {f: getattr(self, f) / GIB for f in fields}


def compute_dtype(training_cfg: Training) -> str:
    """The dtype matmuls compute in and produce: ``mixed_precision_param`` in every layout
    (FSDP/DDP cast the parameters to it, the other layouts autocast to it)."""
    return training_cfg.mixed_precision_param


def compute_dtype_bytes(training_cfg: Training) -> int:
    """Bytes per element of `compute_dtype`."""
    return DTYPE_BYTES[compute_dtype(training_cfg)]


def param_dtype_bytes(training_cfg: Training) -> int:
    """Bytes per element of the parameters, their gradients and the optimizer state: ``dtype``."""
    return DTYPE_BYTES[training_cfg.dtype]


def state_bytes_per_param(training_cfg: Training) -> int:
    """Bytes one stored parameter element costs with its gradient and the two AdamW moments."""
    return (2 + ADAMW_STATES) * param_dtype_bytes(training_cfg)


def autocast_enabled(dims: ParallelDims, training_cfg: Training) -> bool:
    """The forward runs under torch.autocast: a compute dtype below the parameters', and no
    FSDP/DDP policy to cast them (`distributed.data_parallel.apply_autocast`)."""
    return not dims.mp_policy_enabled and compute_dtype(training_cfg) != training_cfg.dtype


def residual_dtype(dims: ParallelDims, training_cfg: Training) -> str:
    """The dtype of the residual stream (block inputs and outputs, norm inputs, pipeline hidden
    states): the compute dtype when FSDP/DDP cast the parameters (the embedding's output is
    already in it), fp32 under autocast (additions and norms are not autocast ops)."""
    return "float32" if autocast_enabled(dims, training_cfg) else compute_dtype(training_cfg)


def residual_dtype_bytes(dims: ParallelDims, training_cfg: Training) -> int:
    """Bytes per element of `residual_dtype`."""
    return DTYPE_BYTES[residual_dtype(dims, training_cfg)]


# ---- states and FSDP buffers --------------------------------------------------------------------


def _param_copy_bytes(units: list[UnitSize], dims: ParallelDims, training_cfg: Training,
                      parallelism_cfg: Parallelism) -> int:
    """Peak bytes of compute-dtype parameter copies: FSDP's unsharded units, or autocast's
    (`units`: one rank's FSDP units in execution order)."""
    if autocast_enabled(dims, training_cfg):
        # autocast casts each matmul weight once per forward and keeps the copy until the forward
        # ends (and backward needs it).
        return compute_dtype_bytes(training_cfg) * sum(u.matmul_local for u in units)
    if not dims.fsdp_enabled:
        return 0
    c = DTYPE_BYTES[training_cfg.mixed_precision_param]
    r = DTYPE_BYTES[training_cfg.mixed_precision_reduce]
    # TP/EP-local elements of each FSDP unit, in execution order.
    numel = [sum(u.local) for u in units]
    grad_bytes = c + r if r != c else c
    policy = parallelism_cfg.fsdp_reshard_after_forward
    if policy == "never" or (policy == "default" and dims.pp_enabled):
        return c * sum(numel) + grad_bytes * max(numel)
    # Unit i computing (params + its unsharded grads in backward) while a neighbour is prefetched.
    return max(c * (n + max(numel[i - 1] if i else 0, numel[i + 1] if i + 1 < len(numel) else 0))
               + grad_bytes * n for i, n in enumerate(numel))


# ---- the estimate -------------------------------------------------------------------------------


def _rank_state(model_args: ModelArgs, dims: ParallelDims, pipe: PipelineLayout, pp_rank: int,
                training_cfg: Training, parallelism_cfg: Parallelism,
                optimizer_cfg: Optimizer | None) -> tuple[int, int, int]:
    """(stored parameter elements, optimizer-state elements, FSDP/autocast parameter-copy bytes)
    of one rank of `pp_rank`."""
    def compute() -> tuple[int, int, int]:
        sizes = unit_sizes(model_args, dims)
        units = rank_units(pipe, pp_rank)
        local = [sizes[unit] for unit in units]
        specs = [s for s in param_specs(model_args) if s.fsdp_unit in set(units)]
        return (sum(u.stored for u in local), optimizer_state_elements(specs, dims, optimizer_cfg),
                _param_copy_bytes(local, dims, training_cfg, parallelism_cfg))

    split = None if optimizer_cfg is None or optimizer_cfg.name != "Muon" else (
        optimizer_cfg.muon_router, tuple(optimizer_cfg.muon_params), tuple(optimizer_cfg.adamw_params))
    key = (repr(model_args), dims, pipe.key, pp_rank, training_cfg.dtype, training_cfg.mixed_precision_param,
           training_cfg.mixed_precision_reduce, parallelism_cfg.fsdp_reshard_after_forward, split)
    return memoised(_STATES, key, compute)


_STATES: dict[tuple, tuple[int, int, int]] = {}


def memory_per_pp_rank(model_args: ModelArgs, dims: ParallelDims, training_cfg: Training,
                       ac_cfg: ActivationCheckpoint, parallelism_cfg: Parallelism, *,
                       compiled: bool = False, lora: LoRA | None = None,
                       optimizer_cfg: Optimizer | None = None) -> list[MemoryEstimate]:
    """The estimate for one rank of each pp rank (index = pp rank).

    Args:
        model_args: the model's shape.
        dims: the resolved layout.
        training_cfg: local_batch_size, seq_len, dtype, mixed_precision_param / _reduce.
        ac_cfg: activation checkpointing mode and selective option.
        parallelism_cfg: pipeline schedule and micro-batch size, FSDP reshard policy, CPU offload,
            loss parallel.
        compiled: blocks run under torch.compile (fused norms save less).
        lora: `[lora]`: when enabled the base is frozen (no gradients, no optimizer state) and
            the adapters (`plan.lora.adapter_specs`) are stored beside it and train.
        optimizer_cfg: the optimizer's state per element (Muon: one state for its matrices);
            None counts AdamW's two.
    """
    pipe = job_pipeline_layout(model_args, dims, parallelism_cfg, training_cfg, optimizer_cfg)
    a = compute_dtype_bytes(training_cfg)
    act = ActivationModel(model_args, dims, a, compiled, seq_len=training_cfg.seq_len,
                          loss_parallel=dims.tp_enabled and not parallelism_cfg.disable_loss_parallel,
                          autocast=autocast_enabled(dims, training_cfg),
                          recompute_mm_fqns=tuple(ac_cfg.per_op_sac_force_recompute_mm_shapes_by_fqns),
                          document_masking=training_cfg.document_masking)
    if dims.pp_enabled:
        microbatches, sequences = pipeline_microbatches(training_cfg, parallelism_cfg)
    else:
        sequences, microbatches = training_cfg.local_batch_size, 1
    tokens = sequences * training_cfg.seq_len // dims.cp
    p = param_dtype_bytes(training_cfg)
    estimates = []
    for pp_rank in range(dims.pp):
        numel, state, fsdp_buffers = _rank_state(model_args, dims, pipe, pp_rank, training_cfg, parallelism_cfg,
                                                 optimizer_cfg)
        trained = numel
        if lora is not None and lora.enable:  # AdamW's two states for the adapters (Muon refuses LoRA)
            trained = sum(shard_numel(s, dims) for s in rank_param_specs(adapter_specs(model_args, lora), pipe, pp_rank))
            numel += trained
            state = ADAMW_STATES * trained
        states = {"params": p * numel, "grads": p * trained, "optimizer": p * state,
                  "optimizer_step": step_peak_bytes(model_args, dims, optimizer_cfg, p, rank_units(pipe, pp_rank))}
        host = 0
        if parallelism_cfg.fsdp_cpu_offload and dims.fsdp_enabled:
            host = sum(states.values())
            states = dict.fromkeys(states, 0)
        estimates.append(MemoryEstimate(
            pp_rank=pp_rank,
            **states,
            fsdp_buffers=fsdp_buffers,
            activations=activation_bytes(act, pipe, pp_rank, tokens, microbatches,
                                          parallelism_cfg.pipeline_parallel_schedule, ac_cfg),
            host=host,
        ))
    return estimates


def estimate_memory(model_args: ModelArgs, degrees: Mapping[str, int], training_cfg: Training,
                    ac_cfg: ActivationCheckpoint, parallelism_cfg: Parallelism, *,
                    compiled: bool = False, lora: LoRA | None = None,
                    optimizer_cfg: Optimizer | None = None) -> dict[str, float]:
    """Peak memory of the fullest rank, in GiB.

    Args:
        model_args: the model's shape.
        degrees: resolved ``pp, dp_replicate, dp_shard, cp, tp, ep`` (`config.degrees.resolve_degrees`).
        training_cfg, ac_cfg, parallelism_cfg: the `[training]`, `[activation_checkpoint]` and
            `[parallelism]` sections.
        compiled: ``[compile] enable``.
        lora: ``[lora]`` (`memory_per_pp_rank`).
        optimizer_cfg: the `[optimizer]` section (None: AdamW's two states).
    Returns:
        ``params, grads, optimizer, fsdp_buffers, activations, host, total`` in GiB (``host``:
        CPU-offloaded state, not part of ``total``).
    """
    dims = ParallelDims(**degrees, world_size=math.prod(degrees[d] for d in MESH_DIMS))
    estimates = memory_per_pp_rank(model_args, dims, training_cfg, ac_cfg, parallelism_cfg, compiled=compiled,
                                   lora=lora, optimizer_cfg=optimizer_cfg)
    return max(estimates, key=lambda e: e.total).gib()
