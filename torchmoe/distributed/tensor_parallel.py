"""Tensor parallelism for the Llama 4 transformer, including MoE tensor parallelism.

Layout (sequence parallel between blocks): the residual stream is a DTensor sharded on the
sequence dim over ``tp``; each attention / FFN / MoE block all-gathers its input sequence,
computes on a slice of the heads or hidden units, and reduce-scatters its output back.

MoE TP (``tp > 1`` and ``ep == 1``): the MoE block's input is all-gathered (``Shard(1)`` ->
``Replicate()``) and its output, a partial sum over the local hidden units of every expert, is
reduce-scattered (``Partial()`` -> ``Shard(1)``). Routed and shared experts are column-wise on
w1/w3 and row-wise on w2; the router gate is replicated on the same mesh so every parameter is a
DTensor on ``tp`` (uniform clipping, optimizer and FSDP handling).

Float8 TP (``float8=True``: float8 linears with the tensorwise recipe): every ``Float8Linear``
is sharded with torchao's float8 styles, and a block input whose consumers are all float8
(attention: wq/wk/wv; dense FFN: w1/w3) is cast to float8 before its all-gather, so the forward
all-gathers and the backward all-gathers of wo/w2's output gradients move 1-byte elements. The
MoE input stays high precision (the router and routed experts read it); shared experts cast
their replicated copy locally.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
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

from torchmoe.distributed.float8 import is_float8_linear


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the mesh; plain-tensor input in, plain-tensor output out.

    ``input_layout`` says what the local input is across the mesh:
      - ``Replicate()`` (MoE TP, router gate): the all-gathered MoE input, the same everywhere;
        the gradient reaching the gate is complete because the experts' input boundary
        all-reduces (see `ExpertTensorParallel`).
      - ``Shard(0)`` (EP spanning TP, router gate and shared experts): each rank's own tokens;
        DTensor then sums the parameters' gradients over the mesh.
    """

    def __init__(self, input_layout: Placement = Replicate()) -> None:
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def input_fn(mod, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [self.input_layout], run_check=False)
                         if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

        def output_fn(mod, outputs, mesh):
            return outputs.to_local()

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


class ExpertTensorParallel(ParallelStyle):
    """Routed experts sharded on the hidden dim: w1/w3 ``Shard(1)`` (column-wise), w2 ``Shard(2)``
    (row-wise), so each rank's output is a partial sum.

    The expert input is the same on every rank, but its gradient is a partial sum over the local
    hidden units: marking the local input's gradient ``Partial`` makes autograd all-reduce it at
    this boundary, so everything upstream (gates, router, attention) sees complete gradients.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
                param = getattr(mod, pname)
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)])))

        def input_fn(mod, inputs, mesh):
            x, *rest = inputs
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return (x, *rest)

        return distribute_module(module, device_mesh, partition, input_fn)


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

    for name, block in model.layers.items():
        styles = _LinearStyles(block, float8)
        plan: dict[str, ParallelStyle] = {
            "attention_norm": SequenceParallel(),
            "attention": styles.gather_input("attention", ("wq", "wk", "wv"), (Shard(1), None),
                                             (Replicate(), None)),
            "attention.wq": styles.colwise("attention.wq"),
            "attention.wk": styles.colwise("attention.wk"),
            "attention.wv": styles.colwise("attention.wv"),
            "attention.wo": styles.rowwise("attention.wo", output_layouts=Shard(1), use_local_output=False),
            "ffn_norm": SequenceParallel(),
        }
        if not block.moe_enabled:
            plan.update({
                "feed_forward": styles.gather_input("feed_forward", ("w1", "w3"), (Shard(1),), (Replicate(),)),
                "feed_forward.w1": styles.colwise("feed_forward.w1"),
                "feed_forward.w2": styles.rowwise("feed_forward.w2", output_layouts=Shard(1), use_local_output=False),
                "feed_forward.w3": styles.colwise("feed_forward.w3"),
            })
        elif moe_tp:
            if not block.moe.score_before_experts:
                # Gates applied to the experts' partial outputs would give each rank a partial
                # gate gradient, which the replicated router never reduces.
                raise ValueError("MoE tensor parallelism needs router scores applied before the experts "
                                 "(score_before_experts=True, as in Llama 4); use expert parallelism instead")
            plan.update(_moe_tp_plan(block.moe.shared_experts is not None, styles))
        else:
            # Experts are expert-parallel: the MoE block sees its own sequence shard as a local
            # tensor and returns one (EP dispatches tokens itself).
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)
        parallelize_module(block, tp_mesh, plan)
        applied.update({f"layers.{name}.{fqn}": style for fqn, style in plan.items()})
    return applied


class _LinearStyles:
    """The TP styles of one block's linears: torchao's float8 styles for its ``Float8Linear``
    modules when float8 TP is on, the plain ones otherwise."""

    def __init__(self, block: nn.Module, float8: bool) -> None:
        self.block = block
        self.float8 = float8
        if float8:
            from torchao.float8.float8_tensor_parallel import (
                Float8ColwiseParallel,
                Float8RowwiseParallel,
                PrepareFloat8ModuleInput,
            )

            self._colwise, self._rowwise, self._prepare = (Float8ColwiseParallel, Float8RowwiseParallel,
                                                           PrepareFloat8ModuleInput)

    def _is_float8(self, fqn: str) -> bool:
        return self.float8 and is_float8_linear(self.block.get_submodule(fqn))

    def colwise(self, fqn: str, **kwargs) -> ParallelStyle:
        return self._colwise(**kwargs) if self._is_float8(fqn) else ColwiseParallel(**kwargs)

    def rowwise(self, fqn: str, **kwargs) -> ParallelStyle:
        return self._rowwise(**kwargs) if self._is_float8(fqn) else RowwiseParallel(**kwargs)

    def gather_input(self, fqn: str, consumers: tuple[str, ...], input_layouts: tuple, desired: tuple) -> ParallelStyle:
        """The all-gather of `fqn`'s sequence-sharded input: in float8 when every linear reading
        it is float8 (a high-precision reader could not take a float8 tensor)."""
        if all(self._is_float8(f"{fqn}.{c}") for c in consumers):
            return self._prepare(input_layouts=input_layouts, desired_input_layouts=desired,
                                 fwd_config_submodule_fqn=consumers[0])
        return PrepareModuleInput(input_layouts=input_layouts, desired_input_layouts=desired)


def _moe_tp_plan(has_shared: bool, styles: _LinearStyles) -> dict[str, ParallelStyle]:
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
