"""Tensor parallelism for the decoder (every family), including MoE tensor parallelism: which module
gets which TP style.

Layout (sequence parallel between blocks): the residual stream is a DTensor sharded on the
sequence dim over ``tp``; each attention / FFN / MoE block all-gathers its input sequence,
computes on a slice of the heads or hidden units, and reduce-scatters its output back.

MoE TP (``tp > 1`` and ``ep == 1``): the MoE block's input is all-gathered (``Shard(1)`` ->
``Replicate()``; the mask of the tokens that are data, `MoE.forward`'s ``real``, is whole on every
rank already) and its output, a partial sum over the local hidden units of every expert, is
reduce-scattered (``Partial()`` -> ``Shard(1)``). Routed and shared experts are column-wise on
w1/w3 and row-wise on w2; the router gate is replicated on the same mesh so every parameter is a
DTensor on ``tp`` (uniform clipping, optimizer and FSDP handling).

Float8 TP (tensorwise recipe): the ``Float8Linear`` modules take torchao's float8 styles
(`distributed.tensor_parallel.LinearStyles`); the attention input (wq/wk/wv) and a dense FFN's
(w1/w3) are gathered in float8 when all their readers are float8. The MoE input stays high
precision (the router and routed experts read it); shared experts cast their replicated copy
locally.

LoRA: a linear's adapter follows its weight's style (`adapters_following_weights`); routed
experts' adapters follow their weights (`RoutedExperts.lora_tp_dims`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchmoe.distributed.tensor_parallel import (
    ExpertTensorParallel,
    LinearStyles,
    ReplicateParallel,
    adapters_following_weights,
)
from torchmoe.models.decoder.attention import Attention
from torchmoe.models.decoder.latent_attention import LatentAttention

__all__ = ["apply_tp"]


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, moe_tp: bool,
             float8: bool = False) -> dict[str, ParallelStyle]:
    """Shard `model` (a `Transformer`, or a pipeline stage of one) over `tp_mesh` in place and
    return the plan applied: module name -> style.

    The model returns plain tensors: logits (B, S, vocab / tp) with loss parallel, to be viewed as
    a ``Shard(-1)`` DTensor by the loss, else gathered (B, S, vocab); a pipeline stage without
    the head returns its sequence shard (B, S / tp, dim) of hidden states, and a stage without
    the embedding takes one. Plain tensors are what pipeline stages send each other.

    Args:
        loss_parallel: keep the logits vocab-sharded for a vocab-parallel cross entropy.
        moe_tp: tensor-parallelise MoE blocks (False when expert parallelism handles them).
        float8: float8 TP (`float8.float8_tp_enabled`): torchao's float8 styles for the
            ``Float8Linear`` modules, plain styles for the rest.
    """
    applied: dict[str, ParallelStyle] = {}
    top_plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        # DTensor out (not local): the sequence length read downstream must be the global one.
        top_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                     use_local_output=False)
    if model.norm is not None:
        top_plan["norm"] = SequenceParallel()
    if model.output is not None:
        top_plan["output"] = ColwiseParallel(input_layouts=Shard(1),
                                             output_layouts=Shard(-1) if loss_parallel else Replicate())
    parallelize_module(model, tp_mesh, top_plan)
    applied.update(top_plan)
    if model.tok_embeddings is None:  # a later pipeline stage: hidden-state shards in, as DTensors
        parallelize_module(model, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                              desired_input_layouts=(Shard(1),)))
    if model.norm is None:  # an earlier pipeline stage: hidden-state shards out, as plain tensors
        parallelize_module(model, tp_mesh, PrepareModuleOutput(output_layouts=(Shard(1),),
                                                               desired_output_layouts=(Shard(1),)))

    for name, module in (model.mtp or {}).items():
        # Multi-token prediction (`models.decoder.mtp`): its norms run on sequence shards as the
        # final norm does; the input projection is replicated, taking and giving sequence-sharded
        # DTensors (the gradient of its weight, a sum over this rank's positions, is summed over
        # tp by DTensor). Its block is in `model.layers`, its embedding and head the model's.
        plan = {"enorm": SequenceParallel(), "hnorm": SequenceParallel(), "norm": SequenceParallel()}
        parallelize_module(module, tp_mesh, plan)
        distribute_module(module.eh_proj, tp_mesh)
        applied.update({f"mtp.{name}.{fqn}": style for fqn, style in plan.items()})

    for name, block in model.layers.items():
        styles = LinearStyles(block, float8)
        plan: dict[str, ParallelStyle] = {
            "attention_norm": SequenceParallel(),
            "attention.wo": styles.rowwise("attention.wo", output_layouts=Shard(1), use_local_output=False),
            "ffn_norm": SequenceParallel(),
        }
        # This rank's heads are the tp_rank-th slice (QK-Clip records their logits there).
        block.attention.head_offset = tp_mesh.get_local_rank() * model.args.n_heads // tp_mesh.size()
        if isinstance(block.attention, LatentAttention):
            block.attention.rope_key_gradient_mesh = tp_mesh
            plan.update(_latent_attention_plan(block.attention, styles))
        else:
            plan.update(_attention_plan(block.attention, styles))
            if block.attention.sinks is not None:
                # gpt-oss's per-head sinks go with their heads: each rank holds its heads' logits.
                block.attention.sinks = nn.Parameter(distribute_tensor(block.attention.sinks, tp_mesh, [Shard(0)]))
        if not block.moe_enabled:
            plan.update({
                "feed_forward": styles.gather_input("feed_forward", ("w1", "w3"), (Shard(1),), (Replicate(),)),
                "feed_forward.w1": styles.colwise("feed_forward.w1"),
                "feed_forward.w2": styles.rowwise("feed_forward.w2", output_layouts=Shard(1), use_local_output=False),
                "feed_forward.w3": styles.colwise("feed_forward.w3"),
            })
        elif moe_tp:
            if not block.moe.score_before_experts:
                # Gates that scale the experts' partial outputs (Qwen3) get a partial gradient on
                # each rank: the MoE layer sums it over tp before it reaches the router.
                block.moe.gate_gradient_mesh = tp_mesh
            plan.update(_moe_tp_plan(block.moe.shared_experts is not None, styles))
        else:
            # Experts are expert-parallel: the MoE block sees its own sequence shard as a local
            # tensor and returns one (EP dispatches tokens itself); the mask of the tokens that
            # are data, whole on every rank, is cut to the same shard.
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
                input_kwarg_layouts={"real": Replicate()}, desired_input_kwarg_layouts={"real": Shard(1)},
                output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)
        with adapters_following_weights(block, tp_mesh):
            parallelize_module(block, tp_mesh, plan)
        applied.update({f"layers.{name}.{fqn}": style for fqn, style in plan.items()})
    return applied


def _attention_plan(attention: Attention, styles: LinearStyles) -> dict[str, ParallelStyle]:
    """Grouped-query attention: heads split (wq/wk/wv column-wise, their biases with them; wo's
    bias, added once to the reduced output, replicated)."""
    plan: dict[str, ParallelStyle] = {
        # Inputs (x, freqs_cis, documents): only the hidden states are sharded.
        "attention": styles.gather_input("attention", ("wq", "wk", "wv"), (Shard(1), None, None),
                                         (Replicate(), None, None)),
        "attention.wq": styles.colwise("attention.wq"),
        "attention.wk": styles.colwise("attention.wk"),
        "attention.wv": styles.colwise("attention.wv"),
    }
    if attention.q_norm is not None:
        # Per-head norms (Qwen3) see this rank's heads, (B, S, H / tp, hd): the weight is
        # replicated and its gradient, a sum over the local heads, is summed over tp.
        plan.update({"attention.q_norm": ReplicateParallel(input_layout=Shard(2)),
                     "attention.k_norm": ReplicateParallel(input_layout=Shard(2))})
    return plan


def _latent_attention_plan(attention: LatentAttention, styles: LinearStyles) -> dict[str, ParallelStyle]:
    """Latent attention (DeepSeek's MLA): the projections into heads (wq or wq_b, wkv_b) are
    column-wise, so each rank computes its heads; the bottleneck projections (wq_a, wkv_a) and
    their norms are small and replicated, each rank running them on the whole gathered sequence.
    Their outputs' gradients are complete: the column-wise inputs all-reduce theirs, and the
    shared rotated key's is summed by the layer (`rope_key_gradient_mesh`). The input is
    gathered in high precision (replicated readers take no float8 tensor)."""
    plan: dict[str, ParallelStyle] = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wkv_a": ReplicateParallel(),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": styles.colwise("attention.wkv_b"),
    }
    if attention.wq is not None:
        plan["attention.wq"] = styles.colwise("attention.wq")
    else:
        plan.update({"attention.wq_a": ReplicateParallel(), "attention.q_norm": ReplicateParallel(),
                     "attention.wq_b": styles.colwise("attention.wq_b")})
    return plan


def _moe_tp_plan(has_shared: bool, styles: LinearStyles) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        # The input is gathered in high precision: the router and the routed experts read it.
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Partial(),), desired_output_layouts=(Shard(1),), use_local_output=False),
        "moe.router.gate": ReplicateParallel(),
        "moe.experts": ExpertTensorParallel(),
    }
    if has_shared:
        plan.update({
            "moe.shared_experts.w1": styles.colwise("moe.shared_experts.w1"),
            "moe.shared_experts.w3": styles.colwise("moe.shared_experts.w3"),
            # Partial out: added to the routed experts' partial sum, reduced once by the block.
            "moe.shared_experts.w2": styles.rowwise("moe.shared_experts.w2", output_layouts=Partial()),
        })
    return plan
