"""One training step: the micro-batches' forward and backward (through the pipeline schedule
under PP), the step's one all-reduce of the loss and flags, clipping, the optimizer step and
the MoE bias update.

What knows about ranks here: the loss (the objective normalises by the global batch's token
count, so any dp degree and gradient accumulation give the same gradients), one all-reduce per
step of the loss and the stop flag, and the MoE token counts (`moe_balance`). With masked labels
(chat data) the count is the step's: one small all-reduce of it, and of the step's data tokens
(not padding: the MoE z-loss's normaliser), before the first forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchmoe.config.job_config import JobConfig
from torchmoe.data.micro_batches import MicroBatch
from torchmoe.distributed.fault_tolerance import ReplicaGroups
from torchmoe.distributed.float8 import precompute_float8_scales
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.distributed.replica_state import encode_position
from torchmoe.nn.document_attention import DocumentSegments
from torchmoe.nn.profiler_regions import region
from torchmoe.optim.optimizer import clip_grad_norm_
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.training.model_build import BuiltModel
from torchmoe.training.moe_balance import MoeBalance
from torchmoe.training.objective import Objective, loss_weight
from torchmoe.training.optimization import Optimization
from torchmoe.training.placement import PlaceColumns
from torchmoe.weights.divergence import TrainingDiverged

MicroBatches = list[MicroBatch]  # (inputs, labels), each (B, seq_len) int64, with their starts and target count


@dataclass
class StepResult:
    loss: float  # the main next-token loss, as validation and `eval` compute it
    grad_norm: float
    lr: float  # the learning rate this step used
    stop: bool  # some rank caught SIGTERM/SIGINT: every rank stops after this step
    tokens_per_expert: torch.Tensor | None  # (n_moe_layers, n_experts), summed over the batch
    committed: bool = True  # under fault tolerance: the quorum let the optimizer step
    participants: int = 1  # replica groups whose gradients the step held (fault tolerance)
    mtp_loss: float | None = None  # the multi-token prediction modules' mean loss (in the objective x mtp_loss_coeff)
    qk_clip: dict[str, float] | None = None  # QK-Clip's metrics (`QKClip.reduce`), when it is on


class StepRunner:
    """Runs training steps on this rank's model.

    Args:
        cfg: the job (`training.max_norm`, `[float8]`).
        built, objective, optimization, balance: the parts a step uses.
        dims, mesh, device, world_size: the layout.
        schedule: the pipeline schedule under PP, else None.
        replicas: the replica groups under fault tolerance, else None; `step_replicas` the same
            when they meet every step (no semi-synchronous method), else None.
        position: where this group's rows stand after the step's batch (the data loader's state).
        count_targets: the labels are masked (chat data): each step's loss is normalised by the
            step's own count of targets, summed over `batch_group` (the data-parallel ranks; None
            in one process); else by the objective's constant count.
    """

    def __init__(self, cfg: JobConfig, built: BuiltModel, objective: Objective, optimization: Optimization,
                 balance: MoeBalance, *, dims: ParallelDims, mesh: ParallelMesh | None, device: torch.device,
                 world_size: int, schedule, replicas: ReplicaGroups | None, step_replicas: ReplicaGroups | None,
                 position: Callable[[], dict], count_targets: bool = False, batch_group=None) -> None:
        self.cfg, self.built, self.model = cfg, built, built.model
        self.objective, self.balance = objective, balance
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler
        self.qk_clip = optimization.qk_clip
        self.dims, self.mesh, self.device, self.world_size = dims, mesh, device, world_size
        self.schedule = schedule
        self.replicas, self.step_replicas = replicas, step_replicas
        self.position = position
        self.loss_weight = loss_weight(mesh)
        self.count_targets, self.batch_group = count_targets, batch_group

    def forward_backward(self, micro_batches: MicroBatches, columns: PlaceColumns) -> torch.Tensor:
        """Accumulate the gradients of this rank's micro-batches, each placed by `columns`, the
        gradient reduction across replicas set by `sync_gradients(last=...)` before each; returns
        this rank's shares of the global losses logged (`Objective.forward`: (main,), or (main,
        multi-token prediction); summed over dp ranks each is the global mean)."""
        if self.qk_clip is not None:
            self.qk_clip.begin_step()
        local_loss = torch.zeros(1 + (self.objective.mtp_layers > 0), device=self.device)
        real_tokens = None
        if self.count_targets:
            self.objective.tokens, real_tokens = self.global_targets(micro_batches)
        self.balance.set_aux_loss_scale(len(micro_batches), real_tokens)
        # Every micro-batch's copy to the device starts now: later ones arrive during earlier ones' compute.
        with region("data"):
            micro_batches = [columns(*batch, batch.starts, batch.real) for batch in micro_batches]
        for i, (inputs, labels, documents, real) in enumerate(micro_batches):
            self.sync_gradients(last=i == len(micro_batches) - 1)
            with loss_parallel() if self.objective.tp_mesh is not None else nullcontext():
                if self.schedule is not None:
                    losses = self._pipeline_step(inputs, labels, documents, real)
                else:
                    objective, logged = self.objective.forward(self.model, inputs, labels, documents, real)
                    objective.backward()
                    losses = [logged]
            for loss in losses:
                local_loss += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        return local_loss

    def global_targets(self, micro_batches: MicroBatches) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's targets (labels that are not ignored) and its data tokens (not padding:
        `MicroBatch.real_tokens`) over the data-parallel ranks: the sums of the counts the host
        made with each micro-batch (over whole rows, so under CP every piece divides by the same
        count), all-reduced together once, as 0-dim float64 tensors on the device, which no host
        reads. At least 1: a step without targets has zero loss and zero gradients (every token
        loss is ignored), not 0 / 0. Replica groups that meet every step (their gradients
        averaged) divide the loss by the mean of their counts of targets instead
        (`ReplicaGroups.mean_targets`): the average is then the quorum's mean over its targets,
        however they fall between the groups. The data tokens normalise the MoE z-loss
        (`MoeBalance.set_aux_loss_scale`), each group's by its own, as pretraining's."""
        counts = torch.tensor([sum(batch.supervised for batch in micro_batches),
                               sum(batch.real_tokens for batch in micro_batches)], dtype=torch.int64,
                              device=self.device)
        if self.batch_group is not None:
            dist.all_reduce(counts, group=self.batch_group)
        targets, real_tokens = counts.clamp(min=1).double().unbind()
        if self.step_replicas is not None:  # replica groups meeting every step: the quorum's mean count
            return self.step_replicas.mean_targets(counts[0].double()), real_tokens
        return targets, real_tokens

    def sync_gradients(self, *, last: bool) -> None:
        """Reduce gradients across dp_replicate only in the last micro-batch's backward: summing
        first and all-reducing once is the same gradient, with one all-reduce per step instead
        of one per micro-batch. HSDP keeps its per-micro-batch reduce-scatter (deferring it would
        hold unsharded gradients); under PP the pipeline stages manage their own syncs. Replica
        groups (fault tolerance) are the replicate dimension: FSDP's hooks cross them alike."""
        if self.step_replicas is not None:
            self.step_replicas.set_requires_all_reduce(last)
        if self.schedule is not None or not self.dims.dp_replicate_enabled:
            return
        if self.dims.fsdp_enabled:
            self.model.set_requires_all_reduce(last)
        else:  # DDP
            self.model.set_requires_gradient_sync(last)

    def _pipeline_step(self, inputs: torch.Tensor, labels: torch.Tensor, documents: DocumentSegments | None,
                       real: torch.Tensor | None) -> list[torch.Tensor]:
        """Forward and backward of one local batch through the pipeline schedule; returns the
        pipeline micro-batches' losses on the rank holding the last stage, else nothing. The
        document segment tables and the mask of the tokens that are data go to every stage as
        keyword arguments, which the schedule splits into micro-batches along the rows as it
        splits the inputs (the tables are a pytree)."""
        losses: list[torch.Tensor] = []
        pipe, pp_rank = self.built.pipe, self.built.pp_rank
        first, last = pipe.has_first_stage(pp_rank), pipe.has_last_stage(pp_rank)
        args = (inputs,) if first else ()
        kwargs = {name: value for name, value in (("documents", documents), ("real", real)) if value is not None}
        self.schedule.step(*args, target=labels if last else None, losses=losses if last else None,
                           return_outputs=False, **kwargs)
        return losses

    def finish(self, local_loss: torch.Tensor, *, step: int, stop_requested: bool) -> StepResult:
        """After `forward_backward` of step `step` + 1: agree on the loss and on stopping, clip,
        step, and update the MoE biases. The host reads device values once per step (loss, stop
        flag, norm together).

        Raises:
            TrainingDiverged: the global loss or gradient norm is not finite (nothing was
                stepped, so the model still holds the previous step's weights).
        """
        global_losses, stop_flag, bad_bias, group_steps = self._reduce_loss_and_flags(local_loss, step, stop_requested)
        global_loss, mtp = global_losses[0], list(global_losses[1:])  # under fault tolerance: the group's MTP loss
        counts = self.balance.counts()
        if self.step_replicas is not None:
            # Across the step's replica groups before clipping, so every group clips and steps
            # alike: the gradients (averaged in the backward, or here), the loss, the token
            # counts, and where this group's rows stand after the step's batch.
            global_loss, counts = self.step_replicas.reduce(global_loss, counts, self._local_grads,
                                                            encode_position(self.position()))
        max_norm = self.cfg.training.max_norm
        with region("optimizer"):
            grad_norm = clip_grad_norm_(list(self.model.parameters()), max_norm if max_norm > 0 else float("inf"),
                                        pp_mesh=self.mesh["pp"] if self.dims.pp_enabled else None)
        steps = [group_steps] if group_steps is not None else []
        clip = self.qk_clip.reduce() if self.qk_clip is not None else {}
        values = torch.stack([global_loss, stop_flag, grad_norm.to(global_loss), bad_bias, *mtp, *steps,
                              *(v.to(global_loss) for v in clip.values())]).tolist()
        loss, stop, norm, bad_bias = values[:4]
        mtp_loss, group_steps = (values[4] if mtp else None), values[4 + len(mtp):4 + len(mtp) + len(steps)]
        clipped = dict(zip(clip, values[len(values) - len(clip):])) if clip else None
        if group_steps and group_steps[0] != step * self.world_size:
            raise RuntimeError(f"this rank is at step {step} and other ranks of its replica group are not (a "
                               "recovery failed on some of them): the group stops; launch it again and it takes "
                               "the live state from a healthy group")
        lr = self.scheduler.get_last_lr()[0]
        if self.step_replicas is not None and not self.step_replicas.commit(step + 1):
            # A peer failed during the step, or too few groups took part: nothing is stepped.
            self.optimizer.zero_grad(set_to_none=True)
            self.balance.forget_counts()
            return StepResult(loss, norm, lr, stop > 0, None, committed=False,
                              participants=self.step_replicas.contributors, mtp_loss=mtp_loss)
        if bad_bias:  # set by the previous step's update, which no save has seen yet
            raise TrainingDiverged(f"an MoE expert bias is not finite after step {step}: stopping without "
                                   "saving; lower model.load_balance_coeff")
        for name, value in (("loss", loss), ("gradient norm", norm)):
            if not math.isfinite(value):
                raise TrainingDiverged(f"{name} is {value} at step {step + 1}: stopping without saving; "
                                       "lower optimizer.lr or check the data")
        self._optimizer_step(step, clip=bool(clipped and clipped["qk_clipped_heads"]))
        counts = self.balance.update_biases(counts)
        return StepResult(loss, norm, lr, stop > 0, counts,
                          participants=self.step_replicas.contributors if self.step_replicas is not None else 1,
                          mtp_loss=mtp_loss, qk_clip=clipped)

    def _optimizer_step(self, step: int, *, clip: bool = False) -> None:
        """Step the optimizer (then, with `clip`, QK-Clip's scaling of the heads the step found
        above its threshold; the float8 scales and the schedule) and drop the gradients."""
        try:
            self.optimizer.step()
        except RuntimeError as err:
            # An update too large for the parameters' dtype (an absurd LR): torch refuses the
            # scalar before writing it, on every rank alike.
            if "overflow" not in str(err):
                raise
            raise TrainingDiverged(f"the optimizer update overflows at step {step + 1} ({err}): stopping "
                                   "without saving; lower optimizer.lr") from None
        if clip:  # the updated weights, by the step's logits (Kimi K2's order)
            self.qk_clip.apply()
        precompute_float8_scales([self.model], self.cfg.float8)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _local_grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient as this rank holds it (a DTensor's local shard), in the
        model's order; a parameter without one gets zeros, so that every group's list lines up."""
        grads = []
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad)
        return grads

    def _reduce_loss_and_flags(self, local_loss: torch.Tensor, step: int, stop_requested: bool
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sum the losses (`forward_backward`'s) over data-parallel ranks and agree on stopping and
        on the expert biases being finite, in one all-reduce. Returns (losses, stop flag,
        non-finite bias flag, under fault tolerance the sum of the group's step numbers).

        Only the tp-coordinate-0 rank of each TP group contributes the loss (its TP peers hold
        the same value; under PP only ranks holding the last stage have a nonzero one); any rank
        that caught SIGTERM/SIGINT raises the stop flag for all, so every rank stops (and saves,
        collectively) after the same step. Under PP each stage checks its own layers' biases.
        """
        flag = torch.tensor(float(stop_requested), device=self.device)
        bad_bias = self.balance.bad_bias(flag)
        if self.mesh is None:
            return local_loss, flag, bad_bias, None
        # The step number rides along under fault tolerance: a recovery that failed on some ranks
        # of a group (its sender died mid-transfer) leaves the others on the peer's step, and
        # torchft cannot bring such a group back together.
        steps = [torch.tensor(float(step), device=self.device)] if self.replicas is not None else []
        buf = torch.cat([local_loss * self.loss_weight, torch.stack([flag, bad_bias, *steps])])
        dist.all_reduce(buf)
        n = local_loss.numel()
        return buf[:n], buf[n], buf[n + 1], (buf[n + 2] if steps else None)

