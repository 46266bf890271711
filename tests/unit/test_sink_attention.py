"""gpt-oss's attention (`nn.sink_attention`): sinks and sliding windows by the fused kernels, exact
to the softmax over an explicit mask with the sink column (the definition transformers' eager
gpt-oss computes), forward and every gradient; decoding's math path equal to it; the custom
operator's fake kernel and real one agreeing (what torch.compile relies on)."""

from __future__ import annotations

import pytest
import torch

from torchmoe.nn.attention_kernels import CALLS
from torchmoe.nn.sink_attention import cached_sink_attention, sink_attention


def _reference(q, k, v, sinks, window):
    """The definition: scores masked to the causal window, the sink logit as one more column,
    softmax, the sink's column dropped (fp64 in, fp64 out). The n queries sit at the last n of
    the keys' positions (a prefix before them when k is longer)."""
    b, h, n, hd = q.shape
    s = k.shape[-2]
    keys, values = (t.repeat_interleave(h // t.shape[1], 1) for t in (k, v))
    scores = q @ keys.transpose(-1, -2) * hd**-0.5
    i, j = torch.arange(s - n, s).unsqueeze(-1), torch.arange(s)
    hidden = j > i
    if window is not None:
        hidden |= j <= i - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(b, h, n, 1)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., :s] @ values


def _inputs(seq: int, heads: int = 4, kv_heads: int = 2, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # q laid out as (B, S, H, hd) in memory, as the model's projections give it.
    q = torch.randn(2, seq, heads, 8, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, kv_heads, seq, 8, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    sinks = (torch.randn(heads, generator=g, dtype=dtype) * 2).requires_grad_()
    return q, k, v, sinks


# Windows of several blocks, a length that is not a whole number of them (padded), a window of
# one position (no band), a window as long as the row or longer (plain causal), no window.
CASES = [(16, 4), (13, 4), (10, 3), (7, 1), (9, 9), (9, 16), (12, None)]


@pytest.mark.parametrize(("seq", "window"), CASES)
@pytest.mark.parametrize("with_sinks", [True, False])
def test_forward_and_gradients_are_the_definitions(seq, window, with_sinks):
    q, k, v, sinks = _inputs(seq)
    sinks = sinks if with_sinks else None
    out = sink_attention(q, k, v, sinks, window)
    ref = _reference(q, k, v, sinks, window)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    got = torch.autograd.grad((out * grad).sum(), inputs)
    want = torch.autograd.grad((ref * grad).sum(), inputs)
    for name, a, b in zip("qkvs", got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11, msg=name)


def test_the_fused_kernels_run_and_the_sinks_matter():
    """fp32 on CPU: torch's flash kernel runs both blocks of each window (no math fallback), and
    each sink moves the output far beyond fp32 rounding."""
    q, k, v, sinks = (t.detach().float() for t in _inputs(16))
    before = CALLS["cpu_flash"]
    out = sink_attention(q, k, v, sinks, 4)
    assert CALLS["cpu_flash"] - before == 2
    torch.testing.assert_close(out.double(), _reference(q.double(), k.double(), v.double(), sinks.double(), 4),
                               rtol=1e-5, atol=1e-6)
    assert (out - sink_attention(q, k, v, None, 4)).abs().max() > 1e-2


@pytest.mark.parametrize("window", [4, None])
def test_decoding_math_path_is_the_full_forward(window):
    """The last n queries over every cached key (decoding) give the full forward's rows."""
    q, k, v, sinks = (t.detach() for t in _inputs(13))
    full = sink_attention(q, k, v, sinks, window)
    for n in (1, 5):
        tail = cached_sink_attention(q[..., -n:, :], k, v, sinks, window)
        torch.testing.assert_close(tail, full[..., -n:, :], rtol=1e-12, atol=1e-12)


def test_the_operator_passes_opcheck():
    """The fake kernel's shapes and strides are the real one's, and autograd is registered right
    (torch.library.opcheck: schema, fake tensor, autograd registration)."""
    q, k, v, sinks = _inputs(13, dtype=torch.float32)
    torch.library.opcheck(torch.ops.torchmoe.sink_attention.default, (q, k, v, sinks, 4))
    torch.library.opcheck(torch.ops.torchmoe.sink_attention.default, (q, k, v, sinks, 0))


def test_the_output_is_laid_out_for_the_output_projection():
    """(B, H, S, hd) with (B, S, H, hd) memory: the output projection's input is a free view."""
    q, k, v, sinks = _inputs(16)
    out = sink_attention(q, k, v, sinks, 4)
    assert out.transpose(1, 2).is_contiguous()


# (queries, prefix keys, window): a prefix shorter than the window, as long as its W - 1 keys, longer
# (its first keys seen by no query), a window longer than the span (plain causal), no window.
PREFIXED = [(8, 2, 4), (8, 3, 4), (9, 7, 3), (5, 6, 16), (6, 5, None), (16, 4, 1)]


@pytest.mark.parametrize(("n", "m", "window"), PREFIXED)
def test_queries_after_a_prefix_are_the_definition(n, m, window):
    """Context parallelism's pieces: queries at the last n of m + n key positions, the window
    reaching into the prefix. Output and every gradient (the prefix keys' included, zero where no
    query sees them) equal the definition's in fp64."""
    q, k, v, sinks = _inputs(m + n)
    q = q[..., m:, :]
    out = sink_attention(q, k, v, sinks, window)
    ref = _reference(q, k, v, sinks, window)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad((out * grad).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref * grad).sum(), (q, k, v, sinks))
    for name, a, b in zip("qkvs", got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11, msg=name)
    # The rows of the whole span's attention (the test can fail: without the prefix they differ).
    whole = sink_attention(*_inputs(m + n)[:3], sinks.detach(), window)[..., m:, :]
    torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)
    alone = sink_attention(q, k[..., m:, :], v[..., m:, :], sinks, window)
    assert window == 1 or (out - alone).abs().max() > 1e-3
