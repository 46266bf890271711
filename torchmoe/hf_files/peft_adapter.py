"""LoRA adapters in PEFT's format, both ways, for every family with a PEFT mapping, and the merged
Hugging Face export.

    python -m pytest -q tests/unit/test_lora_peft.py

`save_peft_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained(transformers_model, folder)`` loads onto the family's
transformers model with our logits; `load_peft_adapter` reads such a folder (ours, or PEFT's
own for the same targets) into a model `models.decoder.lora.apply_lora` adapted, to continue
training. `save_merged_model` writes the model with every adapter folded into its weight.

Where each adapter goes is the family's ``peft_target`` (`models.peft_targets`); the tensor
layouts are PEFT's (0.21): for a linear, ``lora_A = A``, ``lora_B = B``; for routed experts
(``target_parameters`` on the [E, ...] stack), ``lora_A (E*r, in)`` stacks the experts' A and
``lora_B (out, r*E)`` interleaves their B (column ``k*E + e`` is expert e's column k). PEFT
nests the wrappers of two parameters of one module in the module's parameter order (the first,
``gate_up_proj``, innermost: its keys carry one ``base_layer.`` more).

Plain (unsharded) models only; a sharded run gathers first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_writes import write_file
from torchmoe.config.job_config import LoRA
from torchmoe.hf_files.hf_storage import ExpertBiasDrop, save_hf_weights
from torchmoe.hf_files.peft_adapter_checks import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_product,
    check_targets,
    read_adapter_config,
    read_adapter_tensors,
)
from torchmoe.models.decoder.lora import adapted_modules, merged_state_dict
from torchmoe.models.hf_config_spec import HFConversionError
from torchmoe.models.peft_targets import PeftTarget
from torchmoe.models.registry import hf_mapping
from torchmoe.nn.experts import RoutedExperts
from torchmoe.nn.lora import ADAPTER_PREFIX, is_adapter_name

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BIASES_WITHOUT_PLACE", "load_peft_adapter", "peft_tensor_names",
           "require_peft_form",
           "save_merged_model", "save_peft_adapter"]

_PREFIX = "base_model.model."
_MERGED_FIX = 'set lora.export = "merged" (the model with each adapter folded into its weight)'
BIASES_WITHOUT_PLACE = ("PEFT's adapter format holds adapters on a base it leaves as it is, and has no place for "
                        "the biases: on its base the adapter would select the base's experts, not the trained ones")
"""Why an adapter export of a LoRA run that trained the expert biases is refused (preflight, convert)."""


def _pairs(model: torch.nn.Module) -> list[tuple[PeftTarget, torch.nn.Parameter, torch.nn.Parameter, bool]]:
    """(PEFT target, our A, our B, is a routed-expert stack) of every adapter of `model`.

    Raises:
        ConfigError: (naming lora.export) the family has no PEFT mapping, or PEFT cannot hold one
            of the adapters.
    """
    mapping = hf_mapping(model.args)
    if mapping.peft_target is None:
        raise ConfigError("lora.export", "adapter", f"torchmoe has no PEFT mapping for {mapping.title}", _MERGED_FIX)
    pairs = []
    try:
        for name, module in adapted_modules(model).items():
            if isinstance(module, RoutedExperts):
                for proj in module.lora_projections:  # w13 (gate_up_proj) before w2: PEFT's nesting order
                    a, b = (getattr(module, f"{ADAPTER_PREFIX}{proj}_{side}") for side in "ab")
                    pairs.append((mapping.peft_target(f"{name}.{proj}", a.shape), a, b, True))
            else:
                pairs.append((mapping.peft_target(f"{name}.weight", module.weight.shape), module.lora_a,
                              module.lora_b, False))
    except HFConversionError as e:
        raise ConfigError("lora.export", "adapter", str(e), _MERGED_FIX) from None
    return pairs


def require_peft_form(model: torch.nn.Module) -> None:
    """Refuse (before training) adapters of `model` that PEFT cannot hold (`ConfigError` naming
    lora.export and the target, offering the merged export). Shapes only: a meta model does."""
    _pairs(model)


def peft_tensor_names(model: torch.nn.Module) -> set[str]:
    """The names of `model`'s adapter tensors in a PEFT adapter file (``...lora_A.weight`` and
    ``...lora_B.weight``). Shapes only: a meta model does.

    Raises:
        ConfigError: as `require_peft_form`.
    """
    return {f"{stem}lora_{side}.weight" for stem in _keys(_pairs(model)) for side in "AB"}


def _keys(pairs: list[tuple[PeftTarget, ...]]) -> list[str]:
    """PEFT's state-dict key stem (before ``lora_A.weight``) of each pair, in order."""
    per_module: dict[str, list[str]] = {}
    for target, *_ in pairs:
        if target.parameter is not None:
            per_module.setdefault(target.module, []).append(target.parameter)
    keys = []
    for target, *_ in pairs:
        if target.parameter is None:
            keys.append(f"{_PREFIX}{target.module}.")
            continue
        params = per_module[target.module]
        depth = len(params) - 1 - params.index(target.parameter)  # wrapped first: innermost
        keys.append(f"{_PREFIX}{target.module}.{'base_layer.' * depth}")
    return keys


def _to_peft(a: torch.Tensor, b: torch.Tensor, experts: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours -> PEFT's (lora_A, lora_B): a (r, in), b (out, r) as they are; expert stacks
    a (E, r, in) -> (E*r, in), b (E, out, r) -> (out, r*E) with column ``k*E + e`` = b[e, :, k]."""
    if not experts:
        return a.detach().clone(), b.detach().clone()
    e, r, n_in = a.shape
    return a.detach().reshape(e * r, n_in).clone(), b.detach().permute(1, 2, 0).reshape(b.shape[1], r * e).clone()


def _from_peft(lora_a: torch.Tensor, lora_b: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               experts: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's (lora_A, lora_B) -> ours, shaped as `a` and `b` (the inverse of `_to_peft`)."""
    if not experts:
        return lora_a, lora_b
    e, r, _ = a.shape
    return lora_a.reshape(a.shape), lora_b.reshape(b.shape[1], r, e).permute(2, 0, 1)


def _config(pairs, cfg: LoRA, base: str | None) -> dict:
    modules = sorted({t.name for t, *_ in pairs if t.parameter is None})
    parameters = sorted({t.name for t, *_ in pairs if t.parameter is not None})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": modules or None,
            "target_parameters": parameters or None, "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}}


def save_peft_adapter(model: torch.nn.Module, out_dir: str | os.PathLike, cfg: LoRA, *,
                      base: str | None = None) -> None:
    """Write `model`'s adapters (added by `apply_lora` with `cfg`) as a PEFT adapter folder, whose
    ``base_model_name_or_path`` is `base` (the Hugging Face folder the run started from; None:
    it started from no Hugging Face folder).

    Raises:
        ConfigError: (naming lora.export, before anything is written) PEFT cannot hold one of
            the adapters, or torchmoe has no PEFT mapping for the family; the fix offers the
            merged export.
    """
    pairs = _pairs(model)
    tensors = {}
    for stem, (_, a, b, experts) in zip(_keys(pairs), pairs):
        tensors[f"{stem}lora_A.weight"], tensors[f"{stem}lora_B.weight"] = _to_peft(a, b, experts)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    write_file(out_dir / ADAPTER_CONFIG, json.dumps(_config(pairs, cfg, base), indent=2) + "\n")


def load_peft_adapter(model: torch.nn.Module, folder: str | os.PathLike, cfg: LoRA) -> None:
    """Copy a PEFT adapter folder's tensors into `model`'s adapters (added by `apply_lora` with
    `cfg`), in place, once the folder is held to the base's rules (`peft_adapter_checks`).

    Raises:
        ConfigError: (naming lora.adapter and the folder) a file is missing, unreadable, damaged or
            malformed; its adapter_config.json is not a LoRA adapter of `cfg`'s rank and alpha, says
            the adapter computes something else than torchmoe does, or contradicts its tensors; a
            tensor is not floating-point, not finite, beyond the bound weights are held to (its
            product with its pair too), of another shape than `model`'s, missing (lora.targets
            adapts it) or extra.
    """
    folder, key = Path(folder), "lora.adapter"
    config = read_adapter_config(folder, cfg, key=key)
    stored = read_adapter_tensors(folder, key=key)
    pairs = _pairs(model)
    wanted = set()
    loaded = []
    for stem, (_, a, b, experts) in zip(_keys(pairs), pairs):
        wanted.update((f"{stem}lora_A.weight", f"{stem}lora_B.weight"))
        if f"{stem}lora_A.weight" not in stored or f"{stem}lora_B.weight" not in stored:
            raise ConfigError(key, str(folder), f"has no tensor {stem}lora_A/B.weight, which lora.targets adapts",
                              "set lora.targets to the adapter's targets")
        new_a, new_b = _from_peft(stored[f"{stem}lora_A.weight"], stored[f"{stem}lora_B.weight"], a, b, experts)
        if new_a.shape != a.shape or new_b.shape != b.shape:
            raise ConfigError(key, str(folder), f"{stem}lora_A/B.weight have shapes {tuple(new_a.shape)} and "
                              f"{tuple(new_b.shape)}, the model's adapter {tuple(a.shape)} and {tuple(b.shape)}",
                              "pass an adapter of this model")
        check_product(stem, new_a, new_b, cfg.alpha / cfg.rank, key=key, folder=folder)
        loaded.append((a, b, new_a, new_b))
    extra = sorted(set(stored) - wanted)
    if extra:
        raise ConfigError(key, str(folder), f"holds {len(extra)} tensor(s) lora.targets does not adapt, e.g. "
                          f"{extra[0]}", "add their targets to lora.targets")
    check_targets(config, {t.module for t, *_ in pairs if t.parameter is None},
                  {t.name for t, *_ in pairs if t.parameter is not None}, _hf_names(model), key=key, folder=folder)
    with torch.no_grad():  # only once every check passed: a refused folder leaves the model as it was
        for a, b, new_a, new_b in loaded:
            a.copy_(new_a)
            b.copy_(new_b)


def _hf_names(model: torch.nn.Module) -> set[str]:
    """Every tensor name of the transformers model of `model`'s family that holds one of ours."""
    mapping = hf_mapping(model.args)
    names = set()
    for name, tensor in model.state_dict().items():
        try:
            hf = None if is_adapter_name(name) else mapping.hf_slice(name, tensor.shape)
        except HFConversionError:  # a tensor of ours the family's model has no place for
            continue
        if hf is not None:
            names.add(hf.hf_name)
    return names


def save_merged_model(model: torch.nn.Module, out_dir: str | os.PathLike, *,
                      bias_drop: ExpertBiasDrop = ExpertBiasDrop()) -> None:
    """Write `model` with every adapter folded in (``W + scaling * B @ A``) as a Hugging Face
    folder of its family, as `torchmoe.hf.save_model` writes a model without adapters (its
    expert biases too: one the family's folder has no place for is refused unless `bias_drop`
    allows leaving it out)."""
    save_hf_weights(merged_state_dict(model), model.args, out_dir, bias_drop=bias_drop)
