"""The MoE routers' balance across ranks: the auxiliary losses' share of the gradient, the
routed-token counts summed over every rank that routes other tokens, and the expert biases
updated from them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from torchmoe.arch.model_args import ModelArgs
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.models.llama4 import update_expert_bias
from torchmoe.plan.parallel_dims import ParallelDims


class MoeBalance:
    """The MoE layers of this rank's `model` and their token counts.

    Args:
        model: this rank's model (`model_build.BuiltModel.model`).
        model_args, dims, mesh: the model and its layout.
        pp_microbatches: the pipeline's micro-batches per local batch (1 without PP).
        device: where the counts live.
    """

    def __init__(self, model: nn.Module, model_args: ModelArgs, dims: ParallelDims, mesh: ParallelMesh | None, *,
                 pp_microbatches: int, device: torch.device) -> None:
        self.layers = model.moe_layers()
        # Row of each local MoE layer among all MoE layers of the model (metrics report them all).
        all_moe = sorted(i for i in model_args.moe_layer_ids if model_args.is_moe_layer(i))
        self.rows = [all_moe.index(int(name)) for name, block in model.layers.items() if block.moe_enabled]
        self.n_layers = len(all_moe)
        self.num_experts = model_args.num_experts
        self.dims, self.mesh = dims, mesh
        # Sliced once: slicing a DeviceMesh builds a new one from its rank tensor every time.
        self.tp_mesh = mesh["tp"] if mesh is not None else None
        self.pp_microbatches = pp_microbatches
        self.device = device

    @property
    def token_shards(self) -> int:
        """Ranks among which one global batch's tokens are split for the MoE router: dp and cp,
        and tp when EP spans it (each TP rank then routes its own sequence shard)."""
        return self.dims.dp * self.dims.cp * (self.dims.tp if self.dims.ep_enabled else 1)

    def set_aux_loss_scale(self, micro_batches: int, real_tokens: torch.Tensor | None = None) -> None:
        """Scale this step's auxiliary losses: they are means per micro-batch (of the pipeline
        too) and token shard, and their gradients are summed over shards and micro-batches, so
        each contributes 1 / (micro-batches * shards). With padding, `real_tokens` (the step's
        data tokens over the data-parallel ranks, a 0-dim device tensor) over as many parts is
        the z-loss's normaliser (`MoE.z_loss_tokens`): its sum over all of them is then the mean
        over the step's data tokens, however they fall between micro-batches and shards."""
        parts = micro_batches * self.pp_microbatches * self.token_shards
        for moe in self.layers:
            moe.aux_loss_grad_scale = 1.0 / parts
            moe.z_loss_tokens = (real_tokens / parts).float() if real_tokens is not None else None

    def bad_bias(self, like: torch.Tensor) -> torch.Tensor:
        """1.0 when some local expert bias is not finite, else 0.0 (on the device, like `like`)."""
        biases = [m.expert_bias for m in self.layers]
        return (~torch.isfinite(torch.cat(biases))).any().float() if biases else torch.zeros_like(like)

    def counts(self) -> torch.Tensor | None:
        """This step's (L_local, E) token counts of the local MoE layers, summed over every rank
        that routes other tokens (within the replica group); None without local MoE layers."""
        if not self.layers:  # a pipeline stage may have none
            return None
        counts = torch.stack([m.tokens_per_expert for m in self.layers])  # (L_local, E)
        if self.mesh is not None and self.dims.dp * self.dims.cp > 1:
            dist.all_reduce(counts, group=self.mesh["loss"].get_group())
        if self.mesh is not None and self.dims.ep_enabled and self.dims.tp_enabled:
            dist.all_reduce(counts, group=self.tp_mesh.get_group())
        return counts

    def forget_counts(self) -> None:
        """Drop the counts of a step that was not committed."""
        for moe in self.layers:
            moe.tokens_per_expert.zero_()

    def update_biases(self, counts: torch.Tensor | None) -> torch.Tensor | None:
        """Update every local layer's bias from `counts` (`counts()`), identically on all
        replicas of its stage. Returns the (n_moe_layers, n_experts) counts of every MoE layer of
        the model (under PP gathered over pp)."""
        if not self.n_layers:
            return None
        if counts is not None:
            update_expert_bias(self.layers, list(counts))
        if not self.dims.pp_enabled:
            return counts
        # Every MoE layer lives on exactly one pp rank: a sum over pp assembles all of them.
        full = torch.zeros(self.n_layers, self.num_experts, device=self.device)
        if counts is not None:
            full[self.rows] = counts
        dist.all_reduce(full, group=self.mesh["pp"].get_group())
        return full
