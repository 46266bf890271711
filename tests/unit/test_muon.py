"""Muon (`optim/muon.py`) against torch.optim.Muon: every matrix's update, every routed
expert's, MLA's projections; the Muon/AdamW split by role; the state dict.

    python -m pytest -q tests/unit/test_muon.py
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from torchmoe.arch.registry import FLAVORS
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.models.decoder.model import Transformer
from torchmoe.optim.muon import Muon, newton_schulz
from torchmoe.optim.muon_groups import describe_split, muon_split
from torchmoe.optim.optimizer import build_optimizer

# name -> Muon settings (config keys): torch's defaults, then each key changed.
SETTINGS = {
    "defaults": {},
    "nesterov_off": {"nesterov": False, "momentum": 0.9},
    "decay_match_rms": {"weight_decay": 0.05, "adjust_lr": "match_rms_adamw"},
    "ns_steps_coefficients": {"ns_steps": 3, "ns_coefficients": [3.0, -3.2, 1.2], "ns_eps": 1e-5},
}


def _torch_kwargs(cfg: OptimizerConfig) -> dict:
    """torch.optim.Muon's arguments for the Muon settings of `cfg`."""
    return dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
                ns_coefficients=tuple(cfg.ns_coefficients), eps=cfg.ns_eps, ns_steps=cfg.ns_steps,
                adjust_lr_fn=cfg.adjust_lr)


def _model(family: str, dtype: torch.dtype = torch.float32) -> Transformer:
    model = Transformer(FLAVORS[family]["tiny"])
    model.init_weights(seed=0)
    return model.to(dtype)


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(p.shape, generator=g).to(p.dtype) for n, p in model.named_parameters()}


class _TorchReference:
    """torch.optim.Muon on each Muon matrix alone (each routed expert's matrix on its own) and
    torch.optim.AdamW on the rest, with the groups build_optimizer makes."""

    def __init__(self, model: nn.Module, cfg: OptimizerConfig, split: dict[str, tuple[str, str]]) -> None:
        self.params: dict[str, list[nn.Parameter]] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if split[name][0] == "muon":
                mats = [nn.Parameter(m.detach().clone()) for m in (p if p.ndim == 3 else [p])]
                self.params[name] = mats
                self.optimizers += [torch.optim.Muon([m], **_torch_kwargs(cfg)) for m in mats]
            else:
                self.params[name] = [nn.Parameter(p.detach().clone())]
                # Biases (gpt-oss's 2-D expert biases too), norms, sinks and the embedding: no decay.
                no_decay_name = p.ndim < 2 or name.endswith((".b13", ".b2")) or "tok_embeddings" in name
                (no_decay if no_decay_name else decay).append(self.params[name][0])
        self.optimizers.append(torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True))

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for name, mats in self.params.items():
            for m, g in zip(mats, grads[name] if len(mats) > 1 else [grads[name]]):
                m.grad = g.clone()
        for opt in self.optimizers:
            opt.step()

    def value(self, name: str) -> torch.Tensor:
        mats = self.params[name]
        return torch.stack([m.detach() for m in mats]) if len(mats) > 1 else mats[0].detach()


def _run_both(model: Transformer, cfg: OptimizerConfig, steps: int = 2) -> tuple[Muon, _TorchReference]:
    ref = _TorchReference(model, cfg, muon_split(model, cfg))
    opt = build_optimizer(model, cfg)
    for step in range(steps):
        grads = _grads(model, step)
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        ref.step(grads)
    return opt, ref


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_matrix_and_expert_update_equals_torch_muon(setting: str) -> None:
    """Two steps (the second uses the momentum buffer) on gpt-oss's tiny model (tall, wide and
    square projections, 3-D expert stacks, 2-D expert biases): every Muon matrix equals
    torch.optim.Muon on it alone, every routed expert's matrix torch.optim.Muon on that expert
    alone, and the AdamW parameters torch's AdamW, bit for bit."""
    cfg = OptimizerConfig(name="Muon", lr=0.02, adamw_lr=0.02, **SETTINGS[setting])
    model = _model("gpt_oss")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, ref = _run_both(model, cfg)
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), name
        assert torch.equal(p.detach(), ref.value(name)), name
    assert {k for s in opt.state.values() for k in s} == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}


def test_mla_projections_are_orthogonalised_each_on_its_own() -> None:
    """DeepSeek-V3's low-rank projections (wq_a, wq_b, wkv_a, wkv_b) and wo are Muon matrices;
    their q/kv norms AdamW's; each update equals torch.optim.Muon's on that weight alone."""
    cfg = OptimizerConfig(name="Muon", lr=0.02, weight_decay=0.01)
    model = _model("deepseek_v3")
    split = muon_split(model, cfg)
    for proj in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"):
        assert split[f"layers.0.attention.{proj}.weight"] == ("muon", "linear weights")
    for norm in ("q_norm", "kv_norm"):
        assert split[f"layers.0.attention.{norm}.weight"][0] == "adamw"
    _, ref = _run_both(model, cfg)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref.value(name)), name


def test_bf16_parameters_equal_torch_muon() -> None:
    cfg = OptimizerConfig(name="Muon", lr=0.02)
    model = _model("qwen3", torch.bfloat16)
    _, ref = _run_both(model, cfg)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref.value(name)), name


def test_bf16_without_nesterov_keeps_the_momentum_buffer_unlike_torch() -> None:
    """torch.optim.Muon, bf16 parameters, nesterov off: its Newton-Schulz casts the buffer with
    a no-op .bfloat16() and divides it in place, so the buffer ends normalised. Here the buffer
    stays (1 - momentum) * grad after the first step; the first update is torch's."""
    w = torch.randn(16, 24).bfloat16()
    grad = torch.randn(16, 24).bfloat16()
    ours, theirs = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    ours.grad, theirs.grad = grad.clone(), grad.clone()
    opt = Muon([{"params": [ours], "algorithm": "muon"}], lr=0.02, nesterov=False)
    torch_opt = torch.optim.Muon([theirs], lr=0.02, nesterov=False)
    opt.step()
    torch_opt.step()
    assert torch.equal(ours.detach(), theirs.detach())
    expected = torch.zeros_like(grad).lerp_(grad, 1 - 0.95)
    assert torch.equal(opt.state[ours]["momentum_buffer"], expected)
    assert not torch.equal(torch_opt.state[theirs]["momentum_buffer"], expected)


@pytest.mark.parametrize("shape", [(4, 24, 16), (4, 16, 24), (3, 20, 20)])
def test_batched_newton_schulz_equals_each_matrix_alone(shape: tuple[int, int, int]) -> None:
    """One batched NS over a stack (tall, wide, square) equals torch's NS of each matrix alone,
    in bf16 and fp32 (bit for bit on CPU: bmm runs each batch entry as mm runs it alone)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    stack = torch.randn(shape)
    coefficients = (3.4445, -4.775, 2.0315)
    batched = newton_schulz(stack, coefficients, 5, 1e-7, torch.bfloat16)
    for e in range(shape[0]):
        assert torch.equal(batched[e], _zeropower_via_newtonschulz(stack[e], coefficients, 5, 1e-7))
        assert torch.equal(newton_schulz(stack, coefficients, 5, 1e-7, torch.float32)[e],
                           newton_schulz(stack[e], coefficients, 5, 1e-7, torch.float32))


@pytest.mark.parametrize("family", ["llama4", "qwen3", "deepseek_v3", "gpt_oss"])
def test_split_by_role(family: str) -> None:
    """Per family: Muon for linear weights and routed experts' matrices; AdamW for embeddings,
    the head, norms, biases (gpt-oss's 2-D expert biases too), sinks and the router gates;
    muon_router moves the gates to Muon."""
    model = _model(family)
    split = muon_split(model, OptimizerConfig(name="Muon"))
    muon = {n for n, (a, _) in split.items() if a == "muon"}
    expected = {n for n, p in model.named_parameters()
                if (n.endswith(".weight") and p.ndim == 2 and "router" not in n and "tok_embeddings" not in n
                    and n != "output.weight") or (".experts." in n and p.ndim == 3)}
    assert muon == expected
    assert split["output.weight"] == ("adamw", "output head")
    assert split["tok_embeddings.weight"] == ("adamw", "embeddings")
    gates = {n for n in split if n.endswith("router.gate.weight")}
    assert gates and all(split[n] == ("adamw", "router gates") for n in gates)
    routed = muon_split(model, OptimizerConfig(name="Muon", muon_router=True))
    assert {n for n, (a, _) in routed.items() if a == "muon"} == expected | gates
    if family == "gpt_oss":
        assert split["layers.0.moe.experts.b13"] == ("adamw", "routed-expert biases")
        assert split["layers.0.attention.sinks"][0] == "adamw"


def test_patterns_override_the_role() -> None:
    model = _model("llama4")
    cfg = OptimizerConfig(name="Muon", muon_params=["output.weight"], adamw_params=["layers.0.*"])
    split = muon_split(model, cfg)
    assert split["output.weight"] == ("muon", "muon_params")
    assert split["layers.0.attention.wq.weight"] == ("adamw", "adamw_params")
    assert split["layers.1.attention.wq.weight"] == ("muon", "linear weights")


def test_pattern_errors_name_the_key_value_and_fix() -> None:
    model = _model("gpt_oss")
    with pytest.raises(ConfigError) as err:
        muon_split(model, OptimizerConfig(name="Muon", muon_params=["*.b13"]))
    assert str(err.value) == (
        'optimizer.muon_params = "*.b13": matches layers.0.moe.experts.b13 of shape (8, 128), which holds no '
        "matrix: Muon orthogonalises matrices (out, in) and stacks of routed experts' matrices only\n"
        "  fix: narrow the pattern to weight matrices")
    with pytest.raises(ConfigError) as err:
        muon_split(model, OptimizerConfig(name="Muon", muon_params=["*.wq.weight"], adamw_params=["layers.1.*"]))
    assert str(err.value) == (
        "optimizer.muon_params = \"*.wq.weight\": matches layers.1.attention.wq.weight, which "
        "optimizer.adamw_params' 'layers.1.*' matches too\n  fix: make the two lists' patterns disjoint")


def test_describe_split_folds_layers() -> None:
    lines = describe_split(_model("qwen3"), OptimizerConfig(name="Muon"))
    # qwen3 tiny: 4 blocks of attention (128x128, 64x128, 64x128, 128x128), a dense first block
    # (256x128 MLP), 3 MoE blocks of 8 experts (64x128 each of w1, w2, w3).
    assert lines[0] == f"Muon: {16 + 3 + 9} tensors, {4 * 128 * 384 + 3 * 256 * 128 + 9 * 8 * 64 * 128:,} elements"
    assert lines[1] == ("  linear weights: layers.N.attention.wq.weight x4, layers.N.attention.wk.weight x4, "
                        "layers.N.attention.wv.weight x4, layers.N.attention.wo.weight x4, "
                        "layers.0.feed_forward.w1.weight, layers.0.feed_forward.w2.weight, "
                        "layers.0.feed_forward.w3.weight")
    assert lines[2] == "  routed experts: layers.N.moe.experts.w1 x3, layers.N.moe.experts.w2 x3, layers.N.moe.experts.w3 x3"
    assert lines[3] == "AdamW: 22 tensors, 135,424 elements"
    assert lines[-2:] == ["  router gates: layers.N.moe.router.gate.weight x3", "  output head: output.weight"]


def test_state_dict_round_trip_continues_exactly() -> None:
    """A fresh Muon loading the state dict after two steps takes the same third step: Muon's
    momentum buffers and AdamW's moments both come back (the AdamW shares the loaded state)."""
    cfg = OptimizerConfig(name="Muon", lr=0.02, adamw_lr=1e-3)
    model = _model("gpt_oss")
    opt, _ = _run_both(model, cfg)
    twin = _model("gpt_oss")
    twin.load_state_dict(model.state_dict())
    twin_opt = build_optimizer(twin, cfg)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # no tensor shared with `opt`
    assert twin_opt._adamw.state is twin_opt.state
    assert [g["lr"] for g in twin_opt.param_groups] == [0.02, 1e-3, 1e-3]
    for m, o in ((model, opt), (twin, twin_opt)):
        grads = _grads(m, 5)
        for n, p in m.named_parameters():
            p.grad = grads[n]
        o.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


def test_only_shards_that_split_matrices_are_gathered() -> None:
    """FSDP's rows, TP's columns or rows and FSDP on the experts' hidden dim are gathered; a
    shard of an expert stack's dim 0 (EP, FSDP of whole experts, strided or not) is not."""
    from torch.distributed.tensor import Replicate, Shard

    from torchmoe import _torch_private as private
    from torchmoe.optim.muon_distributed import whole_matrix_placements

    strided = private.strided_shard_type()(0, split_factor=2)
    assert whole_matrix_placements((strided, Shard(0)), 2) == (Replicate(), Replicate())
    assert whole_matrix_placements((Replicate(), Shard(1)), 2) == (Replicate(), Replicate())
    assert whole_matrix_placements((strided, Shard(0)), 3) == (strided, Shard(0))
    assert whole_matrix_placements((Shard(1), Shard(0)), 3) == (Replicate(), Shard(0))
    assert whole_matrix_placements((Shard(0), Shard(2)), 3) == (Shard(0), Replicate())


def test_opening_lines_show_the_split() -> None:
    """The optimizer's named place (`training.optimization`) hands the run's opening its split:
    Muon's lines follow the run's line; AdamW's optimization has none."""
    from torchmoe.config.job_config import JobConfig
    from torchmoe.training.console import opening
    from torchmoe.training.optimization import build_optimization

    model, cfg = _model("qwen3"), JobConfig()
    cfg.optimizer = OptimizerConfig(name="Muon")
    muon = build_optimization(model, cfg.optimizer, cfg.lr_scheduler, steps=5)
    assert muon.description == describe_split(model, cfg.optimizer)
    assert muon.description[0] == f"Muon: 28 tensors, {4 * 128 * 384 + 3 * 256 * 128 + 9 * 8 * 64 * 128:,} elements"
    lines = opening(cfg, FLAVORS["qwen3"]["tiny"], step=0, global_batch_size=8, world_size=1, device_type="cpu",
                    dump_folder=Path("out"), optimizer_lines=muon.description).splitlines()
    assert lines[1:] == muon.description and lines[0].startswith("training ")
    assert build_optimization(model, OptimizerConfig(name="AdamW"), cfg.lr_scheduler, steps=5).description == []
