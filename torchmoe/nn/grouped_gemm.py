"""The grouped GEMM's layout contract, kept for any expert shape and dtype.

    python -m pytest -q tests/unit/test_grouped_gemm.py

torch's grouped GEMM (`_torch_private.grouped_mm`: CUDA's CUTLASS kernel, and the checks every
device shares) reads the last two dims of each operand as a row-major or a column-major matrix
whose leading stride is a multiple of 16 bytes (8 bf16 or fp16 elements, 4 fp32 ones), starting
at a 16-byte-aligned address. Anything else is "strides should be multiple of 16 bytes" (and on
CUDA "expected data_ptr to be aligned to 16 bytes", which CPU's kernel does not check). Every
routed-expert GEMM meets a dim a checkpoint chooses: the experts' hidden size (a Hugging Face
folder's ``moe_intermediate_size`` 20), the model dim, a MoE tensor-parallel shard of the hidden
size (24 over TP 2 is 12), an adapter's rank, in the forward and in both products of the backward.

`kernel_layout` hands the kernel an operand that meets the contract as it is, and any other as a
copy on padded rows (zeros past each row's end) viewed at the operand's own shape and order: the
kernel multiplies the same logical matrices, so the product and its gradients are the unpadded
ones' (CPU's kernel is the per-group ``mm``; on CUDA a tile reads zeros past the end either way).
`nn.moe_ops`' kernels put every operand through it on every device, so a CPU test sees what a
GPU would read; `fits_kernel` tells the experts when torch's own op, which the compiler lowers to
its grouped-GEMM kernels, takes their operands as they are (`nn.experts.RoutedExperts`).

Why a copy per call, not another way:

- a per-expert loop reads the row counts on the host (a sync per GEMM, a graph break) and
  launches one GEMM per expert;
- ``bmm`` needs as many rows per expert: every block padded to the largest (a host read) or to
  all the rows (E times the memory);
- padded storage would show padded shapes to FSDP's shards, checkpoints, the Hugging Face export,
  Muon and the adapters' merge, or need a view at each of them.

A copy per call costs one pass over each operand off the contract (a projection's local expert
weights, its rows) in the forward and again in the backward, and no FLOP: the kernel's dims stay
the logical ones, and autograd saves the unpadded tensors, so the copies live for one GEMM only.
Every shipped flavor's dims meet the contract, and nothing is copied for them.
"""

from __future__ import annotations

import torch

__all__ = ["STRIDE_BYTES", "fits_kernel", "in_contract", "kernel_layout", "stride_multiple", "strides_in_contract"]

# The byte multiple CUDA's grouped GEMMs read rows (and start addresses) on.
STRIDE_BYTES = 16


def stride_multiple(dtype: torch.dtype) -> int:
    """Elements per `STRIDE_BYTES` in `dtype`: 8 in bf16 and fp16, 4 in fp32."""
    return STRIDE_BYTES // dtype.itemsize


def in_contract(t: torch.Tensor) -> bool:
    """t's last two dims are a matrix the kernel reads as it is (`strides_in_contract`), and its
    first element lies a multiple of `STRIDE_BYTES` from its storage's start (storage
    allocations are aligned; read from the offset, the check runs on meta tensors too)."""
    return t.storage_offset() * t.element_size() % STRIDE_BYTES == 0 and strides_in_contract(t)


def strides_in_contract(t: torch.Tensor) -> bool:
    """t's last two dims are a row- or column-major matrix whose other dim's stride is a multiple
    of `stride_multiple` and at least that dim's length (torch's own check, which torch.compile
    traces as shape guards)."""
    stride, shape, multiple = t.stride(), t.shape, stride_multiple(t.dtype)
    # torch's order: a dim of length 1 makes both readings possible, and column-major wins.
    if stride[-2] == 1 and stride[-1] >= max(1, shape[-2]):
        return stride[-1] % multiple == 0
    if stride[-1] == 1 and stride[-2] >= max(1, shape[-1]):
        return stride[-2] % multiple == 0
    return False


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t itself when `in_contract`, else the same values on storage whose rows are padded with
    zeros to the stride multiple, viewed at t's shape: column-major where t is column-major (the
    kernel's transposed operands), else row-major. (..., M, N) -> (..., M, N)."""
    if in_contract(t):
        return t
    if t.stride(-2) == 1 and t.stride(-1) != 1:
        return kernel_layout(t.transpose(-2, -1)).transpose(-2, -1)
    n = t.shape[-1]
    # A new buffer, not F.pad or clone: those keep a size-1 dim's odd strides (a (E, 1, N) view
    # of strides (N, 1, 1) stays one), which the kernel reads as column-major.
    padded = t.new_zeros(*t.shape[:-1], n + -n % stride_multiple(t.dtype))[..., :n]
    return padded.copy_(t)


def fits_kernel(rows: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's own grouped GEMM runs ``rows @ w[e].T`` (rows (R, K), w (E, N, K)) forward and
    backward on the operands as they are: both strided as the contract wants, and N a stride
    multiple too, as the backward multiplies the output's gradient, which arrives as a contiguous
    (R, N). Strides only, as torch.compile traces them (it cannot trace a storage offset): the
    experts' operands are tensors of their own (the dispatcher's buffer, an activation, a
    parameter's local shard or FSDP's all-gathered copy), never views at an offset."""
    return (strides_in_contract(rows) and strides_in_contract(w.transpose(-2, -1))
            and w.shape[1] % stride_multiple(w.dtype) == 0)
