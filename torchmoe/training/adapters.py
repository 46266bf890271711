"""LoRA in the trainer (`[lora]`): which parameters train and which tensors checkpoints and loads
hold, the adapters' start (PEFT's init, or an imported adapter), and the Hugging Face export.

    python -m pytest -q tests/integration/test_lora_training.py tests/unit/test_lora.py

The adapters are added on the meta model before the parallelize pipeline
(`model_build.build_model`), so FSDP, EP, PP and compile see them as ordinary parameters. The
base is frozen: the optimizer, the gradient norm and clipping see the adapters alone, and its
expert biases stay the base's unless the run trains them (`model.load_balance_coeff` set).
A checkpoint holds what the run changes (`checkpointed`): the adapters, their optimizer state,
the expert biases it trains, the [lora] settings the adapters mean something under
(`checkpoints.adapter_settings`), and the base's fingerprint (`checkpoints.base_fingerprint`); the
base is what the run started from (`checkpoint.initial_load_path`, else the seed's init), loaded
again at each resume, from the run's own copy (`<checkpoint.folder>/base/`) with
`lora.checkpoint_base`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from torchmoe.arch.model_args import ModelArgs
from torchmoe.checkpoints.adapter_settings import check_saved_adapters
from torchmoe.config.files.paths import source_key
from torchmoe.config.job_config import JobConfig, LoRA
from torchmoe.hf_files.hf_storage import ExpertBiasDrop
from torchmoe.hf_files.peft_adapter import load_peft_adapter, save_merged_model, save_peft_adapter
from torchmoe.models.decoder.lora import apply_lora
from torchmoe.models.llama4 import Transformer
from torchmoe.nn.lora import is_adapter_name
from torchmoe.training.model_build import default_dtype
from torchmoe.training.optimization import TrainableSubset, every_parameter

# The MoE layers' aux-loss-free selection bias (`models.decoder.moe.MoE`), by the end of its name.
_EXPERT_BIAS = ".moe.expert_bias"


def trainable(lora: LoRA) -> TrainableSubset:
    """The parameters the optimizer updates: the adapters under LoRA, else every one."""
    return (lambda name, param: is_adapter_name(name)) if lora.enable else every_parameter


def trained_buffer(args: ModelArgs) -> Callable[[str], bool]:
    """The buffers of the base that a LoRA run changes, by name: every MoE layer's expert bias when
    the run trains it (`model.load_balance_coeff` > 0, which LoRA leaves off unless it is set:
    `arch.registry.model_args_from_config`); nothing else of the base moves."""
    return (lambda name: name.endswith(_EXPERT_BIAS)) if args.load_balance_coeff else (lambda name: False)


def checkpointed(lora: LoRA, args: ModelArgs) -> Callable[[str], bool] | None:
    """The model tensors a checkpoint holds, by name: under LoRA what the run changes, the adapters
    and the buffers it trains (`trained_buffer`; the rest of the frozen base is the run's initial
    weights, loaded again at resume); None: every one."""
    if not lora.enable:
        return None
    buffer = trained_buffer(args)
    return lambda name: is_adapter_name(name) or buffer(name)


def base_weights(lora: LoRA) -> Callable[[str], bool] | None:
    """The model tensors `checkpoint.initial_load_path` fills: the base under LoRA (the folder
    holds no adapters; its expert biases are where trained ones start); None: every one."""
    return (lambda name: not is_adapter_name(name)) if lora.enable else None


def _meta_model(args: ModelArgs, lora: LoRA) -> Transformer:
    """The whole model of `args` with `lora`'s adapters, on the meta device (names and shapes)."""
    with torch.device("meta"):
        model = Transformer(args)
    apply_lora(model, lora)
    return model


def base_tensors(args: ModelArgs, lora: LoRA) -> list[str]:
    """The names of the frozen base's tensors, what its fingerprint covers: its parameters and the
    persistent buffers it starts from (the expert biases), from a meta model."""
    return [name for name in _meta_model(args, lora).state_dict() if not is_adapter_name(name)]


def saved_tensors_check(cfg: JobConfig, args: ModelArgs) -> Callable[[Mapping[str, Sequence[int]]], None]:
    """The check of a checkpoint's saved model tensors (name -> shape) that refuses, naming the
    setting, tensors another `[lora]` setting (or `lora.enable`) would read into other places:
    `adapter_settings.check_saved_adapters` against what the whole model of this run checkpoints."""
    def check(saved: Mapping[str, Sequence[int]]) -> None:
        expected = None
        if cfg.lora.enable:
            keep = checkpointed(cfg.lora, args)
            expected = {name: t.shape for name, t in _meta_model(args, cfg.lora).state_dict().items() if keep(name)}
        check_saved_adapters(saved, expected, cfg.lora, cfg.model.load_balance_coeff)

    return check


def set_aside(model: nn.Module, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Copies of the buffers of `model` that `keep` names (this rank's shards and stages), which
    are zeroed, as a new run's router state is before its base loads (`MoE.reset_router_state`):
    the trained expert biases a resume loaded from its checkpoint, kept aside while the base is
    loaded (or, the seed's init, left) and fingerprinted (`put_back` returns them)."""
    state = {name: t for name, t in get_model_state_dict(model).items() if keep(name)}
    saved = {name: t.detach().clone() for name, t in state.items()}
    with torch.no_grad():
        for tensor in state.values():
            tensor.zero_()
    return saved


def put_back(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy `saved` (`set_aside`'s) back into `model`'s tensors, in place."""
    state = get_model_state_dict(model)  # sharing the tensors' storage
    with torch.no_grad():
        for name, tensor in saved.items():
            state[name].copy_(tensor)


def base_source(cfg: JobConfig, base: Path | None) -> tuple[str, str, str]:
    """(setting, path, fix) of where a LoRA run's frozen base comes from, for the message that
    refuses another base than its checkpoints': the run's saved copy `base` if not None, else
    `checkpoint.initial_load_path`, else the seed's random init."""
    if base is not None:
        return ("checkpoint.folder", str(base), f"move {base} away (the base then loads from "
                "checkpoint.initial_load_path, checked the same way), or start a new run in another job.dump_folder")
    if cfg.checkpoint.initial_load_path:
        return (source_key(cfg, "checkpoint.initial_load_path"), cfg.checkpoint.initial_load_path,
                "restore the folder the run started from there, or start a new run in another job.dump_folder "
                "(lora.checkpoint_base = true keeps a copy of the base with the checkpoints)")
    return ("training.seed", str(cfg.training.seed), "set the seed the run started with (its random init is the "
            "base), or start a new run in another job.dump_folder")


def import_adapter(lora: LoRA, args: ModelArgs, model: nn.Module) -> None:
    """A new run's adapters from `lora.adapter` (a PEFT adapter folder), if set; else they keep
    PEFT's init, drawn with the model's (`Transformer.init_weights`) and left alone by the base's
    load. Every rank reads the folder whole and copies its own shards of it."""
    if not (lora.enable and lora.adapter):
        return
    state = get_model_state_dict(model)  # sharing the parameters' storage
    dtype = next(t.dtype for name, t in state.items() if is_adapter_name(name))
    full = plain_model(args, lora, dtype)
    load_peft_adapter(full, lora.adapter, lora)
    values = full.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            if is_adapter_name(name):
                value = values[name].to(tensor.dtype)
                if isinstance(tensor, DTensor):
                    value = distribute_tensor(value, tensor.device_mesh, tensor.placements).to(tensor.device)
                tensor.copy_(value)


def gathered_state(model: nn.Module, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors of `model` (this rank's shards and pipeline stages) that `keep` names, whole
    and on the CPU, gathered to rank 0 (collective; {} on the other ranks)."""
    options = StateDictOptions(full_state_dict=True)
    local = {name: t.detach().cpu() for name, t in get_model_state_dict(model, options=options).items()
             if keep(name)}
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    parts: list[dict | None] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)  # pipeline stages hold different tensors
    return {name: t for part in parts for name, t in part.items()} if parts is not None else {}


def export_hf(model: nn.Module, args: ModelArgs, lora: LoRA, folder: Path, *, rank: int,
              bias_drop: ExpertBiasDrop, base: str | None) -> None:
    """Write the trained model as `lora.export` says: the PEFT adapter folder ("adapter", naming
    `base`, `hf_base`'s) or the model with each adapter folded into its weight ("merged", its
    expert biases as trained, as `bias_drop` allows), gathered to rank 0, which writes it
    (collective)."""
    keep = is_adapter_name if lora.export == "adapter" else (lambda name: True)
    state = gathered_state(model, keep)
    if rank != 0:
        return
    plain = plain_model(args, lora, next(iter(state.values())).dtype)
    plain.load_state_dict(state, strict=lora.export != "adapter")
    if lora.export == "adapter":
        save_peft_adapter(plain, folder, lora, base=base)
    else:
        save_merged_model(plain, folder, bias_drop=bias_drop)


def hf_base(cfg: JobConfig) -> str | None:
    """The Hugging Face folder a LoRA run's base came from (its absolute path: what an adapter
    export names as ``base_model_name_or_path``), None for a base from DCP or the seed's init."""
    ckpt = cfg.checkpoint
    return os.path.abspath(ckpt.initial_load_path) if ckpt.initial_load_in_hf and ckpt.initial_load_path else None


def plain_model(args: ModelArgs, lora: LoRA, dtype: torch.dtype) -> Transformer:
    """An unsharded CPU model of `args` with `lora`'s adapters, its tensors uninitialised."""
    # Parameters in the run's dtype, as the trainer builds them (buffers keep their own).
    with torch.device("meta"), default_dtype(dtype):
        model = Transformer(args)
    apply_lora(model, lora)
    return model.to_empty(device="cpu")
