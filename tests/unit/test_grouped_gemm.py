"""Routed experts' grouped GEMMs take any expert shape in any dtype (`nn.grouped_gemm`): every call
site, forward and backward, equals the per-expert loop, and every operand the kernel gets is in
the layout CUDA's kernel reads, address included (which CPU's kernel does not check).

    python -m pytest -q tests/unit/test_grouped_gemm.py

Dims are what Hugging Face folders and layouts give: a hidden size of 20 (`moe_intermediate_size`),
a model dim of 30, MoE TP's shard of 20 over 2 (10), odd adapter ranks. The reference is the
experts' own per-expert loop (``use_grouped_mm = False``: one ``mm`` per expert on contiguous
rows). bf16 and fp16 are bit-exact against it: CPU's half-precision GEMM gives the same bits for a
matrix on padded rows (measured: 0 of 32,229 products differ). fp32 is bit-exact where no operand
needs padding; where one does, CPU's BLAS picks its kernel by the rows' stride, and a product on
padded rows rounds otherwise: rtol 1e-5 (observed at most 2e-7 of the largest value).
"""

from __future__ import annotations

import pytest
import torch

import torchmoe._torch_private as private
from torchmoe.nn.experts import ClampedSwiGLUExperts, GroupedExperts
from torchmoe.nn.grouped_gemm import STRIDE_BYTES, fits_kernel, in_contract, kernel_layout, stride_multiple
from torchmoe.nn.lora import add_expert_adapters
from torchmoe.nn.moe_ops import grouped_mm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
COUNTS = [5, 0, 7, 9]  # rows per expert: an empty one; 21 rows


def _draw(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.3).to(dtype)


def _assert_equal_to_reference(got: torch.Tensor, want: torch.Tensor, padded: bool, what: str) -> None:
    """Bit-exact, but for fp32 products on padded rows (the module docstring's reason)."""
    if got.dtype == torch.float32 and padded:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=what)
    else:
        assert torch.equal(got, want), (what, (got - want).abs().max().item())


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[tuple, tuple]]:
    """Every call of torch's grouped GEMM, its operands held to CUDA's layout contract, and the
    output rows it leaves unspecified (past the last group: CUDA leaves them uninitialised)
    filled with 0.5, a value inside every activation's range (a NaN or a huge value would be
    clamped out by gpt-oss's activation and pass no gradient on): no gradient may read them."""
    calls = []
    real = private.grouped_mm

    def checked(a, b, offsets):
        for name, t in (("a", a), ("b", b)):
            assert in_contract(t), (name, tuple(t.shape), t.stride())
            assert t.data_ptr() % STRIDE_BYTES == 0, (name, t.data_ptr())  # CUDA's check, not CPU's
        calls.append((tuple(a.shape), tuple(b.shape)))
        out = real(a, b, offsets)
        if b.dim() == 3:  # (rows, N): rows past offsets[-1] belong to no group
            out[offsets[-1]:] = 0.5
        return out

    monkeypatch.setattr(private, "grouped_mm", checked)
    return calls


# ---- the contract ------------------------------------------------------------------------------


def _operands(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Row-major, column-major and other layouts, with aligned and unaligned leading strides."""
    base = _draw((6, 40), dtype, 0)
    return {
        "aligned rows": _draw((5, 16), dtype, 1),
        "rows of 20": _draw((5, 20), dtype, 2),
        "rows of 30": _draw((5, 30), dtype, 3),
        "weights (E, K=30, N=16) column-major": _draw((3, 16, 30), dtype, 4).transpose(-2, -1),
        "weights (E, K=16, N=20) column-major": _draw((3, 20, 16), dtype, 5).transpose(-2, -1),
        "a gradient's transpose (N=6, R)": _draw((9, 6), dtype, 6).t(),
        "a slice off the 16-byte grid": base[:, 1:17],
        "an expanded gradient (strides 0)": _draw((1, 16), dtype, 7).expand(5, 16),
        "every other column": base[:, ::2],
        "a rank-1 adapter's B_e transposed (E, 1, N=20), strides (N, 1, 1)":
            _draw((3, 20, 1), dtype, 8).transpose(-2, -1),
        "one column (R, 1), strides (1, 1)": _draw((9, 1), dtype, 10),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_layout_keeps_the_values_and_meets_the_contract(dtype: torch.dtype) -> None:
    """What `in_contract` accepts is passed on as it is; everything else becomes a copy with the
    same shape and values, in the contract, column-major where it was."""
    accepted = set()
    for name, t in _operands(dtype).items():
        laid = kernel_layout(t)
        assert laid.shape == t.shape and torch.equal(laid, t), name
        assert in_contract(laid) and laid.data_ptr() % STRIDE_BYTES == 0, (name, laid.stride())
        if in_contract(t):
            accepted.add(name)
            assert laid is t, name
        if t.stride(-2) == 1 and t.stride(-1) != 1:
            assert laid.stride(-2) == 1, (name, laid.stride())
    fp32 = dtype == torch.float32  # 20 fp32 elements are 80 bytes
    assert accepted == {"aligned rows", "weights (E, K=16, N=20) column-major", *(["rows of 20"] if fp32 else [])}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_contract_is_torch_s_own_check(dtype: torch.dtype) -> None:
    """`in_contract` says what torch's kernel says of an operand's strides (as the first operand
    of a (rows, K) x (E, K, N) product, and as its second): it accepts those `in_contract`
    accepts, raises "strides should be multiple of 16 bytes" (or "Invalid strides") on the
    others, and accepts every `kernel_layout`; the address aside (CPU's kernel does not check
    it; CUDA's does)."""
    for name, t in _operands(dtype).items():
        if t.storage_offset() * t.element_size() % STRIDE_BYTES:
            assert not in_contract(t), name
            t = t.clone()  # the strides alone
        for operand in (t, kernel_layout(t)):
            runs = {"rows": lambda m: private.grouped_mm(m, _draw((1, m.shape[1], 16), dtype, 9),
                                                         torch.tensor([m.shape[0]], dtype=torch.int32)),
                    "weights": lambda m: private.grouped_mm(kernel_layout(_draw((4, m.shape[0]), dtype, 9)),
                                                            m.unsqueeze(0), torch.tensor([4], dtype=torch.int32))}
            matrix = operand if operand.dim() == 2 else operand[0]
            for role, run in runs.items():
                if in_contract(matrix):
                    run(matrix)
                else:
                    with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes|Invalid strides"):
                        run(matrix)


def test_stride_multiples_and_which_experts_run_torch_s_op_as_they_are() -> None:
    """16 bytes: 8 bf16/fp16 elements, 4 fp32. torch's own bf16 op (the compiler's) runs K and N
    that are multiples; any other K or N goes to the padding custom op."""
    assert [stride_multiple(d) for d in DTYPES] == [4, 8, 8]
    bf16 = torch.bfloat16
    assert fits_kernel(torch.empty(7, 32, dtype=bf16), torch.empty(4, 16, 32, dtype=bf16))
    assert not fits_kernel(torch.empty(7, 30, dtype=bf16), torch.empty(4, 16, 30, dtype=bf16))  # K = 30
    assert not fits_kernel(torch.empty(7, 32, dtype=bf16), torch.empty(4, 20, 32, dtype=bf16))  # N = 20
    assert fits_kernel(torch.empty(7, 20), torch.empty(4, 12, 20))  # fp32: 20 and 12 are multiples of 4


# ---- the custom op -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(30, 20), (20, 6), (12, 36), (7, 5), (16, 16)])
def test_the_grouped_mm_op_equals_per_group_products(dtype, k, n, kernel_calls) -> None:
    """``torchmoe::grouped_mm`` forward, input gradient and weight gradient, per group."""
    counts = torch.tensor(COUNTS)
    offsets = counts.cumsum(0).to(torch.int32)
    x, w = _draw((21, k), dtype, 1).requires_grad_(), _draw((4, n, k), dtype, 2).requires_grad_()
    grad = _draw((21, n), dtype, 3)
    out = grouped_mm(x, w, offsets)
    out.backward(grad)
    rx, rw = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([rx[s:e] @ rw[g].T for g, (s, e) in enumerate(zip([0, *offsets[:-1].tolist()],
                                                                           offsets.tolist()))])
    ref.backward(grad)
    padded = k % stride_multiple(dtype) != 0 or n % stride_multiple(dtype) != 0
    _assert_equal_to_reference(out, ref, padded, "out")
    _assert_equal_to_reference(x.grad, rx.grad, padded, "x.grad")
    _assert_equal_to_reference(w.grad, rw.grad, padded, "w.grad")
    assert len(kernel_calls) == 3  # forward, input gradient, weight gradient


# ---- every call site -------------------------------------------------------------------------------


def _experts(kind: str, dim: int, hidden: int, rank: int | None, grouped: bool, dtype: torch.dtype):
    """`kind`'s experts (4) with drawn weights and, given a rank, drawn adapters on every projection."""
    experts = (GroupedExperts(dim, hidden, 4, grouped) if kind == "swiglu" else
               ClampedSwiGLUExperts(dim, hidden, 4, grouped, limit=0.7, alpha=1.702))
    if rank:
        add_expert_adapters(experts, experts.lora_shapes(), rank, alpha=6.0, dropout=0.0)
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(experts.named_parameters())):
            p.copy_(_draw(p.shape, torch.float32, 10 + i))
    return experts.to(dtype)


# (dim, hidden, adapter rank): a folder's hidden 20 under a model dim of 30; dim 36 / hidden 12
# (fp32-aligned, bf16 not) with rank 3; hidden 36 under dim 20 with rank 5; hidden 10, MoE TP 2's
# shard of 20; the shipped flavors' kind of dims (nothing padded) with rank 4.
SHAPES = [(30, 20, None), (36, 12, 3), (20, 36, 5), (30, 10, None), (32, 16, 4)]


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("kind", ["swiglu", "clamped"])
@pytest.mark.parametrize("dim, hidden, rank", SHAPES)
def test_experts_of_any_shape_equal_the_per_expert_loop(dtype, kind, dim, hidden, rank, kernel_calls) -> None:
    """SwiGLU experts (w1, w3, w2) and gpt-oss's clamped ones (interleaved w13 with its bias,
    w2 with its bias), with their adapters where a rank is given: the output and the gradients
    of the input, every weight, bias and adapter. Rows past the last block (whose GEMM outputs
    are left over here) reach no gradient: gpt-oss's biases gave them the last expert's, and its b13
    gradient took their values."""
    grouped, looped = (_experts(kind, dim, hidden, rank, g, dtype) for g in (True, False))
    counts = torch.tensor(COUNTS)
    x = _draw((24, dim), dtype, 1)  # 3 rows past the last block, as the dispatcher pads on CUDA
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = grouped(xg, counts)
    grad = _draw(tuple(out.shape), dtype, 2)
    grad[21:] = 0  # the dispatcher drops the padding rows' outputs
    out.backward(grad)
    looped(xl, counts).backward(grad)
    multiple = stride_multiple(dtype)
    padded = any(d % multiple for d in (dim, hidden, 2 * hidden, rank or multiple))
    _assert_equal_to_reference(out[:21], looped(x, counts)[:21], padded, "out")
    _assert_equal_to_reference(xg.grad[:21], xl.grad[:21], padded, "x.grad")
    reference = dict(looped.named_parameters())
    for name, p in grouped.named_parameters():
        _assert_equal_to_reference(p.grad, reference[name].grad, padded, name)
    # Every projection and adapter ran the grouped GEMM (the custom op's backward: 2 more each).
    forward = (3 if kind == "swiglu" else 2) + (4 if rank else 0)
    assert len(kernel_calls) >= forward


# ---- float8 experts (torchao's kernel is CUDA-only: a stand-in holds its asserts) -------------------


def _torchao_stand_in(calls: list):
    """`_to_fp8_rowwise_then_scaled_grouped_mm` as torchao asserts its operands (A (M, K) row-major,
    B_t (E, K, N) column-major, K and N multiples of 16, groups of 16 rows), computed without float8."""

    def grouped_mm(a, b_t, offsets, *, out_dtype, pad_token_groups_for_grouped_mm):
        assert a.size(-1) % 16 == 0 and b_t.size(-2) % 16 == 0 and b_t.size(-1) % 16 == 0, (a.shape, b_t.shape)
        assert a.stride(-1) == 1 and b_t.stride(-2) == 1, (a.stride(), b_t.stride())
        assert offsets.dtype == torch.int32 and not pad_token_groups_for_grouped_mm
        calls.append((tuple(a.shape), tuple(b_t.shape)))
        return private.grouped_mm(a, b_t, offsets)

    return grouped_mm


@pytest.mark.parametrize("kind", ["swiglu", "clamped"])
@pytest.mark.parametrize("dim, hidden", [(30, 20), (36, 10), (32, 16)])
def test_float8_experts_pad_any_shape_to_torchao_s_tiles(kind, dim, hidden, monkeypatch) -> None:
    """Float8 experts (`distributed.float8._float8_grouped_mm`, rows padded to 16 per expert by
    the dispatcher) hand torchao K and N padded to 16; the output and every gradient equal the
    per-expert loop. fp32 within 1e-5: zero columns change the contraction's length, and CPU's
    BLAS blocks it otherwise (observed at most 3.3e-7 of the largest value)."""
    import torchmoe.distributed.float8 as float8
    from torchmoe.nn.dispatch import TokenDispatcher

    calls: list = []
    monkeypatch.setattr(float8, "_torchao_grouped_mm", lambda: _torchao_stand_in(calls))
    grouped, looped = (_experts(kind, dim, hidden, None, g, torch.float32) for g in (True, False))
    grouped.float8_grouped_mm = float8._float8_grouped_mm
    counts = torch.tensor(COUNTS)
    x = _draw((21, dim), torch.float32, 1)
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    dispatcher = TokenDispatcher(num_experts=4, top_k=1)
    out = dispatcher.run_local_experts(xg, counts, grouped)
    ref = dispatcher.run_local_experts(xl, counts, looped)
    grad = _draw(tuple(out.shape), torch.float32, 2)
    out.backward(grad)
    ref.backward(grad)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(xg.grad, xl.grad, **tol)
    reference = dict(looped.named_parameters())
    for name, p in grouped.named_parameters():
        torch.testing.assert_close(p.grad, reference[name].grad, **tol, msg=name)
    tile = lambda d: -(-d // 16) * 16  # noqa: E731
    widths = [hidden, hidden] if kind == "swiglu" else [2 * hidden]
    assert [b[1:] for _, b in calls] == [(tile(dim), tile(n)) for n in widths] + [(tile(hidden), tile(dim))]
