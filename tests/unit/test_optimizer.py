"""build_optimizer param groups and implementations; clip_grad_norm_ against torch's."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from torchmoe import _torch_private as private
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.optim.optimizer import build_optimizer, clip_grad_norm_


class _TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.norm = nn.RMSNorm(8)
        self.proj = nn.Linear(8, 8, bias=True)
        self.output = nn.Linear(8, 16, bias=False)
        self.register_buffer("expert_bias", torch.zeros(4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.proj(self.norm(self.tok_embeddings(tokens))))


def _groups(opt: torch.optim.Optimizer, model: nn.Module) -> dict[float, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[float, set[str]] = {}
    for g in opt.param_groups:
        out.setdefault(g["weight_decay"], set()).update(names[id(p)] for p in g["params"])
    return out


def test_weight_decay_exclusions_and_hyperparameters() -> None:
    model = _TinyMoE()
    cfg = OptimizerConfig(lr=3e-4, eps=1e-7, weight_decay=0.05, beta1=0.8, beta2=0.9)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    assert _groups(opt, model) == {
        0.05: {"proj.weight", "output.weight"},
        0.0: {"tok_embeddings.weight", "norm.weight", "proj.bias"},
    }
    for g in opt.param_groups:
        assert g["lr"] == 3e-4 and g["eps"] == 1e-7 and g["betas"] == (0.8, 0.9)
    # The expert bias is a buffer: never optimized.
    assert all(p is not model.expert_bias for g in opt.param_groups for p in g["params"])


def test_decay_all_params_decays_norms_and_embeddings_as_torchtitan() -> None:
    model = _TinyMoE()
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.05, decay_all_params=True))
    assert _groups(opt, model) == {0.05: {"proj.weight", "output.weight", "tok_embeddings.weight", "norm.weight",
                                          "proj.bias"}}


def _no_decay_by_name(name: str) -> bool:
    """The docs' rule (config.md, muon.md), written from the names alone: biases (``bias``,
    gpt-oss's per-expert ``b13`` and ``b2`` of shape (experts, out)), norms (every ``*norm``
    module's weight), attention sinks and the token embedding get no weight decay."""
    owner, _, leaf = name.rpartition(".")
    return (leaf in ("bias", "b13", "b2", "sinks") or owner.rpartition(".")[2].endswith("norm")
            or name == "tok_embeddings.weight")


def _family_model(family: str, lora: bool) -> nn.Module:
    """`family`'s tiny model (DeepSeek-V3's with a multi-token-prediction layer); `lora`: with
    adapters on every target it has, the base frozen."""
    import importlib

    from torchmoe.config.job_config import LoRA
    from torchmoe.models.decoder.lora import apply_lora
    from torchmoe.models.decoder.model import Transformer

    args = importlib.import_module(f"torchmoe.arch.{family}").FLAVORS["tiny"]
    model = Transformer(args.replace(mtp_layers=1) if family == "deepseek_v3" else args)
    if lora:
        targets = ["attention", "experts", "router"]
        targets += ["shared_experts"] if family in ("llama4", "deepseek_v3") else []
        targets += ["mlp"] if family != "gpt_oss" else []
        apply_lora(model, LoRA(enable=True, targets=targets, rank=4))
    return model


@pytest.mark.parametrize("family", ["llama4", "qwen3", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_weight_decay_follows_each_parameter_s_role_in_every_family(family: str, name: str) -> None:
    """Every family's parameters, as AdamW (and Muon's AdamW part) groups them: the no-decay group
    is exactly the biases of every shape (gpt-oss's 2-D expert biases b13, b2 decayed before),
    norms, sinks and the token embedding; the rest decays (Muon's matrices with Muon's own
    decay); the routers' expert-bias buffers are in no group."""
    model = _family_model(family, lora=False)
    opt = build_optimizer(model, OptimizerConfig(name=name, weight_decay=0.05))
    names = {id(p): n for n, p in model.named_parameters()}
    decays = {names[id(p)]: g["weight_decay"] > 0 for g in opt.param_groups for p in g["params"]}
    assert sorted(decays) == sorted(names.values())  # every parameter, once; no buffer
    assert {n for n, d in decays.items() if not d} == {n for n in names.values() if _no_decay_by_name(n)}
    if family == "gpt_oss":
        assert not decays["layers.0.moe.experts.b13"] and not decays["layers.0.moe.experts.b2"]
    if family == "deepseek_v3":
        assert not decays["mtp.4.enorm.weight"] and decays["mtp.4.eh_proj.weight"]


@pytest.mark.parametrize("family", ["llama4", "qwen3", "deepseek_v3", "gpt_oss"])
def test_lora_adapters_decay_as_peft_s_do(family: str) -> None:
    """A LoRA run's optimizer holds the adapters alone, and weight decay applies to every one of
    them, linear and routed experts' alike (transformers' Trainer, which PEFT trains under,
    exempts only biases and norms)."""
    model = _family_model(family, lora=True)
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.05))
    groups = _groups(opt, model)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(n.rpartition(".")[2].startswith("lora_") for n in adapters)
    assert groups == {0.05: adapters}


@pytest.mark.parametrize(
    "implementation, foreach, fused",
    [("for-loop", False, False), ("foreach", True, False), ("fused", False, True)],
)
def test_implementations(implementation: str, foreach: bool, fused: bool) -> None:
    model = _TinyMoE()
    opt = build_optimizer(model, OptimizerConfig(name="Adam", implementation=implementation))
    assert isinstance(opt, torch.optim.Adam) and not isinstance(opt, torch.optim.AdamW)
    assert all(g["foreach"] == foreach and g["fused"] == fused for g in opt.param_groups)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()


def test_fused_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(private, "fused_optimizer_devices", lambda: ["cuda"])
    with caplog.at_level(logging.WARNING):
        opt = build_optimizer(_TinyMoE(), OptimizerConfig(implementation="fused"))
    assert all(g["foreach"] and not g["fused"] for g in opt.param_groups)
    assert "using 'foreach' instead" in caplog.text


def _params_with_grads(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(*s, generator=g)) for s in [(4, 3), (5,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    params.append(nn.Parameter(torch.zeros(3)))  # no grad: skipped
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_matches_torch(norm_type: float, foreach: bool | None, max_norm: float) -> None:
    ours, ref = _params_with_grads(0), _params_with_grads(0)
    total = clip_grad_norm_(ours, max_norm, norm_type=norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours, ref):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


def test_clip_without_grads_returns_zero() -> None:
    assert clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
