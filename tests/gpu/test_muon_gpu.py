"""Muon on CUDA: the routed experts' batched Newton-Schulz (one bmm over the local experts) against
each expert's matrix alone (torch's 2-D path, what `torch.optim.Muon` runs), on cuBLAS, in both NS
dtypes. On CPU the two are bit for bit equal (tests/unit/test_muon.py); cuBLAS may pick another
kernel for a batched GEMM than for a single one, so here the bound is the dtype's rounding and the
test says whether they are bit-identical. Skipped (with the reason) where there is no GPU.

    python -m pytest -q tests/gpu/test_muon_gpu.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

from torchmoe.optim.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, newton_schulz

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(8, 256, 512), (8, 512, 256), (4, 1408, 2048)])  # wide, tall, DeepSeek-like
def test_batched_experts_orthogonalise_as_each_expert_alone(dtype: torch.dtype, rtol: float, shape, record_property):
    g = torch.Generator(device="cuda").manual_seed(0)
    stack = torch.randn(shape, device="cuda", generator=g)
    batched = newton_schulz(stack, NS_COEFFICIENTS, NS_STEPS, NS_EPS, dtype).float()
    alone = torch.stack([newton_schulz(m, NS_COEFFICIENTS, NS_STEPS, NS_EPS, dtype) for m in stack]).float()
    record_property("bit_identical", bool(torch.equal(batched, alone)))
    worst = ((batched - alone).abs().amax(dim=(-2, -1)) / alone.abs().amax(dim=(-2, -1))).max().item()
    record_property("max_relative_difference", worst)
    assert worst <= rtol, worst
