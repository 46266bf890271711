"""Muon's step on DTensor shards equals the single process's, in every layout.

    python -m pytest -q tests/distributed/test_muon_layouts.py

One world of 4 CPU/gloo ranks parallelizes the model under several layouts (the trainer's own
`parallelize_model`), gives every parameter the same full gradients as a single-process copy of
the model (each rank's shard of them), and takes two Muon steps on both: the full weights must
equal the single process's. The layouts cover every placement Muon meets (DeepSeek-V3's tiny model:
MLA, dense, shared and routed experts): FSDP's rows (Shard(0)), HSDP (Replicate, Shard(0)), TP's
column- and row-wise splits under FSDP (_StridedShard, and MoE TP's row-wise experts), routed
experts split between whole experts by EP and FSDP, FSDP on the experts' hidden dim (llama4's
uneven flavor: one local expert per EP rank), and EP over TP.

Both NS dtypes are exact, not within a tolerance: each rank gathers its matrices whole in the NS
dtype (the gather is a copy, and the cast the NS's first op) and runs the single process's NS on
them; the momentum and the update are elementwise on each shard.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

WORLD = 4
SEED = 3
REPO = Path(__file__).resolve().parents[2]
TP2, EP2 = (["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.expert_parallel_degree", "2"])
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "tiny"]  # MLA, shared and routed experts
UNEVEN = ["--model.name", "llama4", "--model.flavor", "uneven"]
LAYOUTS = {
    # name: (flags, placements of Muon parameters the layout must produce, as str(DTensor.placements))
    "fsdp4": (DEEPSEEK, ["(Shard(dim=0),)"]),
    "hsdp2x2": ([*DEEPSEEK, "--parallelism.data_parallel_replicate_degree", "2"], ["(Replicate(), Shard(dim=0))"]),
    # Column-wise (wq_b, wkv_b, w1, w3) and row-wise (wo, w2) under FSDP; MoE TP's row-wise experts.
    "tp2_fsdp2": ([*DEEPSEEK, *TP2], ["(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))",
                                     "(Shard(dim=0), Shard(dim=2))"]),
    "ep2_fsdp2": ([*DEEPSEEK, *EP2], ["(_StridedShard(dim=0, sf=2), Shard(dim=0))"]),  # whole experts
    "ep2_fsdp2_uneven": ([*UNEVEN, *EP2], ["(Shard(dim=1), Shard(dim=0))"]),  # FSDP on the experts' hidden dim
    "ep2_spanning_tp2": ([*DEEPSEEK, *TP2, *EP2], ["(Shard(dim=0), Shard(dim=1))"]),
}
NS_DTYPES = ("float32", "bfloat16")


def _register_uneven_flavor() -> None:
    from torchmoe.models.llama4 import FLAVORS

    FLAVORS["uneven"] = FLAVORS["tiny"].replace(vocab_size=510, ffn_hidden_dim=382, moe_hidden_dim=254,
                                                num_experts=2)


def _full_grads(model, step: int) -> dict:
    """Gradients for every parameter, the same on every rank and in every layout."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + 7)
    return {name: torch.randn(p.shape, generator=g) for name, p in sorted(model.named_parameters())}


def _set_grads(model, grads: dict) -> None:
    """Each parameter's gradient: its full one, or this rank's shard of it for a DTensor."""
    from torch.distributed.tensor import DTensor, Replicate

    for name, p in model.named_parameters():
        full = grads[name].to(p.dtype)
        if isinstance(p, DTensor):
            whole = DTensor.from_local(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
            p.grad = whole.redistribute(p.device_mesh, p.placements)
        else:
            p.grad = full


def _compare(label: str, out_dir: Path) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torchmoe.arch.registry import model_args_from_config
    from torchmoe.config.loader import load_job_config
    from torchmoe.distributed.mesh import build_mesh
    from torchmoe.models.decoder.model import Transformer
    from torchmoe.models.decoder.parallelize import parallelize_model
    from torchmoe.optim.muon_groups import muon_split
    from torchmoe.optim.optimizer import build_optimizer
    from torchmoe.plan.parallel_dims import ParallelDims

    flags, _ = LAYOUTS[label]
    record: dict = {}
    for ns_dtype in NS_DTYPES:
        cfg = load_job_config(["--config", str(REPO / "configs" / "debug_model.toml"), *flags,
                               "--optimizer.name", "Muon", "--optimizer.lr", "0.02", "--optimizer.ns_dtype", ns_dtype,
                               "--optimizer.weight_decay", "0.05", "--job.dump_folder", str(out_dir / label)])
        args = model_args_from_config(cfg.model)
        dims = ParallelDims.from_config(cfg.parallelism, WORLD)
        with torch.device("meta"):
            model = Transformer(args)
        model = parallelize_model(model, dims, build_mesh(dims, "cpu"), cfg, "cpu")
        model.to_empty(device="cpu")
        model.init_weights(seed=SEED)
        reference = Transformer(args)
        reference.init_weights(seed=SEED)
        split = muon_split(reference, cfg.optimizer)
        optimizers = [build_optimizer(model, cfg.optimizer), build_optimizer(reference, cfg.optimizer)]
        for step in (1, 2):
            grads = _full_grads(reference, step)
            for m, opt in zip((model, reference), optimizers):
                _set_grads(m, grads)
                opt.step()
        ref = dict(reference.named_parameters())
        diffs = {}
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            diffs[name] = (full.detach() - ref[name].detach()).abs().max().item()
        record[ns_dtype] = {
            "max_diff": max(diffs.values()),
            "worst": max(diffs, key=diffs.get),
            "muon_placements": sorted({str(p.placements) for n, p in model.named_parameters()
                                       if isinstance(p, DTensor) and split[n][0] == "muon"}),
            "muon_params": sum(a == "muon" for a, _ in split.values()),
        }
        del model, optimizers
        dist.barrier()
    return record


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    _register_uneven_flavor()
    write_rank_record(out_dir, {label: _compare(label, out_dir) for label in LAYOUTS})


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("muon"), world=WORLD, timeout=900)


@pytest.mark.parametrize("ns_dtype", NS_DTYPES)
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_muon_step_equals_single_process(measured, label: str, ns_dtype: str) -> None:
    _, placements = LAYOUTS[label]
    for rank in range(WORLD):
        rec = measured[rank][label][ns_dtype]
        assert rec["max_diff"] == 0.0, (label, ns_dtype, rank, rec["worst"], rec["max_diff"])
        assert rec["muon_params"] > 0
    seen = {p for rank in range(WORLD) for p in measured[rank][label][ns_dtype]["muon_placements"]}
    assert set(placements) <= seen, (label, seen)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
