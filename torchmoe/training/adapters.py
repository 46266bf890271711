"""LoRA in the trainer (`[lora]`): which parameters train and which tensors checkpoints and loads
hold, the adapters' start (PEFT's init, or an imported adapter), and the Hugging Face export.

    python -m pytest -q tests/integration/test_lora_training.py tests/unit/test_lora.py

The adapters are added on the meta model before the parallelize pipeline
(`model_build.build_model`), so FSDP, EP, PP and compile see them as ordinary parameters. The
base is frozen: the optimizer, the gradient norm and clipping see the adapters alone. A
checkpoint holds the adapters, their optimizer state and the base's fingerprint
(`components.base_fingerprint`); the base is what the run started from
(`checkpoint.initial_load_path`, else the seed's init), loaded again at each resume, from the run's
own copy (`<checkpoint.folder>/base/`) with `lora.checkpoint_base`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from torchmoe.arch.model_args import ModelArgs
from torchmoe.components.hf_storage import ExpertBiasDrop
from torchmoe.components.peft_adapter import load_peft_adapter, save_merged_model, save_peft_adapter
from torchmoe.config.job_config import JobConfig, LoRA
from torchmoe.config.paths import source_key
from torchmoe.models.decoder.lora import apply_lora
from torchmoe.models.llama4 import Transformer
from torchmoe.nn.lora import is_adapter_name
from torchmoe.training.model_build import default_dtype
from torchmoe.training.optimization import TrainableSubset, every_parameter


def trainable(lora: LoRA) -> TrainableSubset:
    """The parameters the optimizer updates: the adapters under LoRA, else every one."""
    return (lambda name, param: is_adapter_name(name)) if lora.enable else every_parameter


def checkpointed(lora: LoRA) -> Callable[[str], bool] | None:
    """The model tensors a checkpoint holds, by name: the adapters under LoRA (the frozen base is
    the run's initial weights, loaded again at resume); None: every one."""
    return is_adapter_name if lora.enable else None


def base_weights(lora: LoRA) -> Callable[[str], bool] | None:
    """The model tensors `checkpoint.initial_load_path` fills: the base under LoRA (the folder
    holds no adapters); None: every one."""
    return (lambda name: not is_adapter_name(name)) if lora.enable else None


def base_parameters(args: ModelArgs, lora: LoRA) -> list[str]:
    """The names of the frozen base's parameters (what its fingerprint covers: not the buffers,
    such as the expert bias, which are not the base the user gave), from a meta model."""
    with torch.device("meta"):
        model = Transformer(args)
    apply_lora(model, lora)
    return [name for name, _ in model.named_parameters() if not is_adapter_name(name)]


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
              bias_drop: ExpertBiasDrop) -> None:
    """Write the trained model as `lora.export` says: the PEFT adapter folder ("adapter") or the
    model with each adapter folded into its weight ("merged"), gathered to rank 0, which writes
    it (collective)."""
    keep = is_adapter_name if lora.export == "adapter" else (lambda name: True)
    state = gathered_state(model, keep)
    if rank != 0:
        return
    plain = plain_model(args, lora, next(iter(state.values())).dtype)
    plain.load_state_dict(state, strict=lora.export != "adapter")
    if lora.export == "adapter":
        save_peft_adapter(plain, folder, lora)
    else:
        save_merged_model(plain, folder, drop_expert_bias=bias_drop.allowed)


def plain_model(args: ModelArgs, lora: LoRA, dtype: torch.dtype) -> Transformer:
    """An unsharded CPU model of `args` with `lora`'s adapters, its tensors uninitialised."""
    # Parameters in the run's dtype, as the trainer builds them (buffers keep their own).
    with torch.device("meta"), default_dtype(dtype):
        model = Transformer(args)
    apply_lora(model, lora)
    return model.to_empty(device="cpu")
