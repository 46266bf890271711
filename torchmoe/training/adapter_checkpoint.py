"""A LoRA run's step-N checkpoint as the trained model again: the run's model (its config.toml; a
Hugging Face start's config.json), its frozen base (the run's saved copy, `lora.checkpoint_base`,
else its `checkpoint.initial_load_path`, checked against the fingerprint the checkpoint recorded)
and the step's adapters, with the expert biases the run trained where it trained them.
`torchmoe convert dcp-to-hf` writes it as `lora.export` says (`adapters.export_hf`, as the run's
own export at its last step), `torchmoe generate` samples from it, and `torchmoe eval` loads the
same base (`lora_base`) under the trainer (`checkpointing.Checkpoints.load_trained`).

    model = adapted_model(cfg, step_dir)                                        # one process, CPU
    export_checkpoint(cfg, step_dir, out_dir, bias_drop=ExpertBiasDrop(...))   # one process

    python -m pytest -q tests/integration/test_lora_training.py
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import model_args_from_config
from torchmoe.checkpoints.adapter_settings import AdapterSettings
from torchmoe.checkpoints.base_fingerprint import BaseFingerprint, base_fingerprint
from torchmoe.checkpoints.checkpoint import saved_base
from torchmoe.checkpoints.checkpoint_state import dcp_load, load_model_only
from torchmoe.config.errors import ConfigError
from torchmoe.config.files.paths import source_key
from torchmoe.config.job_config import JobConfig
from torchmoe.hf_files.hf_storage import ExpertBiasDrop
from torchmoe.hf_files.peft_adapter import BIASES_WITHOUT_PLACE, require_peft_form
from torchmoe.models.decoder.lora import apply_lora
from torchmoe.models.decoder.model import Transformer
from torchmoe.nn.lora import is_adapter_name
from torchmoe.training.adapters import (
    base_source,
    base_tensors,
    base_weights,
    checkpointed,
    export_hf,
    hf_base,
    plain_model,
    saved_tensors_check,
)
from torchmoe.weight_sources.folder_model import start_gone, with_folder_model
from torchmoe.weight_sources.initial_load import load_initial_weights
from torchmoe.weights.weight_files import model_tensors, read_dcp_metadata

__all__ = ["adapted_model", "export_checkpoint", "lora_base"]

_FIX = "pass a step-N checkpoint folder of the run"


def lora_base(cfg: JobConfig, step_dir: Path) -> tuple[str, bool]:
    """Where the frozen base of the LoRA run `cfg` (its job, `job.dump_folder` its folder) loads
    from for its checkpoint `step_dir`, as (path, whether a Hugging Face folder): the run's saved
    copy (`lora.checkpoint_base`), else its `checkpoint.initial_load_path`; ("", False) for the
    seed's random init.

    Raises:
        ConfigError: the initial folder is gone and the run kept no copy (`start_gone`).
    """
    base = saved_base(step_dir.parent)
    if base is not None:
        return str(base), False
    ckpt = cfg.checkpoint
    if ckpt.initial_load_path and not os.path.lexists(ckpt.initial_load_path):
        raise start_gone(cfg)
    return ckpt.initial_load_path, ckpt.initial_load_in_hf


def _step_tensors(cfg: JobConfig, step_dir: Path) -> tuple[JobConfig, ModelArgs, dict[str, Any]]:
    """The run's job with its folder's model, its arguments, and the model tensors `step_dir`
    holds (name -> DCP metadata), read from the step's metadata and checked against the run's
    `[lora]` settings (config.toml edited since: refused, naming the key)."""
    cfg = with_folder_model(cfg)  # a Hugging Face start: its config.json (the saved base's copy without the folder)
    args = model_args_from_config(cfg.model, lora=cfg.lora.enable)
    stored = model_tensors(read_dcp_metadata("CKPT_DIR", step_dir, _FIX))
    saved_tensors_check(cfg, args)({name: md.size for name, md in stored.items()})
    return cfg, args, stored


def _step_model(cfg: JobConfig, step_dir: Path) -> tuple[JobConfig, ModelArgs, Transformer]:
    """As `_step_tensors`, with the adapted model on the CPU in the adapters' dtype (nothing
    loaded yet) in place of the tensors."""
    cfg, args, stored = _step_tensors(cfg, step_dir)
    dtype = next(md.properties.dtype for name, md in stored.items() if is_adapter_name(name))
    return cfg, args, plain_model(args, cfg.lora, dtype)


def adapted_model(cfg: JobConfig, step_dir: Path) -> Transformer:
    """The model the LoRA checkpoint `step_dir` of the run `cfg` (its job, `job.dump_folder` its
    folder) holds: unsharded on the CPU, with its adapters, the base loaded as a resume loads it
    (`lora_base`) and checked against the fingerprint the step recorded, then the step's tensors
    (`adapters.checkpointed`: the adapters, and the expert biases where the run trained them).
    Parameters in the adapters' dtype, as the run held them.

    Raises:
        ConfigError: the base is gone (naming `checkpoint.initial_load_path` and the fix), is
            another than the run trained on (its fingerprint), or cannot be read; the step's
            tensors are not this model's, or another `[lora]` setting's.
    """
    path, _ = lora_base(cfg, step_dir)
    cfg, args, model = _step_model(cfg, step_dir)
    metadata = read_dcp_metadata("CKPT_DIR", step_dir, _FIX)
    if any(key.startswith("lora.") for key in metadata.state_dict_metadata):  # recorded since 2026-12-07
        dcp_load({"lora": AdapterSettings(cfg.lora, cfg.model.load_balance_coeff)}, step_dir, None)
    base = saved_base(step_dir.parent)
    if base is not None:  # checksummed when saved and checked as it loads: the run's own copy
        model.init_buffers("cpu")  # fresh router state, as the run's before its base loaded
        load_model_only(base, [model], key="checkpoint.folder", keep=base_weights(cfg.lora))
    elif path:
        model.init_buffers("cpu")
        ckpt = dataclasses.replace(cfg.checkpoint, last_save_in_hf=False)  # reading: nothing is exported here
        load_initial_weights(ckpt, cfg.model.flavor, args, model, key=source_key(cfg, "checkpoint.initial_load_path"),
                             keep=base_weights(cfg.lora))
    else:  # the base is the seed's random init, as the run drew it (`model_build.build_model`)
        model.init_weights(seed=cfg.training.seed)
    recorded = any(key.startswith("base.") for key in metadata.state_dict_metadata)
    _check_base(cfg, model, args, step_dir, base, recorded=recorded)
    load_model_only(step_dir, [model], key="CKPT_DIR", keep=checkpointed(cfg.lora, args))
    return model


def export_checkpoint(cfg: JobConfig, step_dir: Path, out_dir: Path, *, bias_drop: ExpertBiasDrop) -> None:
    """Write the model of the LoRA checkpoint `step_dir` into `out_dir` as `cfg.lora.export` says.

    Args:
        cfg: the run's job (its config.toml, `job.dump_folder` its folder), `lora.export` the
            output's form.
        step_dir: the run's `<job.dump_folder>/<checkpoint.folder>/step-N`.

    Raises:
        ConfigError: as `adapted_model`; PEFT cannot hold an adapter, or the expert biases the run
            trained (naming ``--lora-export``, offering "merged"), said before anything is read.
    """
    lora = cfg.lora
    if lora.export == "adapter":  # before anything is read: the export would refuse it
        lora_base(cfg, step_dir)  # a base that is gone is said first
        problem = _unholdable(cfg, step_dir)
        if problem is not None:
            raise ConfigError("--lora-export", "adapter", problem, "pass --lora-export merged (the model with each "
                              "adapter folded into its weight, and the expert biases as trained)")
    model = adapted_model(cfg, step_dir)
    export_hf(model, model.args, lora, out_dir, rank=0, bias_drop=bias_drop, base=hf_base(cfg))


def _unholdable(cfg: JobConfig, step_dir: Path) -> str | None:
    """Why PEFT's adapter format cannot hold the model of the run `cfg`'s checkpoint `step_dir`, or
    None. The adapters' form is the run's config alone, so it is asked before the step is read;
    then the base's tensors the step holds (its trained expert biases)."""
    with torch.device("meta"):  # shapes only
        shapes = Transformer(model_args_from_config(with_folder_model(cfg).model, lora=True))
    apply_lora(shapes, cfg.lora)
    try:
        require_peft_form(shapes)
    except ConfigError as err:
        return err.problem
    _, _, stored = _step_tensors(cfg, step_dir)
    trained = sorted(name for name in stored if not is_adapter_name(name))
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
