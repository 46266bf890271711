"""Each training step's metrics record: its time and throughput, what it compiled, its traffic,
and the validation loss when due; and where the run's collectives switch timeouts (the start's
until the first step and the first validation are done, training's after)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn as nn

from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.compile import DynamoCounts
from torchmoe.distributed.expert_parallel import ep_bytes_moved
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.metrics.metrics import MetricsLogger, ThroughputWindow, peak_memory_gib, reset_peak_memory
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.training.console import compile_report
from torchmoe.training.log import logger
from torchmoe.training.step import StepResult
from torchmoe.training.world import collective_timeout


class StepMetrics:
    """The records `fit` writes, one step at a time: `begin` before the step, `timed` right after
    it, `validate` when due, then `write`.

    Args:
        cfg: the job (`[metrics]`, `[compile]`, `[comm]`'s timeouts, `training.dataset_mix`).
        metrics: the run's metrics logger.
        model: this rank's model (its EP traffic is counted).
        dims, mesh, device, rank: the layout.
        first_step: the step the run starts after (a resumed run's checkpoint).
        global_tokens: the tokens of one global batch.
        flops_per_token: the model's training FLOPs per token (`ModelArgs.flops_per_token`).
        dataloader: the training data (its tokens by source).
        replica_steps: whether replica groups meet every step (their report is logged).
    """

    def __init__(self, cfg: JobConfig, metrics: MetricsLogger, model: nn.Module, *, dims: ParallelDims,
                 mesh: ParallelMesh | None, device: torch.device, rank: int, first_step: int, global_tokens: int,
                 flops_per_token: float, dataloader, replica_steps: bool) -> None:
        self.cfg, self.metrics, self.model = cfg, metrics, model
        self.dims, self.mesh, self.device, self.rank = dims, mesh, device, rank
        self.first_step, self.global_tokens = first_step, global_tokens
        self.dataloader, self.replica_steps = dataloader, replica_steps
        self.flops_per_token = flops_per_token
        self.window = ThroughputWindow()
        self.first = True  # this process's first step (a recovering replica group's step number jumps)
        self.opening = True  # the step being recorded was this process's first
        self.first_validation = True
        self.validation_graphs, self.warned_recompiles = 0, False  # compile: graphs of validation's forwards
        self.compiled_before = DynamoCounts.now()
        self.t0, self.ep_bytes = 0.0, 0

    def begin(self) -> None:
        """A step starts (its attempts under fault tolerance included)."""
        self.t0 = time.perf_counter()
        self.ep_bytes = ep_bytes_moved(self.model) if self.dims.ep_enabled else 0

    def timed(self, extra: dict) -> dict:
        """The step ended: `extra` with its EP traffic and, for the first step, where a resumed
        run continues and what compiled (or, later, what compiled again)."""
        step_s = time.perf_counter() - self.t0
        self.window.add(self.global_tokens, step_s)
        if self.dims.ep_enabled:
            extra["ep_all_to_all_gib"] = (ep_bytes_moved(self.model) - self.ep_bytes) / 2**30
        compiling = self.cfg.compile.enable
        self.opening = self.first
        if self.first:
            if self.first_step > 0:  # the report marks where the curves continue a checkpoint
                extra["resumed_from"] = self.first_step
            if self.mesh is not None:  # loading, compile and warm-up are done
                collective_timeout(self.mesh, self.cfg.comm.train_timeout_seconds, self.device)
            if compiling:
                extra.update(compile_report(DynamoCounts.now().since(self.compiled_before), step_s, rank=self.rank))
                self.compiled_before, self.validation_graphs = DynamoCounts.now(), 0
        elif compiling:
            # Graphs compiled by training steps after the first (a guard that fails from
            # step to step recompiles, until dynamo's limit leaves the code eager).
            extra["compile_recompiles"] = DynamoCounts.now().since(self.compiled_before).graphs - self.validation_graphs
            if extra["compile_recompiles"] and not self.warned_recompiles and self.rank == 0:
                self.warned_recompiles = True
                logger.warning("torch.compile compiled %d more graphs after the first step (a guard failed; "
                               "TORCH_LOGS=recompiles says which): those steps ran slower",
                               extra["compile_recompiles"])
        self.first = False
        return extra

    def validate(self, validation: Callable[[], float]) -> float:
        """`validation()`, after the step's timing and traffic (its numbers are the training's).
        The first one compiles the model's forward without gradients, its ranks apart by more
        than training's timeout allows: it runs under the start's."""
        longer = self.first_validation and self.mesh is not None
        if longer:
            collective_timeout(self.mesh, self.cfg.comm.init_timeout_seconds, self.device)
        before = DynamoCounts.now()
        loss = validation()
        self.validation_graphs += DynamoCounts.now().since(before).graphs  # no_grad: its own
        if longer:
            collective_timeout(self.mesh, self.cfg.comm.train_timeout_seconds, self.device)
        self.first_validation = False
        return loss

    def write(self, step: int, result: StepResult, extra: dict, ft_report: dict, *, validated: bool) -> None:
        """Log step `step`'s record when it validated, is due (`metrics.log_freq`) or is the
        first; else record the numbers it read anyway, so that curves hold every step."""
        # The main loss (validation's and eval's), apart the MTP modules' (in the objective), and
        # QK-Clip's largest logit and clipped heads: in every step's record.
        losses = {"loss": result.loss, **({"mtp_loss": result.mtp_loss} if result.mtp_loss is not None else {}),
                  **(result.qk_clip or {})}
        if not (validated or self.metrics.should_log(step) or self.opening):
            self.metrics.record_step(step, {**losses, "grad_norm": result.grad_norm, "lr": result.lr})
            return
        tokens_per_sec = self.window.take()
        if self.cfg.training.dataset_mix:  # tokens fed by each source since the run began
            extra.update({f"tokens/{name}": count for name, count in self.dataloader.tokens_by_source().items()})
        self.metrics.log(step, {**extra,
            **losses,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens_per_sec": tokens_per_sec,
            "tflops": self.flops_per_token * tokens_per_sec / self.dims.world_size / 1e12,
            "memory_gib": peak_memory_gib(self.device),
            **({"ft_participants": result.participants, **ft_report} if self.replica_steps else {}),
        }, tokens_per_expert=result.tokens_per_expert)
        reset_peak_memory(self.device)
