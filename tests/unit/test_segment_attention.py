"""Attention over packed segments given by cumulative lengths (`torchmoe.nn.segment_attention`):
the host operator against a dense fp64 reference, and the flash path's call of torch's
``varlen_attn`` checked on the CPU against what the CUDA kernel assumes (`tests.helpers.emulated_flash`).

    python -m pytest -q tests/unit/test_segment_attention.py

The reference builds its mask from the segment lists directly: a query sees the keys of its own
segment up to its position counted from the segment's end (bottom-right causal), nothing else.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers import HostReads, emulated_flash
from torchmoe.nn.segment_attention import packed, segment_attention

# (queries, keys) per segment: empty ones (padding and gaps), prefixed ones (more keys than
# queries), single tokens.
SEGMENTS = [(0, 0), (3, 3), (0, 2), (4, 6), (1, 1), (0, 0), (5, 5), (2, 7), (0, 0)]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(dtype=torch.float64):
    torch.manual_seed(0)
    cu_q, cu_k = _offsets([s[0] for s in SEGMENTS]), _offsets([s[1] for s in SEGMENTS])
    # As the model lays them out: (B, S, H, hd) projections seen as (B, H, S, hd), packed.
    q = packed(torch.randn(1, int(cu_q[-1]), 4, 8, dtype=dtype).transpose(1, 2))
    k, v = (packed(torch.randn(1, int(cu_k[-1]), 2, 8, dtype=dtype).transpose(1, 2)) for _ in range(2))
    return [t.detach().requires_grad_() for t in (q, k, v)], cu_q, cu_k


def _dense(q, k, v, cu_q, cu_k, window=None, sinks=None):
    """fp64 masked softmax attention over the packed tensors, the mask built from the segments:
    query i of a segment at key (keys - queries) + i sees its segment's keys up to there, the
    `window` latest of them when given; `sinks` (H,): one more column of each softmax, of that
    logit, whose value is zero."""
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for qa, qb, ka, kb in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        for i in range(qb - qa):
            last = ka + (kb - ka) - (qb - qa) + i  # the query's own key
            allowed[qa + i, max(ka, last - window + 1 if window else ka):last + 1] = True
    kx, vx = (t.repeat_interleave(q.shape[1] // t.shape[1], 1).transpose(0, 1) for t in (k, v))
    scores = (q.transpose(0, 1) @ kx.transpose(-2, -1) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
    return (scores.softmax(-1)[..., :k.shape[0]] @ vx).transpose(0, 1)


def test_the_host_operator_is_the_dense_attention():
    """Output and the gradients of q, k and v equal the dense fp64 attention (1e-12), with grouped
    query heads, empty segments, prefixed segments and the strided layouts the model passes."""
    (q, k, v), cu_q, cu_k = _inputs()
    out = segment_attention(q, k, v, cu_q, cu_k, cu_q, cu_k, max_q=5, max_k=7)
    ref = _dense(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_flash_path_hands_varlen_what_cuda_assumes():
    """On flash the same call is one ``varlen_attn``: its operands pass the CUDA kernel's checks
    (the stand-in asserts them) and the result is the host operator's."""
    (q, k, v), cu_q, cu_k = _inputs()
    reads = HostReads()
    with emulated_flash(reads) as calls, reads.counting():
        out = segment_attention(q, k, v, cu_q, cu_k, cu_q, cu_k, max_q=5, max_k=7)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert len(calls) == 1 and not reads.counts
    ref = _dense(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# Windows shorter than every segment, than some, of one key, and longer than any segment.
WINDOWS = [1, 2, 3, 100]


@pytest.mark.parametrize("flash", [False, True], ids=["host", "flash"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no_sinks"])
def test_windows_and_sinks_are_each_segment_s_own(flash, window, with_sinks):
    """gpt-oss's attention per segment: the sliding window counted from each segment's own keys
    (a prefix's included), the sink logits joined to each segment's softmax. Output and the
    gradients of q, k, v and the sinks equal the dense fp64 masked softmax with the sink column
    (1e-12), on the host operator and on flash's path (emulated: ``varlen_attn`` with
    ``window_size (W - 1, 0)`` and its log-sum-exp, flash's varlen backward given the joined
    output), with no host read there."""
    (q, k, v), cu_q, cu_k = _inputs()
    sinks = (torch.randn(q.shape[1], dtype=q.dtype, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
    sinks_in = sinks if with_sinks else None
    inputs = [q, k, v, *([sinks] if with_sinks else [])]
    reads = HostReads()
    with emulated_flash(reads) if flash else contextlib.nullcontext([]) as calls, reads.counting():
        out = segment_attention(q, k, v, cu_q, cu_k, cu_q, cu_k, max_q=5, max_k=7, window=window, sinks=sinks_in)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, grad)
    assert not flash or (len(calls) == 1 and calls[0][-1] == (window - 1, 0) and not reads.counts)
    ref = _dense(q, k, v, cu_q, cu_k, window, sinks_in)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for name, a, b in zip("qkvs", got, torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    if with_sinks:  # the sinks take a share of the softmax far beyond rounding
        assert (out - _dense(q, k, v, cu_q, cu_k, window)).abs().max() > 1e-2


def test_a_window_or_sinks_change_the_attention():
    """The reference can fail: a window of 2 and the sinks each move the output."""
    (q, k, v), cu_q, cu_k = _inputs()
    plain = segment_attention(q, k, v, cu_q, cu_k, cu_q, cu_k, max_q=5, max_k=7)
    windowed = segment_attention(q, k, v, cu_q, cu_k, cu_q, cu_k, max_q=5, max_k=7, window=2)
    assert (plain - windowed).abs().max() > 1e-2
    torch.testing.assert_close(windowed, _dense(q, k, v, cu_q, cu_k, 2), rtol=0, atol=1e-12)


def test_gradients_in_float64():
    """torch's gradcheck of the host operator's backward against finite differences."""
    (q, k, v), cu_q, cu_k = _inputs()
    assert torch.autograd.gradcheck(lambda *t: segment_attention(*t, cu_q, cu_k, cu_q, cu_k, max_q=5, max_k=7),
                                    (q, k, v))


def test_custom_operator_passes_opcheck():
    (q, k, v), cu_q, cu_k = _inputs(torch.float32)
    torch.library.opcheck(torch.ops.torchmoe.segment_attention, (q, k, v, cu_q, cu_k, cu_q, cu_k, None, 0, 5, 7))
    sinks = torch.randn(q.shape[1], requires_grad=True)
    torch.library.opcheck(torch.ops.torchmoe.segment_attention, (q, k, v, cu_q, cu_k, cu_q, cu_k, sinks, 3, 5, 7))


@pytest.mark.parametrize(("name", "make"), [
    ("cu_q", lambda cu: cu.long()), ("host_cu_k", lambda cu: cu.to("meta")), ("cu_k", lambda cu: cu[::2]),
])
def test_offsets_outside_the_contract_are_refused(name, make):
    """int32, contiguous, 1-D, on the expected device: what ``varlen_attn`` and the host loop read."""
    (q, k, v), cu_q, cu_k = _inputs()
    tables = {"cu_q": cu_q, "cu_k": cu_k, "host_cu_q": cu_q, "host_cu_k": cu_k}
    tables[name] = make(tables[name])
    with pytest.raises(ValueError, match=f"segment_attention: {name} must be a contiguous 1-D int32 tensor"):
        segment_attention(q, k, v, *tables.values(), max_q=5, max_k=7)
