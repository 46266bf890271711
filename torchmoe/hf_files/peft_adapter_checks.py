"""A PEFT adapter folder (`lora.adapter`) held to the base's rules: its two files read as a base
folder's are (a missing, damaged or malformed one is one message naming it, never a
traceback), its ``adapter_config.json`` saying what torchmoe computes and agreeing with its
tensors, and its tensors floating-point, finite and within the bound every weight read from a
file a user names is held to (`finite.WEIGHT_BOUND`), their product ``alpha / r * B @ A``
(what they add to a weight, and the merged export holds) too.

    config = read_adapter_config(folder, cfg, key=key)   # the fields, checked
    tensors = read_adapter_tensors(folder, key=key)      # name -> tensor, checked
    check_targets(config, held_modules, held_parameters, universe, key=key, folder=folder)

    python -m pytest -q tests/unit/test_lora_peft.py -k refuses

Of ``adapter_config.json``'s fields (PEFT 0.22's LoraConfig): ``peft_type`` must be LORA,
``task_type`` CAUSAL_LM (or unset), ``r`` and ``lora_alpha`` the run's; ``target_modules``,
``target_parameters``, ``exclude_modules`` and ``layers_to_transform`` must name exactly the
modules and parameters the tensors adapt (PEFT would adapt a module named without tensors anew,
and not load tensors of a module it does not name), as lists (a pattern is not evaluated: a
crafted one can take forever); ``init_lora_weights`` may not be an initialisation that changes
the base's weights (PiSSA, OLoRA, CorDA, LoftQ...: the adapter then belongs to that changed base);
every field that changes what the adapter computes (``use_rslora``, ``use_dora``,
``rank_pattern``, ``alpha_pattern``, ``fan_in_fan_out``, ``bias``, ``lora_bias``,
``modules_to_save``, ``trainable_token_indices``, ``layer_replication``...) and any field
torchmoe does not know must hold its default. What only describes the file or its training
(``base_model_name_or_path``, ``revision``, ``inference_mode``, ``lora_dropout``, ``peft_version``,
``auto_mapping``, the initialisations' own configs) is not read.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_kinds import check_regular
from torchmoe.config.job_config import LoRA
from torchmoe.models.hf_config_spec import show_json
from torchmoe.weights.finite import WEIGHT_BOUND, refuse_bad_values
from torchmoe.weights.weight_files import read_json_object, reading

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "check_product", "check_targets", "read_adapter_config",
           "read_adapter_tensors"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FOLDER_FIX = "pass a folder written by PEFT's save_pretrained or torchmoe's adapter export, as it wrote it"

# Fields that change what the adapter computes, with the one value torchmoe computes (a missing
# field: PEFT's default, the same value).
_DEFAULTS: dict[str, Any] = {
    "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False,
    "bias": "none", "lora_bias": False, "modules_to_save": None, "trainable_token_indices": None,
    "layer_replication": None, "alora_invocation_tokens": None, "use_qalora": False, "megatron_config": None,
    "loftq_config": {}, "use_bdlora": None, "arrow_config": None, "velora_config": None, "monteclora_config": None,
    "kasa_config": None,
}
# Fields that describe the file or how it trained, not what it computes (the initialisations'
# configs count with `init_lora_weights`, which is checked); the matching fields are checked
# against the tensors (`check_targets`); r and lora_alpha against the run.
_NOT_READ = frozenset({
    "base_model_name_or_path", "revision", "inference_mode", "lora_dropout", "peft_version", "auto_mapping",
    "megatron_core", "runtime_config", "qalora_group_size", "ensure_weight_tying", "eva_config", "corda_config",
    "lora_ga_config", "astra_config", "task_type", "peft_type", "r", "lora_alpha", "init_lora_weights",
    "target_modules", "target_parameters", "exclude_modules", "layers_to_transform", "layers_pattern",
})
# Initialisations that leave the base's weights as they are (the others subtract the adapter's
# start from them: the adapter is then one of that changed base).
_BASE_KEEPING_INITS = (True, False, "gaussian", "orthogonal", "eva", "nora")


def _refuse(key: str, folder: Path, problem: str, fix: str = FOLDER_FIX) -> ConfigError:
    return ConfigError(key, str(folder), problem, fix)


def _same(got: Any, want: Any) -> bool:
    """A JSON value equal to `want` (an int written for a float counts as it)."""
    if isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        return float(got) == want
    return type(got) is type(want) and got == want or (want is None and got in ([], {}))


def read_adapter_config(folder: Path, cfg: LoRA, *, key: str) -> dict:
    """The checked ``adapter_config.json`` of the adapter folder `folder` (`key`'s value), for a
    run of `cfg`.

    Raises:
        ConfigError: the file is missing, unreadable, damaged or not a JSON object; it is not a
            LoRA adapter of `cfg`'s rank and alpha for a causal LM; a field changes what the
            adapter computes from what torchmoe computes (module docstring).
    """
    config = read_json_object(key, folder, ADAPTER_CONFIG, FOLDER_FIX)
    said = f"its {ADAPTER_CONFIG} has"
    if config.get("peft_type") != "LORA":
        raise _refuse(key, folder, f"{said} peft_type = {show_json(config.get('peft_type'))}: not a LoRA adapter",
                      "pass a LoRA adapter (peft_type LORA)")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise _refuse(key, folder, f"{said} task_type = {show_json(config['task_type'])}: an adapter of another "
                      "model than the causal LM torchmoe trains", "pass an adapter of the causal LM (task_type CAUSAL_LM)")
    for field, want in (("r", cfg.rank), ("lora_alpha", cfg.alpha)):
        got = config.get(field)
        if not _same(got, want):
            raise _refuse(key, folder, f"{said} {field} = {show_json(got)}, the run {show_json(want)}",
                          f"set lora.rank/lora.alpha to the adapter's, or pass an adapter of rank {cfg.rank} and "
                          f"alpha {cfg.alpha}")
    init = config.get("init_lora_weights", True)
    if not any(_same(init, ok) for ok in _BASE_KEEPING_INITS):
        raise _refuse(key, folder, f"{said} init_lora_weights = {show_json(init)}: that initialisation changes the "
                      "base's weights (PEFT subtracts the adapter's start from them), so the adapter belongs to a "
                      "base torchmoe does not have", "convert it to a plain LoRA adapter first (PEFT's save_pretrained "
                      "with path_initial_model_for_weight_conversion), or pass one of init_lora_weights = true")
    for field, value in config.items():
        want = _DEFAULTS.get(field)
        unset = value is None or value is False or value in ([], {})  # not 0: 0 == False
        if field in _NOT_READ or _same(value, want) or (field not in _DEFAULTS and unset):
            continue
        what = "torchmoe computes the adapter without it" if field in _DEFAULTS else \
            "a field torchmoe does not know, so it cannot say the adapter computes what torchmoe does"
        raise _refuse(key, folder, f"{said} {field} = {show_json(value)}: {what}",
                      f"pass an adapter with {field} = {show_json(want)} (PEFT's default; plain LoRA)")
    return config


def read_adapter_tensors(folder: Path, *, key: str) -> dict[str, torch.Tensor]:
    """The tensors of the adapter folder `folder`'s ``adapter_model.safetensors``, each in
    floating point, finite and within ±`WEIGHT_BOUND`.

    Raises:
        ConfigError: the file is missing, not a regular file, unreadable, damaged or truncated; a
            tensor is stored as integers (naming it); or holds NaN, inf or a value beyond the bound.
    """
    path = folder / ADAPTER_WEIGHTS
    if not path.exists():
        raise _refuse(key, folder, f"has no {ADAPTER_WEIGHTS}")
    with reading(key, folder, FOLDER_FIX, what=ADAPTER_WEIGHTS):
        check_regular(path)  # a named pipe would wait for a writer
        tensors = load_file(path)
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise _refuse(key, folder, f"its tensor {name} is stored as {str(tensor.dtype).removeprefix('torch.')}, "
                          "not as floating-point weights (a cast would make other numbers of it)")
    refuse_bad_values(tensors, key=key, path=folder)
    return tensors


def _listed(config: Mapping[str, Any], field: str, key: str, folder: Path) -> list[str]:
    """`field` of `config` as a list of names ([] when unset)."""
    value = config.get(field)
    if value is None:
        return []
    if isinstance(value, str):
        raise _refuse(key, folder, f"its {ADAPTER_CONFIG} has {field} = {show_json(value)}: a pattern, which "
                      "torchmoe does not evaluate (a crafted pattern can take forever to match)",
                      f"list the names in {field}, as PEFT's save_pretrained writes a list it was given")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(key, folder, f"its {ADAPTER_CONFIG} has {field} = {show_json(value)}: not a list of names")
    return value


def _names(name: str, targets: list[str]) -> bool:
    """PEFT's match of a module or parameter `name` by a list of `targets`: equal, or ending with
    ``.target``."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _layers(config: Mapping[str, Any], key: str, folder: Path) -> Collection[int] | None:
    """The layer indices `layers_to_transform` keeps (None: every layer)."""
    layers, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if layers is None or layers == []:
        return None
    if pattern not in (None, "", [], "layers", ["layers"]):
        raise _refuse(key, folder, f"its {ADAPTER_CONFIG} has layers_pattern = {show_json(pattern)}: the "
                      "layers of the models torchmoe trains are model.layers.N")
    layers = [layers] if type(layers) is int else layers
    if not isinstance(layers, list) or not all(type(i) is int for i in layers):
        raise _refuse(key, folder, f"its {ADAPTER_CONFIG} has layers_to_transform = {show_json(layers)}: not "
                      "a layer index or a list of them")
    return set(layers)


_LAYER = re.compile(r"^.*?\.[^.]*\.(\d+)\.")  # PEFT's: the first numbered segment of a module's name


def check_targets(config: Mapping[str, Any], held_modules: Collection[str], held_parameters: Collection[str],
                  universe: Collection[str], *, key: str, folder: Path) -> None:
    """``adapter_config.json``'s targets name exactly what its tensors adapt, as PEFT reads them.

    Args:
        config: the adapter's config (`read_adapter_config`).
        held_modules, held_parameters: the modules (``target_modules``) and parameters
            (``module.parameter``, ``target_parameters``) its tensors adapt.
        universe: every tensor name of the family's transformers model (``module.parameter``).

    Raises:
        ConfigError: a matching field is a pattern or not a list of names, or names a module or
            parameter without tensors, or leaves one with tensors out (naming it).
    """
    modules = _listed(config, "target_modules", key, folder)
    parameters = _listed(config, "target_parameters", key, folder)
    excluded = _listed(config, "exclude_modules", key, folder)
    layers = _layers(config, key, folder)

    def targeted(module: str) -> bool:
        if _names(module, excluded) or not _names(module, modules):
            return False
        found = _LAYER.match(module)
        return layers is None or (found is not None and int(found[1]) in layers)

    said = f"its {ADAPTER_CONFIG}'s"
    checks = (("target_modules", {name.rpartition(".")[0] for name in universe}, targeted, set(held_modules)),
              ("target_parameters", set(universe), lambda name: _names(name, parameters), set(held_parameters)))
    for field, places, named, held in checks:
        unheld = sorted(place for place in places if named(place) and place not in held)
        if unheld:
            raise _refuse(key, folder, f"{said} {field} names {unheld[0]}, for which it holds no tensors (PEFT would "
                          "put a new adapter there)")
        unnamed = sorted(place for place in held if not named(place))
        if unnamed:
            raise _refuse(key, folder, f"it holds tensors for {unnamed[0]}, which {said} {field} does not name (PEFT "
                          "would not load them)")


def check_product(name: str, a: torch.Tensor, b: torch.Tensor, scaling: float, *, key: str, folder: Path) -> None:
    """What the adapter `name` adds to its weight, ``scaling * B @ A`` (a (..., r, in), b (...,
    out, r): one pair, or a stack of experts' pairs), stays within ±`WEIGHT_BOUND`: bounded by
    ``scaling * max_i sum_k |B_ik| max_j |A_kj|`` without forming the product.

    Raises:
        ConfigError: the bound exceeds it (the values came with the adapter: no training makes them).
    """
    row_peaks = a.detach().float().abs().amax(-1, keepdim=True)  # (..., r, 1)
    bound = scaling * float((b.detach().float().abs() @ row_peaks).max())
    if not bound <= WEIGHT_BOUND:  # NaN too
        raise _refuse(key, folder, f"its {name}lora_A/B.weight add up to {bound:.3g} to a weight (alpha / r * B @ A), "
                      f"beyond ±{WEIGHT_BOUND:,.0f}, which no trained model reaches: the file is damaged or crafted",
                      "point it at an adapter within that bound (a copy saved before the run diverged, or the "
                      "export as written)")
