"""LoRA with routed-expert adapters under FSDP 2 and under EP 2 (x FSDP over the experts' ranks)
reproduces the single process: loss, gradient norm and every adapter gradient (fp32, 1e-5).

    python -m pytest -q tests/distributed/test_lora_layouts.py

Two forked CPU/gloo ranks build DeepSeek-V3's test flavor with adapters on every target (MLA
attention, the dense layer, the shared and routed experts, the router), non-zero adapters, and
each rank first runs the whole batch in one plain process as the reference. Then each layout
parallelizes the same model (`parallelize_model`: the adapters are sharded as the weights beside
them, whole experts per rank under EP), feeds each rank its half of the batch, and gathers the
adapters' gradients. The base stays frozen: FSDP holds no gradient for it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

WORLD = 2
RTOL = 1e-5
# Degrees (dp_shard, tp, ep) and the activation checkpointing mode of each layout. tp2: sequence
# parallel with MoE TP (routed experts' hidden units sharded); ep2_tp2: EP borrowing tp's ranks.
LAYOUTS = {
    "fsdp2": dict(dp_shard=2, tp=1, ep=1, ac="none"),
    "ep2_fsdp2": dict(dp_shard=2, tp=1, ep=2, ac="none"),
    "fsdp2_ac_full": dict(dp_shard=2, tp=1, ep=1, ac="full"),
    "tp2": dict(dp_shard=1, tp=2, ep=1, ac="none"),
    "ep2_tp2": dict(dp_shard=1, tp=2, ep=2, ac="none"),
}
# Grouped GEMMs need 16-byte row strides (4 fp32 elements); the TP adapters never split r.
RANK = 4


def _model():
    import torch

    from torchmoe.arch.deepseek_v3 import FLAVORS
    from torchmoe.config.job_config import LoRA
    from torchmoe.models.decoder.lora import apply_lora, init_adapters
    from torchmoe.models.decoder.model import Transformer
    from torchmoe.nn.lora import is_adapter_name

    args = dataclasses.replace(FLAVORS["tiny"], n_layers=2, moe_layers=[1], vocab_size=96)
    model = Transformer(args)
    model.init_weights(seed=0)
    apply_lora(model, LoRA(enable=True, targets=["attention", "mlp", "shared_experts", "experts", "router"], rank=RANK,
                           alpha=8.0))
    init_adapters(model, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_name(name) and name.endswith("_b"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _loss(model, tokens):
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _adapter_grads(model) -> dict:
    from torch.distributed.tensor import DTensor

    from torchmoe.nn.lora import is_adapter_name

    grads = {}
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            g = p.grad
            grads[name.replace("_checkpoint_wrapped_module.", "")] = g.full_tensor() if isinstance(g, DTensor) else g
    return grads


def _worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from torchmoe.config.job_config import JobConfig
    from torchmoe.distributed.mesh import build_mesh
    from torchmoe.models.decoder.parallelize import parallelize_model
    from torchmoe.plan.parallel_dims import ParallelDims

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokens = torch.randint(0, 96, (4, 25), generator=torch.Generator().manual_seed(2))
    ref_model = _model()
    ref_loss = _loss(ref_model, tokens)
    ref_loss.backward()
    ref = _adapter_grads(ref_model)
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref.values()]))
    record = {"ref_loss": ref_loss.item(), "ref_norm": ref_norm.item()}
    for label, layout in LAYOUTS.items():
        dp, tp = layout["dp_shard"], layout["tp"]
        dims = ParallelDims(pp=1, dp_replicate=1, cp=1, dp_shard=dp, tp=tp, ep=layout["ep"], world_size=WORLD)
        cfg = JobConfig()
        cfg.parallelism.data_parallel_shard_degree = dp
        cfg.parallelism.tensor_parallel_degree = tp
        cfg.parallelism.expert_parallel_degree = layout["ep"]
        cfg.parallelism.disable_loss_parallel = True
        cfg.activation_checkpoint.mode = layout["ac"]
        cfg.training.mixed_precision_param = "float32"
        model = parallelize_model(_model(), dims, build_mesh(dims, "cpu"), cfg, "cpu")
        # The trainer's normalisation: each data rank's token sum over the global tokens,
        # gradients summed over the data ranks (FSDP's divide factor 1); TP ranks share a batch.
        rows = len(tokens) // dp
        start = rank // tp * rows
        local = _loss(model, tokens[start:start + rows]) / dp
        local.backward()
        loss = local.detach().clone()
        if dp > 1:
            dist.all_reduce(loss)
        grads = _adapter_grads(model)
        trainable = sorted(n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters()
                           if p.requires_grad)
        frozen_grads = sum(p.grad is not None for n, p in model.named_parameters() if not p.requires_grad)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        record[label] = {
            "loss": loss.item(), "norm": norm.item(), "frozen_grads": frozen_grads,
            "only_adapters_train": trainable == sorted(ref),
            "names_equal": sorted(grads) == sorted(ref),
            "max_rel_err": max(((grads[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref),
        }
    write_rank_record(out_dir, record)


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("lora"), world=WORLD, timeout=300)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lora_layout_matches_single_process(layout, records):
    for rank, record in records.items():
        got = record[layout]
        assert got["loss"] == pytest.approx(record["ref_loss"], rel=RTOL), rank
        assert got["norm"] == pytest.approx(record["ref_norm"], rel=RTOL), rank
        assert got["names_equal"] and got["max_rel_err"] <= RTOL, (rank, got)
        assert got["frozen_grads"] == 0 and got["only_adapters_train"], (rank, got)

