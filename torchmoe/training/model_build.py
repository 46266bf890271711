"""Building the model of one rank: created on the meta device, split into pipeline stages, each
stage parallelized, then materialised and initialised on its device; and the pipeline schedule
that runs the stages."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.distributed.pipeline_parallel import build_schedule, stage_io_metas
from torchmoe.models.decoder.lora import apply_lora
from torchmoe.models.decoder.parallelize import parallelize_model
from torchmoe.models.decoder.pipeline_stages import PipelineRankModel, split_into_stages
from torchmoe.models.llama4 import Transformer
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.optim.qk_clip import watch_attention_logits
from torchmoe.plan.memory import residual_dtype
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import PipelineLayout, job_pipeline_layout
from torchmoe.training.log import logger


@dataclass
class BuiltModel:
    """What `build_model` built on this rank."""

    model: nn.Module  # this rank's model under the full model's parameter names (PP: its stages as one)
    parts: list[nn.Module]  # the stages this rank runs, each parallelized (the whole model without PP)
    pipe: PipelineLayout  # which layers each stage holds, and which pp rank runs it
    pp_rank: int
    # QK-Clip: the attention layers (the whole model's names) that record their logits; [] when off.
    watched: list[str] = field(default_factory=list)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created without a dtype inside get `dtype` (torch's default is restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(cfg: JobConfig, model_args: ModelArgs, dims: ParallelDims, mesh: ParallelMesh | None,
                device: torch.device, rank: int) -> BuiltModel:
    """This rank's stages of the model `model_args` describes, parallelized for `dims`, their
    parameters in `training.dtype` and initialised from `training.seed` (the same values under
    every layout), in training mode; with `[lora]`, adapters on its targets (PEFT's init)."""
    # The parameters' dtype (`training.dtype`): every parameter is created in the default
    # dtype, while the buffers that must stay fp32 (RoPE table, router state) say so.
    with torch.device("meta"), default_dtype(torch_dtype(cfg.training.dtype)):
        model = Transformer(model_args)
    if cfg.lora.enable:  # before the split and parallelize: every layout sees the adapters as parameters
        apply_lora(model, cfg.lora)
    # Before the split too: every rank names the same layers, whichever stages it holds.
    watched = watch_attention_logits(model, model_args.n_heads) if cfg.optimizer.qk_clip_threshold > 0 else []
    pipe = job_pipeline_layout(model_args, dims, cfg.parallelism, cfg.training, cfg.optimizer)
    pp_rank = mesh["pp"].get_local_rank() if mesh is not None else 0
    stages = split_into_stages(model, pipe, pp_rank) if dims.pp_enabled else [model]
    parts = [parallelize_model(part, dims, mesh, cfg, device) for part in stages]
    # For whatever draws from the global RNG while training; the weights do not: their values
    # come from the seed and each parameter's name, the same under every layout.
    torch.manual_seed(cfg.training.seed)
    for part in parts:
        # FSDP CPU offload keeps sharded parameters on the host; buffers still go to the device.
        part.to_empty(device="cpu" if cfg.parallelism.fsdp_cpu_offload else device)
        part.init_weights(seed=cfg.training.seed, buffer_device=device)
        part.train()
    # One model under the full model's parameter names, for optimizer, checkpoints, clipping.
    whole = PipelineRankModel(parts) if dims.pp_enabled else parts[0]
    if cfg.model.print_after_conversion and rank == 0:
        logger.info("the model (rank 0's part) after parallelize and conversion:\n%s", whole)
    return BuiltModel(whole, parts, pipe, pp_rank, watched)


def build_pipeline_schedule(built: BuiltModel, cfg: JobConfig, model_args: ModelArgs, dims: ParallelDims,
                            mesh: ParallelMesh, *, microbatches: int,
                            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], vocab_sharded: bool,
                            logits_dtype: torch.dtype, device: torch.device):
    """torch's pipeline schedule over this rank's stages (see `distributed/pipeline_parallel.py`),
    each pipeline micro-batch's loss `loss_fn(logits, labels)`."""
    tp = dims.tp
    hidden_dtype = torch_dtype(residual_dtype(dims, cfg.training))
    metas = lambda stage: stage_io_metas(
        built.pipe, stage, microbatch=cfg.training.local_batch_size // microbatches,
        seq_len=cfg.training.seq_len // dims.cp, seq_shards=tp, dim=model_args.dim,
        vocab_local=model_args.vocab_size // tp if vocab_sharded else model_args.vocab_size,
        hidden_dtype=hidden_dtype, logits_dtype=logits_dtype)
    return build_schedule(built.parts, built.pipe, mesh["pp"], cfg.parallelism.pipeline_parallel_schedule,
                          n_microbatches=microbatches, loss_fn=loss_fn, io_metas=metas, device=device)
