"""The parallelize pipeline: turn a single-device Llama 4 into the layout the job asks for.

Applied in place, in this order (each step assumes the previous ones):
    0. float8              (linears swapped, routed experts' grouped GEMMs switched; must precede
                            TP so TP shards the float8 modules)
    1. tensor parallel     (incl. MoE TP when ep == 1, loss parallel, async TP; float8 styles
                            for the tensorwise recipe)
    2. expert parallel     (routed experts sharded over ep, tokens all-to-all)
    2b. context parallel   (attention over each cp rank's head-tail pieces of every sequence)
    3. activation checkpointing
    4. torch.compile per block  (after AC so recomputation is compiled too; before FSDP so
                                 FSDP's hooks stay outside the graphs)
    5. FSDP2 / HSDP, or DDP (their mixed-precision policy casts the parameters), else autocast
       (when the compute dtype is below the parameters')
"""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.activation_checkpoint import apply_ac
from torchmoe.distributed.compile import apply_compile
from torchmoe.distributed.data_parallel import apply_autocast, apply_ddp, apply_fsdp
from torchmoe.distributed.float8 import apply_float8, float8_tp_enabled
from torchmoe.distributed.parallel_dims import ParallelDims, ParallelMesh
from torchmoe.distributed.tensor_parallel import apply_tp


def parallelize_llama4(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh | None, cfg: JobConfig,
                       device: torch.device | str) -> nn.Module:
    """Apply every enabled parallelism and optimisation to `model` (on the meta device or
    materialised) and return it. `mesh` may be None only when the world is a single rank;
    `device` is what the job trains on (what float8 is checked against)."""
    par = cfg.parallelism
    if cfg.float8.enable or cfg.float8.routed_experts:
        apply_float8(model, cfg.float8, device)

    if dims.tp_enabled:
        if par.enable_async_tensor_parallel:
            _enable_async_tp(mesh["tp"])
        apply_tp(model, mesh["tp"], loss_parallel=not par.disable_loss_parallel, moe_tp=dims.moe_tp_enabled,
                 float8=float8_tp_enabled(cfg.float8))

    if dims.ep_enabled:
        from torchmoe.distributed.expert_parallel import apply_ep

        apply_ep(model, mesh["ep"], tp_mesh=mesh["tp"] if dims.tp_enabled else None)

    if dims.cp_enabled:
        from torchmoe.distributed.context_parallel import apply_cp

        apply_cp(model, mesh["cp"], cfg.training.seq_len)

    apply_ac(model, cfg.activation_checkpoint)

    if cfg.compile.enable:
        apply_compile(model, cfg.compile, fullgraph=not (dims.ep_enabled or dims.cp_enabled),
                      expert_parallel=dims.ep_enabled)

    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            mesh[dims.dense_fsdp_dims],
            param_dtype=cfg.training.mixed_precision_param,
            reduce_dtype=cfg.training.mixed_precision_reduce,
            reshard_after_forward=par.fsdp_reshard_after_forward,
            pp_enabled=dims.pp_enabled,
            cpu_offload=par.fsdp_cpu_offload,
            expert_mesh=mesh[dims.expert_fsdp_dims] if dims.ep_enabled else None,
        )
    elif dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"], param_dtype=cfg.training.mixed_precision_param,
                  reduce_dtype=cfg.training.mixed_precision_reduce)
    else:
        apply_autocast(model, cfg.training)
    return model


def _enable_async_tp(tp_mesh) -> None:
    """Async TP: inductor fuses TP collectives with the matmuls they feed, over symmetric memory.
    Validation guarantees CUDA and compile are on."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
