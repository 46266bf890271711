"""Tensor-parallel styles beyond torch's own, for MoE models: parameters replicated on the mesh
(`ReplicateParallel`: router gates, shared experts under EP), routed experts sharded on their hidden
dim (`ExpertTensorParallel`), and the per-module choice between torchao's float8 styles and plain
ones (`LinearStyles`). Which module of a model gets which style is the model's TP plan
(`torchmoe.models.decoder.tensor_parallel`).

Float8 TP (``float8=True``: float8 linears with the tensorwise recipe): every ``Float8Linear``
is sharded with torchao's float8 styles, and a block input whose consumers are all float8 is
cast to float8 before its all-gather, so the forward all-gathers and the backward all-gathers of
the row-wise projections' output gradients move 1-byte elements.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from torchmoe.distributed.float8 import is_float8_linear

__all__ = ["ExpertTensorParallel", "LinearStyles", "ReplicateParallel", "sum_gradient"]


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
            for pname, dim in mod.tp_dims.items():
                param = getattr(mod, pname)
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)])))

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
