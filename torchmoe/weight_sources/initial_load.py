"""`checkpoint.initial_load_path`: the weights a new run starts from, a DCP or a Hugging Face folder.

    load_initial_weights(cfg.checkpoint, cfg.model.flavor, model_args, model)   # every rank, before step 1

Every rank checks and reads the folder before the first step, so whatever is wrong with it (a
file missing, unreadable or damaged, weights of another flavor or not in floating point) is a
`ConfigError` on every rank, which rank 0 reports: ``checkpoint.initial_load_path`` for the
folder, ``model.flavor`` for weights of another flavor (naming the flavor they fit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from torchmoe.arch.model_args import ModelArgs
from torchmoe.checkpoints.checkpoint_state import load_model_only
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Checkpoint as CheckpointConfig
from torchmoe.distributed.one_reader import one_reads
from torchmoe.hf_files.hf_storage import ExpertBiasDrop, dropped_bias_max, load_hf_weights, read_hf_args
from torchmoe.models.registry import hf_mapping
from torchmoe.weights.flavor_fit import matching_flavor, require_fit
from torchmoe.weights.weight_files import model_tensors, read_dcp_metadata

__all__ = ["hf_bias_drop", "load_initial_weights"]

logger = logging.getLogger(__name__)

_BIAS_DROP_FIX = ("set checkpoint.hf_drop_expert_bias = true to export the model without its expert bias (the "
                  "folder then selects other experts), or checkpoint.last_save_in_hf = false: the run's DCP "
                  "checkpoints keep it")
_DCP_FIX = ("point it at a DCP checkpoint folder: a step-N folder of a run, or the output of "
            "`torchmoe convert hf-to-dcp`")



def load_initial_weights(ckpt: CheckpointConfig, flavor: str, args: ModelArgs, model: nn.Module, *,
                         key: str = "checkpoint.initial_load_path", keep: Callable[[str], bool] | None = None) -> None:
    """Load the model weights of `ckpt.initial_load_path` into `model` (this rank's part: shards
    or pipeline stages, under the full model's names). Collective under a process group.

    Args:
        ckpt: the `[checkpoint]` section; `initial_load_in_hf` says which kind of folder it is.
        flavor: model.flavor, which `args` (the whole model's architecture) was built from.
        key: the setting that named the folder, for messages (``model.hf_assets_path`` where
            that filled it: `config.files.paths.source_key`).
        keep: the tensors of `model` the folder fills, by name (LoRA: the base, not the adapters
            it never held); None: every one.

    Raises:
        ConfigError: the folder cannot be read, or holds weights of another model; or with
            `last_save_in_hf` (and not `hf_drop_expert_bias`), a non-zero expert bias that the
            family's Hugging Face model has no place for.
    """
    path = Path(ckpt.initial_load_path)
    if ckpt.initial_load_in_hf:
        _load_hf(path, flavor, args, model, key, keep)
    else:
        metadata = read_dcp_metadata(key, path, _DCP_FIX)  # read by rank 0, once
        require_fit("model.flavor", flavor, args, model_tensors(metadata), f"{key} {path}")
        load_model_only(path, [model], key=key, metadata=metadata, keep=keep)
        if ckpt.last_save_in_hf and not ckpt.hf_drop_expert_bias:
            _require_exportable_bias(path, args, model, key)


def hf_bias_drop(ckpt: CheckpointConfig) -> ExpertBiasDrop:
    """Whether `last_save_in_hf` may write the model without an expert bias its family's Hugging
    Face model has no place for (`checkpoint.hf_drop_expert_bias`)."""
    return ExpertBiasDrop(ckpt.hf_drop_expert_bias, "checkpoint.hf_drop_expert_bias", _BIAS_DROP_FIX)


def _require_exportable_bias(path: Path, args: ModelArgs, model: nn.Module, key: str) -> None:
    """Before training: a DCP checkpoint's non-zero expert bias, which `last_save_in_hf` could not
    write (the preflight refuses a run that trains one; this one is loaded), is refused now rather
    than after the training (collective: every rank raises)."""
    bias_max = dropped_bias_max(get_model_state_dict(model), args, None)
    if bias_max > 0:
        raise ConfigError(key, str(path), f"its model's expert_bias (max |bias| {bias_max:.3g}) has no place in "
                          f"Hugging Face {hf_mapping(args).title}, and checkpoint.last_save_in_hf = true would write "
                          "the trained model without it (selecting other experts)", _BIAS_DROP_FIX)


def _load_hf(hf_dir: Path, flavor: str, args: ModelArgs, model: nn.Module, key: str,
             keep: Callable[[str], bool] | None) -> None:
    """Every rank reads the safetensors slices its shards cover, straight into its parameters."""
    fix = f"point it at a complete Hugging Face {hf_mapping(args).title} folder (config.json + *.safetensors)"
    hf_args = one_reads(lambda: read_hf_args(hf_dir, key=key, fix=fix))  # rank 0 reads config.json for all
    # A Hugging Face config must agree with the run's flavor in every field that decides the
    # tensors' shapes and what the model computes with them (the training settings are the run's).
    differ = args.architecture_differences(hf_args)
    if differ:
        fits = matching_flavor(hf_args)
        fix = f"pass --model.name {hf_args.family} --model.flavor {fits}" if fits else \
            "build the model from the folder's config.json (weight_sources.folder_model.with_folder_model, which " \
            "torchmoe train, eval and generate run for a Hugging Face folder)"
        if hf_args.family != args.family:  # the family is what is wrong, not the flavor nor the folder
            raise ConfigError("model.name", args.family, f"{key} {hf_dir} holds a {hf_mapping(hf_args).title} model "
                              f"({hf_args.family}), not a {hf_mapping(args).title} one", fix)
        raise ConfigError(key, str(hf_dir), f"its config differs from flavor {flavor!r} in {', '.join(differ)}",
                          fix.replace(f"--model.name {hf_args.family} ", ""))
    state = get_model_state_dict(model)
    if keep is not None:
        state = {name: t for name, t in state.items() if keep(name)}
    load_hf_weights(state, hf_dir, args, key=key, fix=fix)
    logger.info("loaded Hugging Face weights from %s", hf_dir)
