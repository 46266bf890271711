"""One key block's attention by a fused kernel, with its log-sum-exp, under the kernel's layout
contract on every device.

    python -m pytest -q tests/unit/test_attention_kernels.py

`block_forward` and `block_backward` are the only callers of torch's private attention kernels
(`torchmoe._torch_private`; the public SDPA returns no log-sum-exp). Which kernel runs is
`attention_kernel_choice.choose`'s rule, asked once per device, dtype and head dim (`kernel_for`).

The layout contract. CUDA's kernels read their operands by raw offsets: flash's backward takes the
log-sum-exp as a contiguous (B, H, S) tensor and checks neither its shape nor its strides (a
strided slice of a larger one gives every head but the first another row's values), and every
kernel needs the head dim contiguous in q, k, v, the output and its gradient; the
memory-efficient kernel's half-precision backward also reads the output in the layout its forward
returns it ((B, S, H, hd) in memory), which `block_backward` hands it. The CPU kernel
honours any strides, so a CPU test would never see a violation. `require_layout` checks the
contract before every kernel call on every device, so the CPU suite fails where a GPU would give
wrong gradients silently.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch

from torchmoe import _torch_private as private
from torchmoe.nn import attention_kernel_choice
from torchmoe.nn.attention_kernel_choice import CPU_FLASH, EFFICIENT, FLASH

__all__ = ["CALLS", "KernelLayoutError", "accumulation_dtype", "block_backward", "block_forward", "heads_inner",
           "kernel_for", "require_layout"]


# Kernel calls by kernel, forward and backward ("flash_varlen": `nn.segment_attention`'s calls of
# the public varlen kernel): what the GPU tests read to know that no fallback ran.
CALLS: Counter[str] = Counter()


class KernelLayoutError(ValueError):
    """A tensor handed to a fused attention kernel outside the layout the CUDA kernel assumes."""


def require_layout(*, lse: torch.Tensor | None = None, lse_shape: tuple[int, ...] | None = None,
                   **operands: torch.Tensor) -> None:
    """Raise `KernelLayoutError` unless every operand (q, k, v, out, grad: (..., hd)) has its head
    dim contiguous, and `lse` is fully contiguous with the shape `lse_shape` (what CUDA's kernels
    read it as: (B, H, S), or (H, T) for cumulative lengths)."""
    for name, t in operands.items():
        if t.stride(-1) != 1:
            raise KernelLayoutError(f"attention kernel: {name} {tuple(t.shape)} has strides {t.stride()}; "
                                    "the head dim (last) must be contiguous")
    if lse is not None:
        if not lse.is_contiguous() or (lse_shape is not None and tuple(lse.shape) != tuple(lse_shape)):
            raise KernelLayoutError(f"attention kernel: the log-sum-exp {tuple(lse.shape)} with strides "
                                    f"{lse.stride()} must be a contiguous {tuple(lse_shape or lse.shape)} tensor: "
                                    "CUDA's kernels read it by raw offsets")


def kernel_for(q: torch.Tensor) -> str:
    """The kernel that runs attention for queries like `q` (`attention_kernel_choice.choose`), decided
    once per device, dtype, head dim and torch's kernel switches."""
    return _kernel(q.device.type, q.device.index, _dtype_name(q.dtype), q.shape[-1], *_switches(q.device.type))


def describe_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The run log's line: the kernel attention runs on `device` in `dtype`, and why."""
    kernel = _kernel(device.type, device.index, _dtype_name(dtype), head_dim, *_switches(device.type))
    return attention_kernel_choice.describe(kernel, device.type, _dtype_name(dtype), head_dim, _capability(device.type,
                                                                                                     device.index))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _switches(device_type: str) -> tuple[bool, bool]:
    """torch's flash and memory-efficient switches (what `sdpa_kernel` sets) on CUDA."""
    if device_type != "cuda":
        return True, True
    return torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()


def _capability(device_type: str, index: int | None) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(index) if device_type == "cuda" else None


@functools.lru_cache(maxsize=64)
def _kernel(device_type: str, index: int | None, dtype: str, head_dim: int, flash: bool, efficient: bool) -> str:
    return attention_kernel_choice.choose(device_type, dtype, head_dim, _capability(device_type, index),
                                   flash_enabled=flash, efficient_enabled=efficient)


def accumulation_dtype(q: torch.Tensor) -> torch.dtype:
    """What log-sum-exps and merges are computed in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def heads_inner(t: torch.Tensor) -> torch.Tensor:
    """(B, H, S, hd) laid out as (B, S, H, hd) in memory, what attention kernels return (a view
    when it already is)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, S, hd) -> (B, heads, S, hd): each key/value head for its group of query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_repeat_heads`: (B, H, S, hd) summed over each group -> (B, Hkv, S, hd)."""
    b, h, s, hd = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, s, hd).sum(2)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key block: (out (B, H, n, hd), lse (B, H, n) contiguous in the
    accumulation dtype: CUDA's layout, whatever the kernel returned; the CPU kernel's is
    (B, n, H) underneath). q: (B, H, n, hd); k, v: (B, Hkv, m, hd), causal only on a square
    block (m = n)."""
    require_layout(q=q, k=k, v=v)
    kernel = kernel_for(q)
    CALLS[kernel] += 1
    if kernel == CPU_FLASH:
        out, lse = private.flash_attention_cpu(q, k, v, causal)
    elif kernel == FLASH:
        out, lse = private.flash_attention_cuda(q, k, v, causal)
    elif kernel == EFFICIENT:
        heads = q.shape[1]
        out, lse = private.efficient_attention_cuda(q, _repeat_heads(k, heads), _repeat_heads(v, heads), causal)
        lse = lse[..., :q.shape[-2]]  # the kernel pads the log-sum-exp's length to a multiple of 32
    else:
        return _math_forward(q, k, v, causal=causal)
    return out, lse.to(accumulation_dtype(q)).contiguous()


def block_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one key block's share of an attention whose whole output and log-sum-exp
    are `out` and `lse` (B, H, n): the kernel recomputes the probabilities from `lse`, so they
    are the merged softmax's, and ``D = rowsum(grad * out)`` is the merged output's."""
    require_layout(q=q, k=k, v=v, out=out, grad=grad, lse=lse, lse_shape=tuple(q.shape[:-1]))
    kernel = kernel_for(q)
    CALLS[kernel] += 1
    if kernel == CPU_FLASH:
        return private.flash_attention_cpu_backward(grad, q, k, v, out, lse, causal)
    if kernel == FLASH:
        return private.flash_attention_cuda_backward(grad, q, k, v, out, lse, causal)
    if kernel == EFFICIENT:
        heads, kv_heads = q.shape[1], k.shape[1]
        padded = torch.nn.functional.pad(lse, (0, -q.shape[-2] % 32))  # the kernel's own layout of it
        # The output as the kernel's forward lays it out: its half-precision backward reads `out`
        # at the gradient's offsets after making that (B, S, H, hd)-contiguous. Handed a
        # (B, H, S, hd)-contiguous output it returned gradients off by up to 8e37 (H200, bf16,
        # torch 2.11, 2026-12-04); fp32 and flash read either layout right.
        dq, dk, dv = private.efficient_attention_cuda_backward(grad, q, _repeat_heads(k, heads),
                                                               _repeat_heads(v, heads), heads_inner(out), padded,
                                                               causal)
        return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)
    return _math_backward(grad, q, k, v, out, lse, causal=causal)


# ---- a prefix block and a causal block, merged -----------------------------------------------------


def prefixed_block_forward(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes `prefixed_causal_attention` of q into `out` (B, H, n, hd) and returns the log-sum-exp
    (B, H, n) of its scores, in the accumulation dtype: each block by its fused kernel, merged."""
    out_p, lse_p = block_forward(q, k_prefix, v_prefix, causal=False)
    out_d, lse_d = block_forward(q, k, v, causal=True)
    lse = torch.logaddexp(lse_p, lse_d).contiguous()
    # Weights exp(lse_i - lse) in (0, 1]: each block's share of the softmax's denominator.
    acc = accumulation_dtype(q)
    out.copy_(torch.exp(lse_p - lse).unsqueeze(-1) * out_p.to(acc) + torch.exp(lse_d - lse).unsqueeze(-1) * out_d.to(acc))
    return lse


def prefixed_block_backward(grad: torch.Tensor, q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                            k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            dq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Writes the query gradient of `prefixed_causal_attention` into `dq` and returns
    (dk_prefix, dv_prefix, dk, dv): each block's kernel backward with the merged `out` and `lse`."""
    dq_p, dk_p, dv_p = block_backward(grad, q, k_prefix, v_prefix, out, lse, causal=False)
    dq_d, dk_d, dv_d = block_backward(grad, q, k, v, out, lse, causal=True)
    dq.copy_(dq_p.to(accumulation_dtype(q)) + dq_d.to(accumulation_dtype(q)))
    return dk_p, dv_p, dk_d, dv_d


# ---- the math definition (what no fused kernel takes, and the reference) ----------------------


def _probabilities(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None, *, causal: bool) -> torch.Tensor:
    """Scores (B, H, n, m) of q against k (heads repeated) in the accumulation dtype, causal on
    a square block, and exp(scores - lse) when `lse` is given."""
    acc = accumulation_dtype(q)
    scores = q.to(acc) @ _repeat_heads(k, q.shape[1]).to(acc).transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores if lse is None else torch.exp(scores - lse.unsqueeze(-1))


def _math_forward(q, k, v, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _probabilities(q, k, None, causal=causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ _repeat_heads(v, q.shape[1]).to(scores.dtype)
    return out.to(q.dtype), lse


def _math_backward(grad, q, k, v, out, lse, *, causal: bool):
    p = _probabilities(q, k, lse, causal=causal)  # (B, H, n, m), the merged softmax's share
    acc = p.dtype
    g, vx = grad.to(acc), _repeat_heads(v, q.shape[1]).to(acc)
    dv = p.transpose(-2, -1) @ g
    ds = p * (g @ vx.transpose(-2, -1) - (g * out.to(acc)).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    dq = ds @ _repeat_heads(k, q.shape[1]).to(acc)
    dk = ds.transpose(-2, -1) @ q.to(acc)
    kv_heads = k.shape[1]
    return dq.to(q.dtype), _sum_heads(dk, kv_heads).to(k.dtype), _sum_heads(dv, kv_heads).to(v.dtype)
