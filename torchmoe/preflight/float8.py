"""Checks of `[float8]` against the model, the layout, the compute dtype and this machine: a float8
job that cannot run is refused before anything is built."""

from __future__ import annotations

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.float8 import float8_unavailable
from torchmoe.plan.float8 import float8_tp_enabled, selected_by


def check_float8(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int], check_device: bool) -> None:
    """What `[float8]` asks for must fit the model and the layout, and (`check_device`) run on this
    machine with this install; on an explicit ``training.device = "cpu"`` the device is known in
    a dry run too."""
    f8 = cfg.float8
    if f8.routed_experts:
        _check_experts(cfg, args)
    device = cfg.training.device
    on_cpu = device == "cpu" or (check_device and not torch.cuda.is_available())
    if check_device or device == "cpu":
        from torchmoe.preflight import train_device

        unavailable = float8_unavailable(f8, train_device(device), check_install=check_device)
        if unavailable:
            key, problem, fix = unavailable
            raise ConfigError(key, getattr(f8, key.split(".")[1]), problem, fix)
    if on_cpu and f8.enable:
        # gloo has no float8 dtypes: only high-precision collectives can run on CPU.
        if degrees["tp"] > 1 and float8_tp_enabled(f8):
            raise ConfigError("float8.recipe_name", f8.recipe_name,
                              "float8 tensor parallelism (the tensorwise recipe) all-gathers float8 tensors, "
                              "which gloo (CPU) cannot carry",
                              'use recipe_name = "rowwise" on CPU (TP then communicates in high precision), '
                              "or run on CUDA")
        if f8.enable_fsdp_float8_all_gather:
            raise ConfigError("float8.enable_fsdp_float8_all_gather", True,
                              "FSDP would all-gather float8 weights, which gloo (CPU) cannot carry",
                              "set enable_fsdp_float8_all_gather = false on CPU, or run on CUDA")


def _check_experts(cfg: JobConfig, args: ModelArgs) -> None:
    """float8.routed_experts: moe_fqns names routed experts, which run grouped GEMMs from bf16 (on
    any dims: `distributed.float8` pads a model dim or an expert hidden dim, MoE TP's share of it
    included, to float8 tiles)."""
    f8, flavor = cfg.float8, cfg.model.flavor
    names = args.routed_expert_names()
    if not names:
        raise ConfigError("float8.routed_experts", True, f"flavor {show_value(flavor)} has no MoE layers",
                          "set float8.routed_experts = false")
    if not f8.moe_fqns:
        raise ConfigError("float8.moe_fqns", [], "float8.routed_experts = true converts the routed experts "
                          "float8.moe_fqns names, and it names none",
                          'set float8.moe_fqns = ["experts"] (every MoE layer), or float8.routed_experts = false')
    for entry in f8.moe_fqns:
        if not any(selected_by(name, [entry]) for name in names):
            raise ConfigError("float8.moe_fqns", f8.moe_fqns,
                              f"{show_value(entry)} names no routed-expert module (flavor {show_value(flavor)} has "
                              f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''})",
                              'use ["experts"] for the routed experts of every MoE layer')
    if not cfg.model.use_grouped_mm:
        raise ConfigError("float8.routed_experts", True, "float8 routed experts are grouped GEMMs, but "
                          "model.use_grouped_mm = false runs the experts in a loop",
                          "set model.use_grouped_mm = true, or float8.routed_experts = false")
    if cfg.training.mixed_precision_param != "bfloat16":
        raise ConfigError("float8.routed_experts", True, "the float8 grouped GEMM computes from and writes bf16, "
                          f"but training.mixed_precision_param = {show_value(cfg.training.mixed_precision_param)}",
                          'set training.mixed_precision_param = "bfloat16"')
