"""Attention on fused CUDA kernels only: every layer kind and every context-parallel mode's
attention calls run with SDPA's math kernel excluded, and the planner's activation memory holds
on a Scout-shaped stack. Skipped (with the reason) where there is no GPU.

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
    from torchmoe.components.optimizer import build_optimizer
    from torchmoe.config.job_config import ActivationCheckpoint, Optimizer, Parallelism, Training
    from torchmoe.distributed.data_parallel import apply_autocast
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
