"""Attention on fused CUDA kernels only: every layer kind and every context-parallel mode's
attention calls run with SDPA's math kernel excluded; document masking in bf16 and fp16 on
flash's varlen kernel (forward and the three gradients) against each document alone, with CP
prefixes, and in fp32 on the memory-efficient kernel; gpt-oss's sinks and windows within documents
on the same kernels (flash's varlen backward given the sinks' joined output); torchmoe's own math fallback never runs
where a fused kernel should; and the planner's activation memory holds on a Scout-shaped stack.
Skipped (with the reason) where there is no GPU.

    python -m pytest -q tests/gpu/test_attention_gpu.py -m gpu

The math kernel is SDPA's fallback for whatever the fused kernels refuse (a mask tensor, grouped
query heads on the memory-efficient kernel): it materialises the score matrix, which at long
context is gigabytes per head. Excluding it (`sdpa_kernel` without `SDPBackend.MATH`) turns such
a fallback into an error. The prefixed blocks (`torchmoe.nn.attention`) call the flash or
memory-efficient kernels directly.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.unit.test_attention import CASES, _inputs, _reference, _run
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.nn.attention_kernels import CALLS
from torchmoe.nn.document_attention import AttentionCall, document_attention, document_segments, document_starts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


@pytest.mark.parametrize(("start", "n", "chunk"), CASES)
def test_every_attention_kind_runs_on_fused_kernels(start, n, chunk):
    """The calls of each kind (plain causal, a piece of a longer sequence with its prefix, whole
    chunks folded or one by one, a first chunk with its halo, a partial last chunk) in bf16 with
    grouped query heads, forward and backward, without the math kernel; against the fp32 masked
    reference on the host (bf16 resolution: 3e-2 absolute at values of order 1)."""
    torch.manual_seed(0)
    (q, k, v), m = _inputs(start, n, chunk)
    ref = _reference(q, k, v, start, chunk)
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    cuda = [t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(FUSED):
        out = _run(*cuda, m, start, chunk)
        got = torch.autograd.grad(out, cuda, grad.cuda().bfloat16())
    torch.testing.assert_close(out.float().cpu(), ref, rtol=0, atol=3e-2)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.float().cpu(), e, rtol=0, atol=3e-2)


def test_prefixed_blocks_in_fp32_use_the_memory_efficient_kernel():
    """fp32 (flash takes fp16/bf16 only): the prefixed operator runs the memory-efficient kernel
    with repeated key/value heads; fp32 accuracy against the host reference."""
    torch.manual_seed(0)
    (q, k, v), m = _inputs(12, 20, 8)
    prefix, keys = (k[..., :m, :], v[..., :m, :]), (k[..., m:, :], v[..., m:, :])
    ref = _reference(q, k, v, 12, 8)[..., :4, :]  # the first chunk's queries: the prefixed block
    from torchmoe.nn.attention import prefixed_causal_attention

    args = [t.detach().cuda() for t in (q[..., :4, :], *prefix, keys[0][..., :4, :], keys[1][..., :4, :])]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = prefixed_causal_attention(*args)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=1e-5)


def _kernels_during(fn):
    """What `fn` returns, and the kernel calls it made (`nn.attention_kernels.CALLS`)."""
    before = CALLS.copy()
    result = fn()
    return result, CALLS - before


# Rows of documents of 20, 100, 9, 127 and 64, 1, 191 tokens (EOS = 1): shorter, as long as and
# longer than the 64-token chunks, some crossing chunk boundaries.
def _document_rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(2, 500, (2, 256), generator=gen)
    for b, lengths in enumerate(([20, 100, 9, 127], [64, 1, 191])):
        rows[b, torch.tensor(lengths).cumsum(0)[:-1] - 1] = 1
    return rows


def _alone(q, k, v, starts, chunk, lo):
    """fp32 reference for queries from `lo`: each (document, chunk) window of each row attended
    alone by SDPA's causal kernel over the window's keys, from the window start on."""
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2] - lo, q.shape[3], device=q.device)
    groups = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        pos = torch.arange(q.shape[2], device=q.device)
        window = starts[b].to(q.device) if chunk is None else torch.maximum(starts[b].to(q.device), pos // chunk * chunk)
        for w in window[lo:].unique().tolist():
            rows = (window == w).nonzero().flatten()
            first, last = max(int(rows[0]), lo), int(rows[-1]) + 1
            qs = q[b:b + 1, :, first:last].float()
            ks, vs = (t[b:b + 1, :, w:last].float().repeat_interleave(groups, 1) for t in (k, v))
            # Queries [first, last) over keys [w, last): each sees the keys up to its own position.
            mask = torch.arange(last - w, device=q.device)[None, :] <= torch.arange(first - w, last - w,
                                                                                    device=q.device)[:, None]
            out[b, :, first - lo:last - lo] = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(("chunk", "lo"), [(None, 0), (64, 0), (None, 96), (64, 96)],
                         ids=["documents", "chunks", "cp_prefix", "cp_prefix_chunks"])
def test_document_masking_on_fused_kernels_equals_each_document_alone(dtype, chunk, lo):
    """Documents (and chunks), whole rows or a later piece with its prefix (context parallelism),
    8 query heads over 4 key/value heads of 64: output and the q, k, v gradients against each
    window attended alone in fp32 (bf16/fp16 resolution: 3e-2 absolute at values of order 1,
    and 1e-2 relative beyond: a bf16 gradient of 7.0 came 4.9e-3 relative off on an H200,
    2026-12-04; fp32 1e-4). bf16/fp16 run flash's varlen kernel, fp32 the memory-efficient one; torchmoe's
    math fallback never."""
    torch.manual_seed(0)
    rows = _document_rows()
    starts = document_starts(rows, 1)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    base = 0 if chunk is None else lo // chunk * chunk
    segments = document_segments(starts, [AttentionCall(chunk, lo, 256 - lo, lo - base)], torch.device("cuda"))
    prefix = (k[..., base:lo, :], v[..., base:lo, :]) if lo > base else None

    def run():
        out = document_attention(q[..., lo:, :], k[..., lo:, :], v[..., lo:, :], segments, chunk=chunk, start=lo,
                                 prefix=prefix)
        return out, torch.autograd.grad(out, (q, k, v), grad)

    grad = torch.randn(2, 8, 256 - lo, 64, device="cuda", dtype=dtype)
    (out, grads), kernels = _kernels_during(run)
    assert kernels["math"] == 0, kernels
    assert kernels["flash_varlen"] if dtype != torch.float32 else kernels["efficient"], kernels
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _alone(qf, kf, vf, starts, chunk, lo)
    expected = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    atol, rtol = (1e-4, 0) if dtype == torch.float32 else (3e-2, 1e-2)
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("window", "lo"), [(8, 0), (150, 0), (None, 0), (8, 96), (None, 96)],
                         ids=["window8", "window150", "sinks_only", "cp_prefix_window8", "cp_prefix"])
def test_sinks_and_windows_within_documents_on_fused_kernels(dtype, window, lo):
    """gpt-oss's attention under document masking, 8 query heads over 4 key/value heads of 64,
    whole rows or a later piece with its prefix (the W - 1 keys before it on a windowed layer):
    bf16 runs flash's varlen kernel forward (its window and log-sum-exp) and its varlen backward
    given the sinks' joined output (`_torch_private.flash_varlen_attention_backward`), fp32 the
    memory-efficient kernel per segment; torchmoe's math fallback never. Output and the q, k, v
    and sink gradients against the sink operator on each document alone in fp64 on the host
    (bf16 resolution as above; fp32 1e-4)."""
    from torchmoe.nn.document_attention import whole_row_calls
    from torchmoe.nn.sink_attention import sink_attention

    torch.manual_seed(0)
    rows = _document_rows()
    starts = document_starts(rows, 1)
    q = torch.randn(2, 8, 256, 64, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 256, 64, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(8, dtype=torch.float64) * 2
    grad = torch.randn(2, 8, 256 - lo, 64, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = torch.cat([torch.cat([sink_attention(ref_in[0][b:b + 1, :, s:e], ref_in[1][b:b + 1, :, s:e],
                                               ref_in[2][b:b + 1, :, s:e], ref_in[3], window)
                                for s, e in _spans(starts[b])], dim=-2) for b in range(2)])[..., lo:, :]
    expected = torch.autograd.grad(ref, ref_in, grad)
    cuda = [t.cuda().to(dtype).requires_grad_() for t in (q, k, v)]
    cuda_sinks = sinks.float().cuda().requires_grad_()
    m = 0 if lo == 0 else lo if window is None else min(window - 1, lo)
    calls = [AttentionCall(None, lo, 256 - lo, m, window)] if lo else whole_row_calls([(None, window)], 256)
    segments = document_segments(starts, calls, torch.device("cuda"))

    def run():
        qc, kc, vc = cuda
        prefix = (kc[..., lo - m:lo, :], vc[..., lo - m:lo, :]) if m else None
        out = document_attention(qc[..., lo:, :], kc[..., lo:, :], vc[..., lo:, :], segments, start=lo,
                                 prefix=prefix, window=window, sinks=cuda_sinks)
        return out, torch.autograd.grad(out, [*cuda, cuda_sinks], grad.cuda().to(dtype))

    (out, got), kernels = _kernels_during(run)
    assert kernels["math"] == 0, kernels
    assert kernels["flash_varlen"] == 2 if dtype == torch.bfloat16 else kernels["efficient"], kernels
    atol, rtol = (1e-4, 0) if dtype == torch.float32 else (3e-2, 1e-2)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=rtol, atol=atol)
    for name, g, e in zip("qkvs", got, expected):
        # A sink's gradient sums a share of every query's row: in bf16, 3% of the largest (0.11 of
        # 6.7 seen with torch's CPU kernels in bf16, 2026-12-07).
        if name == "s" and dtype == torch.bfloat16:
            atol, rtol = 3e-2 * e.abs().max().item(), 0
        torch.testing.assert_close(g.double().cpu(), e, rtol=rtol, atol=atol, msg=name)


def _spans(starts: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each document of a row from its (S,) document starts."""
    firsts = sorted(set(starts.tolist()))
    return list(zip(firsts, firsts[1:] + [starts.shape[0]]))


@pytest.mark.parametrize("backends", [[SDPBackend.FLASH_ATTENTION], [SDPBackend.EFFICIENT_ATTENTION]],
                         ids=["flash", "efficient"])
def test_prefixed_blocks_run_the_fused_kernel_asked_for(backends):
    """A CP piece's prefixed block (bf16) on the flash kernel, then with flash switched off on the
    memory-efficient one: that kernel ran, torchmoe's math fallback never; output within bf16's
    resolution of the fp32 masked reference."""
    from torchmoe.nn.attention import prefixed_causal_attention

    torch.manual_seed(0)
    (q, k, v), m = _inputs(12, 20, 8)
    ref = _reference(q, k, v, 12, 8)[..., :4, :]
    args = [t.detach().cuda().bfloat16() for t in (q[..., :4, :], k[..., :m, :], v[..., :m, :], k[..., m:m + 4, :],
                                                   v[..., m:m + 4, :])]
    with sdpa_kernel(backends):
        out, kernels = _kernels_during(lambda: prefixed_causal_attention(*args))
    name = "flash" if backends == [SDPBackend.FLASH_ATTENTION] else "efficient"
    assert kernels[name] == 2 and kernels["math"] == 0, kernels
    torch.testing.assert_close(out.float().cpu(), ref, rtol=0, atol=3e-2)


@pytest.mark.parametrize("seq", [256, 320])
def test_the_model_trains_without_the_math_kernel(seq):
    """The tiny flavor's chunked layers (64-token chunks: 256 whole, 320 with a partial last
    chunk) and its NoPE layer, bf16, forward and backward, with the math kernel excluded."""
    model = Transformer(FLAVORS["tiny"]).cuda().bfloat16()
    model.init_weights(seed=0)
    tokens = torch.randint(0, FLAVORS["tiny"].vocab_size, (2, seq), device="cuda")
    with sdpa_kernel(FUSED):
        model(tokens).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_peak_memory_follows_the_planner_on_a_scout_stack():
    """Two Scout blocks (the second NoPE: full causal attention over 32K tokens) trained as
    `torchmoe train` trains on one GPU (bf16 autocast, fp32 master weights, fused AdamW), with the
    math kernel excluded: the second step's peak allocated memory within 10% of the planner's
    total (which assumes flash-like attention: no score matrix)."""
    import importlib.util

    from tests.helpers import REPO
    from torchmoe.config.job_config import ActivationCheckpoint, Optimizer, Parallelism, Training
    from torchmoe.distributed.data_parallel import apply_autocast
    from torchmoe.optim.optimizer import build_optimizer
    from torchmoe.plan.memory import estimate_memory

    spec = importlib.util.spec_from_file_location("bench_scout_stack", REPO / "scripts" / "bench_scout_stack.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seq = 32768
    args = bench.stack_args("scout", 2, 32768)
    training = Training(local_batch_size=1, seq_len=seq, mixed_precision_param="bfloat16")
    degrees = dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1)
    planned = estimate_memory(args, degrees, training, ActivationCheckpoint(mode="none"), Parallelism())["total"]
    if planned > 0.9 * torch.cuda.get_device_properties(0).total_memory / 2**30:
        pytest.skip(f"the stack needs {planned:.0f} GiB; this GPU is smaller")
    model = bench.fast_init(args, torch.device("cuda"))
    apply_autocast(model, training)  # fp32 weights, bf16 compute
    optimizer = build_optimizer(model, Optimizer())
    tokens = torch.randint(0, args.vocab_size, (1, seq + 1), device="cuda")
    with sdpa_kernel(FUSED):
        for step in range(2):
            torch.cuda.reset_peak_memory_stats()
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            del logits
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated() / 2**30
    assert abs(measured - planned) <= 0.1 * planned, (measured, planned)


@pytest.mark.parametrize("backends", [[SDPBackend.FLASH_ATTENTION], [SDPBackend.EFFICIENT_ATTENTION]],
                         ids=["flash", "efficient"])
@pytest.mark.parametrize(("seq", "window"), [(512, 128), (500, 128), (256, None)])
def test_sink_attention_runs_the_fused_kernel_asked_for(backends, seq, window):
    """gpt-oss's sinks and windows (`nn.sink_attention`) in bf16 with grouped heads: a window's
    own and band blocks (two calls forward, two backward) or one causal call per direction on the
    kernel asked for, the math fallback never; output and every gradient (the sinks' included)
    within bf16's resolution of the fp64 definition on the host."""
    from tests.unit.test_sink_attention import _inputs as sink_inputs
    from tests.unit.test_sink_attention import _reference as sink_reference
    from torchmoe.nn.sink_attention import sink_attention

    q, k, v, sinks = sink_inputs(seq, heads=8, kv_heads=2)
    ref = sink_reference(q, k, v, sinks, window)
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v, sinks), grad)
    cuda = [t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v)]
    cuda_sinks = sinks.detach().float().cuda().requires_grad_()
    with sdpa_kernel(backends):
        def run():
            out = sink_attention(*cuda, cuda_sinks, window)
            return out, torch.autograd.grad(out, [*cuda, cuda_sinks], grad.cuda().bfloat16())
        (out, got), kernels = _kernels_during(run)
    name = "flash" if backends == [SDPBackend.FLASH_ATTENTION] else "efficient"
    assert kernels[name] == (4 if window is not None else 2) and kernels["math"] == 0, kernels
    torch.testing.assert_close(out.float().cpu(), ref.float(), rtol=0, atol=3e-2)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.float().cpu(), e.float(), rtol=3e-2, atol=5e-2)
