"""The training loop: build the parts from a `JobConfig`, then for each step take the batch, do
the forward and backward, step the optimizer, log, checkpoint (`Trainer.fit`).

    python -m torchmoe train --config configs/debug_model.toml
    torchrun --nproc_per_node=4 -m torchmoe train --config configs/debug_model.toml \\
        --parallelism.data_parallel_shard_degree 4

The loop is layout-agnostic: the parallelize pipeline decides how the model is split, and each
part (`torchmoe.training`'s other modules) does one job; the loop only orders them.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe.arch.registry import model_args_from_config
from torchmoe.checkpoints.adapter_settings import AdapterSettings
from torchmoe.checkpoints.base_fingerprint import BaseFingerprint
from torchmoe.checkpoints.checkpoint import CheckpointManager, checkpoint_timeout
from torchmoe.checkpoints.checkpoint_state import ModelWrapper, OptimizerWrapper, RankLocal, RNGState
from torchmoe.config.files.paths import source_key, written_folders
from torchmoe.config.job_config import JobConfig
from torchmoe.data.dataloader import build_dataloader
from torchmoe.data.file_index import INDEX_FOLDER
from torchmoe.data.tokenizer import build_tokenizer
from torchmoe.distributed.failure import FailureWatch
from torchmoe.distributed.interruption import leaving_for_failure
from torchmoe.distributed.mesh import ParallelMesh, build_mesh
from torchmoe.metrics.metrics import MetricsLogger, device_peak_flops
from torchmoe.metrics.run_logs import LogFile, setup_logging
from torchmoe.nn.attention_kernels import describe_kernel
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.nn.profiler_regions import region
from torchmoe.performance.garbage_collection import GarbageCollection
from torchmoe.performance.profiling import maybe_memory_snapshot, maybe_profile
from torchmoe.plan.memory import compute_dtype
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import microbatches
from torchmoe.preflight import train_device
from torchmoe.run_folders.run_lock import lock_folders
from torchmoe.training.adapters import checkpointed, saved_tensors_check, trainable
from torchmoe.training.checkpointing import Checkpoints
from torchmoe.training.console import chat_report, closing, opening, say
from torchmoe.training.cpu_threads import cpu_threads
from torchmoe.training.log import logger
from torchmoe.training.model_build import build_model, build_pipeline_schedule
from torchmoe.training.moe_balance import MoeBalance
from torchmoe.training.objective import Objective
from torchmoe.training.optimization import build_optimization
from torchmoe.training.placement import LocalColumns
from torchmoe.training.progress import Progress
from torchmoe.training.replicas import LiveState, Replicas, join_replica_groups
from torchmoe.training.run_files import write_run_files
from torchmoe.training.step import MicroBatches, StepResult, StepRunner
from torchmoe.training.step_metrics import StepMetrics
from torchmoe.training.validation import Validation, ValidationLoss
from torchmoe.training.world import init_distributed


class Trainer:
    """Owns the parts of one training job on this rank, and steps them (`fit`).

    Args:
        cfg: the job.
        failure_watch: the multi-rank failure protocol's watch (see `session.train`), if any:
            signals that arrive once this rank is leaving for a failure are ignored.
        index_cache: where the data files' indexes are kept (`data.file_index`); None: the dump
            folder's `data_index`.
    """

    def __init__(self, cfg: JobConfig, *, failure_watch: FailureWatch | None = None,
                 index_cache: Path | None = None) -> None:
        self.cfg = cfg
        self.failure_watch = failure_watch
        self.device = train_device(cfg.training.device)
        # Before the first op: a CPU run computes with the CPUs it has to itself (`cpu_threads`).
        self.threads = cpu_threads() if self.device.type == "cpu" else None
        world_size = init_distributed(self.device, cfg.comm, cfg.parallelism, Path(cfg.job.dump_folder))
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        setup_logging(self.rank, cfg.metrics.log_level)
        self.dims = ParallelDims.from_config(cfg.parallelism, world_size)
        self.mesh: ParallelMesh | None = build_mesh(self.dims, self.device.type) if world_size > 1 else None
        if cfg.training.deterministic:
            # cuBLAS refuses deterministic mode without a fixed workspace configuration.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.dump_folder = Path(cfg.job.dump_folder)
        self.index_cache = index_cache or self.dump_folder / INDEX_FOLDER
        self.world_size = world_size
        # Before anything is written (or stale temporaries deleted) there; released if setup fails.
        nccl_traces = self.device.type == "cuda" and world_size > 1
        self.folder_locks = lock_folders(written_folders(cfg, nccl_traces=nccl_traces), cfg.job.folder_lock)
        self.log_file: LogFile | None = None
        self.replicas: Replicas | None = None  # set by `_build` under fault tolerance; `release` stops it
        try:
            if cfg.metrics.enable_log_files:
                self.log_file = LogFile.attach(self.dump_folder, self.rank, cfg.metrics.log_level)
            self._build(cfg)
        except BaseException as err:
            self.release(err)
            raise

    def _build(self, cfg: JobConfig) -> None:
        """Everything but the folders: data, model, optimizer, checkpoints, the step (`__init__`)."""
        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path, key=source_key(cfg, "model.tokenizer_path"))
        self.model_args = model_args_from_config(cfg.model, lora=cfg.lora.enable)
        batch_mesh = self.mesh["batch"] if self.mesh is not None else None
        dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
        ft = cfg.fault_tolerance
        # Under fault tolerance the batch rows are split over every group's dp ranks, group
        # after group (HSDP's order, replica groups as its replicate dim); each rank keeps its
        # own rows in checkpoints, as the batch mesh spans one group only.
        groups, group = (ft.group_size, ft.replica_id) if ft.enable else (1, 0)
        self.dataloader = build_dataloader(
            cfg.training, self.tokenizer, dp_rank=group * self.dims.dp + dp_rank, dp_degree=groups * self.dims.dp,
            batch_mesh=None if ft.enable else batch_mesh, index_cache=self.index_cache,
        )
        self.validation = Validation(cfg, self.tokenizer, dp_rank=dp_rank, dp_degree=self.dims.dp,
                                     batch_mesh=batch_mesh, index_cache=self.index_cache)
        # The loss is normalised by this group's tokens: averaged over the groups of a step, it
        # is the mean over their rows (without fault tolerance: the global batch's).
        self.global_tokens = self.dataloader.global_batch_size // groups * cfg.training.seq_len
        # Chat data masks labels: each step then counts its own targets (`StepRunner.global_targets`).
        self.masked_labels = bool(self.dataloader.chat_stats())
        # What the matmuls compute in, in every layout (FSDP/DDP cast the parameters to it, other
        # layouts autocast): the planner's dtype, and the peak MFU is measured against.
        self.compute_dtype = torch_dtype(compute_dtype(cfg.training))
        built = build_model(cfg, self.model_args, self.dims, self.mesh, self.device, self.rank)
        self.model, self.model_parts, self.pipe, self.pp_rank = built.model, built.parts, built.pipe, built.pp_rank
        self.pp_microbatches = microbatches(cfg.training, cfg.parallelism)[0] if self.dims.pp_enabled else 1
        self.balance = MoeBalance(self.model, self.model_args, self.dims, self.mesh,
                                  pp_microbatches=self.pp_microbatches, device=self.device)
        self.moe_layers = self.balance.layers
        optimization = build_optimization(self.model, cfg.optimizer, cfg.lr_scheduler, cfg.training.steps,
                                          trainable=trainable(cfg.lora), watched=built.watched,
                                          n_heads=self.model_args.n_heads, device=self.device)
        self.optimizer, self.scheduler = optimization.optimizer, optimization.scheduler
        self.optimizer_lines = optimization.description  # for the opening lines
        self.checkpointer = CheckpointManager(self.dump_folder, cfg.checkpoint, total_steps=cfg.training.steps,
                                              timeout=checkpoint_timeout(cfg.checkpoint, cfg.comm))
        self.state = {
            "model": ModelWrapper([self.model], flavor=cfg.model.flavor, family=cfg.model.name,
                                  keep=checkpointed(cfg.lora, self.model_args),
                                  check=saved_tensors_check(cfg, self.model_args)),
            "optimizer": OptimizerWrapper([self.model], [self.optimizer]),
            "lr_scheduler": self.scheduler,
            "dataloader": RankLocal(self.dataloader, rank=self.rank) if ft.enable else self.dataloader,
            "rng": RankLocal(RNGState(), rank=self.rank),
        }
        if cfg.lora.enable:  # what the adapters mean, and the frozen base's fingerprint, which a resume checks
            self.state["lora"] = AdapterSettings(cfg.lora, cfg.model.load_balance_coeff)
            self.state["base"] = BaseFingerprint()  # `Checkpoints.check_base`
        self.checkpoints = Checkpoints(cfg, self.checkpointer, self.state, self.model, self.model_args, rank=self.rank)
        self.progress = Progress()
        self.last_result: StepResult | None = None  # this process's newest step, for the closing line
        self.validation_loss: float | None = None  # the newest, for the closing line
        self._quorum_joined = False  # the next attempt's quorum was joined already (`fit`)
        self._stop_signal: int | None = None
        if ft.enable:
            self.replicas = join_replica_groups(
                cfg, self.model_args, self.dims, model=self.model, parts=self.model_parts, state=self.state,
                live=LiveState(self.state, optimization, self.progress, self.dataloader), rank=self.rank,
                world_size=self.world_size, global_batch_size=self.dataloader.global_batch_size, device=self.device)
        self.step_replicas = self.replicas.step_groups if self.replicas is not None else None
        loss_parallel = self.dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
        self.objective = Objective(self.model_args, tokens=self.global_tokens,
                                   tp_mesh=self.mesh["tp"] if loss_parallel else None)
        self._local_columns = LocalColumns(
            self.model_args, self.dims, self.mesh, seq_len=cfg.training.seq_len, device=self.device,
            eos_id=self.tokenizer.eos_id if cfg.training.document_masking else None)
        schedule = build_pipeline_schedule(
            built, cfg, self.model_args, self.dims, self.mesh, microbatches=self.pp_microbatches,
            loss_fn=self.objective.loss, vocab_sharded=loss_parallel, logits_dtype=self.compute_dtype,
            device=self.device) if self.dims.pp_enabled else None
        self.steps = StepRunner(
            cfg, built, self.objective, optimization, self.balance, dims=self.dims, mesh=self.mesh,
            device=self.device, world_size=self.world_size, schedule=schedule, step_replicas=self.step_replicas,
            replicas=self.replicas.groups if self.replicas is not None else None, position=self.dataloader.state_dict,
            count_targets=self.masked_labels, batch_group=batch_mesh.get_group() if batch_mesh is not None else None)

    @property
    def step(self) -> int:
        """The steps trained so far."""
        return self.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.progress.step = value

    def load_initial_state(self) -> None:
        """Resume from the newest complete checkpoint, else load `initial_load_path` if set (also
        at a resume whose checkpoints lack the frozen base: `Checkpoints.load_initial_weights`); then,
        the run being known to go ahead, write its files (`run_files.write_run_files`)."""
        resumed = self.checkpointer.load_latest(self.state)
        if resumed is not None:
            self.step = resumed
        self.checkpoints.load_initial_weights(resumed=resumed is not None)
        if self.replicas is not None:
            # Where this group's rows start when a recovery finds no position it committed.
            self.replicas.live.start_position = self.dataloader.state_dict()
            if self.replicas.semi_sync is not None and resumed is None:
                self.replicas.semi_sync.anchor_here()  # the initial weights may have been loaded just now
        self._write_run_files(resumed=resumed is not None)

    def _write_run_files(self, *, resumed: bool) -> None:
        write_run_files(self.cfg, self.dump_folder, rank=self.rank, world_size=self.world_size,
                        log_file=self.log_file, resumed=resumed)

    def forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        """Accumulate the gradients of this rank's micro-batches (`StepRunner.forward_backward`)."""
        return self.steps.forward_backward(micro_batches, self._local_columns)

    def train_step(self, micro_batches: MicroBatches) -> StepResult:
        """`forward_backward`, then agree on the loss and on stopping, clip, step, and update the
        MoE biases (`StepRunner.finish`)."""
        local_loss = self.forward_backward(micro_batches)
        return self.steps.finish(local_loss, step=self.step, stop_requested=self._stop_signal is not None)

    def load_trained(self, step_dir: Path) -> None:
        """The model of a LoRA run's checkpoint `step_dir` over its base, without its training
        state (`Checkpoints.load_trained`), for `torchmoe eval`; then the run files, as
        `load_initial_state` writes them."""
        self.checkpoints.load_trained(step_dir)
        self._write_run_files(resumed=False)

    def validate(self) -> ValidationLoss:
        """The mean token loss of the model as it is over the validation batches, and what it
        covers (`Validation.loss`)."""
        return self.validation.loss(self.model, self.moe_layers, self._local_columns, self.objective, self.mesh,
                                    self.device)

    def _committed_step(self) -> StepResult:
        """Draw a batch and train on it; under fault tolerance join each attempt's quorum first
        and try again until the quorum commits: with the same batch, or with the next rows of
        this group once it took a peer's live state (`LiveState.load` moved its rows)."""
        batch = None
        while True:
            if self.step_replicas is not None and not self._quorum_joined:
                self.replicas.join_quorum()
            self._quorum_joined = False
            if batch is None or self.progress.recovered:
                self.progress.recovered = False
                with region("data"):
                    batch = self.dataloader.next_batch()
            result = self.train_step(batch)
            if result.committed:
                return result
            logger.warning("step %d was not committed: a replica group failed during it, or fewer than "
                           "fault_tolerance.min_replica_size (%d) took part (%d did); trying it again",
                           self.step + 1, self.cfg.fault_tolerance.min_replica_size, result.participants)

    def fit(self) -> None:
        """Train from the step the run stands at to `training.steps`, each step's record logged and
        its checkpoint saved when due; a signal stops every rank after the same step."""
        cfg = self.cfg
        if self.replicas is not None:
            self.replicas.first_quorum(self.step)
            self._quorum_joined = True
        metrics = self._open_metrics()
        with ExitStack() as stack:
            per_step = self._enter_run(stack, metrics)
            report = StepMetrics(cfg, metrics, self.model, dims=self.dims, mesh=self.mesh, device=self.device,
                                 rank=self.rank, first_step=self.step, global_tokens=self.global_tokens,
                                 flops_per_token=self.model_args.flops_per_token(cfg.training.seq_len),
                                 dataloader=self.dataloader, replica_steps=self.step_replicas is not None)
            began, first_step, stopped = time.perf_counter(), self.step, False
            while self.step < cfg.training.steps:
                report.begin()
                result = self.last_result = self._committed_step()
                self.step += 1
                ft_report, extra = self.replicas.after_step(self.step, self.dataloader.state_dict) \
                    if self.replicas is not None else ({}, {})
                extra = report.timed(extra)
                validated = cfg.validation.enable and self.step % cfg.validation.freq == 0
                if validated:
                    extra["validation_loss"] = self.validation_loss = report.validate(lambda: self.validate().loss)
                report.write(self.step, result, extra, ft_report, validated=validated)
                if result.stop:  # agreed by all ranks: a rank's own signal may arrive later
                    self._stop()
                    stopped = True
                    break
                self.checkpoints.after_step(self.step, stopping=False)
                for hook in per_step:
                    hook(self.step)
        # After the stack: an asynchronous save has finished, so the closing line names it.
        if not stopped and cfg.checkpoint.last_save_in_hf:
            self._save_hf()
        self._say(metrics, closing(
            cfg, self.last_result, step=self.step, first_step=first_step, seconds=time.perf_counter() - began,
            global_batch_size=self.dataloader.global_batch_size, validation_loss=self.validation_loss,
            checkpoints=self.checkpointer, log_file=self.log_file, dump_folder=self.dump_folder))
        chat = chat_report(self.dataloader.chat_stats())
        if chat is not None:
            logger.info("%s", chat)
        if not stopped:
            metrics.require_written()  # last: records held back by a full disk did not stop training

    def _open_metrics(self) -> MetricsLogger:
        """The run's metrics logger, and its opening lines on the console."""
        cfg, steps = self.cfg, self.cfg.training.steps
        metrics = MetricsLogger(self.dump_folder, cfg.metrics, rank=self.rank, total_steps=steps,
                                peak_flops=device_peak_flops(self.device, self.compute_dtype), start_step=self.step,
                                run_config=asdict(cfg))
        self._say(metrics, opening(cfg, self.model_args, step=self.step,
                                   global_batch_size=self.dataloader.global_batch_size, world_size=self.world_size,
                                   device_type=self.device.type, dump_folder=self.dump_folder,
                                   optimizer_lines=self.optimizer_lines, threads=self.threads))
        if self.step > 0:
            logger.info("resuming at step %d", self.step + 1)
        if self.rank == 0:  # decided once per device, dtype and head dim (`nn.attention_kernels`)
            logger.info("%s", describe_kernel(self.device, self.compute_dtype, self.model_args.head_dim))
        warmup = cfg.lr_scheduler.warmup_steps
        if warmup >= steps and self.rank == 0:
            logger.warning("lr_scheduler.warmup_steps (%d) >= training.steps (%d): the learning rate never reaches "
                           "optimizer.lr in this run", warmup, steps)
        return metrics

    def _enter_run(self, stack: ExitStack, metrics: MetricsLogger) -> list:
        """Enter what lasts as long as the loop (signal handlers, the checkpointer's and metrics'
        closing, profiler, memory snapshots, garbage collection) on `stack`; returns what is
        called with each step's number after its checkpoint."""
        cfg = self.cfg
        for sig in (signal.SIGTERM, signal.SIGINT):  # the caller's handlers come back at the end
            stack.callback(signal.signal, sig, signal.signal(sig, self._on_signal))
        # Before they come back, when a failure ends the loop: a signal then (torchrun's agent
        # stopping the survivors of a dead rank) must not replace the failure's report.
        stack.push(lambda exc_type, exc, tb: leaving_for_failure() if exc_type is not None else None)
        stack.push(self.checkpoints.close_on_exit)
        stack.callback(metrics.close)
        prof = stack.enter_context(maybe_profile(cfg.profiling, self.dump_folder, rank=self.rank,
                                                 start_step=self.step))
        mem = stack.enter_context(maybe_memory_snapshot(cfg.profiling, self.dump_folder, rank=self.rank,
                                                        start_step=self.step))
        collector = GarbageCollection(cfg.training.gc_freq)
        stack.callback(collector.close)
        return [collector.step, lambda step: prof.step(), lambda step: mem.step()]

    def _on_signal(self, signum, frame) -> None:
        """Note SIGTERM/SIGINT; the stop is agreed in the step's all-reduce and announced then
        (`_stop`). Not at once: torchrun's agent terminates the survivors of a worker that died,
        and their next collective, failing on the dead peer, tells them so."""
        if self.failure_watch is not None and self.failure_watch.failure is not None:
            # This rank is leaving for a failure already (and exits within the watch's grace
            # whatever happens).
            return
        self._stop_signal = signum

    def _stop(self) -> None:
        """Every rank agreed to stop after this step: the rank that caught the signal says so, and
        the checkpoint is saved (or why there is none is said)."""
        if self._stop_signal is not None:
            logger.warning("received %s: stopping after step %d", signal.Signals(self._stop_signal).name, self.step)
        if self.checkpointer.writes:
            self.checkpoints.after_step(self.step, stopping=True)
        else:
            why = "checkpoint.load_only is true" if self.cfg.checkpoint.enable else "checkpoint.enable is false"
            logger.warning("%s: stopping at step %d without a checkpoint", why, self.step)

    def _say(self, metrics: MetricsLogger, text: str) -> None:
        say(metrics, self.log_file, text)

    def _save_hf(self) -> None:
        """The weights as a Hugging Face folder (`Checkpoints.save_hf`)."""
        self.checkpoints.save_hf(self.step)

    def create_seed_checkpoint(self) -> None:
        """Write step-0 with the initial weights: `initial_load_path`'s when set, else freshly
        initialised ones (one process: `preflight.check_launch`)."""
        self.checkpoints.load_initial_weights(resumed=False)
        self._write_run_files(resumed=False)
        self.checkpoints.save_seed()

    def release(self, error: BaseException | None = None) -> None:
        """Close this rank's log file, after `error` (why it leaves) if given, and free the run's
        folders for another run. Idempotent."""
        if self.log_file is not None:
            self.log_file.close(error)
        self.folder_locks.release()
        if self.replicas is not None:
            # torchft's servers and threads: a quorum thread still retrying a lighthouse that is
            # gone would hold the interpreter's exit until the quorum's timeout.
            self.replicas.groups.shutdown()

    def close(self, error: BaseException | None = None) -> None:
        """Leave together with every rank (the run ended the same way on all of them; `error`
        that way, if given: see `release`). The failure watch stops first, while every rank
        still holds the rendezvous store: tearing the process groups down may take any rank a
        while (NCCL at scale), and a watch still polling then would take the store host's exit
        (rank 0 under srun) for a failure."""
        self.release(error)
        if self.failure_watch is not None:
            self.failure_watch.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
