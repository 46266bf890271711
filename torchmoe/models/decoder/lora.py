"""LoRA on the decoder: which modules `lora.targets` names, adapting them, and merging adapters
back into the weights.

    python -m pytest -q tests/unit/test_lora.py

`apply_lora` runs on the built model (any device, meta included) before the parallelize
pipeline, which then shards and wraps adapters as it does the weights beside them. Adapters
are added to the main decoder's layers only; the multi-token prediction layers stay frozen
(Hugging Face's causal LM, which PEFT adapts, has none).

    target            modules                                                        adapter
    attention         every nn.Linear of the attention (wq/wk/wv/wo, MLA's wq_a,     linear
                      wq_b, wkv_a, wkv_b)
    mlp               the dense layers' feed_forward.w1/w2/w3                          linear
    shared_experts    moe.shared_experts.w1/w2/w3                                      linear
    experts           moe.experts: w13 (the fused gate/up rows) and w2, per expert     grouped
    router            moe.router.gate                                                  linear
"""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.config.job_config import LoRA
from torchmoe.nn.experts import RoutedExperts
from torchmoe.nn.init import fill_parameters
from torchmoe.nn.lora import (
    adapter_param_inits,
    add_expert_adapters,
    add_linear_adapter,
    expert_delta,
    freeze_base,
    has_adapter,
    is_adapter_name,
    linear_delta,
)

__all__ = ["adapted_modules", "apply_lora", "init_adapters", "merged_state_dict", "target_of"]


def _target_modules(model: nn.Module, targets: list[str]) -> dict[str, nn.Module]:
    """Name (in `model`) -> module of every module `targets` names, in layer order."""
    found: dict[str, nn.Module] = {}
    for layer_name, layer in model.layers.items():
        if int(layer_name) >= model.args.n_layers:  # a multi-token prediction module's block: frozen
            continue
        prefix = f"layers.{layer_name}"
        if "attention" in targets:
            found.update({f"{prefix}.attention.{n}": m for n, m in layer.attention.named_modules()
                          if isinstance(m, nn.Linear)})
        if not layer.moe_enabled:
            if "mlp" in targets:
                found.update({f"{prefix}.feed_forward.{n}": m for n, m in layer.feed_forward.named_children()})
            continue
        moe = layer.moe
        if "shared_experts" in targets and moe.shared_experts is not None:
            found.update({f"{prefix}.moe.shared_experts.{n}": m for n, m in moe.shared_experts.named_children()})
        if "router" in targets:
            found[f"{prefix}.moe.router.gate"] = moe.router.gate
        if "experts" in targets:
            found[f"{prefix}.moe.experts"] = moe.experts
    return found


# Where each target's modules sit in a block (`_target_modules`), for naming the target of an adapter.
_TARGET_PLACES = {"attention": ".attention.", "mlp": ".feed_forward.", "shared_experts": ".moe.shared_experts.",
                  "experts": ".moe.experts.", "router": ".moe.router."}


def target_of(name: str) -> str:
    """The `lora.targets` entry that adapts the module holding the adapter parameter `name`
    (``layers.1.moe.experts.lora_w13_a`` -> "experts")."""
    return next(target for target, place in _TARGET_PLACES.items() if place in name)


def apply_lora(model: nn.Module, cfg: LoRA) -> list[str]:
    """Add adapters to the modules `cfg.targets` names and freeze everything else, in place;
    returns the adapted modules' names. The adapters are uninitialised: `Transformer.init_weights`
    draws them (PEFT's init) with the rest, or `init_adapters` alone after a weight load."""
    found = _target_modules(model, list(cfg.targets))
    for module in found.values():
        if isinstance(module, RoutedExperts):
            add_expert_adapters(module, module.lora_shapes(), cfg.rank, cfg.alpha, cfg.dropout)
        else:
            add_linear_adapter(module, cfg.rank, cfg.alpha, cfg.dropout)
    freeze_base(model)
    return list(found)


def init_adapters(model: nn.Module, *, seed: int) -> None:
    """Draw `model`'s adapters alone (PEFT's init, layout-independent as every init), in place:
    after the base weights came from a checkpoint."""
    fill_parameters(model, adapter_param_inits(model), seed=seed)


def adapted_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every module of `model` holding adapters."""
    return {name: m for name, m in model.named_modules() if has_adapter(m)}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict without adapters, each adapted weight replaced by ``W + scaling * B @ A``
    (per expert for routed experts; the fused gate/up adapter split back into w1 and w3 rows).
    Plain (unsharded) tensors only."""
    state = {name: t for name, t in model.state_dict().items() if not is_adapter_name(name)}
    with torch.no_grad():
        for name, module in adapted_modules(model).items():
            if not isinstance(module, RoutedExperts):
                key = f"{name}.weight"
                state[key] = state[key] + linear_delta(module).to(state[key].dtype)
                continue
            for proj, weights in module.lora_projections.items():
                delta = expert_delta(module, proj)  # (E, out, in)
                start = 0
                for w in weights:
                    key = f"{name}.{w}"
                    rows = state[key].shape[1]
                    state[key] = state[key] + delta[:, start:start + rows].to(state[key].dtype)
                    start += rows
    return state
