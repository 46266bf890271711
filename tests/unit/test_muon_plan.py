"""The planner's Muon (`plan/muon.py`): its state against the real optimizer's on each family's
debug flavor, its Newton-Schulz FLOPs against torch's FLOP counter on `newton_schulz`, its gathers
against the hand formula, its step's transient peak against the real step's (MemTracker) and a
hand count, and the memory estimate, pipeline split and step time that use them.

    python -m pytest -q tests/unit/test_muon_plan.py
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from torchmoe.arch.deepseek_v3 import deepseek_v3
from torchmoe.arch.registry import FLAVORS, model_args_from_config
from torchmoe.config import load_job_config
from torchmoe.config.job_config import ActivationCheckpoint
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.config.job_config import Parallelism, Training
from torchmoe.models.decoder.model import Transformer
from torchmoe.optim.muon import Muon, newton_schulz
from torchmoe.optim.muon_groups import muon_split
from torchmoe.optim.optimizer import build_optimizer
from torchmoe.plan.hardware import load_profile
from torchmoe.plan.layout import param_specs
from torchmoe.plan.memory import estimate_memory, memory_per_pp_rank
from torchmoe.plan.muon import (
    is_muon,
    muon_cost,
    ns_flops,
    ns_flops_per_token,
    optimizer_state_elements,
    step_peak_bytes,
)
from torchmoe.plan.parallel_dims import MESH_DIMS, ParallelDims
from torchmoe.plan.pipeline import job_pipeline_layout, layer_costs, rank_units
from torchmoe.plan.step_time import predict, predict_layout

DEBUG = {"llama4": "debugmodel", "qwen3": "debugmodel_moe", "deepseek_v3": "debugmodel", "gpt_oss": "debugmodel"}
ONE = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1, world_size=1)


def _dims(**degrees: int) -> ParallelDims:
    full = dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1) | degrees
    return ParallelDims(**full, world_size=math.prod(full[d] for d in MESH_DIMS))


@pytest.mark.parametrize("family", sorted(DEBUG))
def test_state_and_split_match_the_real_optimizer(family: str) -> None:
    """After one step, the bytes of the real optimizer's states (momentum_buffer; exp_avg and
    exp_avg_sq) equal the planner's count, and its Muon parameters are the trainer's."""
    args = FLAVORS[family][DEBUG[family]]
    with torch.device("meta"):  # shapes and dtypes are all the count needs
        model = Transformer(args)
    cfg = OptimizerConfig(name="Muon", muon_router=family == "qwen3")  # both router rules, one each
    optimizer = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    measured = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                   for key, t in state.items() if key != "step")
    specs = param_specs(args)
    assert measured == 4 * optimizer_state_elements(specs, ONE, cfg)
    split = muon_split(model, cfg)
    assert {s.fqn for s in specs if is_muon(s, cfg)} == {n for n, (a, _) in split.items() if a == "muon"}
    adamw_states = 2 * sum(s.numel for s in specs)
    assert optimizer_state_elements(specs, ONE, OptimizerConfig(name="AdamW")) == adamw_states
    assert optimizer_state_elements(specs, ONE, cfg) < adamw_states


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (3, 40, 24)])
def test_ns_flops_match_the_flop_counter(shape: tuple[int, ...]) -> None:
    """4 r^2 c + 2 r^3 per quintic step (r, c: the short and long side), per matrix of a stack."""
    update = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(update, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
    experts = shape[0] if len(shape) == 3 else 1
    assert counter.get_total_flops() == experts * ns_flops(*shape[-2:], 5)
    assert ns_flops(48, 80, 5) == 5 * (4 * 48 * 48 * 80 + 2 * 48 ** 3)


def test_gathers_fsdp2_ep2() -> None:
    """FSDP 4 with EP 2 (4 ranks) on DeepSeek's debug flavor: every dense Muon matrix gathered
    whole over dp_shard_cp, b (n-1)/n P bytes; each rank's experts are whole: no gather, NS on its
    own 2."""
    args = FLAVORS["deepseek_v3"]["debugmodel"]
    dims = _dims(dp_shard=4, ep=2)
    cfg = OptimizerConfig(name="Muon")
    cost = muon_cost(args, dims, cfg)
    specs = [s for s in param_specs(args) if is_muon(s, cfg)]
    dense = sum(s.numel for s in specs if not s.expert)
    # 8 experts, 4 per EP rank, efsdp = 4 / 2 = 2: FSDP shards whole experts, 2 per rank.
    assert (args.num_experts, dims.efsdp) == (8, 2)
    expected_received = 2 * (1 - 1 / 4) * dense
    expected_flops = sum(ns_flops(*s.shape[-2:], 5) * (2 if s.expert else 1) for s in specs)
    assert cost.received_bytes == pytest.approx(expected_received, rel=1e-12)
    assert cost.ns_flops == expected_flops
    assert muon_cost(args, ONE, cfg).received_bytes == 0


def test_tp_gathers_after_fsdp() -> None:
    """FSDP 2 x TP 2: a column-wise matrix is gathered over dp_shard_cp (its TP-local half), then
    over tp (whole), and each rank receives 3/4 of it; fp32 NS doubles the bytes."""
    args = FLAVORS["llama4"]["debugmodel"]
    cfg = OptimizerConfig(name="Muon", ns_dtype="float32")
    cost = muon_cost(args, _dims(dp_shard=2, tp=2), cfg, units=["layers.0"])
    wq = next(s for s in param_specs(args) if s.fqn == "layers.0.attention.wq.weight")
    assert cost.gathers[0] == ("dp_shard_cp", 2, 4 * wq.numel // 2)
    assert cost.gathers[1] == ("tp", 2, 4 * wq.numel)


def test_memory_estimate_counts_one_state_for_muon() -> None:
    """The estimate's optimizer bytes: Muon's count, below AdamW's two states."""
    args = FLAVORS["deepseek_v3"]["debugmodel"]
    degrees = dict(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2)
    training = Training(local_batch_size=1, seq_len=64)
    muon = OptimizerConfig(name="Muon")
    gib = {name: estimate_memory(args, degrees, training, ActivationCheckpoint(), Parallelism(), optimizer_cfg=cfg)
           for name, cfg in (("muon", muon), ("adamw", OptimizerConfig()))}
    dims = _dims(dp_shard=2, ep=2)
    expected = 4 * optimizer_state_elements(param_specs(args), dims, muon) / 1024 ** 3
    assert gib["muon"]["optimizer"] == pytest.approx(expected, rel=1e-12)
    assert gib["muon"]["optimizer"] < gib["adamw"]["optimizer"]
    assert gib["muon"]["params"] == gib["adamw"]["params"]


def test_step_time_adds_the_ns_and_the_gathers() -> None:
    """Under Muon the step's optimizer time grows by the NS FLOPs at the matmul rate (and the
    Muon passes) and an exposed "muon" gather term appears; AdamW has none."""
    profile = load_profile("h100")
    base = ["--config", "configs/debug_model.toml", "--parallelism.data_parallel_shard_degree", "4"]
    adamw = predict(load_job_config(base), 4, profile)
    muon_cfg = load_job_config(base + ["--optimizer.name", "Muon"])
    muon = predict(muon_cfg, 4, profile)
    assert "muon" not in adamw.comm and muon.comm["muon"] > 0
    args = model_args_from_config(muon_cfg.model)
    dims = _dims(dp_shard=4)
    cost = muon_cost(args, dims, muon_cfg.optimizer)
    bandwidth = profile.memory_bandwidth_gbs * 1e9
    p = 4 if muon_cfg.training.dtype == "float32" else 2
    expected = (cost.ns_flops / profile.rate("matmul", "bfloat16") + p * (11 - 7) * cost.muon_stored / bandwidth)
    assert muon.compute["optimizer"] - adamw.compute["optimizer"] == pytest.approx(expected, rel=1e-9)


def test_step_peak_matches_the_measured_step() -> None:
    """One process (plain tensors, fp32 parameters): the bytes the real Muon step holds at its
    peak beyond its parameters, gradients and buffers (torch's MemTracker, the second step) equal
    `step_peak_bytes`: the largest parameter's Nesterov update, its NS X, X', G, H and norm, and
    the previous parameter's result. A DeepSeek-V3 of every matrix kind (MLA's bottlenecks, dense
    and shared MLPs, routed experts) at 1/4 of the debug flavor's widths: bf16 Newton-Schulz runs
    at about 1 GFLOP/s on this project's CPU, and the debug flavor's step took 100 to 490 s."""
    from torch.distributed._tools.mem_tracker import MemTracker

    args = deepseek_v3(dim=64, n_layers=2, n_heads=4, vocab_size=256, ffn_hidden_dim=256, moe_hidden_dim=64,
                       num_experts=4, num_shared_experts=1, top_k=2, first_k_dense=1, q_lora_rank=32,
                       kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    torch.manual_seed(0)
    model = Transformer(args)
    cfg = OptimizerConfig(name="Muon")
    split = muon_split(model, cfg)
    params = [p for n, p in model.named_parameters() if split[n][0] == "muon"]
    optimizer = Muon([{"params": params, "algorithm": "muon"}], nesterov=cfg.nesterov, ns_dtype=cfg.ns_dtype)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # creates the momentum buffers
    tracker = MemTracker()
    tracker.track_external(*params, optimizer)
    with tracker:
        optimizer.step()
    cpu = torch.device("cpu")
    measured = tracker.get_tracker_snapshot("peak")[cpu]["Total"] - tracker.get_tracker_snapshot("current")[cpu]["Total"]
    assert measured == step_peak_bytes(args, ONE, cfg, 4)


def test_step_peak_hand_count_fsdp4_ep2() -> None:
    """FSDP 4 x EP 2 on DeepSeek's debug flavor, fp32 parameters: the peak is wkv_b's (4096, 512),
    gathered whole: its fp32 Nesterov shard, the bf16 gathered copy and NS's X, X' (512 x 4096),
    G, H (512 x 512) and norm, and wkv_a's (576, 256) result shard before it. The memory
    estimate's total takes the larger of it and FSDP buffers + activations."""
    args = FLAVORS["deepseek_v3"]["debugmodel"]
    dims = _dims(dp_shard=4, ep=2)
    r, c = 512, 4096
    nesterov_shard, wkv_a = 4 * r * c // 4, 576 * 256 // 4
    assert step_peak_bytes(args, dims, OptimizerConfig(name="Muon"), 4) == nesterov_shard + 2 * (
        3 * r * c + 2 * r * r + 1 + wkv_a) == 15802370
    fp32 = OptimizerConfig(name="Muon", ns_dtype="float32", nesterov=False)
    assert step_peak_bytes(args, dims, fp32, 4) == 4 * (3 * r * c + 2 * r * r + 1 + wkv_a)
    assert step_peak_bytes(args, dims, OptimizerConfig(), 4) == 0
    # Two experts whole per rank (EP 2, FSDP of whole experts), cast to bf16, in one batched NS.
    experts = step_peak_bytes(args, dims, OptimizerConfig(name="Muon", muon_params=["*.experts.*"],
                                                          adamw_params=["*.weight"]), 4)
    assert experts == 4 * 2 * 256 * 256 + 2 * 2 * (3 * 256 * 256 + 2 * 256 * 256 + 1) + 2 * 2 * 256 * 256
    training = Training(local_batch_size=1, seq_len=64)
    muon_est = memory_per_pp_rank(args, dims, training, ActivationCheckpoint(), Parallelism(),
                                  optimizer_cfg=OptimizerConfig(name="Muon"))[0]
    assert muon_est.optimizer_step == 15802370
    assert muon_est.total == (muon_est.params + muon_est.grads + muon_est.optimizer
                              + max(muon_est.fsdp_buffers + muon_est.activations, 15802370))


def _pp2(optimizer: list[str]) -> tuple:
    """Qwen3's debug MoE flavor (8 alike blocks) on pp 2, Muon for all but blocks 0 and 1."""
    argv = ["--config", "configs/debug_model.toml", "--model.name", "qwen3", "--model.flavor", "debugmodel_moe",
            "--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "1F1B", "--training.local_batch_size", "2",
            "--parallelism.pipeline_parallel_microbatch_size", "1", *optimizer]
    cfg = load_job_config(argv)
    args = model_args_from_config(cfg.model)
    return cfg, args, _dims(pp=2)


MUON_BUT_TWO = ["--optimizer.name", "Muon", "--optimizer.adamw_params", '["layers.0.*", "layers.1.*"]']


def test_pipeline_split_counts_the_ns() -> None:
    """The split's time per block grows by its NS FLOPs per step over the step's tokens (x tp);
    with Muon's matrices only in blocks 2-7 the stage holding them gets fewer blocks (under
    AdamW, and with the NS left out, the 8 alike blocks split 4 / 4); the step prediction uses
    that split; AdamW adds nothing."""
    cfg, args, dims = _pp2(MUON_BUT_TWO)
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    per_token = ns_flops_per_token(args, dims, cfg.training, cfg.optimizer)
    specs = param_specs(args)
    for i in range(args.n_layers):
        mine = [s for s in specs if s.fsdp_unit == f"layers.{i}" and is_muon(s, cfg.optimizer)]
        hand = sum(ns_flops(*s.shape[-2:], 5) * (s.shape[0] if s.expert else 1) for s in mine)
        assert per_token.get(f"layers.{i}", 0) == hand // tokens
        assert (hand > 0) == (i >= 2)
    plain, _, _ = layer_costs(args, dims, cfg.training.seq_len)
    with_ns, _, _ = layer_costs(args, dims, cfg.training.seq_len, optimizer_flops=per_token)
    assert [w - p for w, p in zip(with_ns, plain)] == [per_token.get(f"layers.{i}", 0) for i in range(args.n_layers)]
    adamw_cfg = _pp2([])[0]
    assert ns_flops_per_token(args, dims, adamw_cfg.training, adamw_cfg.optimizer) == {}
    adamw_pipe = job_pipeline_layout(args, dims, adamw_cfg.parallelism, adamw_cfg.training, adamw_cfg.optimizer)
    muon_pipe = job_pipeline_layout(args, dims, cfg.parallelism, cfg.training, cfg.optimizer)
    assert adamw_pipe.layers == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert muon_pipe.layers == [[0, 1, 2, 3, 4], [5, 6, 7]]
    profile = load_profile("h100")  # the step prediction runs the split the trainer runs
    on_muon_split = predict_layout(cfg, dims, profile, 8, args=args, pipe=muon_pipe)
    assert predict_layout(cfg, dims, profile, 8, args=args).step_s == on_muon_split.step_s


def test_step_time_per_pp_rank_is_the_sum_of_its_parts() -> None:
    """Under PP each rank's optimizer time is its own stage's elementwise passes and NS FLOPs at
    the matmul rate, its Muon gathers none (no FSDP); the step is the slowest rank's: here pp rank 0
    (blocks 0-4, three of them Muon's, and the embedding) against pp rank 1 (5-7 and the head)."""
    cfg, args, dims = _pp2(MUON_BUT_TWO)
    profile = load_profile("h100")
    pipe = job_pipeline_layout(args, dims, cfg.parallelism, cfg.training, cfg.optimizer)
    pred = predict_layout(cfg, dims, profile, 8, args=args, pipe=pipe)
    bandwidth = profile.memory_bandwidth_gbs * 1e9
    specs = param_specs(args)
    seconds = []
    for r in range(2):
        units = set(rank_units(pipe, r))
        mine = [s for s in specs if s.fsdp_unit in units]
        muon = [s for s in mine if is_muon(s, cfg.optimizer)]
        ns = sum(ns_flops(*s.shape[-2:], 5) * (s.shape[0] if s.expert else 1) for s in muon)
        passes = 11 * sum(s.numel for s in muon) + 7 * sum(s.numel for s in mine if s not in muon)
        seconds.append(4 * passes / bandwidth + ns / profile.rate("matmul", "bfloat16"))
    assert pred.compute["optimizer"] in (pytest.approx(seconds[0], rel=1e-12), pytest.approx(seconds[1], rel=1e-12))
    assert pred.comm["muon"] == 0
    assert pred.step_s == pytest.approx(pred.compute_s + pred.comm_s + pred.bubble, rel=1e-12)
