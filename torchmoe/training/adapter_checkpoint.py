"""A LoRA run's step-N checkpoint as the trained model again, for `torchmoe convert dcp-to-hf`:
the run's model (its config.toml; a Hugging Face start's config.json), its frozen base (the run's
saved copy, `lora.checkpoint_base`, else its `checkpoint.initial_load_path`, checked against the
fingerprint the checkpoint recorded) and the step's adapters, with the expert biases the run
trained where it trained them, written as `lora.export` says (`adapters.export_hf`, as the run's
own export at its last step).

    export_checkpoint(cfg, step_dir, out_dir, bias_drop=ExpertBiasDrop(...))   # one process

    python -m pytest -q tests/integration/test_lora_training.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import model_args_from_config
from torchmoe.components.adapter_settings import AdapterSettings
from torchmoe.components.base_fingerprint import BaseFingerprint, base_fingerprint
from torchmoe.components.checkpoint import saved_base
from torchmoe.components.checkpoint_state import dcp_load, load_model_only
from torchmoe.components.folder_model import with_folder_model
from torchmoe.components.hf_storage import ExpertBiasDrop
from torchmoe.components.initial_load import load_initial_weights
from torchmoe.components.peft_adapter import BIASES_WITHOUT_PLACE, require_peft_form
from torchmoe.components.weight_files import model_tensors, read_dcp_metadata
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import JobConfig
from torchmoe.config.paths import source_key
from torchmoe.nn.lora import is_adapter_name
from torchmoe.training.adapters import (
    base_source,
    base_tensors,
    base_weights,
    export_hf,
    hf_base,
    plain_model,
    saved_tensors_check,
)

__all__ = ["export_checkpoint"]

_FIX = "pass a step-N checkpoint folder of the run"


def export_checkpoint(cfg: JobConfig, step_dir: Path, out_dir: Path, *, bias_drop: ExpertBiasDrop) -> None:
    """Write the model of the LoRA checkpoint `step_dir` into `out_dir` as `cfg.lora.export` says.

    Args:
        cfg: the run's job (its config.toml, `job.dump_folder` its folder), `lora.export` the
            output's form.
        step_dir: the run's `<job.dump_folder>/<checkpoint.folder>/step-N`.

    Raises:
        ConfigError: the base is gone (naming `checkpoint.initial_load_path` and the fix), is
            another than the run trained on (its fingerprint), or cannot be read; PEFT cannot hold
            an adapter, or the expert biases the run trained (naming ``--lora-export``, offering
            "merged"); the step's adapters are not this model's.
    """
    ckpt, lora = cfg.checkpoint, cfg.lora
    base = saved_base(step_dir.parent)
    if base is None and ckpt.initial_load_path and not os.path.lexists(ckpt.initial_load_path):
        key = source_key(cfg, "checkpoint.initial_load_path")
        raise ConfigError(key, ckpt.initial_load_path, f"is gone, and {step_dir.parent} holds no copy of the frozen "
                          f"base (lora.checkpoint_base was false): the adapters of {step_dir} cannot be put back on "
                          "their base", "restore the folder the run started from there; lora.checkpoint_base = true "
                          "makes future runs keep the base with their checkpoints")
    cfg = with_folder_model(cfg)  # a Hugging Face start: its config.json (the saved base's copy without the folder)
    args = model_args_from_config(cfg.model, lora=cfg.lora.enable)
    metadata = read_dcp_metadata("CKPT_DIR", step_dir, _FIX)
    stored = model_tensors(metadata)
    dtype = next(md.properties.dtype for name, md in stored.items() if is_adapter_name(name))
    # The base's tensors the run trained (its expert biases), as the checkpoint holds them.
    trained = sorted(name for name in stored if not is_adapter_name(name))
    model = plain_model(args, lora, dtype)
    problem = _unholdable(model, step_dir, trained) if lora.export == "adapter" else None
    if problem is not None:  # before anything is read: the export would refuse it
        raise ConfigError("--lora-export", "adapter", problem, "pass --lora-export merged (the model with each "
                          "adapter folded into its weight, and the expert biases as trained)")
    # The run's [lora] settings made these tensors (config.toml edited since: refused, naming the key).
    saved_tensors_check(cfg, args)({name: md.size for name, md in stored.items()})
    if any(key.startswith("lora.") for key in metadata.state_dict_metadata):  # recorded since 2026-12-07
        dcp_load({"lora": AdapterSettings(lora, cfg.model.load_balance_coeff)}, step_dir, None)
    if base is not None:
        model.init_buffers("cpu")  # fresh router state, as the run's before its base loaded
        load_model_only(base, [model], key="checkpoint.folder", keep=base_weights(lora))
    elif ckpt.initial_load_path:
        model.init_buffers("cpu")
        load_initial_weights(ckpt, cfg.model.flavor, args, model, key=source_key(cfg, "checkpoint.initial_load_path"),
                             keep=base_weights(lora))
    else:  # the base is the seed's random init, as the run drew it (`model_build.build_model`)
        model.init_weights(seed=cfg.training.seed)
    recorded = any(key.startswith("base.") for key in metadata.state_dict_metadata)
    _check_base(cfg, model, args, step_dir, base, recorded=recorded)
    load_model_only(step_dir, [model], key="CKPT_DIR", keep=lambda name: is_adapter_name(name) or name in trained)
    export_hf(model, args, lora, out_dir, rank=0, bias_drop=bias_drop, base=hf_base(cfg))


def _unholdable(model: nn.Module, step_dir: Path, trained: list[str]) -> str | None:
    """Why PEFT's adapter format cannot hold the model of `step_dir` (`model` adapted as the run
    was; `trained`: the base's tensors the checkpoint holds, its trained expert biases), or None."""
    try:
        require_peft_form(model)
    except ConfigError as err:
        return err.problem
    if trained:
        return f"{step_dir} holds the expert biases its run trained (e.g. {trained[0]}): {BIASES_WITHOUT_PLACE}"
    return None


def _check_base(cfg: JobConfig, model: nn.Module, args: ModelArgs, step_dir: Path, base: Path | None, *,
                recorded: bool) -> None:
    """The base in `model` must be the one `step_dir` recorded (`Checkpoints.check_base`, at a
    resume), if it `recorded` one (a checkpoint of the version before fingerprints did not)."""
    fingerprint = BaseFingerprint()
    if recorded:
        dcp_load({"base": fingerprint}, step_dir, None)
    key, path, fix = base_source(cfg, base)
    fingerprint.check(base_fingerprint(model, base_tensors(args, cfg.lora)), key=key, path=path, fix=fix)
