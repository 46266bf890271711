"""Activation checkpointing per transformer block: full, selective per layer, selective per op."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, _CachedTorchDispatchMode, _CachingTorchDispatchMode

from torchmoe.ops.attention import PREFIXED_ATTENTION

# Outputs saved by per-op selective AC: expensive to recompute, small relative to their cost.
# Matmuls alternate (every second one saved) to balance memory against recompute.
_SAVE_ALWAYS = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops.aten.max.default,  # float8 amax: tiny, and recomputing it under TP needs comms
    # Attention over a prefix block and a causal block (context parallelism, chunks that do not
    # divide the sequence): its merged output and log-sum-exp, as for one fused kernel.
    PREFIXED_ATTENTION,
}
# The cuDNN attention kernel, and float8 routed experts' grouped GEMM (`float8.routed_experts`).
_SAVE_ALWAYS |= {getattr(torch.ops.aten, name).default for name in ("_scaled_dot_product_cudnn_attention",
                                                                    "_scaled_grouped_mm")
                 if hasattr(torch.ops.aten, name)}
# Matmuls, float8 linears' included (torchao runs them as _scaled_mm).
_MM = {torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default}


# Profiler annotations (record_function) are no computation, but SAC counts every op and requires
# recomputation to replay forward's exactly. FSDP's pre-forward hook of a unit nested in a block
# (EP's experts) runs as a new root during recomputation and annotates once more, so without
# this the recompute of an FSDP x EP block fails ("invocation index ... not found in storage").
_PROFILER_OPS = frozenset({torch.ops.profiler._record_function_enter.default,
                           torch.ops.profiler._record_function_enter_new.default,
                           torch.ops.profiler._record_function_exit._RecordFunction})


class _SkipProfilerOps:
    """Mixed into SAC's two dispatch modes: profiler annotations pass through uncounted."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PROFILER_OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Caching(_SkipProfilerOps, _CachingTorchDispatchMode):
    """SAC's forward-side mode (records what to save or recompute)."""


class _Cached(_SkipProfilerOps, _CachedTorchDispatchMode):
    """SAC's recompute-side mode (replays the records)."""


def _op_policy_context():
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func in _SAVE_ALWAYS:
            return CheckpointPolicy.MUST_SAVE
        if func in _MM:
            # Forward and recompute count separately so both make the same decisions.
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    storage: dict = defaultdict(dict)  # shared by the two modes, as in create_selective_checkpoint_contexts
    return _Caching(policy, storage), _Cached(None, storage)


def apply_ac(model: nn.Module, mode: str, selective_option: str) -> None:
    """Wrap the blocks of `model` (a `Transformer` or pipeline stage) in place.

    Args:
        mode: 'none', 'full' (recompute whole blocks) or 'selective'.
        selective_option: for 'selective', 'op' (per-op policy: save attention, grouped GEMM,
            every second matmul) or an integer n (fully checkpoint every n-th block).
    """
    if mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif selective_option == "op":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_op_policy_context)
        elif i % int(selective_option) == 0:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        model.layers.register_module(name, wrapped)
