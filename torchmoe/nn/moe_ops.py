"""The MoE layer's two operators that torch.compile cannot trace as they are, as custom ops.

    python -m pytest -q tests/unit/test_moe_compile.py

A custom op is one node in a compiled graph: the graph stays whole around it (no graph break) and
the compiler fuses what comes before and after, while the op itself runs its eager kernel.

- ``torchmoe::grouped_mm``: the grouped GEMM in dtypes other than bf16, and in bf16 where an
  operand is off the kernel's layout contract (`nn.grouped_gemm`: a dim that is not a multiple of
  16 bytes). torch's ``_grouped_mm`` has eager kernels for fp32, but its meta function (what the
  compiler traces with) accepts bf16 only, so a compiled fp32 MoE would otherwise break the graph
  around every expert projection. Its backward is two more grouped GEMMs, themselves custom ops,
  so the backward graph stays whole as well. Each kernel hands torch's its operands in the
  contract's layout (`grouped_gemm.kernel_layout`), and autograd saves the unpadded inputs. bf16
  operands in the contract keep torch's own op, which the compiler lowers to its grouped-GEMM
  kernels.
- ``torchmoe::accumulate_token_counts``: adds a forward's routed-token counts to the layer's
  buffer unless the forward is an activation-checkpoint recomputation. The check must run at
  every call; traced, it would be evaluated once at compile time.
- ``torchmoe::count_exchanged_bytes``: expert parallelism's all-to-all byte counter, split the
  same way into forward and recomputation bytes (traced, the check was a graph break).
"""

from __future__ import annotations

import torch

from torchmoe import _torch_private as private
from torchmoe.nn.grouped_gemm import kernel_layout

__all__ = ["accumulate_token_counts", "count_exchanged_bytes", "grouped_mm"]


@torch.library.custom_op("torchmoe::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-group ``x_g @ w_g.T``: rows ``offsets[g-1]:offsets[g]`` of x times expert g's weight.

    Args:
        x: (R, K) rows sorted by group; rows past ``offsets[-1]`` are ignored.
        w: (G, N, K) per-group weights in ``nn.Linear`` layout (out, in).
        offsets: (G,) int32 end row of each group (cumulative counts).
    Returns:
        (R, N) contiguous; rows past ``offsets[-1]`` are unspecified.
    """
    # The kernel pads its output's rows to 16 bytes (N = 6 fp32 gets stride 8); the fake kernel
    # promises a contiguous result, and for N a stride multiple this is no copy.
    return private.grouped_mm(kernel_layout(x), kernel_layout(w.transpose(-2, -1)), offsets).contiguous()


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("torchmoe::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The weight gradient of `grouped_mm`: per group ``grad_g.T @ x_g``.

    Args:
        grad: (R, N) gradient of the output; x: (R, K) the forward's input; offsets: (G,) int32.
    Returns:
        (G, N, K) contiguous.
    """
    return private.grouped_mm(kernel_layout(grad.transpose(0, 1)), kernel_layout(x), offsets).contiguous()


@grouped_mm_weight_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(offsets.shape[0], grad.shape[1], x.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    # d x_g = grad_g @ w_g: grouped_mm with w_g.T as the "weight" (a view, no copy).
    grad_x = grouped_mm(grad, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    grad_w = grouped_mm_weight_grad(grad, x, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("torchmoe::accumulate_token_counts", mutates_args=("buffer",))
def accumulate_token_counts(buffer: torch.Tensor, counts: torch.Tensor) -> None:
    """``buffer += counts`` unless this forward is an activation-checkpoint recomputation.

    Recomputation runs inside the autograd engine (a graph task is current); counting it again
    would skew the counts by the recomputed fraction.

    Args:
        buffer: (E,) fp32 running counts (the layer's ``tokens_per_expert``).
        counts: (E,) fp32 routed copies per expert in this forward.
    """
    if not private.in_backward():
        buffer.add_(counts)


@accumulate_token_counts.register_fake
def _(buffer: torch.Tensor, counts: torch.Tensor) -> None:
    return None


@torch.library.custom_op("torchmoe::count_exchanged_bytes", mutates_args=("counter",))
def count_exchanged_bytes(counter: torch.Tensor, nbytes: int) -> None:
    """Add `nbytes` to ``counter[0]`` in a forward, to ``counter[1]`` in an activation-checkpoint
    recomputation (as `accumulate_token_counts` tells them apart).

    Args:
        counter: (2,) int64 CPU tensor (the EP dispatcher's; read on the host without a sync).
        nbytes: bytes this forward's all-to-alls send to other ranks.
    """
    counter[int(private.in_backward())] += nbytes


@count_exchanged_bytes.register_fake
def _(counter: torch.Tensor, nbytes: int) -> None:
    return None
