"""CUDA-only paths: bf16 grouped GEMM with 16-row block padding, a training run on one GPU,
float8 conversion, and the GPU's metrics. Skipped (with the reason) where there is no GPU.

    python -m pytest -q tests/gpu -m gpu
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from tests.launch import metrics_by_step, run_train
from torchmoe.models.llama4 import FLAVORS, MoE
from torchmoe.nn.init import init_parameters

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_grouped_bf16_with_block_padding_matches_loop():
    """On CUDA expert blocks are padded to 16 rows for the grouped GEMM; outputs and gradients
    must still equal the per-expert loop (bf16: 1e-2 relative, a few ulps)."""
    torch.manual_seed(0)  # for the inputs below
    grouped = MoE(FLAVORS["tiny"]).cuda().bfloat16()
    init_parameters(grouped, grouped.param_inits(0.02), seed=0)
    grouped.reset_router_state("cuda")
    looped = MoE(FLAVORS["tiny"].replace(use_grouped_mm=False)).cuda().bfloat16()
    looped.load_state_dict(grouped.state_dict())
    x = torch.randn(4, 100, 128, device="cuda", dtype=torch.bfloat16)  # 400 tokens: ragged blocks
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_g, out_l = grouped(xg), looped(xl)
    grad = torch.randn_like(out_g)
    out_g.backward(grad)
    out_l.backward(grad)
    for a, b in ((out_g, out_l), (xg.grad, xl.grad), (grouped.experts.w1.grad, looped.experts.w1.grad)):
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= 1e-2


def test_init_on_cuda_equals_cpu():
    """Weights are drawn on the host and copied: a CUDA model holds the CPU model's values exactly."""
    from torchmoe.models.llama4 import Transformer

    models = {}
    for device in ("cpu", "cuda"):
        with torch.device("meta"):
            models[device] = Transformer(FLAVORS["tiny"])
        models[device].to_empty(device=device)
        models[device].init_weights(seed=3)
    for (name, want), got in zip(models["cpu"].named_parameters(), models["cuda"].parameters()):
        assert got.is_cuda and torch.equal(got.cpu(), want), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_on_one_gpu_logs_mfu(tmp_path, dtype):
    """One GPU, no FSDP: bf16 runs under autocast. MFU is against the peak of the dtype that ran."""
    from torchmoe.metrics.metrics import device_peak_flops

    run_train(["--config", DEBUG_CONFIG, "--training.device", "cuda", "--training.steps", "20",
               "--metrics.log_freq", "10", "--training.mixed_precision_param", str(dtype).removeprefix("torch.")],
              dump_folder=tmp_path, threads=None)
    rows = metrics_by_step(tmp_path)
    assert rows[20]["loss"] < rows[1]["loss"] - 1.0
    assert rows[20]["memory_gib"] > 0
    if rows[20]["mfu"] is None:  # only GPUs with a known peak report MFU
        pytest.skip(f"no peak FLOP/s known for {torch.cuda.get_device_name()}")
    assert 0 < rows[20]["mfu"] < 100
    assert rows[20]["mfu"] == pytest.approx(100 * rows[20]["tflops"] * 1e12 / device_peak_flops("cuda", dtype))


def test_float8_converts_eligible_linears():
    pytest.importorskip("torchao", reason="float8 needs torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9+")
    from torchmoe.config.job_config import Float8
    from torchmoe.distributed.float8 import apply_float8
    from torchmoe.models.llama4 import Transformer

    model = Transformer(FLAVORS["tiny"]).cuda()
    apply_float8(model, Float8(enable=True), "cuda")
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert "layers.0.attention.wq" in converted and "output" not in converted
    assert not any("router" in n for n in converted)
