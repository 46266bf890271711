"""Activation checkpointing per transformer block: full, selective per layer, selective per op.

The per-op policy saves what is expensive to recompute (attention, grouped GEMMs, collectives) and
every second plain matmul. Matmuls whose weight has the shape of a linear named by
``per_op_sac_force_recompute_mm_shapes_by_fqns`` are always recomputed and left out of that count
(torchtitan's rule, by shape: a matmul's operands carry no module name).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from torchmoe import _torch_private as private
from torchmoe.config.job_config import ActivationCheckpoint
from torchmoe.nn.attention import PREFIXED_ATTENTION
from torchmoe.nn.segment_attention import SEGMENT_ATTENTION
from torchmoe.nn.sink_attention import SINK_ATTENTION

# Outputs saved by per-op selective AC: expensive to recompute, small relative to their cost:
# fused attention kernels, grouped GEMMs (float8's too), TP's reduce-scatters and EP's
# all-to-alls; float8's amax (tiny, and recomputing it under TP needs comms); the attention over
# a prefix block and a causal block (context parallelism, chunks that do not divide the
# sequence): its merged output and log-sum-exp, as for one fused kernel; the attention over
# segments (document masking, and prefixed blocks on flash: torch's varlen kernel, or the host
# operator), likewise.
_SAVE_ALWAYS = private.saved_by_selective_ac() | {torch.ops.aten.max.default, PREFIXED_ATTENTION,
                                                  SEGMENT_ATTENTION, SINK_ATTENTION}
# Matmuls alternate (every second one saved) to balance memory against recompute; float8
# linears' included (torchao runs them as _scaled_mm).
_MM = {torch.ops.aten.mm.default, private.scaled_mm_op()}


# Profiler annotations (record_function) are no computation, but SAC counts every op and requires
# recomputation to replay forward's exactly. FSDP's pre-forward hook of a unit nested in a block
# (EP's experts) runs as a new root during recomputation and annotates once more, so without
# this the recompute of an FSDP x EP block fails ("invocation index ... not found in storage").
_PROFILER_OPS = private.profiler_record_ops()
_CachingMode, _CachedMode = private.sac_dispatch_modes()


class _SkipProfilerOps:
    """Mixed into SAC's two dispatch modes: profiler annotations pass through uncounted."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PROFILER_OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Caching(_SkipProfilerOps, _CachingMode):
    """SAC's forward-side mode (records what to save or recompute)."""


class _Cached(_SkipProfilerOps, _CachedMode):
    """SAC's recompute-side mode (replays the records)."""


def op_sac_policy(recompute_shapes: frozenset[tuple[int, int]]):
    """The per-op selective AC policy of one block's forward (and its recompute).

    Args:
        recompute_shapes: (in, out) shapes of matmul weight operands (``x @ weight.T``: a
            DTensor's full shape) whose matmuls are always recomputed and not counted.
    """
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func in _SAVE_ALWAYS:
            return CheckpointPolicy.MUST_SAVE
        if func in _MM:
            if tuple(args[1].shape) in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            # Forward and recompute count separately so both make the same decisions.
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_policy_context(recompute_shapes: frozenset[tuple[int, int]]):
    """SAC's two dispatch modes for one checkpointed call of a block, sharing one storage."""
    storage: dict = defaultdict(dict)  # shared by the two modes, as in create_selective_checkpoint_contexts
    return _Caching(op_sac_policy(recompute_shapes), storage), _Cached(None, storage)


def forced_recompute_shapes(block: nn.Module, prefix: str, fqns: list[str]) -> frozenset[tuple[int, int]]:
    """(in, out) features of `block`'s nn.Linear layers whose full name (`prefix` + their name in
    the block) contains one of `fqns`: the weight operand shape of their matmuls."""
    shapes = set()
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) and any(f in f"{prefix}.{name}" for f in fqns):
            out_features, in_features = module.weight.shape  # a DTensor's full shape, as the policy sees it
            shapes.add((in_features, out_features))
    return frozenset(shapes)


def draws_random_numbers(block: nn.Module) -> bool:
    """`block`'s forward draws from the RNG: it holds a dropout of p > 0 (LoRA's adapter dropout).
    Its recomputation must then replay the forward's draws (torch's ``preserve_rng_state``: the
    RNG state saved and restored around it, a few bytes per block), or the backward differentiates
    another dropout mask than the forward applied. Blocks that draw nothing skip the saving."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in block.modules())


def apply_ac(model: nn.Module, ac_cfg: ActivationCheckpoint) -> None:
    """Wrap the blocks of `model` (a `Transformer` or pipeline stage) in place, as `ac_cfg` says:
    'full' recomputes whole blocks; 'selective' either runs the per-op policy ('op': save
    attention, grouped GEMMs, collectives and every second matmul) or fully checkpoints every
    n-th block. ``early_stop`` ends each recomputation once what backward needs is recomputed."""
    if ac_cfg.mode == "none":
        return
    option, forced = ac_cfg.selective_ac_option, ac_cfg.per_op_sac_force_recompute_mm_shapes_by_fqns
    for i, (name, block) in enumerate(list(model.layers.items())):
        wrap = functools.partial(private.checkpoint_wrapper, preserve_rng_state=draws_random_numbers(block),
                                 early_stop=ac_cfg.early_stop)
        if ac_cfg.mode == "full":
            wrapped = wrap(block)
        elif option == "op":
            shapes = forced_recompute_shapes(block, f"layers.{name}", forced)
            wrapped = wrap(block, context_fn=functools.partial(_op_policy_context, shapes))
        elif i % int(option) == 0:
            wrapped = wrap(block)
        else:
            continue
        model.layers.register_module(name, wrapped)
