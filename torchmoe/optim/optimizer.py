"""The optimizer and gradient-norm clipping across device meshes.

    optimizer = build_optimizer(model, job_config.optimizer)
    grad_norm = clip_grad_norm_(model.parameters(), job_config.training.max_norm)

Under FSDP2 + TP + EP the parameters of one model are DTensors on *different* meshes: dense
weights on `dp_shard_cp × tp`, routed-expert weights on `ep × efsdp`. Both the optimizer and the
clipping here are written for that case; with plain tensors they behave like the torch ones.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from typing import Hashable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchmoe import _torch_private as private
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.nn.shards import local_shard
from torchmoe.optim.muon import Muon
from torchmoe.optim.muon_groups import muon_split
from torchmoe.optim.param_roles import parameter_roles

logger = logging.getLogger(__name__)

_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def _mesh_key(t: torch.Tensor, *, placements: bool = False) -> Hashable:
    """What tensors must share to go through one foreach/fused call: None for plain tensors,
    the mesh (device type, ranks, dim names) for DTensors, plus their placements if asked."""
    if not isinstance(t, DTensor):
        return None
    key = _mesh_identity(t.device_mesh)
    return key + (t.placements,) if placements else key


@functools.lru_cache(maxsize=64)
def _mesh_identity(mesh: DeviceMesh) -> tuple:
    """(device type, ranks, dim names) of `mesh`, read once per mesh: clipping groups every
    gradient by it at every step, and reading the ranks is a tensor op."""
    return mesh.device_type, tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Build Adam/AdamW over the trainable parameters of `model`, or Muon (`muon.Muon`: its
    matrices per `muon_groups.muon_split`, AdamW with adamw_lr / adamw_weight_decay for the rest).

    Param groups: one per (decay or not, mesh); biases of any shape, norms, sinks and the token
    embedding get no weight decay unless `cfg.decay_all_params` (torchtitan's behaviour), by
    their role (`param_roles`, which Muon's split follows too). foreach and fused kernels batch all tensors of a
    param group into one op, and DTensor refuses one op over tensors on different meshes (or a
    mix of DTensors and plain tensors), so parameters are grouped by mesh; each group's kernel
    then only sees tensors of one mesh. With plain tensors this is just the usual two groups.

    Args:
        model: the (possibly parallelized) model, or an `nn.ModuleList` of pipeline stages.
        cfg: the `[optimizer]` section.

    Returns:
        The optimizer ('Adam' applies weight_decay as torch does: L2 added to the gradient).
        `implementation='fused'` falls back to foreach with a warning where the
        parameters' device type or dtype has no fused kernel.
    """
    name = cfg.name.lower()
    muon = name == "muon"
    split = muon_split(model, cfg) if muon else {}
    roles = parameter_roles(model)
    weight_decay = cfg.adamw_weight_decay if muon and cfg.adamw_weight_decay != -1 else cfg.weight_decay
    muon_params: list[nn.Parameter] = []
    groups: dict[tuple[bool, Hashable], list[nn.Parameter]] = {}
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if split.get(pname, ("adamw",))[0] == "muon":
            muon_params.append(p)
        else:
            no_decay = not cfg.decay_all_params and not roles[pname].decays
            groups.setdefault((no_decay, _mesh_key(p)), []).append(p)
    if not groups and not muon_params:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    param_groups = [
        {"params": params, "weight_decay": 0.0 if no_decay else weight_decay}
        for (no_decay, _), params in groups.items()
    ]
    params = [p for g in param_groups for p in g["params"]]

    implementation = cfg.implementation
    if implementation == "fused" and not _fused_supported(params):
        logger.warning(
            "optimizer.implementation='fused' is not supported for these parameters "
            "(device types %s, dtypes %s); using 'foreach' instead",
            sorted({p.device.type for p in params}),
            sorted({str(p.dtype) for p in params}),
        )
        implementation = "foreach"
    kwargs = dict(
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=implementation == "foreach",
        fused=implementation == "fused",
    )
    build = functools.partial(_build_muon, muon_params, cfg) if muon else _OPTIMIZERS[name]
    try:
        return build(param_groups, **kwargs)
    except RuntimeError as e:
        if implementation != "fused":
            raise
        logger.warning("fused %s failed to build (%s); using 'foreach' instead", cfg.name, e)
        kwargs.update(foreach=True, fused=False)
        return build(param_groups, **kwargs)


def _build_muon(muon_params: list[nn.Parameter], cfg: OptimizerConfig, adamw_groups: list[dict],
                **adamw: object) -> Muon:
    """Muon over `muon_params` (one group), torch's AdamW (`adamw` kwargs, lr = adamw_lr) over
    `adamw_groups`. Muon's per-parameter loop takes any mix of meshes, so it needs one group."""
    adamw["lr"] = cfg.adamw_lr if cfg.adamw_lr != -1 else cfg.lr
    groups = [{"params": muon_params, "algorithm": "muon"}] if muon_params else []
    groups += [{**g, "algorithm": "adamw"} for g in adamw_groups]
    return Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
                ns_coefficients=tuple(cfg.ns_coefficients), eps=cfg.ns_eps, ns_steps=cfg.ns_steps,
                adjust_lr_fn=cfg.adjust_lr, ns_dtype=cfg.ns_dtype, adamw=adamw)


def _fused_supported(params: list[nn.Parameter]) -> bool:
    devices = private.fused_optimizer_devices()
    return all(p.device.type in devices and p.is_floating_point() for p in params)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip gradients by their total norm over all parameters, whatever mesh each lives on.

    Each group of gradients sharing a mesh and placements gets one norm, computed by DTensor on
    its own mesh and reduced there by `.full_tensor()` (a sum over Shard dims, nothing over
    Replicate dims). The group norms are then combined as plain tensors: sum of p-th powers
    (max for inf). Adding norms from different meshes inside DTensor would fail (cross-mesh op),
    and reducing local shard norms by hand would double-count replicated dims.

    Args:
        parameters: tensors or DTensors; those without `.grad` are skipped.
        max_norm: clip so that the total norm is at most this.
        norm_type: p of the p-norm (`math.inf` for the max norm).
        foreach: use foreach kernels (None = torch's default for the device).
        pp_mesh: with pipeline parallelism, the `pp` mesh: each stage holds different
            parameters, so the per-stage norms are combined over it.

    Returns:
        The total norm before clipping (accumulated in fp64), a 0-dim fp32 plain tensor on the
        gradients' device.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    by_mesh: dict[Hashable, list[torch.Tensor]] = {}
    for g in grads:
        # Also split by placements so the per-tensor norms stacked inside get_total_norm share
        # one placement (Partial for sharded grads, Replicate for replicated ones).
        by_mesh.setdefault(_mesh_key(g, placements=True), []).append(g)
    device = local_shard(grads[0]).device
    norms = []
    for group in by_mesh.values():
        norm = _group_norm(group, norm_type, foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.to(device))
    stacked = torch.stack(norms)  # (n_groups,)
    if math.isinf(norm_type):
        total = stacked.max()
        if pp_mesh is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
    else:
        total = stacked.pow(norm_type).sum()
        if pp_mesh is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = total.pow(1.0 / norm_type)

    # Scaling each local shard scales the DTensor whatever its placement, so the clip itself
    # needs no communication and no mesh grouping: only a grouping by device for foreach.
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0).float()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        local = local_shard(g)
        by_device.setdefault(local.device, []).append(local)
    for dev, local_grads in by_device.items():
        if foreach is False:
            for g in local_grads:
                g.mul_(coef.to(dev))
        else:
            private.foreach_mul_(local_grads, coef.to(dev))
    return total.float()


def _group_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    """The total norm of gradients sharing a mesh and placements, accumulated in fp64 (a 0-dim
    fp64 tensor, a DTensor for DTensor gradients). fp32 reductions over a large tensor lose up to
    ~5e-5 relative on CPU, and layouts with different shard sizes would lose differently."""
    if foreach is False:
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]
    else:
        norms = private.foreach_norm(grads, norm_type, torch.float64)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)
