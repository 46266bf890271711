"""Data parallelism: FSDP2 (``fully_shard``) over ``dp_shard × cp``, HSDP with ``dp_replicate``,
or DDP (``replicate``) when only ``dp_replicate > 1``; and the mixed precision of the layouts
without any (`apply_autocast`).

Mixed precision: FSDP2 and DDP's ``replicate`` (built on FSDP2) take a ``MixedPrecisionPolicy``
that casts the parameters (``training.dtype``) to ``training.mixed_precision_param`` when they are
gathered, so the whole forward and backward run in it (the residual stream included) and the
gradients come back in the parameters' dtype. Layouts with neither (one process, TP, EP or PP
alone) run the model's forward under ``torch.autocast`` in that dtype instead when it is below
the parameters' (fp32 parameters, bf16 compute): matmul-like ops compute in it, elementwise ops
and the residual stream stay fp32. Pure bf16 parameters (``training.dtype = "bfloat16"``) need
neither cast: the policy's dtype is theirs, and no autocast is entered.

Gradients are *summed* across data-parallel ranks (divide factor 1): the trainer normalises each
micro-batch's loss by the token count of the whole global batch, so the sum is the exact
gradient of the global mean loss, whatever the number of ranks.
"""

from __future__ import annotations

import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from torchmoe import _torch_private as private
from torchmoe.config.job_config import Training
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.nn.shards import local_shard


def _reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """'default' reshards unless pipelining (stages run several micro-batches back to back, so
    keeping parameters gathered between them saves all-gathers)."""
    return {"always": True, "never": False}.get(policy, not pp_enabled)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    pp_enabled: bool,
    cpu_offload: bool,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard `model` in place: one FSDP unit per transformer block, the embedding, and the final
    norm + output head; the root wraps whatever is left.

    Args:
        dp_mesh: 1-D (``dp_shard_cp``) for FSDP, or 2-D (``dp_replicate``, ``dp_shard_cp``) for HSDP.
        param_dtype / reduce_dtype: mixed-precision compute and gradient-reduction dtypes.
        reshard_after_forward: 'default', 'always' or 'never'.
        expert_mesh: when experts are expert-parallel, the mesh sharding their parameters
            (``efsdp``, with ``dp_replicate`` for HSDP); routed experts then form their own
            FSDP units on it, inside each block's unit.
    """
    # FSDP2 warns, per unit and rank, that a unit returned a view: an in-place op on that view
    # would drop its pre-backward hook. torchmoe never modifies a unit's output in place (a block
    # returns `h + ...`, the loss reads the logits out of place: every layout's gradients equal
    # the single process's in tests/distributed), so the warning has nothing to act on.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))
    # Pinned host memory (faster copies to the device) needs an accelerator; on a CPU mesh the
    # offload runs unpinned (the code path of offload, for tests: there is nothing to offload from).
    offload = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    reshard = _reshard_after_forward(reshard_after_forward, pp_enabled)
    common = dict(mp_policy=mp, offload_policy=offload)

    units: list[nn.Module] = []
    if model.tok_embeddings is not None:
        units.append(fully_shard(model.tok_embeddings, mesh=dp_mesh, reshard_after_forward=reshard, **common))
    for block in model.layers.values():
        if expert_mesh is not None and block.moe_enabled:
            units.append(fully_shard(block.moe.experts, mesh=expert_mesh, reshard_after_forward=reshard,
                                     shard_placement_fn=_expert_placement(expert_mesh.size(-1)), **common))
        units.append(fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, **common))
    head = [m for m in (model.norm, model.output) if m is not None]
    if head:
        # The head is used last in forward and first in backward: keeping it gathered avoids an
        # immediate re-gather.
        units.extend(fully_shard(head, mesh=dp_mesh, reshard_after_forward=False, **common))
    units.append(fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **common))
    for unit in units:
        _sum_gradients(unit)
    if expert_mesh is not None:
        _prefetch_explicitly(model, head)


def _prefetch_explicitly(model: nn.Module, head: list[nn.Module]) -> None:
    """Under expert parallelism, tell every FSDP unit which units to all-gather ahead of time.

    FSDP2's implicit forward prefetching relies on the host running ahead of the device: a unit's
    all-gather is issued when the host reaches its pre-forward, while the device still computes
    the previous unit. EP's all-to-all needs its split sizes on the host, a sync in every MoE
    block that drains the device queue, so the host reaches the next block only once this one
    has finished and its all-gather would run exposed. Explicit prefetching issues it from the
    current unit's pre-forward instead, before any of the unit's compute (and its sync) is queued.

    Forward, in execution order (embedding, blocks, final norm + head): each unit prefetches the
    next block and that block's experts unit. A block's experts are all-gathered only at the
    experts' pre-forward, after attention, the router and the count exchange (with its sync):
    prefetched one block earlier, their all-gather overlaps the previous block instead. A block
    with no unit before it (the first block of a later pipeline stage) prefetches its own experts,
    which then overlap its attention. Backward mirrors this in reverse order (head, blocks from
    the last, embedding): each unit prefetches the previous block's experts, then that block (a
    block's experts run backward before its attention). Only targets change: each all-gather
    still happens once per pass, so parameter memory grows by at most the next block in flight.

    Args:
        model: the FSDP-wrapped model (or pipeline stage) whose units `apply_fsdp` made.
        head: the final norm and output head this stage holds (one FSDP unit), may be empty.
    """
    blocks = list(model.layers.values())
    experts = {block: [block.moe.experts] if block.moe_enabled else [] for block in blocks}
    first = [model.tok_embeddings] if model.tok_embeddings is not None else []
    last = head[:1]  # fully_shard([norm, output]) is one unit: either module names it
    _chain(first + blocks + last, experts, lambda unit, targets: unit.set_modules_to_forward_prefetch(targets),
           experts_first=False)
    _chain(last + blocks[::-1] + first, experts, lambda unit, targets: unit.set_modules_to_backward_prefetch(targets),
           experts_first=True)


def _chain(order: list[nn.Module], experts: dict[nn.Module, list[nn.Module]], set_prefetch, *,
           experts_first: bool) -> None:
    """Make each unit of `order` (one pass's execution order) prefetch the next unit and, when
    that is a block, its experts unit (`experts[block]`); a block opening the chain also
    prefetches its own experts. `experts_first`: list a block's experts before the block (in
    backward they are needed first)."""
    def targets(unit: nn.Module) -> list[nn.Module]:
        own = experts.get(unit, [])
        return own + [unit] if experts_first else [unit] + own

    for i, unit in enumerate(order):
        opening = experts.get(unit, []) if i == 0 else []
        following = targets(order[i + 1]) if i + 1 < len(order) else []
        if opening or following:
            set_prefetch(unit, opening + following)


def _expert_placement(efsdp: int):
    """FSDP placement of expert-parallel weights: whole local experts per rank when there are
    enough of them, else the hidden dim (dim 0 with fewer experts than ranks would pad most
    ranks with a whole expert of zeros). The planner uses the same rule."""
    from torchmoe.plan.layout import expert_fsdp_shard_dim

    def placement(param: nn.Parameter) -> Shard:
        local = local_shard(param)
        return Shard(expert_fsdp_shard_dim(local.shape[0], efsdp))

    return placement


def _sum_gradients(unit) -> None:
    """Reduce gradients with a plain SUM: divide factor 1, and no pre-multiplied-sum op (gloo
    has none, and with a factor of 1 there is nothing to multiply)."""
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: str, reduce_dtype: str) -> None:
    """Replicate `model` over `dp_mesh` (DDP semantics: full parameters everywhere, gradients
    all-reduced during backward), with gradients summed like FSDP's."""
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))
    private.replicate(model, mesh=dp_mesh, mp_policy=mp)
    _sum_gradients(model)


def apply_autocast(model: nn.Module, training_cfg: Training) -> None:
    """Run `model`'s forward (and so its backward) under ``torch.autocast`` in
    ``mixed_precision_param``, for layouts where no FSDP/DDP policy casts the parameters. Never
    together with FSDP/DDP: their policy already casts, and autocast would only add casts of the
    cast. A compute dtype equal to the parameters' (``dtype``: fp32, or pure bf16) leaves the
    model as it is."""
    compute = training_cfg.mixed_precision_param
    model.autocast_dtype = None if compute == training_cfg.dtype else torch_dtype(compute)
