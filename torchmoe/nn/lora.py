"""Low-rank adapters (LoRA): a trainable ``scaling * B @ A`` beside a frozen weight.

    python -m pytest -q tests/unit/test_lora.py

Two kinds, both ordinary parameters of the module they adapt, so every pass of the parallelize
pipeline (FSDP, expert parallel's ``Shard(0)``, activation checkpointing, compile) and every
checkpoint sees them as it sees the module's own:

- **Linear adapters** (`add_linear_adapter`): ``lora_a (r, in)`` and ``lora_b (out, r)`` on an
  ``nn.Linear`` (attention projections, dense and shared-expert MLPs, the router gate), added to
  its output by a forward hook: ``y = W x (+ bias) + scaling * B A dropout(x)``. The module keeps
  its class and its weight's name, so checkpoints, Hugging Face mappings and plans address it
  as before.
- **Routed-expert adapters** (`add_expert_adapters`): one pair per expert, stacked like the
  experts' weights: ``lora_<proj>_a (E, r, in)`` and ``lora_<proj>_b (E, out, r)``, run by the
  same grouped GEMMs as the experts (`grouped_lora`: two per projection, no per-expert loop).
  Dim 0 is the expert, so expert parallel shards them with the experts (whole experts per rank).

Initialisation is PEFT's: A ``kaiming_uniform_(a=sqrt(5))`` (uniform in ``±1/sqrt(in)``), B zero,
so an adapted model computes exactly its base model until B moves. ``scaling = alpha / r``.

Adapter parameters are those whose own name starts with ``lora_`` (`is_adapter_name`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchmoe.nn.grouped_gemm import stride_multiple
from torchmoe.nn.init import Constant, ParamInit, Uniform

__all__ = ["ADAPTER_PREFIX", "add_expert_adapters", "add_linear_adapter", "adapter_param_inits", "freeze_base",
           "expert_delta", "grouped_lora", "has_adapter", "is_adapter_name", "linear_delta",
           "trainable_parameters"]

ADAPTER_PREFIX = "lora_"
# torch.compile's module wrapper puts its module under this name (activation checkpointing's
# wrapper hides its own from named_parameters).
_COMPILE_WRAPPER = "_orig_mod."


def is_adapter_name(name: str) -> bool:
    """`name` (a parameter's dotted name) is an adapter's: its last component starts with ``lora_``."""
    return name.rsplit(".", 1)[-1].startswith(ADAPTER_PREFIX)


def has_adapter(module: nn.Module) -> bool:
    """`module` holds adapter parameters of its own (a float8 swap would drop them)."""
    return any(is_adapter_name(name) for name, _ in module.named_parameters(recurse=False))


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


def add_linear_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Give `linear` a LoRA adapter in place: parameters ``lora_a (rank, in)`` and ``lora_b (out,
    rank)`` (on the weight's device and dtype, uninitialised: see `adapter_param_inits`),
    ``lora_scaling = alpha / rank``, ``lora_dropout``, and a forward hook adding
    ``scaling * lora_b @ lora_a @ dropout(x)`` to the output."""
    w = linear.weight
    linear.register_parameter("lora_a", nn.Parameter(torch.empty(rank, linear.in_features, device=w.device,
                                                                 dtype=w.dtype)))
    linear.register_parameter("lora_b", nn.Parameter(torch.empty(linear.out_features, rank, device=w.device,
                                                                 dtype=w.dtype)))
    linear.lora_scaling = alpha / rank
    linear.lora_dropout = _dropout(dropout)
    linear.register_forward_hook(_add_linear_adapter)


def _add_linear_adapter(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The forward hook of `add_linear_adapter`: x (..., in), output (..., out) -> (..., out)."""
    x = module.lora_dropout(args[0])
    return output + F.linear(F.linear(x, module.lora_a), module.lora_b) * module.lora_scaling


def linear_delta(module: nn.Module) -> torch.Tensor:
    """The weight change of a linear adapter, ``scaling * B @ A``: (out, in)."""
    return (module.lora_b @ module.lora_a) * module.lora_scaling


def add_expert_adapters(experts: nn.Module, shapes: dict[str, tuple[int, int]], rank: int, alpha: float,
                        dropout: float) -> None:
    """Give the routed experts `experts` (weights ``[E, ...]``) one adapter pair per expert and
    projection, in place: for each ``proj -> (out, in)`` of `shapes`, ``lora_<proj>_a (E, rank,
    in)`` and ``lora_<proj>_b (E, out, rank)`` (uninitialised), plus ``lora_scaling`` and
    ``lora_dropout``. The experts' forward adds `grouped_lora` to each projection."""
    ref = next(experts.parameters())
    for proj, (out_features, in_features) in shapes.items():
        for side, shape in (("a", (rank, in_features)), ("b", (out_features, rank))):
            experts.register_parameter(f"{ADAPTER_PREFIX}{proj}_{side}", nn.Parameter(
                torch.empty(experts.num_experts, *shape, device=ref.device, dtype=ref.dtype)))
    experts.lora_scaling = alpha / rank
    experts.lora_dropout = _dropout(dropout)


MatMul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: nn.Module,
                 mm: MatMul, counts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's adapter on its block of rows: ``scaling * B_e A_e dropout(x_row)``.

    Args:
        x: (R, in) rows sorted expert-major (expert e owns the next ``counts[e]`` rows).
        a: (E, r, in) and b: (E, out, r): the experts' adapters (local experts only).
        mm: the experts' grouped GEMM ``(rows, w (E, N, K), counts, offsets) -> rows @ w[e].T``.
        counts: (E,) rows per expert; offsets: (E,) int32 cumulative block ends.
    Returns:
        (R, out); rows past the last block are unspecified.
    """
    # The grouped GEMM reads rows on 16-byte strides (`nn.grouped_gemm`). `mm` pads the experts'
    # dims (in, out) for it; the rank is the adapter's own, so it is padded here once, with zero
    # rows of A_e and zero columns of B_e: they add nothing to the output, the pad's backward
    # drops their gradients, bf16 stays on torch's own op (a rank of 4 in bf16 is 8 bytes), and
    # fp32 is the loop's bit for bit (rows of r on a padded stride are not: CPU's BLAS picks its
    # kernel by the stride).
    pad = -a.shape[1] % stride_multiple(x.dtype)
    if pad:
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))  # (E, r + pad, in), (E, out, r + pad)
    low = mm(dropout(x), a, counts, offsets)  # (R, r + pad)
    return mm(low, b, counts, offsets) * scaling


def expert_delta(experts: nn.Module, proj: str) -> torch.Tensor:
    """The weight change of routed-expert adapter `proj`, ``scaling * B_e @ A_e`` per expert:
    (E, out, in)."""
    a = getattr(experts, f"{ADAPTER_PREFIX}{proj}_a")
    b = getattr(experts, f"{ADAPTER_PREFIX}{proj}_b")
    return torch.bmm(b, a) * experts.lora_scaling


def adapter_param_inits(model: nn.Module) -> dict[str, ParamInit]:
    """PEFT's initialisation of every adapter parameter of `model`, by name: A uniform in
    ``±1/sqrt(in)`` (``kaiming_uniform_(a=sqrt(5))``: gain ``sqrt(1/3)`` times ``sqrt(3/in)``),
    B zero. Shapes are the full ones (a DTensor's global shape)."""
    inits: dict[str, ParamInit] = {}
    for name, param in model.named_parameters():
        if not is_adapter_name(name):
            continue
        # Declared under the unwrapped name (as every init): it seeds the draw, and torch.compile's
        # wrapper forwards the lookup.
        name = name.replace(_COMPILE_WRAPPER, "")
        inits[name] = Uniform(1 / math.sqrt(param.shape[-1])) if name.endswith("_a") else Constant(0.0)
    return inits


def freeze_base(model: nn.Module) -> None:
    """Make every parameter of `model` but the adapters' frozen (``requires_grad = False``): no
    gradient is computed or reduced for them, and `trainable_parameters` leaves them out of the
    optimizer."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter of `model` that trains (``requires_grad``): what an
    optimizer should hold."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]
