"""Pipeline parallelism at run time: this rank's stages, and torch's schedule over them.

    torchrun --nproc_per_node=2 -m torchmoe train --config configs/debug_model.toml \\
        --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble

The split comes from `plan.pipeline.pipeline_layout`, the function the dry run prints. Each stage
is a pruned copy of the meta-device `Transformer` (its blocks, plus the embedding on the first
stage and the final norm + head on the last), so parameter names stay the full model's; each then
goes through the parallelize pipeline like a whole model. `PipelineRankModel` shows a rank's
stages as one model under those names, for the optimizer, checkpoints and clipping.

Stages exchange plain tensors: ``(micro-batch, seq_len / tp, dim)`` hidden states (the
sequence-parallel shard under TP). Their shapes are given to torch up front (static metadata),
so torch never runs a probing forward, which would count routed tokens that no step trained on.

Gradients are summed, never averaged (``scale_grads=False``): the loss function divides each
micro-batch's summed token losses by the token count of the whole global batch, as the
non-pipelined trainer does, so every schedule gives the same gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class

from torchmoe.plan.pipeline import PipelineLayout, is_multi_stage


def stage_io_metas(pipe: PipelineLayout, stage: int, *, microbatch: int, seq_len: int, seq_shards: int, dim: int,
                   vocab_local: int, hidden_dtype: torch.dtype,
                   logits_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors shaped like `stage`'s input and output for one micro-batch.

    Args:
        microbatch: sequences per micro-batch.
        seq_len: tokens of each sequence on this rank (seq_len / cp under context parallelism).
        seq_shards: how many ranks share each sequence between blocks (tp, sequence parallel).
        vocab_local: logits columns one rank holds (vocab / tp under loss parallel).
        hidden_dtype: the dtype of hidden states between stages (the residual stream's).
        logits_dtype: the dtype of the logits (the compute dtype: the head is a matmul).
    Returns:
        (input, output): token ids (B, S) int64 or hidden states (B, S / seq_shards, dim); hidden
        states, or logits (B, S, vocab_local) on the last stage.
    """
    hidden = torch.empty(microbatch, seq_len // seq_shards, dim, dtype=hidden_dtype, device="meta")
    first, last = stage == 0, stage == pipe.num_stages - 1
    inputs = torch.empty(microbatch, seq_len, dtype=torch.long, device="meta") if first else hidden.requires_grad_()
    outputs = torch.empty(microbatch, seq_len, vocab_local, dtype=logits_dtype, device="meta") if last else hidden
    return inputs, outputs.requires_grad_()


def build_schedule(stages: list[nn.Module], pipe: PipelineLayout, pp_mesh: DeviceMesh, schedule: str, *,
                   n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   io_metas: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                   device: torch.device) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """torch's `schedule` over this rank's (parallelized, materialised) `stages`.

    Args:
        stages: this rank's stage modules, in the order of ``pipe.ranks[pp rank]``.
        loss_fn: (last stage output, labels) -> the micro-batch's share of the global mean loss.
        io_metas: stage id -> its (input, output) meta tensors (`stage_io_metas`).
    """
    pp_rank = pp_mesh.get_local_rank()
    pipeline_stages = []
    for stage_id, module in zip(pipe.ranks[pp_rank], stages):
        inputs, outputs = io_metas(stage_id)
        pipeline_stages.append(PipelineStage(module, stage_id, pipe.num_stages, device, input_args=inputs,
                                             output_args=outputs, group=pp_mesh.get_group()))
    # Single-stage schedule classes take the stage itself, multi-stage ones the list.
    stages_arg = pipeline_stages if is_multi_stage(schedule) else pipeline_stages[0]
    return get_schedule_class(schedule)(stages_arg, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                        scale_grads=False)
