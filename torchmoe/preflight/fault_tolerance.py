"""Checks of `[fault_tolerance]` against the layout, the batch and this install: what torchft
cannot serve is refused before any group starts (`distributed.fault_tolerance` runs the rest)."""

from __future__ import annotations

import os

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.semi_sync import check_fragments


def check_fault_tolerance(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int], check_device: bool) -> None:
    """With fault_tolerance.enable: the replica groups are the replicate dimension, the global
    batch splits over every group's dp ranks, streaming DiLoCo's fragments over the model's blocks,
    the cross-group process group suits the device, and (`check_device`) torchft is installed."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    if ft.semi_sync_method:  # what the run's `SemiSync` splits: the blocks and the MTP modules
        check_fragments(ft.num_fragments, args.n_layers + args.mtp_layers)
    if degrees["dp_replicate"] != 1:
        raise ConfigError("parallelism.data_parallel_replicate_degree", degrees["dp_replicate"],
                          "must be 1 with fault_tolerance.enable: the replica groups are the replicate dimension "
                          "(each group is a launch of its own)",
                          f"set it to 1, and launch fault_tolerance.group_size ({ft.group_size}) groups of this layout")
    if cfg.checkpoint.create_seed_checkpoint:
        raise ConfigError("checkpoint.create_seed_checkpoint", True, "writes a seed checkpoint from one process, "
                          "which joins no replica group", "write it with fault_tolerance.enable = false, then train "
                          "each group with it on")
    global_batch = cfg.training.global_batch_size
    step = cfg.training.local_batch_size * degrees["dp_shard"] * ft.group_size
    if global_batch != -1 and global_batch % step:
        raise ConfigError("training.global_batch_size", global_batch,
                          f"must be a multiple of local_batch_size({cfg.training.local_batch_size}) * dp_shard"
                          f"({degrees['dp_shard']}) * fault_tolerance.group_size({ft.group_size}) = {step}: every "
                          f"replica group trains an equal share; {global_batch} % {step} = {global_batch % step}",
                          f"use a multiple of {step}, or -1 for exactly {step}")
    if ft.process_group == "nccl" and (cfg.training.device == "cpu" or (check_device and not torch.cuda.is_available())):
        raise ConfigError("fault_tolerance.process_group", "nccl", "NCCL moves CUDA tensors, and this run trains "
                          "on the CPU", 'use "gloo" (any device), or train on CUDA GPUs')
    if ft.should_quantize and ft.semi_sync_method and (ft.process_group != "nccl" or cfg.training.device == "cpu"):
        raise ConfigError("fault_tolerance.should_quantize", True,
                          "quantizes on CUDA (torchft's triton kernels over NCCL), and this run's syncs cross groups "
                          f"on {show_value(ft.process_group)} from {show_value(cfg.training.device)}",
                          'set should_quantize = false, or train on CUDA GPUs with process_group = "nccl"')
    if check_device and not all(name in os.environ for name in ("MASTER_ADDR", "MASTER_PORT")):
        # torchft's Manager reads them (a KeyError: 'MASTER_ADDR' traceback before).
        raise ConfigError("fault_tolerance.enable", True, "runs each replica group as a torchrun launch, and this "
                          "process was not started by torchrun (MASTER_ADDR and MASTER_PORT are not set)",
                          "launch each group with torchrun, also with one rank: TORCHFT_LIGHTHOUSE=http://HOST:PORT "
                          "torchrun --nproc-per-node N -m torchmoe train ...")
    if check_device:
        from torchmoe.distributed.fault_tolerance import import_torchft

        import_torchft(cfg.metrics.log_level)  # first: it sets the Rust core's log level
