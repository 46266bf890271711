"""Tensor-parallel styles beyond torch's own, for MoE models: parameters replicated on the mesh
(`ReplicateParallel`: router gates, shared experts under EP), routed experts sharded on their hidden
dim (`ExpertTensorParallel`), LoRA adapters placed after their base weight
(`adapters_following_weights`), and the per-module choice between torchao's float8 styles and
plain ones (`LinearStyles`). Which module of a model gets which style is the model's TP plan
(`torchmoe.models.decoder.tensor_parallel`).

Float8 TP (``float8=True``: float8 linears with the tensorwise recipe): every ``Float8Linear``
is sharded with torchao's float8 styles, and a block input whose consumers are all float8 is
cast to float8 before its all-gather, so the forward all-gathers and the backward all-gathers of
the row-wise projections' output gradients move 1-byte elements.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from torchmoe.distributed.float8 import is_float8_linear
from torchmoe.nn.lora import ADAPTER_PREFIX, has_adapter

__all__ = ["ExpertTensorParallel", "LinearStyles", "ReplicateParallel", "adapters_following_weights", "sum_gradient"]


def sum_gradient(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`x` (a plain tensor, the same on every rank of `mesh`) unchanged; in backward its gradient,
    a partial sum on each rank, is all-reduced over `mesh` so every rank upstream sees the whole."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


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
    """Routed experts sharded on the hidden dim, each parameter on the dim its module's
    ``tp_dims`` names (SwiGLU's w1/w3 ``Shard(1)``, column-wise, and w2 ``Shard(2)``, row-wise),
    so each rank's output is a partial sum.

    The expert input is the same on every rank, but its gradient is a partial sum over the local
    hidden units: marking the local input's gradient ``Partial`` makes autograd all-reduce it at
    this boundary, so everything upstream (gates, router, attention) sees complete gradients.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            if name:  # a submodule (the adapters' dropout) holds no parameter
                return
            # Adapters (`nn.lora.add_expert_adapters`) on the dims `lora_tp_dims` names, the rest
            # replicated: `RoutedExperts` sums their partial gradients over the mesh.
            dims = {**mod.tp_dims, **(mod.lora_tp_dims if mod.lora_scaling is not None else {})}
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(dims[pname]) if pname in dims else Replicate()
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def input_fn(mod, inputs, mesh):
            x, *rest = inputs
            return (sum_gradient(x, mesh), *rest)

        return distribute_module(module, device_mesh, partition, input_fn)


class LinearStyles:
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


# Base weight placement (nn.Linear's (out, in)) -> the placements of its adapter's A (r, in) and
# B (out, r): the sharded dim of W stays sharded (B's rows, A's columns), the rank dim never is.
_ADAPTER_PLACEMENTS: dict[Placement, tuple[Placement, Placement]] = {
    Shard(0): (Replicate(), Shard(0)),  # column-wise: x A^T on every rank, B's rows give this rank's outputs
    Shard(1): (Shard(1), Replicate()),  # row-wise: x_local A_local^T is a partial sum, like W x_local
    Replicate(): (Replicate(), Replicate()),
}


@contextmanager
def adapters_following_weights(root: nn.Module, mesh: DeviceMesh) -> Iterator[None]:
    """Tensor-parallelise `root` inside this context: every LoRA-adapted ``nn.Linear`` under it
    gets its adapter placed after its weight's style, whatever the style does with extra
    parameters (torch's column-wise style would shard A's rank dim).

    The adapter's forward hook (`nn.lora.add_linear_adapter`, registered before the style's hooks)
    runs on the style's DTensors, so the adapter's output has the base output's layout:
      - column-wise W ``Shard(0)``: A replicated, B ``Shard(0)``; ``x A^T`` (tokens, r) is computed
        on every rank (no communication), its output sharded as W x. A's gradient, a partial sum
        over the output shards, is summed over tp: (r, in) per step; the input's gradient joins
        the base's partial one.
      - row-wise W ``Shard(1)``: A ``Shard(1)``, B replicated; ``B A_local x_local`` is a partial
        sum added to the base's partial output before the style reduces it, so the forward adds
        no communication; B's gradient, a partial sum, is all-reduced: (out, r) per step.
      - replicated W: both replicated.
    Neither shards the rank, so r need not divide the TP degree. A Linear the plan leaves alone
    keeps plain adapters.
    """
    # Set aside: the adapter's parameters and its dropout module (torch's row-wise style would
    # look for a weight on every submodule of the linear).
    held: dict[nn.Linear, tuple[dict[str, nn.Parameter], dict[str, nn.Module]]] = {}
    for module in root.modules():
        if isinstance(module, nn.Linear) and has_adapter(module):
            params = {n: p for n, p in module.named_parameters(recurse=False) if n.startswith(ADAPTER_PREFIX)}
            children = {n: m for n, m in module.named_children() if n.startswith(ADAPTER_PREFIX)}
            held[module] = (params, children)
            for n in (*params, *children):
                delattr(module, n)
    yield
    for module, (params, children) in held.items():
        weight = module.weight
        for n, param in params.items():
            if isinstance(weight, DTensor):
                a, b = _ADAPTER_PLACEMENTS[weight.placements[0]]
                param = nn.Parameter(distribute_tensor(param.detach(), mesh, [a if n.endswith("_a") else b]),
                                     requires_grad=param.requires_grad)
            module.register_parameter(n, param)
        for n, child in children.items():
            module.add_module(n, child)
