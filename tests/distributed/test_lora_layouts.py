"""LoRA with adapters on every target, routed experts included, reproduces the single process in
every layout: loss, gradient norm and every adapter gradient (fp32, 1e-5).

    python -m pytest -q tests/distributed/test_lora_layouts.py

Two forked CPU/gloo ranks build each family's test flavor with adapters on every target it has
(DeepSeek-V3: MLA attention, the dense layer, the shared and routed experts, the router; gpt-oss:
biased attention with sinks, clamped SwiGLU experts with their fused interleaved gate/up, the
router), non-zero adapters, and each rank first runs the whole batch in one plain process as the
reference. Then each layout parallelizes the same model (`parallelize_model`) and feeds each
rank its share of the batch: its rows under data parallelism, the whole batch under TP, its
head-tail pieces of every row under CP. The base stays frozen: only the adapters train, and no
frozen parameter gets a gradient.

Layouts: FSDP 2; DDP 2 (replicated: HSDP's outer dim); EP 2 x FSDP over the experts' ranks; TP 2
with sequence parallel and MoE TP (each adapter placed after its weight's style, the routed
experts' adapters after their hidden units: `distributed.tensor_parallel`); EP 2 spanning TP 2;
CP 2; PP 2 (1F1B, two micro-batches); and full activation checkpointing with every block
compiled (aot_eager, no graph break).
gpt-oss runs the TP layouts, where its experts' adapters differ from DeepSeek's (B of the fused
gate/up sharded with its rows, not replicated).

A gpt-oss of expert shapes no 16-byte row holds (`nn.grouped_gemm`: a model dim of 36, the
experts' hidden size 20, so 10 per rank under MoE TP 2, adapters of rank 3) runs EP 2 under FSDP,
TP 2 and EP 2 spanning TP 2: in fp32 as above, and in bf16 compute (which crashed: "strides
should be multiple of 16 bytes"), where each layout's loss and adapter gradients are those of the
same layout on the per-expert loop (``use_grouped_mm = False``), bit for bit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

WORLD = 2
RTOL = 1e-5
# Degrees and options of each layout (unnamed degrees are 1).
LAYOUTS = {
    "fsdp2": dict(dp_shard=2),
    "ddp2": dict(dp_replicate=2),
    "ep2_fsdp2": dict(dp_shard=2, ep=2),
    "tp2": dict(tp=2),
    "ep2_tp2": dict(tp=2, ep=2),
    "cp2": dict(cp=2),
    "pp2": dict(pp=2),
    "fsdp2_ac_compile": dict(dp_shard=2, ac="full", compile=True),
}
ODD = "gpt_oss_odd_shapes"
FAMILY_LAYOUTS = {"deepseek_v3": list(LAYOUTS), "gpt_oss": ["tp2", "ep2_tp2"], ODD: ["ep2_fsdp2", "tp2", "ep2_tp2"]}
# Layouts run in bf16 compute too, against the per-expert loop.
BF16_LAYOUTS = {ODD: ["ep2_fsdp2", "tp2", "ep2_tp2"]}
# Each model: its family, its sizes (two blocks: DeepSeek-V3's first dense, gpt-oss's first over a
# sliding window) and its adapters' rank (no TP adapter is split on it).
MODELS = {"deepseek_v3": ("deepseek_v3", dict(n_layers=2, moe_layers=[1]), 4),
          "gpt_oss": ("gpt_oss", dict(n_layers=2, moe_layers=[0, 1], sliding_layers=[0]), 4),
          ODD: ("gpt_oss", dict(n_layers=2, moe_layers=[0, 1], sliding_layers=[0], dim=36, moe_hidden_dim=20), 3)}
TARGETS = ["attention", "mlp", "shared_experts", "experts", "router"]
SEQ = 24  # tokens a row feeds the model: 4 head-tail pieces of 6 under CP 2


def _model(name: str, grouped: bool = True):
    """`MODELS[name]` with adapters on every target, non-zero; `grouped`: the experts' grouped
    GEMMs, else their per-expert loop."""
    import importlib

    import torch

    from torchmoe.config.job_config import LoRA
    from torchmoe.models.decoder.lora import apply_lora, init_adapters
    from torchmoe.models.decoder.model import Transformer
    from torchmoe.nn.lora import is_adapter_name

    family, sizes, rank = MODELS[name]
    flavors = importlib.import_module(f"torchmoe.arch.{family}").FLAVORS
    args = dataclasses.replace(flavors["tiny"], vocab_size=96, use_grouped_mm=grouped, **sizes)
    model = Transformer(args)
    model.init_weights(seed=0)
    apply_lora(model, LoRA(enable=True, targets=TARGETS, rank=rank, alpha=8.0))
    init_adapters(model, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_name(name) and name.endswith("_b"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _loss_sum(model, inputs, labels):
    import torch.nn.functional as F

    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _adapter_grads(model) -> dict:
    from torch.distributed.tensor import DTensor

    from torchmoe.nn.lora import is_adapter_name

    grads = {}
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            g = p.grad
            grads[_plain_name(name)] = g.full_tensor() if isinstance(g, DTensor) else g
    return grads


def _plain_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _norm(grads: dict) -> float:
    import torch

    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()


def _run_layout(family: str, layout: dict, tokens, *, dtype: str = "float32", grouped: bool = True) -> dict:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from torchmoe.config.job_config import JobConfig
    from torchmoe.distributed.mesh import build_mesh
    from torchmoe.models.decoder.parallelize import parallelize_model
    from torchmoe.plan.parallel_dims import ParallelDims

    degrees = {key: layout.get(key, 1) for key in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
    dims = ParallelDims(world_size=WORLD, **degrees)
    cfg = JobConfig()
    par = cfg.parallelism
    par.data_parallel_replicate_degree, par.data_parallel_shard_degree = degrees["dp_replicate"], degrees["dp_shard"]
    par.context_parallel_degree, par.tensor_parallel_degree = degrees["cp"], degrees["tp"]
    par.expert_parallel_degree = degrees["ep"]
    par.disable_loss_parallel = True
    cfg.activation_checkpoint.mode = layout.get("ac", "none")
    cfg.compile.enable, cfg.compile.backend = layout.get("compile", False), "aot_eager"
    cfg.training.seq_len = SEQ
    cfg.training.mixed_precision_param = dtype
    counters.clear()
    if dims.pp_enabled:
        return _run_pipeline(family, dims, cfg, tokens)
    model = parallelize_model(_model(family, grouped), dims, build_mesh(dims, "cpu"), cfg, "cpu")
    # The trainer's balance-loss scale (`training.moe_balance`): each rank routes 1 / token_shards
    # of the batch's tokens (gpt-oss has a balance loss).
    token_shards = dims.dp * dims.cp * (dims.tp if dims.ep_enabled else 1)
    for moe in model.moe_layers():
        moe.aux_loss_grad_scale = 1.0 / token_shards
    # Each data rank's rows (TP and CP ranks share theirs), CP: this rank's pieces of each row.
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    rows = len(tokens) // dp
    mine = tokens[dist.get_rank() // (degrees["cp"] * degrees["tp"]) * rows:][:rows]
    inputs, labels = mine[:, :-1], mine[:, 1:]
    if degrees["cp"] > 1:
        local = model.context_parallel.positions(torch.device("cpu"))
        inputs, labels = inputs[:, local], labels[:, local]
    # The trainer's normalisation: each rank's loss sum over the global token count, gradients
    # summed over the data and CP ranks (divide factor 1); TP ranks compute the same sum.
    local_loss = _loss_sum(model, inputs, labels) / labels.numel() / (dp * degrees["cp"])
    local_loss.backward()
    loss = local_loss.detach().clone()
    if dp * degrees["cp"] > 1:
        dist.all_reduce(loss)
    grads = _adapter_grads(model)
    trainable = sorted(_plain_name(n) for n, p in model.named_parameters() if p.requires_grad)
    return {
        "loss": loss.item(), "norm": _norm(grads), "grads": grads, "trainable": trainable,
        "frozen_grads": sum(p.grad is not None for p in model.parameters() if not p.requires_grad),
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def _run_pipeline(family: str, dims, cfg, tokens) -> dict:
    """PP 2 (block 0 and the embedding on rank 0, block 1 and the head on rank 1), 1F1B over two
    micro-batches of two rows, as the trainer builds it (`distributed.pipeline_parallel`)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchmoe.distributed.mesh import build_mesh
    from torchmoe.distributed.pipeline_parallel import build_schedule, stage_io_metas
    from torchmoe.models.decoder.parallelize import parallelize_model
    from torchmoe.models.decoder.pipeline_stages import split_into_stages
    from torchmoe.plan.pipeline import PipelineLayout

    rank, microbatches = dist.get_rank(), 2
    mesh = build_mesh(dims, "cpu")
    pipe = PipelineLayout(num_stages=2, layers=[[0], [1]], ranks=[[0], [1]])
    model = _model(family)
    (stage,) = split_into_stages(model, pipe, rank)
    stage = parallelize_model(stage, dims, mesh, cfg, "cpu")
    for moe in stage.moe_layers():
        moe.aux_loss_grad_scale = 1.0 / microbatches
    labels = tokens[:, 1:]

    def loss_fn(logits, target):  # the micro-batch's share of the global mean
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum") / labels.numel()

    metas = lambda s: stage_io_metas(pipe, s, microbatch=len(tokens) // microbatches, seq_len=SEQ, seq_shards=1,
                                     dim=model.tok_embeddings.weight.shape[1], vocab_local=96,
                                     hidden_dtype=torch.float32, logits_dtype=torch.float32)
    schedule = build_schedule([stage], pipe, mesh["pp"], "1F1B", n_microbatches=microbatches, loss_fn=loss_fn,
                              io_metas=metas, device=torch.device("cpu"))
    losses: list = []
    if rank == 0:
        schedule.step(tokens[:, :-1])
    else:
        schedule.step(target=labels, losses=losses)
    loss = torch.stack(losses).sum() if losses else torch.zeros(())
    dist.all_reduce(loss)
    stage_grads = _adapter_grads(stage)
    parts: list = [None] * WORLD
    dist.all_gather_object(parts, stage_grads)
    grads = {name: g for part in parts for name, g in part.items()}
    dist.all_gather_object(parts, [n for n, p in stage.named_parameters() if p.requires_grad])
    return {
        "loss": loss.item(), "norm": _norm(grads), "grads": grads,
        "trainable": sorted(n for part in parts for n in part),
        "frozen_grads": sum(p.grad is not None for p in stage.parameters() if not p.requires_grad),
        "graph_breaks": 0, "graphs": 0,
    }


def _worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tokens = torch.randint(0, 96, (4, SEQ + 1), generator=torch.Generator().manual_seed(2))
    record = {}
    for family, layouts in FAMILY_LAYOUTS.items():
        ref_model = _model(family)
        ref_loss = _loss_sum(ref_model, tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
        ref_loss.backward()
        ref = _adapter_grads(ref_model)
        record[family] = {"ref_loss": ref_loss.item(), "ref_norm": _norm(ref)}
        for label in layouts:
            got = _run_layout(family, LAYOUTS[label], tokens)
            grads = got.pop("grads")
            got["names_equal"] = sorted(grads) == sorted(ref)
            got["only_adapters_train"] = got.pop("trainable") == sorted(ref)
            got["max_rel_err"] = max(((grads[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)
            record[family][label] = got
        for label in BF16_LAYOUTS.get(family, []):
            grouped, looped = (_run_layout(family, LAYOUTS[label], tokens, dtype="bfloat16", grouped=g)
                               for g in (True, False))
            record[family][f"bf16_{label}"] = {
                "losses": [grouped["loss"], looped["loss"]],
                "grads_equal": sorted(grouped["grads"]) == sorted(looped["grads"]) and all(
                    torch.equal(g, looped["grads"][n]) for n, g in grouped["grads"].items()),
                "adapters": len(grouped["grads"]), "finite": bool(torch.isfinite(torch.tensor(grouped["norm"])))}
    write_rank_record(out_dir, record)


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("lora"), world=WORLD, timeout=600)


@pytest.mark.parametrize("family,layout", [(f, lay) for f, layouts in FAMILY_LAYOUTS.items() for lay in layouts])
def test_lora_layout_matches_single_process(family, layout, records):
    for rank, record in records.items():
        ref, got = record[family], record[family][layout]
        assert got["loss"] == pytest.approx(ref["ref_loss"], rel=RTOL), (rank, got)
        assert got["norm"] == pytest.approx(ref["ref_norm"], rel=RTOL), (rank, got)
        assert got["names_equal"] and got["max_rel_err"] <= RTOL, (rank, got)
        assert got["frozen_grads"] == 0 and got["only_adapters_train"], (rank, got)
        if LAYOUTS[layout].get("compile"):  # each block one graph (two blocks, forward graphs counted)
            assert got["graph_breaks"] == 0 and got["graphs"] >= 2, (rank, got)


@pytest.mark.parametrize("family,layout", [(f, lay) for f, layouts in BF16_LAYOUTS.items() for lay in layouts])
def test_odd_expert_shapes_run_every_layout_in_bf16_as_the_per_expert_loop(family, layout, records):
    for rank, record in records.items():
        got = record[family][f"bf16_{layout}"]
        grouped, looped = got["losses"]
        assert grouped == looped and got["grads_equal"] and got["finite"], (rank, got)
        assert got["adapters"] > 0 and grouped == pytest.approx(record[family]["ref_loss"], rel=2e-2), (rank, got)
