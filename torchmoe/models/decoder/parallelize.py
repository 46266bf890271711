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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from torchmoe import _torch_private as private
from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.activation_checkpoint import apply_ac
from torchmoe.distributed.compile import apply_compile
from torchmoe.distributed.context_parallel import ContextParallelAttention
from torchmoe.distributed.data_parallel import apply_autocast, apply_ddp, apply_fsdp
from torchmoe.distributed.expert_parallel import AllToAllDispatcher
from torchmoe.distributed.float8 import apply_float8
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.distributed.tensor_parallel import ReplicateParallel
from torchmoe.models.decoder.attention import CausalAttention
from torchmoe.models.decoder.tensor_parallel import apply_tp
from torchmoe.plan.context import CPLayout
from torchmoe.plan.float8 import float8_tp_enabled
from torchmoe.plan.parallel_dims import ParallelDims


def parallelize_model(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh | None, cfg: JobConfig,
                       device: torch.device | str) -> nn.Module:
    """Apply every enabled parallelism and optimisation to `model` (on the meta device or
    materialised) and return it. `mesh` may be None only when the world is a single rank;
    `device` is what the job trains on (what float8 is checked against)."""
    par = cfg.parallelism
    # Styles re-register the parameters they shard as new (trainable) ones: LoRA's frozen base
    # stays frozen.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if cfg.float8.enable or cfg.float8.routed_experts:
        apply_float8(model, cfg.float8, device)

    if dims.tp_enabled:
        if par.enable_async_tensor_parallel:  # validation guarantees CUDA and compile
            private.enable_async_tp(mesh["tp"].get_group().group_name)
        apply_tp(model, mesh["tp"], loss_parallel=not par.disable_loss_parallel, moe_tp=dims.moe_tp_enabled,
                 float8=float8_tp_enabled(cfg.float8))

    if dims.ep_enabled:
        apply_ep(model, mesh["ep"], tp_mesh=mesh["tp"] if dims.tp_enabled else None)

    if dims.cp_enabled:
        apply_cp(model, mesh["cp"], cfg.training.seq_len)

    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)

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


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, *, tp_mesh: DeviceMesh | None) -> None:
    """Shard every MoE layer's routed experts over `ep_mesh` (``Shard(0)``: whole experts per
    rank; the preflight checks that ep divides the experts) and install the all-to-all
    dispatcher. With `tp_mesh`, make the router gate and shared experts replicated DTensors on
    ``tp`` fed token-sharded inputs (see `distributed.expert_parallel`)."""
    for moe in model.moe_layers():
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        moe.dispatcher = AllToAllDispatcher(moe.num_experts, moe.top_k, ep_mesh)
        if tp_mesh is not None:
            moe.sequence_shard_groups.append(tp_mesh.get_group())
            parallelize_module(moe.router.gate, tp_mesh, ReplicateParallel(input_layout=Shard(0)))
            if moe.shared_experts is not None:
                # Per projection: the MoE layer calls the shared expert's halves, not its forward.
                for proj in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
                    parallelize_module(proj, tp_mesh, ReplicateParallel(input_layout=Shard(0)))


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Context-parallelise `model` (a `Transformer` or a pipeline stage) over `cp_mesh` in place:
    the model and its attention modules share one `ContextParallelAttention`, and MoE blocks sum
    their balance-loss statistics over cp."""
    cp_attention = ContextParallelAttention(CPLayout(seq_len, cp_mesh.size()), cp_mesh)
    model.context_parallel = cp_attention
    for module in model.modules():
        if isinstance(module, CausalAttention):
            module.context_parallel = cp_attention
    for moe in model.moe_layers():
        moe.sequence_shard_groups.append(cp_mesh.get_group())
