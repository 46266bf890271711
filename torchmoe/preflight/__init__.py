"""Every check a job passes before it starts: the config's sections (`torchmoe.config.validate`),
then the checks that need the model, the layout, the data, this machine and the files.

    from torchmoe.preflight import validate_job_config
    validate_job_config(cfg, world_size=8)                      # a real run, on this machine
    validate_job_config(cfg, world_size=1024, check_device=False)  # the dry-run's plan

It sits above everything it checks (models, data, plan, distributed), so that `torchmoe.config`
stays a leaf that everything imports. Runs before any process group exists: under torchrun each
rank finds the same problem and rank 0 alone prints it.
"""

from __future__ import annotations

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import model_args_from_config
from torchmoe.config.degrees import resolve_degrees
from torchmoe.config.files.paths import source_key
from torchmoe.config.job_config import JobConfig
from torchmoe.config.launch_env import launch_int
from torchmoe.config.validate import validate_sections
from torchmoe.data.dataloader import validation_data
from torchmoe.data.tokenizer import build_tokenizer
from torchmoe.preflight.fault_tolerance import check_fault_tolerance
from torchmoe.preflight.features import check_features, check_launch
from torchmoe.preflight.files import (
    check_dataset_mix,
    check_dataset_rows,
    check_dry_run_outputs,
    check_hf_assets,
    check_initial_load_path,
    check_outputs,
    check_tokenizer,
)
from torchmoe.preflight.float8 import check_float8
from torchmoe.preflight.layout import (
    check_batch,
    check_flavor,
    check_force_load_balance,
    check_memory_fits,
    check_model_split,
    check_pipeline,
    check_seq_len,
    check_validation,
)
from torchmoe.preflight.optimizer import check_optimizer

__all__ = ["device_memory_gib", "train_device", "validate_job_config", "validate_layout"]


def validate_job_config(cfg: JobConfig, world_size: int, *, check_device: bool = True) -> None:
    """Check every setting of `cfg` for a run on `world_size` ranks.

    Args:
        cfg: the loaded job config.
        world_size: the number of ranks the run (or the dry-run's plan) has.
        check_device: also check this machine and launch: CUDA and packages the config needs,
            memory, the launcher's environment, and the files the run reads and writes. The
            dry-run passes False: it plans for the target cluster from any machine (and only
            its own output, dry_run.json, is checked).

    Raises:
        ConfigError: the first problem found, naming the key, the value and the fix.
    """
    degrees, args = validate_layout(cfg, world_size, check_device=check_device)
    if not check_device:
        check_dry_run_outputs(cfg.job)
        return
    check_launch(cfg.checkpoint, world_size)
    device = train_device(cfg.training.device)
    check_memory_fits(cfg, args, degrees, device)
    check_outputs(cfg, world_size, device)
    check_hf_assets(cfg.model)
    check_initial_load_path(cfg)
    tokenizer_key = source_key(cfg, "model.tokenizer_path")
    tokenizer = build_tokenizer(cfg.model.tokenizer_path, key=tokenizer_key)
    check_tokenizer(tokenizer, args.vocab_size, cfg.model, cfg.training, key=tokenizer_key)
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    global_batch = cfg.training.global_batch_size if cfg.training.global_batch_size != -1 else \
        cfg.training.local_batch_size * dp
    check_dataset_rows(cfg.training, global_batch, tokenizer)
    if cfg.validation.enable:
        check_dataset_rows(validation_data(cfg.training, cfg.validation), cfg.validation.local_batch_size * dp,
                           tokenizer, key="validation.dataset_path")


def validate_layout(cfg: JobConfig, world_size: int, *, check_device: bool = False) -> tuple[dict[str, int], ModelArgs]:
    """The checks of the model, the layout and the features on `world_size` ranks, without the
    files: what `torchmoe plan` asks of every layout it scores. Returns the resolved degrees
    and the model's arguments.

    Raises:
        ConfigError: as `validate_job_config`.
    """
    validate_sections(cfg)
    check_flavor(cfg.model)
    degrees = resolve_degrees(cfg.parallelism, world_size)
    args = model_args_from_config(cfg.model, lora=cfg.lora.enable)
    check_seq_len(args, cfg.model.flavor, cfg.training.seq_len)
    check_model_split(args, cfg.model.flavor, degrees, cfg.training.seq_len)
    check_force_load_balance(args, degrees, cfg.training.seq_len)
    check_batch(cfg.training, cfg.parallelism, degrees)
    check_dataset_mix(cfg.training)
    check_pipeline(cfg, args, degrees, world_size)
    check_validation(cfg, args, degrees)
    check_features(cfg, args, degrees, check_device)
    check_optimizer(cfg.optimizer, args)
    check_float8(cfg, args, degrees, check_device)
    check_fault_tolerance(cfg, args, degrees, check_device)
    return degrees, args


def device_memory_gib() -> float | None:
    """This machine's memory per device: the first CUDA device's, None without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return None


def train_device(requested: str) -> torch.device:
    """The device this rank trains on for `training.device = requested` ("" picks CUDA when
    there is one): cuda:LOCAL_RANK or the CPU. `check_features` refused "cuda" without CUDA."""
    if requested == "cuda" or (not requested and torch.cuda.is_available()):
        return torch.device("cuda", launch_int("LOCAL_RANK", 0))
    return torch.device("cpu")
