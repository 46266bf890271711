"""One key block's fused kernel (`torchmoe.nn.attention_kernels`): which kernel runs, the layout
contract CUDA's kernels assume (enforced on every device), and the math definition they fall
back to, against dense references.

    python -m pytest -q tests/unit/test_attention_kernels.py
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from torchmoe.nn import attention
from torchmoe.nn import attention_kernel_choice as attention_kernel
from torchmoe.nn import attention_kernels
from torchmoe.nn.attention_kernel_choice import CPU_FLASH, EFFICIENT, FLASH, MATH
from torchmoe.nn.attention_kernels import KernelLayoutError, block_backward, block_forward, describe_kernel

# (device, dtype, head_dim, capability) -> the kernel torch 2.13 can run there (sdp_utils.cpp).
RULES = [
    ("cuda", "bfloat16", 128, (9, 0), FLASH),
    ("cuda", "float16", 64, (8, 0), FLASH),
    ("cuda", "bfloat16", 256, (10, 0), FLASH),
    ("cuda", "float16", 64, (7, 5), EFFICIENT),  # T4: no flash before sm80
    ("cuda", "float16", 64, (7, 0), EFFICIENT),  # V100
    ("cuda", "bfloat16", 64, (7, 5), MATH),  # bf16 needs sm80 in both fused kernels
    ("cuda", "float32", 128, (9, 0), EFFICIENT),  # flash takes fp16/bf16 only
    ("cuda", "float64", 128, (9, 0), MATH),  # no fused kernel takes fp64
    ("cuda", "bfloat16", 200, (8, 6), EFFICIENT),  # flash's backward on sm86: head_dim <= 192 or > 224
    ("cuda", "bfloat16", 256, (8, 6), FLASH),
    ("cuda", "bfloat16", 200, (9, 0), FLASH),
    ("cuda", "bfloat16", 264, (9, 0), EFFICIENT),  # past flash's 256
    ("cuda", "float16", 12, (8, 0), MATH),  # off the fp16 GEMM alignment (8)
    ("cuda", "float32", 12, (8, 0), EFFICIENT),  # fp32's alignment is 4
    ("cuda", "bfloat16", 128, (13, 0), MATH),  # past both kernels' supported range
    ("cpu", "bfloat16", 16, None, CPU_FLASH),
    ("cpu", "float64", 16, None, CPU_FLASH),
    ("mps", "float32", 64, None, MATH),
]


@pytest.mark.parametrize(("device", "dtype", "head_dim", "capability", "kernel"), RULES)
def test_the_kernel_is_the_one_torch_can_run(device, dtype, head_dim, capability, kernel):
    assert attention_kernel.choose(device, dtype, head_dim, capability) == kernel


def test_switched_off_kernels_are_skipped():
    """torch's switches (what `sdpa_kernel` sets) are honoured: flash off gives efficient, both off math."""
    assert attention_kernel.choose("cuda", "bfloat16", 128, (9, 0), flash_enabled=False) == EFFICIENT
    assert attention_kernel.choose("cuda", "bfloat16", 128, (9, 0), flash_enabled=False,
                                   efficient_enabled=False) == MATH


def test_the_run_log_names_the_kernel():
    line = describe_kernel(torch.device("cpu"), torch.float32, 16)
    assert line.startswith("attention kernel: cpu_flash (cpu, float32, head_dim 16)")


def _block(heads=4, kv_heads=2, n=8, hd=16, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(2, heads, n, hd, dtype=dtype), torch.randn(2, kv_heads, n, hd, dtype=dtype), \
        torch.randn(2, kv_heads, n, hd, dtype=dtype)


def test_a_strided_log_sum_exp_is_refused_on_every_device():
    """What the document operator used to hand the kernels: one row's columns of a (B, H, n)
    log-sum-exp, ``lse[b:b+1, :, i:e]``. CUDA's flash backward reads it as contiguous (head 1 on
    would read another row's values); the CPU kernel would read it right, so the wrapper refuses
    it on the CPU too."""
    q, k, v = _block()
    out, lse = block_forward(q, k, v, causal=True)
    grad = torch.randn_like(out)
    rows = (slice(0, 1), slice(None), slice(2, 6))
    assert lse.is_contiguous()  # (B, H, n), whatever layout the CPU kernel returned it in
    with pytest.raises(KernelLayoutError, match=r"log-sum-exp \(1, 4, 4\) with strides \(32, 8, 1\) must be a"):
        block_backward(grad[rows], q[rows], k[rows], v[rows], out[rows], lse[rows], causal=True)
    block_backward(grad[rows], q[rows], k[rows], v[rows], out[rows], lse[rows].contiguous(), causal=True)


def test_what_cuda_reads_from_a_strided_log_sum_exp_is_another_rows():
    """The reason for the contract, emulated: reading a strided (1, H, n) slice of a (B, H, S)
    log-sum-exp by a contiguous layout's offsets (as CUDA's kernel does) gives head 0 right and
    every later head another row's values; the gradients from them are wrong."""
    q, k, v = _block(dtype=torch.float64)
    out, lse = block_forward(q, k, v, causal=True)
    rows = (slice(0, 1), slice(None), slice(2, 6))
    strided = lse[rows]
    as_cuda_reads = torch.as_strided(strided, strided.shape, strided.contiguous().stride(), strided.storage_offset())
    assert torch.equal(as_cuda_reads[:, 0], strided[:, 0]) and not torch.equal(as_cuda_reads[:, 1:], strided[:, 1:])
    grad = torch.randn_like(out[rows])
    right = attention_kernels._math_backward(grad, q[rows], k[rows], v[rows], out[rows], strided, causal=True)
    wrong = attention_kernels._math_backward(grad, q[rows], k[rows], v[rows], out[rows], as_cuda_reads, causal=True)
    assert (right[0][:, 1:] - wrong[0][:, 1:]).abs().max() > 0.1


@pytest.mark.parametrize("layout", ["heads_outer", "heads_inner"])
def test_the_efficient_kernel_reads_the_output_in_its_forward_layout(monkeypatch, layout):
    """CUDA's memory-efficient backward in half precision reads the output at the gradient's
    offsets after laying that out (B, S, H, hd): a (B, H, S, hd)-contiguous output (what padding or
    folding blocks gives) returned gradients off by up to 8e37 on an H200 (2026-12-04). The
    wrapper hands it the output in that layout, whatever it was given: checked here, with the
    CUDA call replaced by the math one on the CPU, for the arguments the kernel receives."""
    from torchmoe import _torch_private as private

    q, k, v = _block(dtype=torch.float64)
    out, lse = block_forward(q, k, v, causal=True)
    out = out.contiguous() if layout == "heads_outer" else attention_kernels.heads_inner(out)
    grad = torch.randn_like(out)
    received = {}

    def efficient_backward(grad, q, k, v, out, padded_lse, causal):
        received.update(out=out, lse=padded_lse)
        return attention_kernels._math_backward(grad, q, k, v, out, padded_lse[..., :q.shape[-2]], causal=causal)

    monkeypatch.setattr(attention_kernels, "kernel_for", lambda q: EFFICIENT)
    monkeypatch.setattr(private, "efficient_attention_cuda_backward", efficient_backward)
    got = block_backward(grad, q, k, v, out, lse, causal=True)
    given = received["out"]
    assert given.transpose(1, 2).is_contiguous() and torch.equal(given, out)
    assert received["lse"].shape == (2, 4, 32) and received["lse"].is_contiguous()  # padded to 32 rows
    monkeypatch.undo()
    for g, want in zip(got, attention_kernels._math_backward(grad, q, k, v, out, lse, causal=True)):
        torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)


def test_a_head_dim_that_is_not_contiguous_is_refused():
    q, k, v = _block()
    with pytest.raises(KernelLayoutError, match=r"q \(2, 4, 8, 16\) has strides .*the head dim \(last\) must be"):
        block_forward(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, causal=True)


def _dense(q, k_all, v_all, m):
    """fp64 softmax attention: every query sees the m prefix keys and its own block causally."""
    n = q.shape[-2]
    allowed = torch.ones(n, m + n, dtype=torch.bool)
    allowed[:, m:] = torch.ones(n, n, dtype=torch.bool).tril()
    groups = q.shape[1] // k_all.shape[1]
    k_all, v_all = k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1)
    scores = q @ k_all.transpose(-2, -1) * q.shape[-1] ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v_all


def test_math_backward_with_the_merged_log_sum_exp_is_the_dense_gradient():
    """The prefixed block's backward on the math definition: each block's backward with the
    merged output and log-sum-exp, query gradients summed, equals autograd through a dense fp64
    softmax over both blocks (1e-12). Each block's own log-sum-exp instead is far off: what this
    test exists to catch."""
    torch.manual_seed(0)
    m, n = 3, 5
    q = torch.randn(1, 4, n, 8, dtype=torch.float64, requires_grad=True)
    k_all, v_all = (torch.randn(1, 2, m + n, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, 4, n, 8, dtype=torch.float64)
    expected = torch.autograd.grad(_dense(q, k_all, v_all, m), (q, k_all, v_all), grad)

    kp, vp, kd, vd = k_all[..., :m, :], v_all[..., :m, :], k_all[..., m:, :], v_all[..., m:, :]
    out_p, lse_p = attention_kernels._math_forward(q, kp, vp, causal=False)
    out_d, lse_d = attention_kernels._math_forward(q, kd, vd, causal=True)
    lse = torch.logaddexp(lse_p, lse_d)
    out = torch.exp(lse_p - lse).unsqueeze(-1) * out_p + torch.exp(lse_d - lse).unsqueeze(-1) * out_d
    torch.testing.assert_close(out, _dense(q, k_all, v_all, m), rtol=0, atol=1e-12)

    def gradients(lse_prefix, lse_own):
        dq_p, dk_p, dv_p = attention_kernels._math_backward(grad, q, kp, vp, out, lse_prefix, causal=False)
        dq_d, dk_d, dv_d = attention_kernels._math_backward(grad, q, kd, vd, out, lse_own, causal=True)
        return dq_p + dq_d, torch.cat([dk_p, dk_d], -2), torch.cat([dv_p, dv_d], -2)

    for got, want in zip(gradients(lse, lse), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (gradients(lse_p, lse_d)[0] - expected[0]).abs().max() > 0.1


def test_the_prefixed_operator_on_the_math_fallback_is_the_dense_attention(monkeypatch):
    """With the math definition as the kernel (what fp64 on CUDA runs), the prefixed operator's
    output and gradients equal the dense fp64 attention."""
    monkeypatch.setattr(attention_kernels, "kernel_for", lambda q: MATH)
    torch.manual_seed(1)
    m, n = 4, 6
    q = torch.randn(2, 4, n, 8, dtype=torch.float64, requires_grad=True)
    k_all, v_all = (torch.randn(2, 2, m + n, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = attention.prefixed_causal_attention(q, k_all[..., :m, :], v_all[..., :m, :], k_all[..., m:, :],
                                              v_all[..., m:, :])
    ref = _dense(q, k_all, v_all, m)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k_all, v_all), grad),
                         torch.autograd.grad(ref, (q, k_all, v_all), grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_math_fallback_equals_the_cpu_kernel():
    """Devices without a fused kernel run the math definition: it agrees with CPU's flash kernel,
    forward (output and log-sum-exp) and backward, for both block kinds."""
    q, k, v = _block()
    grad = torch.randn_like(q)
    for causal in (False, True):
        out, lse = block_forward(q, k, v, causal=causal)
        math_out, math_lse = attention_kernels._math_forward(q, k, v, causal=causal)
        torch.testing.assert_close(math_out, out, rtol=0, atol=2e-6)
        torch.testing.assert_close(math_lse, lse, rtol=0, atol=2e-6)
        for got, expected in zip(attention_kernels._math_backward(grad, q, k, v, out, lse, causal=causal),
                                 block_backward(grad, q, k, v, out, lse, causal=causal)):
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)


class _Copies(TorchFunctionMode):
    """Counts the torch calls that copy a tensor's data (what a reshape that is not a view does)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("reshape", "flatten") and isinstance(result, torch.Tensor):
            self.copies += result.data_ptr() != args[0].data_ptr() or result.storage_offset() != args[0].storage_offset()
        return result


def test_whole_chunks_of_a_slice_are_attended_without_copies():
    """A slice of a longer row (rows 2 of them) cannot be folded into the batch as a view: its
    whole chunks go one call each, and nothing is copied (backward would keep the copies).
    Folding it would copy: the counter sees that, so it would see a wrong `_foldable`."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 32, heads, 8).transpose(1, 2) for heads in (4, 2, 2))
    span = (..., slice(8, 24), slice(None))  # two whole chunks of 8 inside the row
    assert not any(attention._foldable(t[span]) for t in (q, k, v))
    with _Copies() as counter:
        attention._whole_chunks(q[span], k[span], v[span], 8)
    assert counter.copies == 0
    with _Copies() as counter:
        attention.chunked_causal_attention(q[span], k[span], v[span], 8)
    assert counter.copies > 0
    assert all(attention._foldable(t) for t in (q, k, v))  # a whole row folds as a view
