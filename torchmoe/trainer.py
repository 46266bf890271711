"""The training loop: build everything from a `JobConfig`, then step.

    python -m torchmoe train --config configs/debug_model.toml
    torchrun --nproc_per_node=4 -m torchmoe train --config configs/debug_model.toml \\
        --parallelism.data_parallel_shard_degree 4

The loop is layout-agnostic: the parallelize pipeline decides how the model is split. What knows
about ranks here: the loss normalisation (by the global batch's token count, so any dp degree and
gradient accumulation give the same gradients), one all-reduce per step of the loss and the stop
flag, and the reduction of the MoE token counts over every rank that routes different tokens.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from torchmoe.arch.registry import FLAVORS, model_args_from_config
from torchmoe.components.checkpoint import CheckpointManager, SaveFailed, checkpoint_timeout
from torchmoe.components.checkpoint_state import ModelWrapper, OptimizerWrapper, RankLocal, RNGState
from torchmoe.components.divergence import TrainingDiverged
from torchmoe.components.finite import NonFiniteValues
from torchmoe.components.garbage_collection import GarbageCollection
from torchmoe.components.hf_storage import save_hf_weights
from torchmoe.components.initial_load import hf_bias_drop, load_initial_weights
from torchmoe.components.lr_scheduler import build_lr_scheduler
from torchmoe.components.metrics import (
    MetricsLogger,
    ThroughputWindow,
    device_peak_flops,
    peak_memory_gib,
    reset_peak_memory,
)
from torchmoe.components.metrics_records import METRICS_FILE, check_history
from torchmoe.components.optimizer import build_optimizer, clip_grad_norm_
from torchmoe.components.profiling import maybe_memory_snapshot, maybe_profile
from torchmoe.components.run_info import write_run_info
from torchmoe.components.run_lock import lock_folders
from torchmoe.components.run_logs import LogFile, setup_logging
from torchmoe.components.tokenizer_files import copy_tokenizer_files
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Comm, JobConfig, Parallelism
from torchmoe.config.launch_env import launch_int
from torchmoe.config.loader import write_config_toml
from torchmoe.config.paths import job_paths, source_key, user_path_faults, written_folders
from torchmoe.data.dataloader import DataLoader, build_corpus, build_dataloader, validation_data
from torchmoe.data.file_index import INDEX_FOLDER
from torchmoe.data.packing import CorpusEnd
from torchmoe.data.tokenizer import build_tokenizer
from torchmoe.distributed.compile import DynamoCounts
from torchmoe.distributed.expert_parallel import ep_bytes_moved
from torchmoe.distributed.failure import FailureWatch, PeerFailed
from torchmoe.distributed.fault_tolerance import ReplicaGroups, connect, watch_lighthouse
from torchmoe.distributed.float8 import precompute_float8_scales
from torchmoe.distributed.interruption import leaving_for_failure
from torchmoe.distributed.launcher import watch_launcher
from torchmoe.distributed.mesh import ParallelMesh, build_mesh
from torchmoe.distributed.one_reader import one_reads
from torchmoe.distributed.pipeline_parallel import build_schedule, stage_io_metas
from torchmoe.distributed.process_groups import backend_spec, set_timeout
from torchmoe.distributed.replica_state import GroupLayout, decode_position, encode_position, like, local_tensors
from torchmoe.distributed.semi_sync import SemiSync
from torchmoe.models.decoder.mtp import mtp_targets
from torchmoe.models.decoder.parallelize import parallelize_model
from torchmoe.models.decoder.pipeline_stages import PipelineRankModel, split_into_stages
from torchmoe.models.llama4 import Transformer, update_expert_bias
from torchmoe.nn.attention_kernels import describe_kernel
from torchmoe.nn.document_attention import (
    AttentionCall,
    DocumentSegments,
    document_segments,
    document_starts,
    whole_row_calls,
)
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.nn.profiler_regions import region
from torchmoe.plan.context import CPLayout
from torchmoe.plan.memory import compute_dtype, residual_dtype
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import microbatches, pipeline_layout
from torchmoe.preflight import train_device

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

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


def _init_distributed(device: torch.device, comm_cfg: Comm, parallelism_cfg: Parallelism, dump_folder: Path) -> int:
    """Join the launched world (torchrun sets WORLD_SIZE) with the `[comm]` init timeout, a gloo
    backend beside NCCL when host tensors are reduced (`process_groups.backend_spec`), and the
    NCCL flight recorder (its buffer, and where it dumps on a timeout); returns the world size."""
    world_size = launch_int("WORLD_SIZE", 1)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # Read by NCCL process groups when they are created; a user's own setting wins.
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(comm_cfg.trace_buf_size))
            if comm_cfg.trace_buf_size > 0:
                traces = dump_folder / comm_cfg.save_traces_folder
                traces.mkdir(parents=True, exist_ok=True)
                os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
                # NCCL appends the rank to this prefix.
                os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(traces / comm_cfg.save_traces_file_prefix))
        # FSDP CPU offload keeps sharded gradients on the host: clipping reduces them there.
        backend = backend_spec(device.type, host_collectives=parallelism_cfg.fsdp_cpu_offload)
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None,
                                timeout=timedelta(seconds=comm_cfg.init_timeout_seconds))
    return world_size


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created without a dtype inside get `dtype` (torch's default is restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class Trainer:
    """Owns the model, optimizer, data and bookkeeping of one training job on this rank.

    Args:
        cfg: the job.
        failure_watch: the multi-rank failure protocol's watch (see `train`), if any: signals
            that arrive once this rank is leaving for a failure are ignored.
        index_cache: where the data files' indexes are kept (`data.file_index`); None: the dump
            folder's `data_index`.
    """

    def __init__(self, cfg: JobConfig, *, failure_watch: FailureWatch | None = None,
                 index_cache: Path | None = None) -> None:
        self.cfg = cfg
        self.failure_watch = failure_watch
        self.device = train_device(cfg.training.device)
        world_size = _init_distributed(self.device, cfg.comm, cfg.parallelism, Path(cfg.job.dump_folder))
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
        self.replicas: ReplicaGroups | None = None  # set by `_build` under fault tolerance; `release` stops it
        try:
            if cfg.metrics.enable_log_files:
                self.log_file = LogFile.attach(self.dump_folder, self.rank, cfg.metrics.log_level)
            self._build(cfg)
        except BaseException as err:
            self.release(err)
            raise

    def _build(self, cfg: JobConfig) -> None:
        """Everything but the folders: model, optimizer, data, checkpoints (`__init__`)."""
        self.tokenizer = tokenizer = build_tokenizer(cfg.model.tokenizer_path,
                                                     key=source_key(cfg, "model.tokenizer_path"))
        self.model_args = model_args_from_config(cfg.model)
        self.batch_mesh = batch_mesh = self.mesh["batch"] if self.mesh is not None else None
        self.dp_rank = dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
        ft = cfg.fault_tolerance
        # Under fault tolerance the batch rows are split over every group's dp ranks, group
        # after group (HSDP's order, replica groups as its replicate dim); each rank keeps its
        # own rows in checkpoints, as the batch mesh spans one group only.
        groups, group = (ft.group_size, ft.replica_id) if ft.enable else (1, 0)
        self.dataloader = build_dataloader(
            cfg.training, tokenizer, dp_rank=group * self.dims.dp + dp_rank, dp_degree=groups * self.dims.dp,
            batch_mesh=None if ft.enable else batch_mesh, index_cache=self.index_cache,
        )
        # The validation data opened now, under the start's timeout: a new corpus's index is built
        # (by rank 0) before the first validation, whose collectives run under the training's.
        self._validation_corpus = None
        if cfg.validation.enable:
            self._validation_corpus = build_corpus(validation_data(cfg.training, cfg.validation),
                                                   key="validation.dataset_path", index_cache=self.index_cache)
            self._validation_loader()
        # The loss is normalised by this group's tokens: averaged over the groups of a step, it
        # is the mean over their rows (without fault tolerance: the global batch's).
        self.global_tokens = self.dataloader.global_batch_size // groups * cfg.training.seq_len
        # What the matmuls compute in, in every layout (FSDP/DDP cast the parameters to it, other
        # layouts autocast): the planner's dtype, and the peak MFU is measured against.
        self.compute_dtype = torch_dtype(compute_dtype(cfg.training))

        # The parameters' dtype (`training.dtype`): every parameter is created in the default
        # dtype, while the buffers that must stay fp32 (RoPE table, router state) say so.
        param_dtype = torch_dtype(cfg.training.dtype)
        with torch.device("meta"), _default_dtype(param_dtype):
            model = Transformer(self.model_args)
        # The stages this rank runs (the whole model without PP), each parallelized on its own.
        self.pipe = pipeline_layout(self.model_args, self.dims, cfg.parallelism, cfg.training.seq_len)
        self.pp_rank = self.mesh["pp"].get_local_rank() if self.mesh is not None else 0
        parts = split_into_stages(model, self.pipe, self.pp_rank) if self.dims.pp_enabled else [model]
        self.model_parts = [parallelize_model(part, self.dims, self.mesh, cfg, self.device) for part in parts]
        # For whatever draws from the global RNG while training; the weights do not: their values
        # come from the seed and each parameter's name, the same under every layout.
        torch.manual_seed(cfg.training.seed)
        for part in self.model_parts:
            # FSDP CPU offload keeps sharded parameters on the host; buffers still go to the device.
            part.to_empty(device="cpu" if cfg.parallelism.fsdp_cpu_offload else self.device)
            part.init_weights(seed=cfg.training.seed, buffer_device=self.device)
            part.train()
        # One model under the full model's parameter names, for optimizer, checkpoints, clipping.
        self.model = PipelineRankModel(self.model_parts) if self.dims.pp_enabled else self.model_parts[0]
        if cfg.model.print_after_conversion and self.rank == 0:
            logger.info("the model (rank 0's part) after parallelize and conversion:\n%s", self.model)
        self.moe_layers = self.model.moe_layers()
        # Row of each local MoE layer among all MoE layers of the model (metrics report them all).
        all_moe = sorted(i for i in self.model_args.moe_layer_ids if self.model_args.is_moe_layer(i))
        self.moe_rows = [all_moe.index(int(name)) for name, block in self.model.layers.items() if block.moe_enabled]
        self.n_moe_layers = len(all_moe)

        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.checkpointer = CheckpointManager(self.dump_folder, cfg.checkpoint, total_steps=cfg.training.steps,
                                              timeout=checkpoint_timeout(cfg.checkpoint, cfg.comm))
        self.state = {
            "model": ModelWrapper([self.model], flavor=cfg.model.flavor, family=cfg.model.name),
            "optimizer": OptimizerWrapper([self.model], [self.optimizer]),
            "lr_scheduler": self.scheduler,
            "dataloader": RankLocal(self.dataloader, rank=self.rank) if ft.enable else self.dataloader,
            "rng": RankLocal(RNGState(), rank=self.rank),
        }
        self.step = 0
        self.last_result: StepResult | None = None  # this process's newest step, for the closing line
        self.validation_loss: float | None = None  # the newest, for the closing line
        # The replica groups when they meet every step (fault tolerance without semi_sync_method).
        self.step_replicas: ReplicaGroups | None = None
        self.semi_sync: SemiSync | None = None
        self._recovered = False  # a peer's live state was taken since the batch was drawn
        self._quorum_joined = False  # the next attempt's quorum was joined already (`fit`)
        # What a recovering group takes, as references (`_live_refs`); None: rebuild it.
        self._live: dict | None = None
        self._group_steps: torch.Tensor | None = None  # the sum of the group's step numbers (`_reduce_loss_and_flags`)
        if ft.enable:
            quorum_s = cfg.comm.init_timeout_seconds
            self.replicas = ReplicaGroups(
                connect(ft, quorum_timeout_s=quorum_s, log_level=cfg.metrics.log_level), ft,
                layout=self._group_layout(),
                known_models=[self._model_text(name, flavor) for name, flavors in FLAVORS.items() for flavor in flavors],
                position_width=len(encode_position(self.dataloader.state_dict())), state=self._live_state,
                load=self._load_live_state, device=self.device, quorum_timeout_s=quorum_s,
                watch=watch_lighthouse(ft, self.rank, self.world_size))
            self.state["fault_tolerance"] = self.replicas
            self.state["row_positions"] = RankLocal(self.replicas.positions, rank=self.rank)
            if ft.semi_sync_method:
                self.semi_sync = SemiSync(self.replicas, ft, self._local_named_params,
                                          [(n, b) for n, b in self.model.named_buffers() if n.endswith("expert_bias")],
                                          layer_ids=range(self.model_args.n_layers + self.model_args.mtp_layers))
                self.state["semi_sync"] = RankLocal(self.semi_sync, rank=self.rank)
            else:
                self.step_replicas = self.replicas
                in_backward = ft.gradient_average == "backward" or (
                    ft.gradient_average == "auto" and ft.process_group == "nccl")
                if not in_backward:
                    where = "after the backward"
                elif self.replicas.attach(self.model_parts):
                    where = "inside FSDP's backward"
                else:
                    where = "after the backward (no FSDP in the group)"
                if self.rank == 0:
                    logger.info("gradients are averaged across replica groups %s", where)
        self.loss_parallel = self.dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
        # Sliced once: slicing a DeviceMesh builds a new one from its rank tensor every time.
        self.tp_mesh = self.mesh["tp"] if self.mesh is not None else None
        # This rank's share in sums of the loss over the world: only tp-coordinate 0 counts it,
        # since its TP peers hold the same value.
        self.loss_weight = 1.0 if self.mesh is None or self.tp_mesh.get_local_rank() == 0 else 0.0
        self._stop_signal: int | None = None
        self.pp_microbatches = microbatches(cfg.training, cfg.parallelism)[0] if self.dims.pp_enabled else 1
        # Context parallelism: the columns of each sequence this rank trains on (its head-tail pieces).
        self.cp_positions = torch.tensor(CPLayout(cfg.training.seq_len, self.dims.cp).positions(
            self.mesh["cp"].get_local_rank())) if self.dims.cp_enabled else None
        self.schedule = self._build_schedule() if self.dims.pp_enabled else None

    def _build_schedule(self):
        """torch's pipeline schedule over this rank's stages (see `distributed/pipeline_parallel.py`)."""
        cfg, args = self.cfg, self.model_args
        tp = self.dims.tp
        hidden_dtype = torch_dtype(residual_dtype(self.dims, cfg.training))
        metas = lambda stage: stage_io_metas(
            self.pipe, stage, microbatch=cfg.training.local_batch_size // self.pp_microbatches,
            seq_len=cfg.training.seq_len // self.dims.cp, seq_shards=tp, dim=args.dim,
            vocab_local=args.vocab_size // tp if self.loss_parallel else args.vocab_size,
            hidden_dtype=hidden_dtype, logits_dtype=self.compute_dtype)
        return build_schedule(self.model_parts, self.pipe, self.mesh["pp"], cfg.parallelism.pipeline_parallel_schedule,
                              n_microbatches=self.pp_microbatches, loss_fn=self._loss, io_metas=metas,
                              device=self.device)

    # ---- setup ---------------------------------------------------------------------------------

    def load_initial_state(self) -> None:
        """Resume from the newest complete checkpoint, else load `initial_load_path` if set; then,
        the run being known to go ahead, write its files (`_write_run_files`)."""
        resumed = self.checkpointer.load_latest(self.state)
        if resumed is not None:
            self.step = resumed
        else:
            self._load_initial_weights()
        if self.replicas is not None:
            # Where this group's rows start when a recovery finds no position it committed.
            self._start_position = self.dataloader.state_dict()
        if self.semi_sync is not None and resumed is None:
            self.semi_sync.anchor_here()  # the initial weights may have been loaded just now
        self._write_run_files(resumed=resumed is not None)

    def _load_initial_weights(self) -> None:
        if self.cfg.checkpoint.initial_load_path:
            load_initial_weights(self.cfg.checkpoint, self.cfg.model.flavor, self.model_args, self.model,
                                 key=source_key(self.cfg, "checkpoint.initial_load_path"))

    def _write_run_files(self, *, resumed: bool) -> None:
        """Write config.toml and run_info.json (rank 0) and open every rank's log file, once nothing
        can refuse the run any more: a refused run leaves the folder as it found it. A run that
        resumed no checkpoint must not cut another run's metrics (`metrics.check_history`); rank
        0 decides for every rank.

        Raises:
            ConfigError: on every rank, from `check_history`.
        """
        one_reads(lambda: None if resumed else check_history(self.dump_folder, self.cfg))
        if self.rank == 0:
            write_config_toml(self.cfg, self.dump_folder / "config.toml")
            write_run_info(self.dump_folder, world_size=self.world_size)
        if self.log_file is not None:  # after the files a resume needs, on a disk nearly full
            self.log_file.open()

    @property
    def _token_shards(self) -> int:
        """Ranks among which one global batch's tokens are split for the MoE router: dp and cp,
        and tp when EP spans it (each TP rank then routes its own sequence shard)."""
        return self.dims.dp * self.dims.cp * (self.dims.tp if self.dims.ep_enabled else 1)

    def _set_aux_loss_scale(self, micro_batches: int) -> None:
        # Auxiliary losses are means per micro-batch (of the pipeline too) and token shard;
        # gradients are summed over shards and micro-batches, so each contributes
        # 1 / (micro-batches * shards).
        for moe in self.moe_layers:
            moe.aux_loss_grad_scale = 1.0 / (micro_batches * self.pp_microbatches * self._token_shards)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the global mean loss: its summed token losses over the token
        count of the whole global batch, so summing over micro-batches and dp ranks gives exactly
        the global mean. Runs inside `loss_parallel()` when the logits are vocab-sharded.

        Args:
            logits: (B, S, V) or, with loss parallel, this rank's (B, S, V / tp) vocab shard.
            labels: (B, S) int64.
        """
        return self._summed_loss(logits, labels) / self.global_tokens

    def _forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor,
                      documents: DocumentSegments | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward on one micro-batch: (its share of the objective, for the backward;
        the shares of the losses logged, detached). The objective is the main loss (`_loss`); with
        multi-token prediction modules, plus ``mtp_loss_coeff`` times their mean loss, each depth's
        summed over its targets (`models.decoder.mtp`) over the same global token count. Logged:
        the main loss alone (what validation and `eval` compute), then the modules' mean loss
        (a plain (2,) tensor; without the modules the objective itself)."""
        if not self.model_args.mtp_layers:
            loss = self._loss(self.model(inputs, documents), labels)
            return loss, loss.detach()
        logits, depths = self.model(inputs, documents, labels=labels)
        main = self._summed_loss(logits, labels)
        mtp = sum(self._summed_loss(out, mtp_targets(labels, k)) for k, out in enumerate(depths, start=1))
        scale = self.model_args.mtp_loss_coeff / len(depths)
        whole = [t.detach().full_tensor() if isinstance(t, DTensor) else t.detach() for t in (main, mtp)]
        logged = torch.stack([whole[0], whole[1] / len(depths)]) / self.global_tokens
        return (main + scale * mtp) / self.global_tokens, logged

    def _summed_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's token losses summed (fp32 cross entropy); shapes as in `_loss`."""
        if self.loss_parallel:
            logits = DTensor.from_local(logits, self.tp_mesh, [Shard(-1)], run_check=False)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

    # ---- one step --------------------------------------------------------------------------------

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate the gradients of this rank's micro-batches; returns this rank's shares of
        the global losses logged (`_forward_loss`: (main,), or (main, multi-token prediction);
        summed over dp ranks each is the global mean).

        Args:
            micro_batches: (inputs, labels) pairs, each (local_batch_size, seq_len) int64.
        """
        self._set_aux_loss_scale(len(micro_batches))
        local_loss = torch.zeros(1 + (self.model_args.mtp_layers > 0), device=self.device)
        # Every micro-batch's copy to the device starts now: later ones arrive during earlier ones' compute.
        with region("data"):
            micro_batches = [self._local_columns(inputs, labels) for inputs, labels in micro_batches]
        for i, (inputs, labels, documents) in enumerate(micro_batches):
            self._sync_replicas(last=i == len(micro_batches) - 1)
            with loss_parallel() if self.loss_parallel else nullcontext():
                if self.schedule is not None:
                    losses = self._pipeline_step(inputs, labels, documents)
                else:
                    objective, logged = self._forward_loss(inputs, labels, documents)
                    objective.backward()
                    losses = [logged]
            for loss in losses:
                local_loss += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        return local_loss

    @torch.no_grad()
    def validate(self) -> float:
        """The mean token loss of the model as it is over the validation batches (`[validation]`):
        `steps` batches, or with -1 every complete batch of one pass over the data, the same
        batches each time. Runs the training layout's forward without gradients; the routed-token
        counts the next bias update reads are left as they were.

        Every rank draws its rows of each batch; they agree before each forward whether one ran
        out of data (one flag in an all-reduce), so all stop at the same batch.
        """
        val = self.cfg.validation
        loader = self._validation_loader()
        counts = [moe.tokens_per_expert.clone() for moe in self.moe_layers]
        total = torch.zeros((), device=self.device)
        batches = 0
        while val.steps == -1 or batches < val.steps:
            try:
                micro_batches, ended = loader.next_batch(), 0.0
            except CorpusEnd:
                micro_batches, ended = [], 1.0
            flag = torch.tensor(ended, device=self.device)
            if self.mesh is not None:
                dist.all_reduce(flag)
            if flag.item():
                break
            for inputs, labels in micro_batches:
                inputs, labels, documents = self._local_columns(inputs, labels)
                with loss_parallel() if self.loss_parallel else nullcontext():
                    loss = self._summed_loss(self.model(inputs, documents), labels)
                total += self.loss_weight * (loss.full_tensor() if isinstance(loss, DTensor) else loss)
            batches += 1
        for moe, saved in zip(self.moe_layers, counts):
            moe.tokens_per_expert.copy_(saved)
        if self.mesh is not None:
            dist.all_reduce(total)
        if not batches:
            raise ConfigError("validation.dataset", val.dataset, "holds less than one batch "
                              f"({loader.global_batch_size} rows of {val.seq_len + 1} tokens)",
                              "use more validation data, or a smaller validation.local_batch_size / seq_len")
        return total.item() / (batches * loader.global_batch_size * val.seq_len)

    def _collective_timeout(self, seconds: int) -> None:
        """Every group of the mesh (and the default one) times collectives out after `seconds`."""
        set_timeout(seconds, [None, *self.mesh.groups()], self.device)

    def _validation_loader(self) -> DataLoader:
        """A loader of the validation data from its start (one pass); its corpus is built once."""
        val = self.cfg.validation
        return build_dataloader(validation_data(self.cfg.training, val), self.tokenizer, dp_rank=self.dp_rank,
                                dp_degree=self.dims.dp, batch_mesh=self.batch_mesh, repeat=False,
                                corpus=self._validation_corpus)

    def _local_columns(self, inputs: torch.Tensor,
                       labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DocumentSegments | None]:
        """This rank's columns of a (B, seq_len) micro-batch (its CP pieces; all without CP), on
        its device, and with `training.document_masking` the segment tables of every attention
        call this rank's layers make (`nn.document_attention.document_segments`), else None.
        The tables come from the whole rows' token ids, on the host, before they travel (a
        piece's first document may begin in an earlier piece): no layer reads a device value
        for them. Every rank of a pipeline derives them from the same batch, so stages without
        the token ids get each micro-batch's own. Validation batches have training's seq_len
        under CP (`preflight`).

        To a GPU the copy is asynchronous: from pinned host memory, with ``non_blocking``, so the
        host goes on queueing work while the batch travels (the stream orders its use)."""
        documents = None
        if self.cfg.training.document_masking:
            documents = document_segments(document_starts(inputs, self.tokenizer.eos_id),
                                          self._attention_calls(inputs.shape[-1]), self.device)
        columns = (inputs, labels)
        if self.cp_positions is not None:
            columns = tuple(t[:, self.cp_positions] for t in columns)
        if self.device.type == "cuda":
            inputs, labels = (t.pin_memory().to(self.device, non_blocking=True) for t in columns)
        else:
            inputs, labels = (t.to(self.device) for t in columns)
        return inputs, labels, documents

    def _attention_calls(self, seq_len: int) -> list[AttentionCall]:
        """The kinds of attention call this rank's layers make on rows of `seq_len` tokens: one
        per chunk size of the model, per local CP piece under CP."""
        chunks = self.model_args.attention_chunks()
        if not self.dims.cp_enabled:
            return whole_row_calls(chunks, seq_len)
        layout = CPLayout(seq_len, self.dims.cp)
        return [AttentionCall(*call) for call in layout.attention_calls(self.mesh["cp"].get_local_rank(), chunks)]

    def _sync_replicas(self, *, last: bool) -> None:
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

    def _pipeline_step(self, inputs: torch.Tensor, labels: torch.Tensor,
                       documents: DocumentSegments | None) -> list[torch.Tensor]:
        """Forward and backward of one local batch through the pipeline schedule; returns the
        pipeline micro-batches' losses on the rank holding the last stage, else nothing. The
        document segment tables go to every stage as a keyword argument, which the schedule
        splits into micro-batches along the rows as it splits the inputs (they are a pytree)."""
        losses: list[torch.Tensor] = []
        first, last = self.pipe.has_first_stage(self.pp_rank), self.pipe.has_last_stage(self.pp_rank)
        args = (inputs,) if first else ()
        kwargs = {"documents": documents} if documents is not None else {}
        self.schedule.step(*args, target=labels if last else None, losses=losses if last else None,
                           return_outputs=False, **kwargs)
        return losses

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """`forward_backward`, then agree on the loss and on stopping, clip, step, and update the
        MoE biases. The host reads device values once per step (loss, stop flag, norm together).

        Raises:
            TrainingDiverged: the global loss or gradient norm is not finite (nothing was
                stepped, so the model still holds the previous step's weights).
        """
        global_losses, stop_flag, bad_bias = self._reduce_loss_and_flags(self.forward_backward(micro_batches))
        global_loss, mtp = global_losses[0], list(global_losses[1:])  # under fault tolerance: the group's MTP loss
        counts = self._moe_counts()
        if self.step_replicas is not None:
            # Across the step's replica groups before clipping, so every group clips and steps
            # alike: the gradients (averaged in the backward, or here), the loss, the token
            # counts, and where this group's rows stand after the step's batch.
            global_loss, counts = self.step_replicas.reduce(global_loss, counts, self._local_grads,
                                                            encode_position(self.dataloader.state_dict()))
        max_norm = self.cfg.training.max_norm
        with region("optimizer"):
            grad_norm = clip_grad_norm_(list(self.model.parameters()), max_norm if max_norm > 0 else float("inf"),
                                        pp_mesh=self.mesh["pp"] if self.dims.pp_enabled else None)
        steps = [self._group_steps] if self.replicas is not None and self.mesh is not None else []
        values = torch.stack([global_loss, stop_flag, grad_norm.to(global_loss), bad_bias, *mtp, *steps]).tolist()
        loss, stop, norm, bad_bias = values[:4]
        mtp_loss, group_steps = (values[4] if mtp else None), values[4 + len(mtp):]
        if group_steps and group_steps[0] != self.step * self.world_size:
            raise RuntimeError(f"this rank is at step {self.step} and other ranks of its replica group are not (a "
                               "recovery failed on some of them): the group stops; launch it again and it takes "
                               "the live state from a healthy group")
        lr = self.scheduler.get_last_lr()[0]
        if self.step_replicas is not None and not self.step_replicas.commit(self.step + 1):
            # A peer failed during the step, or too few groups took part: nothing is stepped.
            self.optimizer.zero_grad(set_to_none=True)
            for moe in self.moe_layers:
                moe.tokens_per_expert.zero_()
            return StepResult(loss, norm, lr, stop > 0, None, committed=False,
                              participants=self.step_replicas.contributors, mtp_loss=mtp_loss)
        if bad_bias:  # set by the previous step's update, which no save has seen yet
            raise TrainingDiverged(f"an MoE expert bias is not finite after step {self.step}: stopping without "
                                   "saving; lower model.load_balance_coeff")
        for name, value in (("loss", loss), ("gradient norm", norm)):
            if not math.isfinite(value):
                raise TrainingDiverged(f"{name} is {value} at step {self.step + 1}: stopping without saving; "
                                       "lower optimizer.lr or check the data")
        try:
            self.optimizer.step()
        except RuntimeError as err:
            # An update too large for the parameters' dtype (an absurd LR): torch refuses the
            # scalar before writing it, on every rank alike.
            if "overflow" not in str(err):
                raise
            raise TrainingDiverged(f"the optimizer update overflows at step {self.step + 1} ({err}): stopping "
                                   "without saving; lower optimizer.lr") from None
        precompute_float8_scales([self.model], self.cfg.float8)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        counts = self._update_moe_biases(counts)
        return StepResult(loss, norm, lr, stop > 0, counts,
                          participants=self.step_replicas.contributors if self.step_replicas is not None else 1,
                          mtp_loss=mtp_loss)

    def _local_named_params(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter as this rank holds it (a DTensor's local shard) with its name, in the
        model's order."""
        return [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in self.model.named_parameters()]

    def _local_grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient as this rank holds it (a DTensor's local shard), in the
        model's order; a parameter without one gets zeros, so that every group's list lines up."""
        grads = []
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad)
        return grads

    def _reduce_loss_and_flags(self, local_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sum the losses (`forward_backward`'s) over data-parallel ranks and agree on stopping and
        on the expert biases being finite, in one all-reduce. Returns (losses, stop flag,
        non-finite bias flag).

        Only the tp-coordinate-0 rank of each TP group contributes the loss (its TP peers hold
        the same value; under PP only ranks holding the last stage have a nonzero one); any rank
        that caught SIGTERM/SIGINT raises the stop flag for all, so every rank stops (and saves,
        collectively) after the same step. Under PP each stage checks its own layers' biases.
        """
        flag = torch.tensor(float(self._stop_signal is not None), device=self.device)
        biases = [m.expert_bias for m in self.moe_layers]
        bad_bias = (~torch.isfinite(torch.cat(biases))).any().float() if biases else torch.zeros_like(flag)
        if self.mesh is None:
            return local_loss, flag, bad_bias
        # The step number rides along under fault tolerance: a recovery that failed on some ranks
        # of a group (its sender died mid-transfer) leaves the others on the peer's step, and
        # torchft cannot bring such a group back together.
        step = [torch.tensor(float(self.step), device=self.device)] if self.replicas is not None else []
        buf = torch.cat([local_loss * self.loss_weight, torch.stack([flag, bad_bias, *step])])
        dist.all_reduce(buf)
        n = local_loss.numel()
        if step:  # read with the step's other values (`train_step`)
            self._group_steps = buf[n + 2]
        return buf[:n], buf[n], buf[n + 1]

    def _moe_counts(self) -> torch.Tensor | None:
        """This step's (L_local, E) token counts of the local MoE layers, summed over every rank
        that routes other tokens (within the replica group); None without local MoE layers."""
        if not self.moe_layers:  # a pipeline stage may have none
            return None
        counts = torch.stack([m.tokens_per_expert for m in self.moe_layers])  # (L_local, E)
        if self.mesh is not None and self.dims.dp * self.dims.cp > 1:
            dist.all_reduce(counts, group=self.mesh["loss"].get_group())
        if self.mesh is not None and self.dims.ep_enabled and self.dims.tp_enabled:
            dist.all_reduce(counts, group=self.tp_mesh.get_group())
        return counts

    def _update_moe_biases(self, counts: torch.Tensor | None) -> torch.Tensor | None:
        """Update every local layer's bias from `counts` (`_moe_counts`), identically on all
        replicas of its stage. Returns the (n_moe_layers, n_experts) counts of every MoE layer of
        the model (under PP gathered over pp)."""
        if not self.n_moe_layers:
            return None
        if counts is not None:
            update_expert_bias(self.moe_layers, list(counts))
        if not self.dims.pp_enabled:
            return counts
        # Every MoE layer lives on exactly one pp rank: a sum over pp assembles all of them.
        full = torch.zeros(self.n_moe_layers, self.model_args.num_experts, device=self.device)
        if counts is not None:
            full[self.moe_rows] = counts
        dist.all_reduce(full, group=self.mesh["pp"].get_group())
        return full

    # ---- fault tolerance ------------------------------------------------------------------------

    def _group_layout(self) -> GroupLayout:
        """What every replica group must share with this one (`replica_state.GroupLayout`)."""
        cfg = self.cfg
        return GroupLayout(model=self._model_text(cfg.model.name, cfg.model.flavor),
                           degrees=self.dims.degrees, ranks=self.world_size, seq_len=cfg.training.seq_len,
                           local_batch_size=cfg.training.local_batch_size,
                           global_batch_size=self.dataloader.global_batch_size)

    def _model_text(self, name: str, flavor: str) -> str:
        """Family `name`'s `flavor` with this run's dtype and MTP layers, as `GroupLayout.model`."""
        mtp = f", {self.model_args.mtp_layers} MTP layers" if self.model_args.mtp_layers else ""
        return f"{name}/{flavor}, {self.cfg.training.dtype}{mtp}"

    def _live_refs(self) -> dict:
        """References to this rank's weights and optimizer state as plain tensors (DTensors'
        local shards: `replica_state.local_tensors`), built on the training thread. The tensors
        are updated in place by every step, so the references stay valid until a load replaces
        them or the optimizer creates its state (its first step): then `_live` is rebuilt."""
        # An optimizer that never stepped has no state to send; asking DCP for it would create
        # some (it takes a zero step to build the moments: Adam's step count would then be off by one).
        optimizer = local_tensors(self.state["optimizer"].state_dict()) if self.optimizer.state else {}
        return {"model": local_tensors(self.state["model"].state_dict()), "optimizer": optimizer,
                "optimizer_states": len(self.optimizer.state)}

    def _refresh_live_refs(self) -> None:
        """Rebuild `_live` when a load or the optimizer's first step replaced tensors it holds."""
        if self._live is None or self._live["optimizer_states"] != len(self.optimizer.state):
            self._live = self._live_refs()

    def _live_state(self) -> dict:
        """What a recovering replica group takes from this rank: weights, optimizer, schedule
        and step. torchft may call this on its own thread during the forward, when nothing is
        being updated: only references (`_live`) and small values are read."""
        live = self._live
        return {"model": live["model"], "optimizer": live["optimizer"],
                "lr_scheduler": self.scheduler.state_dict(), "step": self.step,
                "semi_sync": self.semi_sync.state_dict() if self.semi_sync is not None else {}}

    def _optimizer_template(self) -> dict:
        """This rank's optimizer state dict (DCP's flattened form), with the state a peer sends:
        an optimizer that never stepped gets it from DCP, which builds it by a zero step only
        when no parameter holds a gradient. With the asynchronous quorum a recovery runs after
        the backward, so the gradients wait aside meanwhile."""
        params = list(self.model.parameters())
        grads = [p.grad for p in params]
        if not self.optimizer.state:
            for p in params:
                p.grad = None
        try:
            return self.state["optimizer"].state_dict()
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad

    def _load_live_state(self, state: dict, position: list[float] | None) -> None:
        """Take a healthy peer's `_live_state`, and move this group's rows to `position`, where
        they stood after its last step that counted (the start position if none did)."""
        self.state["model"].load_state_dict(like(self.state["model"].state_dict(), state["model"]))
        if state["optimizer"]:
            self.state["optimizer"].load_state_dict(like(self._optimizer_template(), state["optimizer"]))
        self.scheduler.load_state_dict(state["lr_scheduler"])
        # The peer's optimizer state may carry the learning rate of the step its references were
        # taken at; the schedule's says what it is now.
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        if self.semi_sync is not None:
            self.semi_sync.load_state_dict(state["semi_sync"])
        logger.info("recovered the live state of step %d from a healthy replica group (this group was at step %d)",
                    state["step"], self.step)
        self.step = state["step"]
        loader = self.dataloader.state_dict()
        self.dataloader.load_state_dict(decode_position(position, loader) if position is not None
                                        else self._start_position)
        self._live = None
        self._recovered = True

    # ---- the loop ---------------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        """Note SIGTERM/SIGINT; the stop is agreed in the step's all-reduce and announced then
        (`_announce_stop`). Not at once: torchrun's agent terminates the survivors of a worker
        that died, and their next collective, failing on the dead peer, tells them so."""
        if self.failure_watch is not None and self.failure_watch.failure is not None:
            # This rank is leaving for a failure already (and exits within the watch's grace
            # whatever happens).
            return
        self._stop_signal = signum

    def _announce_stop(self) -> None:
        """Every rank agreed to stop after this step: the rank that caught the signal says so
        (whether a checkpoint follows is said by the save, or by why there is none)."""
        if self._stop_signal is not None:
            logger.warning("received %s: stopping after step %d", signal.Signals(self._stop_signal).name, self.step)

    def fit(self) -> None:
        cfg = self.cfg
        steps = cfg.training.steps
        flops_per_token = self.model_args.flops_per_token(cfg.training.seq_len)
        if self.replicas is not None:
            # The first quorum before the metrics logger starts: a group that is behind takes a
            # peer's live state now, and the progress bar and ETA start at its step. (Its records
            # of the steps it committed before stay either way: the file is cut only from the
            # first step logged, as an asynchronous quorum recovers later, at a commit.)
            self._refresh_live_refs()
            self.replicas.begin_step()
            self._quorum_joined = True
            if self.semi_sync is not None:  # the groups meet again at the first sync
                self.replicas.commit(self.step)
        metrics = MetricsLogger(self.dump_folder, cfg.metrics, rank=self.rank, total_steps=steps,
                                peak_flops=device_peak_flops(self.device, self.compute_dtype), start_step=self.step,
                                run_config=asdict(cfg))
        self._say(metrics, self._opening())
        if self.step > 0:
            logger.info("resuming at step %d", self.step + 1)
        if self.rank == 0:  # decided once per device, dtype and head dim (`nn.attention_kernels`)
            logger.info("%s", describe_kernel(self.device, self.compute_dtype, self.model_args.head_dim))
        warmup = cfg.lr_scheduler.warmup_steps
        if warmup >= steps and self.rank == 0:
            logger.warning("lr_scheduler.warmup_steps (%d) >= training.steps (%d): the learning rate never reaches "
                           "optimizer.lr in this run", warmup, steps)
        with ExitStack() as stack:
            for sig in (signal.SIGTERM, signal.SIGINT):  # the caller's handlers come back at the end
                stack.callback(signal.signal, sig, signal.signal(sig, self._on_signal))
            # Before they come back, when a failure ends the loop: a signal then (torchrun's agent
            # stopping the survivors of a dead rank) must not replace the failure's report.
            stack.push(lambda exc_type, exc, tb: leaving_for_failure() if exc_type is not None else None)
            stack.push(self._close_checkpointer)
            stack.callback(metrics.close)
            prof = stack.enter_context(maybe_profile(cfg.profiling, self.dump_folder, rank=self.rank,
                                                     start_step=self.step))
            mem = stack.enter_context(maybe_memory_snapshot(cfg.profiling, self.dump_folder, rank=self.rank,
                                                            start_step=self.step))
            collector = GarbageCollection(cfg.training.gc_freq)
            stack.callback(collector.close)
            window = ThroughputWindow()
            began, first_step, stopped = time.perf_counter(), self.step, False
            first = True  # this process's first step (a recovering replica group's step number jumps)
            first_validation = True
            validation_graphs, warned_recompiles = 0, False  # compile: graphs of validation's forwards
            compiled_before = DynamoCounts.now()
            while self.step < steps:
                t0 = time.perf_counter()
                ep_bytes = ep_bytes_moved(self.model) if self.dims.ep_enabled else 0
                result = self.last_result = self._committed_step()
                self.step += 1
                # This step's waits on and traffic to other groups (its failed attempts' included).
                ft_report = self.replicas.take_report() if self.replicas is not None else {}
                extra = {}
                if self.semi_sync is not None:
                    # A group's rows count as trained once a sync commits: its position rides in it.
                    self._refresh_live_refs()
                    synced = self.semi_sync.after_step(self.step, encode_position(self.dataloader.state_dict()))
                    if synced is not None:
                        extra = {**synced, "ft_participants": self.replicas.contributors}
                step_s = time.perf_counter() - t0
                window.add(self.global_tokens, step_s)
                if self.dims.ep_enabled:
                    extra["ep_all_to_all_gib"] = (ep_bytes_moved(self.model) - ep_bytes) / 2**30
                opening = first
                if first:
                    if first_step > 0:  # the report marks where the curves continue a checkpoint
                        extra["resumed_from"] = first_step
                    if self.mesh is not None:  # loading, compile and warm-up are done
                        self._collective_timeout(cfg.comm.train_timeout_seconds)
                    if cfg.compile.enable:
                        extra.update(self._compile_report(DynamoCounts.now().since(compiled_before), step_s))
                        compiled_before, validation_graphs = DynamoCounts.now(), 0
                elif cfg.compile.enable:
                    # Graphs compiled by training steps after the first (a guard that fails from
                    # step to step recompiles, until dynamo's limit leaves the code eager).
                    extra["compile_recompiles"] = DynamoCounts.now().since(compiled_before).graphs - validation_graphs
                    if extra["compile_recompiles"] and not warned_recompiles and self.rank == 0:
                        warned_recompiles = True
                        logger.warning("torch.compile compiled %d more graphs after the first step (a guard failed; "
                                       "TORCH_LOGS=recompiles says which): those steps ran slower",
                                       extra["compile_recompiles"])
                first = False
                validating = cfg.validation.enable and self.step % cfg.validation.freq == 0
                if validating:  # after the step's timing and traffic: its numbers are the training's
                    # The first one compiles the model's forward without gradients, its ranks
                    # apart by more than training's timeout allows: it runs under the start's.
                    longer = first_validation and self.mesh is not None
                    if longer:
                        self._collective_timeout(cfg.comm.init_timeout_seconds)
                    before_validation = DynamoCounts.now()
                    extra["validation_loss"] = self.validation_loss = self.validate()
                    validation_graphs += DynamoCounts.now().since(before_validation).graphs  # no_grad: its own
                    if longer:
                        self._collective_timeout(cfg.comm.train_timeout_seconds)
                    first_validation = False
                # The main loss (validation's and eval's), and apart the MTP modules' (in the objective).
                losses = {"loss": result.loss, **({"mtp_loss": result.mtp_loss} if result.mtp_loss is not None else {})}
                if validating or metrics.should_log(self.step) or opening:
                    tokens_per_sec = window.take()
                    if cfg.training.dataset_mix:  # tokens fed by each source since the run began
                        extra.update({f"tokens/{name}": count
                                      for name, count in self.dataloader.tokens_by_source().items()})
                    metrics.log(self.step, {**extra,
                        **losses,
                        "grad_norm": result.grad_norm,
                        "lr": result.lr,
                        "tokens_per_sec": tokens_per_sec,
                        "tflops": flops_per_token * tokens_per_sec / self.dims.world_size / 1e12,
                        "memory_gib": peak_memory_gib(self.device),
                        **({"ft_participants": result.participants, **ft_report}
                           if self.step_replicas is not None else {}),
                    }, tokens_per_expert=result.tokens_per_expert)
                    reset_peak_memory(self.device)
                else:  # the numbers the step read anyway, so that curves hold every step
                    metrics.record_step(self.step, {**losses, "grad_norm": result.grad_norm, "lr": result.lr})
                if result.stop:  # agreed by all ranks: a rank's own signal may arrive later
                    self._announce_stop()
                    if self.checkpointer.writes:
                        self._checkpoint(stopping=True)
                    else:
                        why = "checkpoint.load_only is true" if cfg.checkpoint.enable else "checkpoint.enable is false"
                        logger.warning("%s: stopping at step %d without a checkpoint", why, self.step)
                    stopped = True
                    break
                self._checkpoint(stopping=False)
                collector.step(self.step)
                prof.step()
                mem.step()
        # After the stack: an asynchronous save has finished, so the closing line names it.
        if stopped:
            self._say(metrics, self._closing(first_step, time.perf_counter() - began))
            return
        if cfg.checkpoint.last_save_in_hf:
            self._save_hf()
        self._say(metrics, self._closing(first_step, time.perf_counter() - began))
        metrics.require_written()  # last: records held back by a full disk did not stop training

    def _opening(self) -> str:
        """The run's first console lines: its description, what trains where, where it writes."""
        cfg, counts = self.cfg, self.model_args.param_counts()
        tokens = self.dataloader.global_batch_size * cfg.training.seq_len
        steps = f"steps {self.step + 1}-{cfg.training.steps}, {tokens:,} tokens each" if self.step < cfg.training.steps \
            else f"finished at step {self.step} already, nothing to train (raise training.steps to train on)"
        line = (f"training {cfg.model.name} {cfg.model.flavor} ({counts['total'] / 1e6:,.1f} M parameters, "
                f"{counts['active'] / 1e6:,.1f} M active) on {self.world_size} x {self.device.type}: {steps}; "
                f"writing to {self.dump_folder}")
        return f"{cfg.job.description}\n{line}" if cfg.job.description else line

    def _say(self, metrics: MetricsLogger, text: str) -> None:
        """`text` on rank 0's console (`MetricsLogger.say`) and in this rank's log file."""
        metrics.say(text)
        if self.log_file is not None:
            self.log_file.note(text)

    def _closing(self, first_step: int, seconds: float) -> str:
        """The run's last console line: how far it got, its loss, time and throughput, and where
        its metrics, log files and newest checkpoint are."""
        result = self.last_result
        if result is None:
            return f"no step trained; {self.dump_folder} holds what the run wrote"
        trained = self.step - first_step
        tokens = trained * self.dataloader.global_batch_size * self.cfg.training.seq_len
        val = self.validation_loss
        saved = self.checkpointer.complete_checkpoints() if self.checkpointer.folder.is_dir() else []
        where = f"metrics in {self.dump_folder / METRICS_FILE}" + \
            (f", logs in {self.log_file.path.parent}" if self.log_file is not None else "") + \
            (f", newest checkpoint {saved[-1][1]}" if saved else "")
        return (f"{'done' if self.step == self.cfg.training.steps else 'stopped'}: step {self.step}/"
                f"{self.cfg.training.steps}, loss {result.loss:.4f}"
                + (f", validation loss {val:.4f}" if val is not None else "")
                + f"; {trained} steps in {seconds:,.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s); {where}")

    def _committed_step(self) -> StepResult:
        """Draw a batch and train on it; under fault tolerance join each attempt's quorum first
        and try again until the quorum commits: with the same batch, or with the next rows of
        this group once it took a peer's live state (`_load_live_state` moved its rows)."""
        batch = None
        while True:
            if self.step_replicas is not None and not self._quorum_joined:
                self._refresh_live_refs()
                self.step_replicas.begin_step()
            self._quorum_joined = False
            if batch is None or self._recovered:
                self._recovered = False
                with region("data"):
                    batch = self.dataloader.next_batch()
            result = self.train_step(batch)
            if result.committed:
                return result
            logger.warning("step %d was not committed: a replica group failed during it, or fewer than "
                           "fault_tolerance.min_replica_size (%d) took part (%d did); trying it again",
                           self.step + 1, self.cfg.fault_tolerance.min_replica_size, result.participants)

    def _compile_report(self, compiled: DynamoCounts, step_s: float) -> dict[str, float]:
        """Log what the first step compiled; the metrics record's keys for it. Under EP each MoE
        block breaks once, at the split sizes' host read (`distributed/compile.py`)."""
        if self.rank == 0:
            logger.info("torch.compile: %d graphs, %d graph breaks; the first step took %.1f s, compilation "
                        "included", compiled.graphs, compiled.graph_breaks, step_s)
        return {"compile_graphs": compiled.graphs, "compile_graph_breaks": compiled.graph_breaks,
                "first_step_s": step_s}

    def _checkpoint(self, *, stopping: bool) -> None:
        """After each step: save when due (or `stopping` for a signal), if the state is finite
        on every rank (else `TrainingDiverged`: the save checks it); else make a finished async
        save visible.

        A save that fails mid-run (disk full, permissions changed) is reported and training
        goes on: the state in memory is intact and the next interval tries again. When it was
        the run's last save, the run ends with that error (`ConfigError`: exit 2), naming the
        checkpoint it can resume from.
        """
        last = stopping or self.step == self.cfg.training.steps
        due = stopping or self.checkpointer.should_save(self.step)
        if due:
            try:  # an earlier async save still in flight: its failure is not this step's
                self.checkpointer.wait()
            except SaveFailed as err:
                self._save_failed(err, last=False)
        try:
            if stopping:
                self.checkpointer.save(self.step, self.state)
            else:
                self.checkpointer.maybe_save(self.step, self.state)
            if due and last:
                self.checkpointer.wait()  # an async last save must be on disk before the run ends
        except SaveFailed as err:
            self._save_failed(err, last=last)
        except NonFiniteValues as err:  # the save checked every rank's state: nothing was written
            raise self._diverged(err, "saving") from None

    def _save_failed(self, err: SaveFailed, *, last: bool) -> None:
        """Report a failed save: fatal (`ConfigError`) when it was the run's last, else one line."""
        newest = self.checkpointer.complete_checkpoints()
        resume = f"the newest checkpoint on disk is {newest[-1][1]}" if newest else "no checkpoint is on disk"
        if last:
            raise ConfigError("checkpoint.folder", str(self.checkpointer.folder), f"{err}; {resume}",
                              "free space or fix permissions there, then run again to resume") from None
        if self.rank == 0:  # every rank has the same error (the save agreed on it): one line
            logger.error("%s; training goes on (the state in memory is intact, the next save is attempted at its "
                         "interval); %s", err, resume)

    def _diverged(self, err: NonFiniteValues, doing: str) -> TrainingDiverged:
        """The state became non-finite in training (what is loaded is checked: `components.finite`);
        the fix names the setting behind the tensors `err` names."""
        fix = "lower model.load_balance_coeff" if any("expert_bias" in n for n in err.names) else "lower optimizer.lr"
        return TrainingDiverged(f"the model or optimizer state is not finite after step {self.step} ({err}): "
                                f"stopping without {doing}; {fix}")

    def _close_checkpointer(self, exc_type, exc, tb) -> bool:
        """Leaving the loop: finish the async save in flight when every rank leaves together
        (done, stopped by a signal, or diverged: the loss is global, so all ranks stop at the
        same step). After any other error this rank leaves alone, and waiting for the save is a
        collective its peers never join."""
        if exc is None or isinstance(exc, TrainingDiverged):
            self.checkpointer.close()
        return False  # never swallows the exception

    def _save_hf(self) -> None:
        """Write the weights as a Hugging Face folder, each rank writing its own shards, with the
        tokenizer's files (`components.tokenizer_files`; none for the byte tokenizer); not
        when they are non-finite (`TrainingDiverged`: the last step's update, unchecked by a save
        when checkpointing is off). Visible only once complete (`CheckpointManager.save_export`);
        a failed write is the run's last error (`_save_failed`)."""
        state = get_model_state_dict(self.model)

        def write(folder: Path) -> None:
            save_hf_weights(state, self.model_args, folder, process_group=self.checkpointer.group,
                            bias_drop=hf_bias_drop(self.cfg.checkpoint))
            if self.rank == 0:  # the tokenizer beside the weights: the folder loads whole
                copy_tokenizer_files(self.cfg.model.tokenizer_path, folder)

        try:
            out = self.checkpointer.save_export(self.step, write)
        except NonFiniteValues as err:
            raise self._diverged(err, "writing Hugging Face weights") from None
        except SaveFailed as err:  # a full disk: nothing of the export is left
            self._save_failed(err, last=True)  # raises: the run's last write
        logger.info("saved Hugging Face weights to %s", out)

    def create_seed_checkpoint(self) -> None:
        """Write step-0 with the initial weights: `initial_load_path`'s when set, else freshly
        initialised ones (one process: `preflight.check_launch`)."""
        self._load_initial_weights()
        self._write_run_files(resumed=False)
        path = self.checkpointer.save_seed_checkpoint(self.state)
        logger.info("seed checkpoint written to %s", path)

    def release(self, error: BaseException | None = None) -> None:
        """Close this rank's log file, after `error` (why it leaves) if given, and free the run's
        folders for another run. Idempotent."""
        if self.log_file is not None:
            self.log_file.close(error)
        self.folder_locks.release()
        if self.replicas is not None:
            # torchft's servers and threads: a quorum thread still retrying a lighthouse that is
            # gone would hold the interpreter's exit until the quorum's timeout.
            self.replicas.shutdown()

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


def train(cfg: JobConfig) -> None:
    """Run the job `cfg` describes (the `torchmoe train` command).

    With several ranks, a rank that fails leaves alone: it enters no further collective, and the
    failure watch (`torchmoe.distributed.failure`) ends every other rank within seconds.

    Raises:
        ConfigError: a user error; also whatever the OS refuses about a file or folder the job
            reads or writes (`config.paths.user_path_faults`: turned into one before the failure
            watch takes this rank's exit status from it).
        PeerFailed: on the ranks that stopped because another rank failed.
    """
    def body(trainer: Trainer) -> None:
        if cfg.checkpoint.create_seed_checkpoint:
            trainer.create_seed_checkpoint()
        else:
            trainer.load_initial_state()
            trainer.fit()

    _with_trainer(cfg, body)


def evaluate(cfg: JobConfig, *, index_cache: Path | None = None) -> float:
    """The mean token loss over `cfg`'s validation batches (`Trainer.validate`) of the weights its
    run starts from (`checkpoint.initial_load_path`), in its layout, without training: the
    `torchmoe eval` command; the data's indexes kept in `index_cache` (`Trainer`). Failures and
    errors as `train`'s."""
    def body(trainer: Trainer) -> float:
        trainer.load_initial_state()
        return trainer.validate()

    return _with_trainer(cfg, body, index_cache=index_cache)


def _with_trainer(cfg: JobConfig, body: Callable[[Trainer], _T], *, index_cache: Path | None = None) -> _T:
    """`body(trainer)` for the job's Trainer (`index_cache` as its), joined to the launched world,
    watched for failed peers, its folders released whatever happens (`train`)."""
    paths = job_paths(cfg)
    with user_path_faults(paths):  # the comm traces folder is created here
        world_size = _init_distributed(train_device(cfg.training.device), cfg.comm, cfg.parallelism,
                                       Path(cfg.job.dump_folder))
    watch = FailureWatch.start() if world_size > 1 else None
    watch_launcher()  # a torchrun worker whose launcher is killed stops within a second
    trainer: Trainer | None = None
    try:
        with user_path_faults(paths):
            trainer = Trainer(cfg, failure_watch=watch, index_cache=index_cache)
            result = body(trainer)
    except TrainingDiverged as err:
        trainer.close(err)  # every rank diverged at the same step (the loss is global)
        raise
    except BaseException as err:
        leaving_for_failure()  # this rank leaves for `err`: a signal from here on is not another stop
        reason = err
        try:
            if watch is not None:
                watch.fail(err)  # raises PeerFailed when another rank failed first
        except PeerFailed as peer:
            reason = peer  # `err` chained as its cause
            raise
        finally:
            if trainer is not None:
                trainer.release(reason)  # this process leaves the run: its folders are free again
        raise
    trainer.close()
    return result
