"""Mask-free causal attention (`torchmoe.nn.attention`) against attention with an explicit mask.

    python -m pytest -q tests/unit/test_attention.py

The reference is torch's SDPA given the dense boolean mask of the same attention (causal, within
chunks, over the keys from the first query's chunk start): the computation fused GPU kernels
refuse, and which `causal_attention` replaces by mask-free calls merged by their log-sum-exp.
Every call of the code under test runs with masks refused (`refusing_attention_masks`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import refusing_attention_masks
from torchmoe.nn.attention import causal_attention, prefixed_causal_attention

# (start, queries, chunk): queries at [start, start + n); the prefix reaches back to the chunk start.
CASES = [
    (0, 16, None),  # plain causal
    (8, 8, None),  # a later piece of a sequence: prefix [0, 8) and its own keys
    (24, 8, None),
    (16, 16, 8),  # starts on a chunk boundary: no prefix, two whole chunks
    (12, 20, 8),  # a partial first chunk with a prefix, one whole chunk, a partial last chunk
    (5, 3, 8),  # all queries inside the first chunk
    (0, 20, 8),  # the sequence ends in a partial chunk (no CP)
    (3, 40, 8),  # several whole chunks between a prefixed head and a tail
]


def _reference(q, k_all, v_all, start: int, chunk: int | None):
    """SDPA with the dense mask: keys at [start - m, start + n)."""
    n, m = q.shape[-2], k_all.shape[-2] - q.shape[-2]
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(start - m, start + n)[None, :]
    mask = qpos >= kpos
    if chunk is not None:
        mask &= qpos // chunk == kpos // chunk
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)


def _inputs(start: int, n: int, chunk: int | None, dtype: torch.dtype = torch.float32, *, transposed: bool = True):
    """q (2, 4, n, 16), and keys/values (2, 2, m + n, 16) from the first query's chunk start, laid
    out as the model makes them (transposed (B, S, H, hd) projections) unless `transposed` is off."""
    m = start % chunk if chunk is not None else start
    shape = lambda heads, length: (2, length, heads, 16) if transposed else (2, heads, length, 16)
    make = lambda heads, length: torch.randn(shape(heads, length), dtype=dtype)
    q, k, v = make(4, n), make(2, m + n), make(2, m + n)
    if transposed:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return [t.detach().requires_grad_() for t in (q, k, v)], m


def _run(q, k_all, v_all, m: int, start: int, chunk: int | None):
    prefix = (k_all[..., :m, :], v_all[..., :m, :]) if m else None
    return causal_attention(q, k_all[..., m:, :], v_all[..., m:, :], chunk=chunk, start=start, prefix=prefix)


@pytest.mark.parametrize("transposed", [True, False], ids=["projections", "contiguous"])
@pytest.mark.parametrize(("start", "n", "chunk"), CASES)
def test_causal_attention_equals_masked_sdpa(start, n, chunk, transposed):
    """Output and the gradients of q, k and v within 2e-6 (fp32 summation order), with grouped
    query heads (4 over 2); on inputs laid out as the model's (whole chunks folded into the batch)
    and contiguous ones (one call per chunk)."""
    torch.manual_seed(0)
    (q, k, v), m = _inputs(start, n, chunk, transposed=transposed)
    with refusing_attention_masks():
        out = _run(q, k, v, m, start, chunk)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = _reference(q, k, v, start, chunk)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    for g, e, name in zip(got, expected, "qkv"):
        torch.testing.assert_close(g, e, rtol=0, atol=2e-6, msg=name)


@pytest.mark.parametrize(("start", "n", "chunk"), [(12, 20, 8), (8, 16, None)])
def test_bf16_tracks_fp32(start, n, chunk):
    """bf16 inputs: the merge runs in fp32; the output stays within bf16's resolution of the fp32
    result (observed 8e-3 at values of order 1, one bf16 step; bound 2e-2)."""
    torch.manual_seed(0)
    (q, k, v), m = _inputs(start, n, chunk)
    with refusing_attention_masks():
        fp32 = _run(q, k, v, m, start, chunk)
        bf16 = _run(*(t.bfloat16() for t in (q, k, v)), m, start, chunk)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, rtol=0, atol=2e-2)


def test_prefixed_attention_gradients_in_float64():
    """torch's gradcheck of the custom operator's backward (the block backwards with the merged
    output and log-sum-exp) against finite differences, in float64."""
    torch.manual_seed(0)
    make = lambda heads, length: torch.randn(1, heads, length, 8, dtype=torch.float64, requires_grad=True)
    inputs = (make(4, 5), make(2, 3), make(2, 3), make(2, 5), make(2, 5))
    assert torch.autograd.gradcheck(prefixed_causal_attention, inputs)


def test_custom_operator_passes_opcheck():
    """Schema, fake kernel (what torch.compile traces with) and autograd registration of the
    operator, by torch's own checker."""
    torch.manual_seed(0)
    make = lambda heads, length: torch.randn(2, heads, length, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.torchmoe.prefixed_causal_attention,
                          (make(4, 6), make(2, 10), make(2, 10), make(2, 6), make(2, 6)))


def test_compiles_into_one_graph():
    """A prefixed head, whole chunks and a tail compile without a graph break (the operator is one
    node) and give the eager result, forward and backward."""
    torch.manual_seed(0)
    (q, k, v), m = _inputs(12, 20, 8)
    compiled = torch.compile(lambda *t: _run(*t, m, 12, 8), backend="aot_eager", fullgraph=True)
    with refusing_attention_masks():
        out = compiled(q, k, v)
        eager = _run(q, k, v, m, 12, 8)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(eager, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_prefix_of_the_wrong_length_is_refused():
    """The caller must pass exactly the keys from the first query's chunk start."""
    (q, k, v), _ = _inputs(12, 20, 8)
    with pytest.raises(ValueError, match="see 4 earlier keys, but the prefix holds 3"):
        causal_attention(q, k[..., 4:, :], v[..., 4:, :], chunk=8, start=12, prefix=(k[..., 1:4, :], v[..., 1:4, :]))
