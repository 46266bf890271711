"""Fault tolerance's replica groups as the training loop meets them: joined at the start, met at
each step's quorum (or at the semi-synchronous method's syncs), and the live state a recovering
group takes from a healthy one (weights, optimizer, schedule, step, its rows' position)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import FLAVORS
from torchmoe.checkpoints.checkpoint_state import RankLocal
from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.fault_tolerance import ReplicaGroups, connect, watch_lighthouse
from torchmoe.distributed.replica_state import GroupLayout, decode_position, encode_position, like, local_tensors
from torchmoe.distributed.semi_sync import SemiSync
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.training.log import logger
from torchmoe.training.optimization import Optimization
from torchmoe.training.progress import Progress


class LiveState:
    """What a recovering replica group takes from this rank (`state`) and how this rank takes a
    peer's (`load`).

    Args:
        state: the checkpoint's state (its "model" and "optimizer" wrappers are read).
        optimization: the optimizer and schedule the state holds.
        progress: the run's step, moved by a load.
        dataloader: its position moves with a load.
    """

    def __init__(self, state: dict, optimization: Optimization, progress: Progress, dataloader) -> None:
        self.checkpoint_state = state
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler
        self.progress = progress
        self.dataloader = dataloader
        self.semi_sync: SemiSync | None = None
        self.start_position: dict | None = None  # where this group's rows start (`Trainer.load_initial_state`)
        self._live: dict | None = None  # what a recovering group takes, as references (`refs`); None: rebuild

    def refs(self) -> dict:
        """References to this rank's weights and optimizer state as plain tensors (DTensors'
        local shards: `replica_state.local_tensors`), built on the training thread. The tensors
        are updated in place by every step, so the references stay valid until a load replaces
        them or the optimizer creates its state (its first step): then they are rebuilt."""
        # An optimizer that never stepped has no state to send; asking DCP for it would create
        # some (it takes a zero step to build the moments: Adam's step count would then be off by one).
        optimizer = local_tensors(self.checkpoint_state["optimizer"].state_dict()) if self.optimizer.state else {}
        return {"model": local_tensors(self.checkpoint_state["model"].state_dict()), "optimizer": optimizer,
                "optimizer_states": len(self.optimizer.state)}

    def refresh(self) -> None:
        """Rebuild the references when a load or the optimizer's first step replaced tensors they hold."""
        if self._live is None or self._live["optimizer_states"] != len(self.optimizer.state):
            self._live = self.refs()

    def state(self) -> dict:
        """What a recovering replica group takes from this rank: weights, optimizer, schedule
        and step. torchft may call this on its own thread during the forward, when nothing is
        being updated: only references and small values are read."""
        live = self._live
        return {"model": live["model"], "optimizer": live["optimizer"],
                "lr_scheduler": self.scheduler.state_dict(), "step": self.progress.step,
                "semi_sync": self.semi_sync.state_dict() if self.semi_sync is not None else {}}

    def optimizer_template(self) -> dict:
        """This rank's optimizer state dict (DCP's flattened form), with the state a peer sends:
        an optimizer that never stepped gets it from DCP, which builds it by a zero step only
        when no parameter holds a gradient. With the asynchronous quorum a recovery runs after
        the backward, so the gradients wait aside meanwhile."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        if not self.optimizer.state:
            for p in params:
                p.grad = None
        try:
            return self.checkpoint_state["optimizer"].state_dict()
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad

    def load(self, state: dict, position: list[float] | None) -> None:
        """Take a healthy peer's `state()`, and move this group's rows to `position`, where they
        stood after its last step that counted (the start position if none did)."""
        model, optimizer = self.checkpoint_state["model"], self.checkpoint_state["optimizer"]
        model.load_state_dict(like(model.state_dict(), state["model"]))
        if state["optimizer"]:
            optimizer.load_state_dict(like(self.optimizer_template(), state["optimizer"]))
        self.scheduler.load_state_dict(state["lr_scheduler"])
        # The peer's optimizer state may carry the learning rate of the step its references were
        # taken at; the schedule's says what it is now.
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        if self.semi_sync is not None:
            self.semi_sync.load_state_dict(state["semi_sync"])
        logger.info("recovered the live state of step %d from a healthy replica group (this group was at step %d)",
                    state["step"], self.progress.step)
        self.progress.step = state["step"]
        loader = self.dataloader.state_dict()
        self.dataloader.load_state_dict(decode_position(position, loader) if position is not None
                                        else self.start_position)
        self._live = None
        self.progress.recovered = True


class Replicas:
    """This rank's replica groups (`ReplicaGroups`) and what the loop does with them.

    Attributes:
        groups: the replica groups.
        step_groups: the same when they meet every step (no `semi_sync_method`), else None.
        semi_sync: the semi-synchronous method (local SGD, DiLoCo), else None.
        live: the live state groups exchange.
    """

    def __init__(self, groups: ReplicaGroups, live: LiveState, semi_sync: SemiSync | None) -> None:
        self.groups, self.live, self.semi_sync = groups, live, semi_sync
        self.step_groups = groups if semi_sync is None else None

    def join_quorum(self) -> None:
        """Join the next step's quorum, the live state's references fresh for a recovering peer."""
        self.live.refresh()
        self.groups.begin_step()

    def first_quorum(self, step: int) -> None:
        """The first quorum, before the metrics logger starts: a group that is behind takes a
        peer's live state now, and the progress bar and ETA start at its step."""
        self.join_quorum()
        if self.semi_sync is not None:  # the groups meet again at the first sync
            self.groups.commit(step)

    def after_step(self, step: int, position: Callable[[], dict]) -> tuple[dict, dict]:
        """After step `step` committed, this group's rows where `position()` says (the data
        loader's state): (this step's waits on and traffic to other groups, its failed attempts'
        included; the sync's metrics when the semi-synchronous method synced at this step)."""
        report = self.groups.take_report()
        if self.semi_sync is None:
            return report, {}
        # A group's rows count as trained once a sync commits: its position rides in it.
        self.live.refresh()
        synced = self.semi_sync.after_step(step, encode_position(position()))
        return report, ({**synced, "ft_participants": self.groups.contributors} if synced is not None else {})


def model_text(name: str, flavor: str, dtype: str, model_args: ModelArgs) -> str:
    """Family `name`'s `flavor` with this run's dtype and MTP layers, as `GroupLayout.model`."""
    mtp = f", {model_args.mtp_layers} MTP layers" if model_args.mtp_layers else ""
    return f"{name}/{flavor}, {dtype}{mtp}"


def join_replica_groups(cfg: JobConfig, model_args: ModelArgs, dims: ParallelDims, *, model: nn.Module,
                        parts: list[nn.Module], state: dict, live: LiveState, rank: int, world_size: int,
                        global_batch_size: int, device: torch.device) -> Replicas:
    """Connect this rank to its replica group's torchft manager (`[fault_tolerance]`), add what
    groups keep in checkpoints to `state`, and say where gradients are averaged."""
    ft, quorum_s = cfg.fault_tolerance, cfg.comm.init_timeout_seconds
    layout = GroupLayout(model=model_text(cfg.model.name, cfg.model.flavor, cfg.training.dtype, model_args),
                         degrees=dims.degrees, ranks=world_size, seq_len=cfg.training.seq_len,
                         local_batch_size=cfg.training.local_batch_size, global_batch_size=global_batch_size)
    known = [model_text(name, flavor, cfg.training.dtype, model_args) for name, flavors in FLAVORS.items()
             for flavor in flavors]
    groups = ReplicaGroups(
        connect(ft, quorum_timeout_s=quorum_s, log_level=cfg.metrics.log_level), ft, layout=layout,
        known_models=known, position_width=len(encode_position(live.dataloader.state_dict())), state=live.state,
        load=live.load, device=device, quorum_timeout_s=quorum_s, watch=watch_lighthouse(ft, rank, world_size))
    state["fault_tolerance"] = groups
    state["row_positions"] = RankLocal(groups.positions, rank=rank)
    semi_sync = None
    if ft.semi_sync_method:
        semi_sync = live.semi_sync = SemiSync(groups, ft, lambda: local_named_params(model),
                                              [(n, b) for n, b in model.named_buffers() if n.endswith("expert_bias")],
                                              layer_ids=range(model_args.n_layers + model_args.mtp_layers))
        state["semi_sync"] = RankLocal(semi_sync, rank=rank)
    else:
        in_backward = ft.gradient_average == "backward" or (
            ft.gradient_average == "auto" and ft.process_group == "nccl")
        if not in_backward:
            where = "after the backward"
        elif groups.attach(parts):
            where = "inside FSDP's backward"
        else:
            where = "after the backward (no FSDP in the group)"
        if rank == 0:
            logger.info("gradients are averaged across replica groups %s", where)
    return Replicas(groups, live, semi_sync)


def local_named_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter as this rank holds it (a DTensor's local shard) with its name, in the
    model's order."""
    return [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()]
