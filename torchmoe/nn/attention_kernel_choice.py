"""Which attention kernel runs a fused attention call: rules over the device, the dtype, the head
dim and the GPU's compute capability, as plain data (no torch), shared by the model
(`nn.attention_kernels`, which asks once per device, dtype and head dim) and the planner
(`plan.step_time`, which prices the kernel that will run).

    python -c "from torchmoe.nn.attention_kernel_choice import choose; print(choose('cuda', 'bfloat16', 128, (9, 0)))"

The kernels, and what each accepts (torch 2.13's own checks, `sdp_utils.cpp`):

    flash       CUDA FlashAttention-2: fp16/bf16 on compute capability 8.0 to 12.1, head_dim a
                multiple of 8 up to 256 (for a backward on sm86/sm89/sm120/sm121 at most 192, or
                above 224: their shared memory is smaller); grouped-query heads natively, and
                cumulative sequence lengths through the public `torch.nn.attention.varlen`.
    efficient   CUDA memory-efficient attention (xFormers' CUTLASS kernel): fp16 and fp32 from
                capability 5.0, bf16 from 8.0; head_dim a multiple of the GEMM alignment (8 in
                fp16/bf16, 4 in fp32 from 8.0); as many key/value heads as query heads (torchmoe
                repeats them), no cumulative lengths in the public API.
    cpu_flash   torch's flash attention for CPUs: every float dtype, any head dim.
    math        torchmoe's own definition, in fp32 (fp64 for fp64 inputs): what the fused kernels
                refuse (fp64 on CUDA, bf16 before 8.0, head dims off the alignment, other devices).
                It materialises each call's score matrix: memory grows with the square of the
                longest document or chunk.

cuDNN's attention is not chosen: torch 2.13 routes `varlen_attn` to it only when the flash kernel
is absent and then refuses grouped-query heads, and its dense form returns no log-sum-exp that
torchmoe could merge; flash covers every GPU cuDNN attention runs on.
"""

from __future__ import annotations

FLASH, EFFICIENT, CPU_FLASH, MATH = "flash", "efficient", "cpu_flash", "math"
KERNELS = (FLASH, EFFICIENT, CPU_FLASH, MATH)

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def choose(device_type: str, dtype: str, head_dim: int, capability: tuple[int, int] | None = None, *,
           flash_enabled: bool = True, efficient_enabled: bool = True, training: bool = True) -> str:
    """The kernel that runs attention over `head_dim`-wide heads in `dtype` on `device_type`.

    Args:
        device_type: "cuda", "cpu", or any other torch device type (math).
        dtype: the query's dtype name ("bfloat16", ...).
        capability: the CUDA device's (major, minor) compute capability; None off CUDA.
        flash_enabled, efficient_enabled: torch's switches for those kernels
            (``torch.backends.cuda.flash_sdp_enabled()``, ...), which `sdpa_kernel` sets.
        training: a backward will run (the sm86/sm89 head-dim limit of flash's backward).
    """
    if device_type == "cpu":
        return CPU_FLASH if dtype in _FLOAT_DTYPES else MATH
    if device_type != "cuda" or capability is None:
        return MATH
    if flash_enabled and _flash_accepts(dtype, head_dim, capability, training):
        return FLASH
    if efficient_enabled and _efficient_accepts(dtype, head_dim, capability):
        return EFFICIENT
    return MATH


def _flash_accepts(dtype: str, head_dim: int, capability: tuple[int, int], training: bool) -> bool:
    if dtype not in ("float16", "bfloat16") or not (8, 0) <= capability <= (12, 1):
        return False
    if head_dim % 8 or not 0 < head_dim <= 256:
        return False
    small_shared_memory = (8, 6) <= capability <= (8, 9) or capability >= (12, 0)
    return not (training and small_shared_memory and 192 < head_dim <= 224)


def _efficient_accepts(dtype: str, head_dim: int, capability: tuple[int, int]) -> bool:
    if not (5, 0) <= capability <= (12, 1):
        return False
    if dtype not in ("float16", "float32") and not (dtype == "bfloat16" and capability >= (8, 0)):
        return False
    half = dtype != "float32"
    # CUTLASS's GEMM alignment in elements (torch's `minimum_gemm_alignment`): tensor cores need
    # 128-bit rows; fp32 before 8.0 runs without them.
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    alignment = max(4 if capability >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)
    return head_dim > 0 and head_dim % alignment == 0


def describe(kernel: str, device_type: str, dtype: str, head_dim: int,
             capability: tuple[int, int] | None = None) -> str:
    """One line for the run's log: the kernel and why it was chosen."""
    where = f"{device_type} sm{capability[0]}{capability[1]}" if capability is not None else device_type
    why = {FLASH: "FlashAttention-2; documents through torch.nn.attention.varlen",
           EFFICIENT: "memory-efficient attention (flash does not take this dtype, head dim or GPU)",
           CPU_FLASH: "torch's CPU flash attention",
           MATH: "torchmoe's math definition: no fused kernel takes this dtype, head dim or device; "
                 "it materialises each call's score matrix"}[kernel]
    return f"attention kernel: {kernel} ({where}, {dtype}, head_dim {head_dim}): {why}"
