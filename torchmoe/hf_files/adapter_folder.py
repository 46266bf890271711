"""A PEFT adapter folder as weights to read (`torchmoe eval` and `torchmoe generate --checkpoint
ADAPTER`): the base it adapts, and the `[lora]` settings that put it on that base.

    base = adapter_base(folder, base="", key="--checkpoint")     # the Hugging Face folder it adapts
    lora = adapter_lora(folder, args, key="--checkpoint")        # targets, rank, alpha; adapter = folder

The base is the folder the command names (``--base``), else the one adapter_config.json names in
``base_model_name_or_path`` where that is a folder on this machine (a hub id is never fetched).
The targets are the `lora.targets` whose adapters are exactly the tensors the folder holds
(`peft_adapter.peft_tensor_names` of each target alone); rank and alpha are its config's. The
tensors themselves are read and checked by `peft_adapter.load_peft_adapter` when the model is
built, as for `lora.adapter`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import LoRA
from torchmoe.config.validate import LORA_TARGETS
from torchmoe.hf_files.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_tensor_names
from torchmoe.models.decoder.lora import apply_lora
from torchmoe.models.decoder.model import Transformer
from torchmoe.weights.weight_files import read_json_object, reading

__all__ = ["adapter_base", "adapter_lora", "is_adapter_folder"]

_FIX = "pass a folder written by PEFT's save_pretrained or torchmoe's adapter export (lora.export = \"adapter\")"
_WHOLE_FIX = ("merge it into its base with PEFT (PeftModel.merge_and_unload(), then save_pretrained) and pass that "
              "folder, or pass an adapter on whole lora.targets (torchmoe's adapter export)")


def is_adapter_folder(folder: Path) -> bool:
    """Whether `folder` holds a PEFT adapter (its adapter_config.json)."""
    return (folder / ADAPTER_CONFIG).is_file()


def adapter_base(folder: Path, *, base: str, key: str) -> Path:
    """The Hugging Face folder the adapter in `folder` (named by `key`) goes on: `base` (the
    ``--base`` flag) when given, else adapter_config.json's ``base_model_name_or_path`` where it
    is a folder here (a relative one is taken from the adapter folder, as PEFT's local paths).

    Raises:
        ConfigError: naming ``--base``: it is given and holds no config.json; or not given and the
            adapter names no base, or one that is no folder here (a hub id).
    """
    if base:
        if not (Path(base) / "config.json").is_file():
            raise ConfigError("--base", base, "holds no config.json: it is not a Hugging Face model folder",
                              f"pass the Hugging Face folder the adapter {folder} was trained on (config.json + "
                              "*.safetensors)")
        return Path(base)
    named = read_json_object(key, folder, ADAPTER_CONFIG, _FIX).get("base_model_name_or_path")
    fix = (f"pass --base FOLDER: the Hugging Face folder the adapter was trained on (config.json + *.safetensors); "
           f"a run's own adapters also load over its base from its step-N folder (--job.dump_folder RUN)")
    if not isinstance(named, str) or not named:
        raise ConfigError("--base", "(not given)", f"{key} {folder} is a PEFT adapter, and its {ADAPTER_CONFIG} names "
                          f"no base (base_model_name_or_path is {json.dumps(named)})", fix)
    path = Path(named) if Path(named).is_absolute() else folder / named
    if not (path / "config.json").is_file():
        raise ConfigError("--base", "(not given)", f"{key} {folder} is a PEFT adapter whose {ADAPTER_CONFIG} names "
                          f"base_model_name_or_path = {show_value(named)}, which is no Hugging Face folder here "
                          "(torchmoe fetches nothing from the hub)", fix)
    return path


def adapter_lora(folder: Path, args: ModelArgs, *, key: str) -> LoRA:
    """The `[lora]` section that puts the adapter in `folder` (named by `key`) on a model of
    `args`: the targets whose adapters are exactly its tensors, its rank and alpha, and the folder
    as `lora.adapter` (dropout 0: the model reads, it does not train).

    Raises:
        ConfigError: (naming `key`) adapter_config.json or the tensor file is missing or damaged,
            rank or alpha is not a positive number, or the tensors are not those of whole
            `lora.targets` of this model (PEFT adapts any module; torchmoe whole targets).
    """
    config = read_json_object(key, folder, ADAPTER_CONFIG, _FIX)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    for field, value in (("r", rank), ("lora_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf") \
                or (field == "r" and not isinstance(value, int)):
            raise ConfigError(key, str(folder), f"its {ADAPTER_CONFIG} has {field} = {show_value(value)}, not a "
                              f"positive {'integer' if field == 'r' else 'number'}", _FIX)
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(key, str(folder), f"has no {ADAPTER_WEIGHTS}", _FIX)
    with reading(key, folder, _FIX, what=ADAPTER_WEIGHTS):
        with safe_open(folder / ADAPTER_WEIGHTS, framework="pt") as f:
            stored = set(f.keys())
    targets, covered = [], set()
    for target in LORA_TARGETS:
        names = _target_names(args, target, rank)
        if names and names <= stored:
            targets.append(target)
            covered |= names
        elif names & stored:
            missing = sorted(names - stored)
            raise ConfigError(key, str(folder), f"adapts part of what lora.targets {show_value(target)} adapts "
                              f"({len(names & stored)} of its {len(names)} tensors; it lacks e.g. {missing[0]}), "
                              "and torchmoe adapts whole targets", _WHOLE_FIX)
    extra = sorted(stored - covered)
    if extra:
        raise ConfigError(key, str(folder), f"holds {len(extra)} adapter tensor(s) of modules no lora.targets of "
                          f"this model adapts, e.g. {extra[0]}", _WHOLE_FIX)
    if not targets:
        raise ConfigError(key, str(folder), "holds no adapter tensors", "pass a PEFT adapter folder that holds the "
                          "lora_A and lora_B tensors of its targets")
    return LoRA(enable=True, targets=targets, rank=rank, alpha=float(alpha), dropout=0.0, adapter=str(folder))


def _target_names(args: ModelArgs, target: str, rank: int) -> set[str]:
    """The adapter file's tensor names of `target`'s adapters on a model of `args` (a meta model);
    empty where the model has no such module or PEFT no place for it."""
    with torch.device("meta"):
        model = Transformer(args)
    apply_lora(model, LoRA(enable=True, targets=[target], rank=rank))
    try:
        return peft_tensor_names(model)
    except ConfigError:  # PEFT cannot hold this target on this family: no PEFT folder holds it
        return set()
