"""The planner: parameter layout, memory estimate (checked against measurements) and the dry run.

    python -m pytest -q tests/unit/test_plan.py

Measurements use no accelerator and no real communication: parameter shards come from the real
parallelize pipeline applied to a meta-device model under a fake process group; activations from
the tensors autograd actually saves in a CPU forward.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from torchmoe.arch.registry import FLAVORS as FAMILY_FLAVORS
from torchmoe.config.job_config import ActivationCheckpoint, JobConfig, Parallelism, Training
from torchmoe.config.loader import load_job_config
from torchmoe.distributed.mesh import build_mesh
from torchmoe.models.llama4 import FLAVORS, ModelArgs, Transformer
from torchmoe.nn.document_attention import document_segments, whole_row_calls
from torchmoe.nn.experts import GroupedExperts
from torchmoe.performance.saved_tensors import saved_bytes
from torchmoe.plan.activations import ActivationModel
from torchmoe.plan.dry_run import format_ranks, run_dry_run
from torchmoe.plan.layout import autocast_casts, param_specs, shard_numel
from torchmoe.plan.memory import GIB, estimate_memory, memory_per_pp_rank
from torchmoe.plan.parallel_dims import ALL_NAMES, MESH_DIMS, ParallelDims

REPO = Path(__file__).resolve().parents[2]

# Small enough to count by hand: layer 0 dense, layer 1 MoE (4 experts, 1 shared).
TINY = ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=4, vocab_size=16,
                 ffn_hidden_dim=12, moe_hidden_dim=8, num_experts=4, top_k=1,
                 interleave_moe_layer_step=2, max_seq_len=64)


def _dims(**degrees: int) -> ParallelDims:
    full = dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1) | degrees
    return ParallelDims(**full, world_size=math.prod(full[d] for d in MESH_DIMS))


# ---- parameter layout --------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "flavor"), [(f, v) for f, flavors in FAMILY_FLAVORS.items() for v in flavors])
def test_param_specs_are_the_models_parameters(family, flavor):
    args = FAMILY_FLAVORS[family][flavor]
    with torch.device("meta"):
        model = Transformer(args)
    real = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert real == [(s.fqn, s.shape) for s in param_specs(args)]


def test_scout_param_totals():
    args = FLAVORS["scout"]
    counts = args.param_counts()
    assert counts["total"] == sum(s.numel for s in param_specs(args)) == 107_769_861_120
    assert counts["active"] == 17_172_894_720
    assert counts["embedding"] == 202048 * 5120


# ---- parameters, gradients, optimizer state: by hand --------------------------------------------


def test_states_by_hand_fsdp_tp_ep():
    # dp_shard2 x tp2, ep2: dense FSDP over 2 ranks, efsdp = 2 * 2 / 2 = 2.
    # embedding/output [16, 8] -> TP vocab [8, 8] -> FSDP [4, 8]: 32 each; final norm [8] -> 4.
    # layer 0: wq/wk/wv [8, 8] -> [4, 8] -> [2, 8]: 16 each; wo [8, 8] -> [8, 4] -> [4, 4]: 16;
    #   norms 4 + 4; w1/w3 [12, 8] -> [6, 8] -> [3, 8]: 24 each; w2 [8, 12] -> [8, 6] -> [4, 6]: 24.
    layer0 = 4 * 16 + 8 + 3 * 24
    # layer 1: attention + norms as above; router [4, 8] (not TP'd) -> [2, 8]: 16; shared expert
    #   (not TP'd under EP) [8, 8] -> [4, 8]: 32 x 3; experts [4, 8, 8] -> EP [2, 8, 8] -> [1, 8, 8]: 64 x 3.
    layer1 = 4 * 16 + 8 + 16 + 3 * 32 + 3 * 64
    per_rank = 32 + 32 + 4 + layer0 + layer1
    assert per_rank == 588
    est = memory_per_pp_rank(TINY, _dims(dp_shard=2, tp=2, ep=2), Training(), ActivationCheckpoint(),
                             Parallelism())[0]
    assert (est.params, est.grads, est.optimizer) == (4 * per_rank, 4 * per_rank, 8 * per_rank)
    # FSDP units' TP/EP-local elements in execution order: embedding 64; layer 0 attention 4 * 32,
    # norms 16, FFN 3 * 48; layer 1 attention 128, norms 16, router 32, shared 3 * 64, experts
    # 3 * 128; head 8 + 64. bf16 gathers (2 B), fp32 reduce: grads 2 + 4 B.
    units = [64, 128 + 16 + 144, 128 + 16 + 32 + 192 + 384, 72]
    assert est.fsdp_buffers == 2 * (units[2] + units[1]) + 6 * units[2] == 6592


def test_no_fsdp_means_full_fp32_states_and_autocast_weight_copies():
    fp32 = memory_per_pp_rank(TINY, _dims(), Training(mixed_precision_param="float32"), ActivationCheckpoint(),
                              Parallelism())[0]
    total = sum(s.numel for s in param_specs(TINY))
    assert (fp32.params, fp32.grads, fp32.optimizer, fp32.fsdp_buffers) == (4 * total, 4 * total, 8 * total, 0)
    # bf16 without FSDP runs under autocast, which keeps a bf16 copy of every matmul weight through
    # the forward: layer 0 attention 4 * 64, FFN 3 * 96; layer 1 attention 256, router 32, shared
    # expert 3 * 64, experts 3 * 256; output head 128 (not the embedding 128, norms 5 * 8).
    bf16 = memory_per_pp_rank(TINY, _dims(), Training(), ActivationCheckpoint(), Parallelism())[0]
    assert bf16.params == fp32.params and bf16.fsdp_buffers == 2 * (544 + 1248 + 128) == 2 * (total - 128 - 40)


def test_pure_bf16_halves_the_states_and_needs_no_weight_copies():
    """training.dtype = "bfloat16": weights, gradients and both AdamW moments at 2 bytes. Without
    FSDP no autocast runs (the weights already are the compute dtype), so no copies and a bf16
    residual stream; under FSDP the all-gathered units are copies as before."""
    pure = Training(dtype="bfloat16")
    total = sum(s.numel for s in param_specs(TINY))
    one = memory_per_pp_rank(TINY, _dims(), pure, ActivationCheckpoint(), Parallelism())[0]
    mixed = memory_per_pp_rank(TINY, _dims(), Training(), ActivationCheckpoint(), Parallelism())[0]
    assert (one.params, one.grads, one.optimizer, one.fsdp_buffers) == (2 * total, 2 * total, 4 * total, 0)
    assert one.activations < mixed.activations  # bf16 residual stream, no per-matmul input casts
    sharded = memory_per_pp_rank(TINY, _dims(dp_shard=2, tp=2, ep=2), pure, ActivationCheckpoint(),
                                 Parallelism())[0]
    assert (sharded.params, sharded.grads, sharded.optimizer, sharded.fsdp_buffers) == (2 * 588, 2 * 588, 4 * 588,
                                                                                         6592)


def test_cpu_offload_moves_states_to_host():
    cfg = Parallelism(fsdp_cpu_offload=True)
    est = memory_per_pp_rank(TINY, _dims(dp_shard=2), Training(), ActivationCheckpoint(), cfg)[0]
    plain = memory_per_pp_rank(TINY, _dims(dp_shard=2), Training(), ActivationCheckpoint(), Parallelism())[0]
    assert est.params == est.grads == est.optimizer == 0
    assert est.host == plain.params + plain.grads + plain.optimizer


# ---- parameters: measured on the real parallelize pipeline --------------------------------------


def _measured_local_elements(model: torch.nn.Module) -> int:
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor, degrees, rank", [
    ("tiny", dict(dp_shard=4), 0),
    ("tiny", dict(dp_shard=2, tp=2), 0),  # MoE TP
    ("tiny", dict(dp_shard=2, tp=2), 3),
    ("tiny", dict(dp_replicate=2, dp_shard=2, tp=2), 5),  # HSDP
    ("tiny", dict(dp_shard=2, cp=2), 1),
    ("uneven", dict(dp_shard=4), 0),  # FSDP padding: rank 0 holds the padded (largest) shard
    ("tiny", dict(dp_shard=2, tp=2, ep=4), 0),
    ("tiny", dict(dp_shard=4, ep=2), 3),
])
def test_states_match_parallelized_meta_model(fake_world, flavor, degrees, rank):
    from torchmoe.models.decoder.parallelize import parallelize_model

    args = FLAVORS["tiny"]
    if flavor == "uneven":
        args = args.replace(vocab_size=510, ffn_hidden_dim=382)
    dims = _dims(**degrees)
    fake_world(rank, dims.world_size)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = Transformer(args)
    cfg = JobConfig()
    parallelize_model(model, dims, mesh, cfg, "cpu")
    est = memory_per_pp_rank(args, dims, cfg.training, cfg.activation_checkpoint, cfg.parallelism)[0]
    assert est.params == 4 * _measured_local_elements(model)


def test_expert_fsdp_on_dim1_matches_fully_shard(fake_world):
    # dp_shard16, ep4: 2 local experts but 4 efsdp ranks, so experts shard on dim 1.
    dims = _dims(dp_shard=16, ep=4)
    fake_world(0, dims.world_size)
    mesh = build_mesh(dims, "cpu")
    args = FLAVORS["tiny"]
    with torch.device("meta"):
        experts = GroupedExperts(args.dim, args.moe_hidden_dim, args.num_experts, use_grouped_mm=True)
    for name in ("w1", "w2", "w3"):
        param = getattr(experts, name)
        experts.register_parameter(name, torch.nn.Parameter(distribute_tensor(param, mesh["ep"], [Shard(0)])))
    fully_shard(experts, mesh=mesh["efsdp"], shard_placement_fn=lambda p: Shard(1))
    specs = [s for s in param_specs(args) if s.fqn.startswith("layers.1.moe.experts.")]
    assert sum(shard_numel(s, dims) for s in specs) == _measured_local_elements(experts)


# ---- activations: measured on CPU ---------------------------------------------------------------


# gpt-oss refuses document masking (test_family_configs): its attention runs over whole rows.
@pytest.mark.parametrize(("family", "masking"), [(f, m) for f in ("llama4", "qwen3", "deepseek_v3", "gpt_oss")
                                                 for m in (False, True) if not (f == "gpt_oss" and m)])
@pytest.mark.parametrize("precision", ["fp32", "bf16_params", "bf16_autocast"])
@pytest.mark.parametrize("seq", [64, 96, 160, 192])
def test_block_activations_match_saved_tensors(precision, seq, masking, family):
    """fp32; bf16 parameters and inputs (what FSDP/DDP's mixed precision computes with); fp32
    parameters and residual stream under bf16 autocast (the layouts without FSDP/DDP). The tiny
    flavor's RoPE layers attend within 64-token chunks: 64 is one chunk (plain causal), 192
    three (folded into the batch), 96 and 160 end in a partial chunk (the whole chunks and the
    rest attended separately, the output concatenated: one more copy of it). With document
    masking (documents of 30 tokens, then the rest of the row) one operator writes the whole
    output and keeps nothing of the documents but the segment tables' few int32 offsets.
    Each family's tiny flavor: Qwen3's per-head norms, DeepSeek-V3's latent attention (its
    replicated bottleneck norms, padded values and sliced output), gpt-oss's sinks, windows (8
    positions: rows of several windows, 96 and 160 not a whole number of them) and clamped
    SwiGLU experts with biases."""
    args = FAMILY_FLAVORS[family]["tiny"]
    torch.manual_seed(0)  # for the inputs below
    model = Transformer(args)
    model.init_weights(seed=0)
    dtype = torch.bfloat16 if precision == "bf16_params" else torch.float32
    for p in model.parameters():
        p.data = p.data.to(dtype)
    batch = 2
    x = torch.randn(batch, seq, args.dim, dtype=dtype, requires_grad=True)
    freqs = model._rotations(seq)
    autocast = precision == "bf16_autocast"
    act = ActivationModel(args, _dims(), a=4 if precision == "fp32" else 2, compiled=False, loss_parallel=False,
                          autocast=autocast, seq_len=seq, document_masking=masking)
    starts = torch.arange(seq).expand(batch, seq).clamp(max=30) // 30 * 30
    documents = document_segments(starts, whole_row_calls(args.attention_spans(), seq),
                                  torch.device("cpu")) if masking else None
    for i, block in model.layers.items():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            measured = saved_bytes(lambda: block(x, freqs, documents), exclude=[*model.parameters(), *model.buffers()])
        # autocast's bf16 weight copies are saved too: the planner counts them once per forward,
        # as parameter copies (`fsdp_buffers`), not per token.
        copies = 2 * sum(s.numel for s in param_specs(args) if s.layer == int(i) and len(s.shape) >= 2
                         and autocast_casts(s.fqn, args) and not s.fqn.endswith(("b13", "b2")))
        estimated = act.block_full(int(i)) * batch * seq + (copies if autocast else 0)
        # Left out as negligible: NoPE layers' (seq,) temperature scale, MoE's (E,) int32 offsets,
        # and with masking the segment tables' int32 offsets (2 of at most 16 per row), which on
        # a GPU live in host memory.
        tables = 2 * batch * 16 * 4 if masking else 0
        assert abs(estimated - measured) <= 4 * seq + 4 * args.num_experts + tables, (i, estimated, measured)


def test_head_activations_match_saved_tensors_plus_logits():
    args = FLAVORS["tiny"]
    model = Transformer(args)
    model.init_weights(seed=0)
    batch, seq = 2, 64
    h = torch.randn(batch, seq, args.dim, requires_grad=True)
    labels = torch.randint(0, args.vocab_size, (batch * seq,))
    logits_bytes = batch * seq * args.vocab_size * 4  # alive during the loss, though not saved

    def head() -> None:
        F.cross_entropy(model.output(model.norm(h)).float().flatten(0, 1), labels)

    act = ActivationModel(args, _dims(), a=4, compiled=False, loss_parallel=False)
    measured = saved_bytes(head, exclude=[*model.parameters(), *model.buffers()]) + logits_bytes
    # Left out as negligible: the int64 labels and the loss's scalar weight total.
    assert abs(act.head() * batch * seq - measured) <= 8 * batch * seq + 4


def _activations(ac: ActivationCheckpoint, training: Training = Training(local_batch_size=2, seq_len=2048),
                 **degrees: int) -> float:
    return estimate_memory(FLAVORS["scout"], dict(pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=1, ep=1) | degrees,
                           training, ac, Parallelism())["activations"]


def test_activations_monotonic_in_ac_mode_batch_and_sharding():
    none = _activations(ActivationCheckpoint(mode="none"))
    every2 = _activations(ActivationCheckpoint(mode="selective", selective_ac_option="2"))
    op = _activations(ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    full = _activations(ActivationCheckpoint(mode="full"))
    assert none > every2 > full and none > op > full
    # Scout, 2 x 2048 tokens, bf16, no AC: tens of GiB (~82 KB per token per layer over 48 layers).
    assert 10 < none < 100
    doubled = _activations(ActivationCheckpoint(mode="none"), Training(local_batch_size=4, seq_len=2048))
    assert doubled == pytest.approx(2 * none, rel=1e-6)
    assert _activations(ActivationCheckpoint(mode="none"), cp=2, dp_shard=4) < none
    assert _activations(ActivationCheckpoint(mode="none"), tp=2, dp_shard=4) < none


def test_op_sac_leaves_out_the_forced_recompute_shapes():
    """Per-op SAC saves half of the plain matmul outputs but those per_op_sac_force_recompute_...
    names, matched by weight shape as the policy matches them (tiny, bf16: 2-byte outputs)."""
    args = FLAVORS["tiny"]

    def op_sac(*fqns: str) -> list[float]:
        act = ActivationModel(args, _dims(), a=2, compiled=False, loss_parallel=False, recompute_mm_fqns=fqns)
        return [act.block_op_sac(i) for i in range(2)]  # dense block 0, MoE block 1

    plain = op_sac()
    gate = op_sac("moe.router.gate")
    assert gate[0] == plain[0] and plain[1] - gate[1] == 2 * args.num_experts / 2
    kv = args.n_kv_heads * args.head_dim  # wk and wv share the weight shape (dim, kv): both go
    assert [p - k for p, k in zip(plain, op_sac("attention.wk"))] == [2 * 2 * kv / 2] * 2
    ac = ActivationCheckpoint(mode="selective", per_op_sac_force_recompute_mm_shapes_by_fqns=["moe.router.gate"])
    assert _activations(ac) < _activations(ActivationCheckpoint(mode="selective"))  # the config reaches it


def test_pipeline_first_rank_holds_more_microbatches():
    per_rank = memory_per_pp_rank(FLAVORS["scout"], _dims(pp=4, dp_shard=2),
                                  Training(local_batch_size=8, seq_len=2048),
                                  ActivationCheckpoint(mode="full"), Parallelism(pipeline_parallel_schedule="1F1B"))
    # 1F1B keeps pp - r micro-batches in flight on pp rank r (the last adds the head's logits).
    assert per_rank[0].activations > per_rank[1].activations > per_rank[2].activations


# ---- dry run ------------------------------------------------------------------------------------


def _config(name: str, tmp_path: Path, *flags: str) -> JobConfig:
    return load_job_config(["--config", str(REPO / "configs" / name), "--job.dump_folder", str(tmp_path), *flags])


def test_format_ranks():
    assert format_ranks([0, 1, 2]) == "0, 1, 2"
    assert format_ranks(list(range(0, 1024, 8))) == "0, 8, 16, …, 1016 (128 ranks)"


def test_dry_run_maverick_1024_json_and_timing(tmp_path):
    cfg = _config("llama4_128e.toml", tmp_path)
    out = io.StringIO()
    start = time.perf_counter()
    report = run_dry_run(cfg, 1024, console=Console(file=out, width=200))
    elapsed = time.perf_counter() - start
    assert elapsed < 10, elapsed
    written = json.loads((tmp_path / "dry_run.json").read_text())
    assert written == json.loads(json.dumps(report))
    for key in ("world_size", "mesh", "params_total", "params_active", "params_per_rank", "flops_per_token",
                "memory_per_rank_gib", "plan", "groups"):
        assert key in written, key
    assert written["world_size"] == 1024
    assert written["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 128, "cp": 1, "tp": 8,
                               "dp_shard_cp": 128, "ep": 8, "efsdp": 128, "batch": 128, "loss": 128}
    assert written["params_total"] == FLAVORS["maverick"].param_counts()["total"]
    assert written["flops_per_token"] == FLAVORS["maverick"].flops_per_token(8192)
    assert set(written["memory_per_rank_gib"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert set(written["groups"]) == {"0", "512", "1023"}
    assert written["groups"]["1023"]["ep"] == list(range(1016, 1024))
    assert written["groups"]["1023"]["dp_shard"] == list(range(7, 1024, 8))
    assert set(written["groups"]["0"]) == set(ALL_NAMES)
    assert written["plan"]["expert_parallel"]["enabled"] and not written["plan"]["moe_tensor_parallel"]["enabled"]
    text = out.getvalue()
    assert "0, 8, 16, …, 1016 (128 ranks)" in text and "wrote" in text


def test_dry_run_cost_does_not_grow_with_the_world(tmp_path):
    """10^9 ranks: groups are described, not materialised (a group of 1.25e8 ranks was a list of
    that many ints, killed for memory after minutes); what is printed and written stays small."""
    import resource

    cfg = _config("llama4_128e.toml", tmp_path, "--training.global_batch_size", "-1")
    world = 10**9
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    report = run_dry_run(cfg, world, console=Console(file=io.StringIO(), width=200))
    assert time.perf_counter() - start < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB: < 100 MB
    shard = report["groups"][str(world - 1)]["dp_shard"]
    assert shard == {"size": world // 8, "first": list(range(7, 64, 8)), "last": world - 1}
    assert report["groups"][str(world - 1)]["ep"] == list(range(world - 8, world))  # small groups: whole
    assert (tmp_path / "dry_run.json").stat().st_size < 100_000


def test_dry_run_warns_when_memory_exceeds_device(tmp_path):
    cfg = _config("llama4_16e.toml", tmp_path, "--job.device_memory_gib", "8",
                  "--activation_checkpoint.mode", "none")
    out = io.StringIO()
    report = run_dry_run(cfg, 64, console=Console(file=out, width=200))
    assert report["memory_per_rank_gib"]["total"] > 8
    assert "exceeds the device's 8.0 GiB" in out.getvalue()
    assert report["plan"]["moe_tensor_parallel"]["enabled"]


def test_dry_run_debug_model_single_rank(tmp_path):
    cfg = _config("debug_model.toml", tmp_path)
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, device_memory_gib=0.0))
    out = io.StringIO()
    report = run_dry_run(cfg, 1, console=Console(file=out, width=200))
    assert report["params_per_rank"] == report["params_total"]
    assert report["memory_per_rank_gib"]["params"] == pytest.approx(4 * report["params_total"] / GIB)
    assert report["groups"] == {"0": {name: [0] for name in ALL_NAMES}}


def test_dry_run_shows_pure_bf16(tmp_path):
    """The dry run counts 2 bytes per state element under training.dtype = "bfloat16" and says so."""
    bf16 = ["--training.mixed_precision_param", "bfloat16", "--parallelism.pipeline_parallel_degree", "2",
            "--training.local_batch_size", "2"]
    reports, outs = {}, {}
    for dtype in ("float32", "bfloat16"):
        cfg = _config("debug_model.toml", tmp_path / dtype, *bf16, "--training.dtype", dtype)
        outs[dtype] = io.StringIO()
        reports[dtype] = run_dry_run(cfg, 4, console=Console(file=outs[dtype], width=200))
    pure, mixed = reports["bfloat16"], reports["float32"]
    for part in ("params", "grads", "optimizer"):
        assert pure["memory_per_rank_gib"][part] == pytest.approx(mixed["memory_per_rank_gib"][part] / 2)
    assert pure["expert_state_per_rank_gib"] == pytest.approx(pure["expert_params_per_rank"] * 8 / GIB)
    assert [s["state_gib"] * 2 for s in pure["pipeline"]["stages"]] == pytest.approx(
        [s["state_gib"] for s in mixed["pipeline"]["stages"]])
    assert "bfloat16 weights, gradients and AdamW state" in pure["plan"]["data_parallel"]["detail"]
    assert "parameters, gradients and optimizer state bfloat16" in outs["bfloat16"].getvalue()


def test_dry_run_expert_memory_per_rank_and_context_parallel(tmp_path):
    """The tiny flavor on 8 ranks, tp 2 with ep 4: 2 MoE layers x 8 experts x 3 x 128 x 256 expert
    weights, a quarter per EP rank, halved again by FSDP over efsdp = 2."""
    cfg = _config("debug_model.toml", tmp_path, "--parallelism.tensor_parallel_degree", "2",
                  "--parallelism.expert_parallel_degree", "4", "--parallelism.context_parallel_degree", "2",
                  "--training.seq_len", "128")
    out = io.StringIO()
    report = run_dry_run(cfg, 8, console=Console(file=out, width=200))
    assert report["expert_params_per_rank"] == 2 * 8 * 3 * 128 * 256 // 4 // 2
    assert report["expert_state_per_rank_gib"] == pytest.approx(report["expert_params_per_rank"] * 16 / GIB)
    assert "routed experts per rank: 196.61 K stored" in out.getvalue()
    # seq 128 on cp 2: pieces of 32 tokens, shorter than the 64-token chunks, so the chunked
    # layers gather keys and values like the NoPE layer 3.
    modes = report["context_parallel"]["modes"]
    assert list(modes) == ["gather", "global"] and modes["global"]["layers"] == [3]
    assert "layers 0,1,2: all-gather K/V (chunk or sliding window longer than a piece)" in out.getvalue()
