"""Strict validation of a `JobConfig`: every impossible or mistyped setting is a `ConfigError`.

    python -c "from torchmoe.config import JobConfig, validate_job_config as v; v(JobConfig(), world_size=1)"

Per-section checks (ranges, allowed names) run first, then the degree arithmetic
(`resolve_degrees`, shared with `ParallelDims` so the two can never disagree), then the checks
that need the model's shape and the other sections together.

torch and the model package are imported inside the functions that need them: importing them
takes seconds, and `torchmoe train --help` or a typo in a flag should answer at once.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Float8,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
)

if TYPE_CHECKING:
    from torchmoe.models.llama4.args import ModelArgs

OPTIMIZERS = ("AdamW", "Adam")
OPTIMIZER_IMPLEMENTATIONS = ("for-loop", "foreach", "fused")
DECAY_TYPES = ("linear", "sqrt", "cosine")
DATASETS = ("python_docs", "local", "hf")
PARAM_DTYPES = ("bfloat16", "float32")
REDUCE_DTYPES = ("float32", "bfloat16")
DEVICES = ("", "cpu", "cuda")
ATTN_BACKENDS = ("", "sdpa", "flex")
# torch.distributed.pipelining's schedules (`plan.pipeline.SCHEDULE_STYLES` says how each places stages).
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")
RESHARD_POLICIES = ("default", "always", "never")
CHECKPOINT_ASYNC_MODES = ("disabled", "async")
AC_MODES = ("none", "selective", "full")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

# (short name used in meshes and messages, Parallelism field), outermost mesh dim first.
_DEGREE_FIELDS = (
    ("pp", "pipeline_parallel_degree"),
    ("dp_replicate", "data_parallel_replicate_degree"),
    ("dp_shard", "data_parallel_shard_degree"),
    ("cp", "context_parallel_degree"),
    ("tp", "tensor_parallel_degree"),
    ("ep", "expert_parallel_degree"),
)


# ---- small checkers --------------------------------------------------------------------------


def _one_of(key: str, value: str, choices: Sequence[str]) -> None:
    if value in choices:
        return
    same_but_case = [c for c in choices if c.lower() == value.lower()]
    close = same_but_case or difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
    options = ", ".join(show_value(c) for c in choices)
    fix = f"did you mean {show_value(close[0])}? Allowed: {options}" if close else f"use one of {options}"
    raise ConfigError(key, value, "not an allowed value", fix)


def _at_least(key: str, value: float, low: float, fix: str = "") -> None:
    # Written as `not (value >= low)` so that NaN fails too; inf is no usable setting either.
    if not value >= low or value == math.inf:
        raise ConfigError(key, value, f"must be >= {low}", fix or f"set it to {low} or more")


def _positive(key: str, value: float) -> None:
    if not 0 < value < math.inf:
        raise ConfigError(key, value, "must be a finite number > 0", "set a positive value")


def _in_unit_interval(key: str, value: float, allow: tuple[float, ...] = ()) -> None:
    if value in allow or 0.0 <= value <= 1.0:
        return
    extra = "".join(f" or {show_value(a)}" for a in allow)
    raise ConfigError(key, value, f"must lie in [0, 1]{extra}", f"set a value between 0 and 1{extra}")


# ---- per-section checks ----------------------------------------------------------------------


def validate_job(job: Job) -> None:
    _at_least("job.device_memory_gib", job.device_memory_gib, 0, "set the GiB per device, or 0 to detect")


def validate_model(model: Model) -> None:
    from torchmoe.models.llama4.args import FLAVORS

    _one_of("model.name", model.name, ("llama4",))
    _one_of("model.flavor", model.flavor, tuple(FLAVORS))
    _one_of("model.attn_backend", model.attn_backend, ATTN_BACKENDS)
    if model.load_balance_coeff != -1.0:
        _at_least("model.load_balance_coeff", model.load_balance_coeff, 0,
                  "use 0 to disable, a positive rate, or -1 for the flavor's default")
    _at_least("model.aux_loss_coeff", model.aux_loss_coeff, 0, "use 0 to disable or a positive coefficient")
    _at_least("model.z_loss_coeff", model.z_loss_coeff, 0, "use 0 to disable or a positive coefficient")


def validate_optimizer(optimizer: Optimizer) -> None:
    _one_of("optimizer.name", optimizer.name, OPTIMIZERS)
    _positive("optimizer.lr", optimizer.lr)
    _positive("optimizer.eps", optimizer.eps)
    _at_least("optimizer.weight_decay", optimizer.weight_decay, 0, "use 0 to disable weight decay")
    for key, beta in (("optimizer.beta1", optimizer.beta1), ("optimizer.beta2", optimizer.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(key, beta, "must lie in [0, 1)", "typical values are beta1 = 0.9, beta2 = 0.95")
    _one_of("optimizer.implementation", optimizer.implementation, OPTIMIZER_IMPLEMENTATIONS)


def validate_lr_scheduler(sched: LRScheduler) -> None:
    _at_least("lr_scheduler.warmup_steps", sched.warmup_steps, 0, "use 0 for no warmup")
    _in_unit_interval("lr_scheduler.decay_ratio", sched.decay_ratio, allow=(-1,))
    _one_of("lr_scheduler.decay_type", sched.decay_type, DECAY_TYPES)
    _in_unit_interval("lr_scheduler.min_lr_factor", sched.min_lr_factor)


def validate_training(training: Training) -> None:
    _at_least("training.local_batch_size", training.local_batch_size, 1)
    if training.global_batch_size != -1:
        _at_least("training.global_batch_size", training.global_batch_size, 1,
                  "set a positive batch size, or -1 for local_batch_size * dp")
    _at_least("training.seq_len", training.seq_len, 1)
    _at_least("training.steps", training.steps, 1)
    if not math.isfinite(training.max_norm):  # <= 0 disables clipping; NaN would poison every gradient
        raise ConfigError("training.max_norm", training.max_norm, "must be a finite number",
                          "set a positive clipping norm, or 0 to disable clipping")
    _one_of("training.dataset", training.dataset, DATASETS)
    if training.dataset in ("local", "hf") and not training.dataset_path:
        what = ("files (a file, folder or glob)" if training.dataset == "local"
                else "the hub dataset ('name' or 'name:config')")
        raise ConfigError("training.dataset_path", training.dataset_path,
                          f"dataset = {show_value(training.dataset)} needs a path", f"set dataset_path to {what}")
    _one_of("training.mixed_precision_param", training.mixed_precision_param, PARAM_DTYPES)
    _one_of("training.mixed_precision_reduce", training.mixed_precision_reduce, REDUCE_DTYPES)
    _one_of("training.device", training.device, DEVICES)


def validate_parallelism(parallelism: Parallelism) -> None:
    """The non-degree settings; the degrees are checked by `resolve_degrees`."""
    _one_of("parallelism.pipeline_parallel_schedule", parallelism.pipeline_parallel_schedule, PIPELINE_SCHEDULES)
    _at_least("parallelism.pipeline_parallel_microbatch_size", parallelism.pipeline_parallel_microbatch_size, 1)
    for key in ("pipeline_parallel_microbatches", "pipeline_parallel_layers_per_stage"):
        if getattr(parallelism, key) != -1:
            _at_least(f"parallelism.{key}", getattr(parallelism, key), 1, "set a positive value, or -1 for the default")
    _one_of("parallelism.fsdp_reshard_after_forward", parallelism.fsdp_reshard_after_forward, RESHARD_POLICIES)


def validate_comm(comm: Comm) -> None:
    _at_least("comm.init_timeout_seconds", comm.init_timeout_seconds, 1)
    _at_least("comm.train_timeout_seconds", comm.train_timeout_seconds, 1)
    _at_least("comm.trace_buf_size", comm.trace_buf_size, 0, "use 0 to turn the flight recorder off")


def validate_checkpoint(checkpoint: Checkpoint) -> None:
    _at_least("checkpoint.interval", checkpoint.interval, 1)
    _at_least("checkpoint.keep_latest_k", checkpoint.keep_latest_k, 0, "use 0 to keep every checkpoint")
    _one_of("checkpoint.async_mode", checkpoint.async_mode, CHECKPOINT_ASYNC_MODES)
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf", True, "no checkpoint.initial_load_path to load from",
                          "set initial_load_path to a Hugging Face Llama 4 folder, or initial_load_in_hf = false")


def validate_activation_checkpoint(ac: ActivationCheckpoint) -> None:
    _one_of("activation_checkpoint.mode", ac.mode, AC_MODES)
    option = ac.selective_ac_option
    if option != "op" and not (option.isdecimal() and option.isascii() and int(option) >= 1):
        raise ConfigError("activation_checkpoint.selective_ac_option", option,
                          "must be 'op' or a positive integer n", 'use "op" or e.g. "2" (every 2nd block)')


def validate_float8(float8: Float8) -> None:
    _one_of("float8.recipe_name", float8.recipe_name, FLOAT8_RECIPES)
    if float8.enable and float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        raise ConfigError("float8.enable_fsdp_float8_all_gather", True,
                          f"only works with recipe_name = \"tensorwise\", not {show_value(float8.recipe_name)}",
                          "set enable_fsdp_float8_all_gather = false or recipe_name = \"tensorwise\"")


def validate_metrics(metrics: Metrics) -> None:
    _at_least("metrics.log_freq", metrics.log_freq, 1)


def validate_profiling(profiling: Profiling) -> None:
    _at_least("profiling.profile_freq", profiling.profile_freq, 1)


# ---- files the run reads ---------------------------------------------------------------------


def _resumes(cfg: JobConfig) -> bool:
    """Whether the run will resume from a complete `step-N/` of its own (as CheckpointManager
    finds them), and so never read `checkpoint.initial_load_path`."""
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    return cfg.checkpoint.enable and folder.is_dir() and any(
        re.fullmatch(r"step-\d+", p.name) and (p / ".complete").is_file() for p in folder.iterdir())


def validate_initial_load_path(cfg: JobConfig) -> None:
    """`checkpoint.initial_load_path`, when the run will load it, must be what
    `initial_load_in_hf` says: a DCP folder (`.metadata`) or a Hugging Face folder (safetensors).

    The model/data files named by `model.tokenizer_path` and `training.dataset_path` are checked
    where they are read (`torchmoe.data`, `DataConfigError`).
    """
    ckpt = cfg.checkpoint
    if not ckpt.initial_load_path or _resumes(cfg):
        return
    key, path = "checkpoint.initial_load_path", Path(ckpt.initial_load_path)
    hf = "a Hugging Face Llama 4 folder (config.json + *.safetensors)"
    dcp = "a DCP checkpoint folder: a step-N folder of a run, or the output of `torchmoe convert hf-to-dcp`"
    want = hf if ckpt.initial_load_in_hf else dcp
    if not path.exists():
        raise ConfigError(key, ckpt.initial_load_path, "no such file or folder",
                          f"point it at {want}, or leave it empty to start from random weights")
    if not path.is_dir():
        raise ConfigError(key, ckpt.initial_load_path, "is a file, not a folder", f"point it at {want}")
    is_dcp = (path / ".metadata").is_file()
    is_hf = (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))
    if ckpt.initial_load_in_hf and not is_hf:
        fix = ("it is a DCP checkpoint: set checkpoint.initial_load_in_hf = false" if is_dcp
               else f"point it at {hf}")
        raise ConfigError(key, ckpt.initial_load_path, "initial_load_in_hf = true, but the folder holds no "
                          "*.safetensors", fix)
    if not ckpt.initial_load_in_hf and not is_dcp:
        fix = ("it is a Hugging Face folder: set checkpoint.initial_load_in_hf = true" if is_hf
               else f"point it at {dcp}")
        raise ConfigError(key, ckpt.initial_load_path, "not a DCP checkpoint (no .metadata in the folder)", fix)


# ---- degrees ---------------------------------------------------------------------------------


def _product(degrees: dict[str, int], names: Sequence[str]) -> tuple[int, str]:
    """The product of the named degrees and its arithmetic, e.g. ``(8, "dp_shard(4) * tp(2)")``."""
    return math.prod(degrees[n] for n in names), " * ".join(f"{n}({degrees[n]})" for n in names)


def resolve_degrees(parallelism: Parallelism, world_size: int) -> dict[str, int]:
    """Resolve the parallel degrees against the world size.

    ``data_parallel_shard_degree = -1`` becomes whatever ``world_size`` leaves after the other
    degrees. `ParallelDims` and the dry-run planner call this, so every layout they build has
    passed these checks.

    Args:
        parallelism: the `[parallelism]` section.
        world_size: number of processes (ranks).

    Returns:
        ``{"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"}`` -> degree, all >= 1, with
        ``pp * dp_replicate * dp_shard * cp * tp == world_size`` and ``ep`` dividing
        ``dp_shard * cp * tp``.

    Raises:
        ConfigError: a degree < 1 (other than dp_shard = -1), a product that is not the world
            size (the message shows the arithmetic), a -1 that does not fill an integral rest,
            ep not dividing dp_shard * cp * tp, or DDP combined with other parallelism.
    """
    if world_size < 1:
        raise ConfigError("WORLD_SIZE", world_size, "must be >= 1", "pass --world-size N with N >= 1")
    degrees = {short: getattr(parallelism, name) for short, name in _DEGREE_FIELDS}
    for short, name in _DEGREE_FIELDS:
        if degrees[short] >= 1 or (short == "dp_shard" and degrees[short] == -1):
            continue
        allowed = ">= 1, or -1 to fill the rest of the world size" if short == "dp_shard" else ">= 1"
        raise ConfigError(f"parallelism.{name}", degrees[short], f"must be {allowed}",
                          f"set it to 1 to disable {short}")

    others, others_text = _product(degrees, ("dp_replicate", "cp", "tp", "pp"))
    if degrees["dp_shard"] == -1:
        if world_size % others:
            raise ConfigError(
                "parallelism.data_parallel_shard_degree", -1,
                f"-1 fills the rest, but WORLD_SIZE({world_size}) / ({others_text}) = "
                f"{world_size}/{others} is not an integer",
                f"choose degrees whose product divides WORLD_SIZE({world_size}), "
                f"or run on a multiple of {others} ranks",
            )
        degrees["dp_shard"] = world_size // others

    total, total_text = _product(degrees, ("dp_replicate", "dp_shard", "cp", "tp", "pp"))
    if total != world_size:
        raise ConfigError(
            "parallelism.data_parallel_shard_degree", degrees["dp_shard"],
            f"{total_text} = {total} != WORLD_SIZE({world_size})",
            "make the degrees multiply to the world size, e.g. data_parallel_shard_degree = -1 to fill the rest "
            "(or pass a matching --world-size / number of processes)",
        )

    if degrees["dp_replicate"] > 1 and degrees["dp_shard"] == 1:
        mixed = [f"{n}({degrees[n]})" for n in ("tp", "cp", "pp", "ep") if degrees[n] > 1]
        if mixed:
            raise ConfigError(
                "parallelism.data_parallel_replicate_degree", degrees["dp_replicate"],
                f"DDP (dp_shard = 1) cannot be combined with {', '.join(mixed)}; HSDP needs dp_shard > 1",
                "use HSDP with data_parallel_shard_degree > 1 (or -1), or plain DDP with every other degree 1",
            )

    ep_region, ep_text = _product(degrees, ("dp_shard", "cp", "tp"))
    if ep_region % degrees["ep"]:
        raise ConfigError(
            "parallelism.expert_parallel_degree", degrees["ep"],
            f"must divide {ep_text} = {ep_region} (EP borrows its ranks from there); "
            f"{ep_region} % {degrees['ep']} = {ep_region % degrees['ep']}",
            f"use an expert_parallel_degree that divides {ep_region}: {_divisors_text(ep_region)}",
        )
    return degrees


def _divisors_text(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# ---- checks across sections ------------------------------------------------------------------


def _validate_model_split(args: ModelArgs, flavor: str, degrees: dict[str, int], seq_len: int) -> None:
    """The model's shape must split evenly over tp, ep and cp (pp: `_validate_pipeline`)."""
    tp, ep, cp = degrees["tp"], degrees["ep"], degrees["cp"]
    has_dense = any(not args.is_moe_layer(i) for i in range(args.n_layers))
    tp_split = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "moe_hidden_dim": args.moe_hidden_dim,
                "vocab_size": args.vocab_size}
    if has_dense:
        tp_split["ffn_hidden_dim"] = args.ffn_hidden_dim
    for dim_name, size in tp_split.items():
        if size % tp:
            valid = _divisors_text(math.gcd(*tp_split.values()))
            raise ConfigError(
                "parallelism.tensor_parallel_degree", tp,
                f"must divide the {flavor} flavor's {dim_name} ({size}); {size} % {tp} = {size % tp}",
                f"use a tensor_parallel_degree that divides every sharded dim of {flavor}: {valid}",
            )
    if args.num_experts % ep:
        raise ConfigError(
            "parallelism.expert_parallel_degree", ep,
            f"the {flavor} flavor has {args.num_experts} experts; {args.num_experts} % {ep} = {args.num_experts % ep}",
            f"use an expert_parallel_degree that divides {args.num_experts}: {_divisors_text(args.num_experts)}",
        )
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            "training.seq_len", seq_len,
            f"context parallelism splits each sequence into 2 * cp = {2 * cp} chunks; "
            f"{seq_len} % {2 * cp} = {seq_len % (2 * cp)}",
            f"use a seq_len that is a multiple of {2 * cp}",
        )
    # Sequence parallelism shards each CP rank's slice of the sequence over tp.
    if tp > 1 and seq_len % (cp * tp):
        raise ConfigError(
            "training.seq_len", seq_len,
            f"sequence parallelism shards it over cp({cp}) * tp({tp}) = {cp * tp}; "
            f"{seq_len} % {cp * tp} = {seq_len % (cp * tp)}",
            f"use a seq_len that is a multiple of {cp * tp}",
        )


def _validate_pipeline(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int], world_size: int) -> None:
    """The stage split and the micro-batches must suit the schedule; what PP cannot run is refused."""
    if degrees["pp"] == 1:
        return
    from torchmoe.distributed.parallel_dims import ParallelDims
    from torchmoe.plan.pipeline import SPLIT_BACKWARD_SCHEDULES, check_microbatches, pipeline_layout

    par = cfg.parallelism
    pipe = pipeline_layout(args, ParallelDims(**degrees, world_size=world_size), par, cfg.training.seq_len)
    check_microbatches(cfg.training, par, degrees["pp"], pipe.num_stages)
    if args.tie_word_embeddings:
        raise ConfigError("parallelism.pipeline_parallel_degree", degrees["pp"],
                          f"the {cfg.model.flavor} flavor ties the output head to the embedding, which live on "
                          "the last and the first pipeline stage", "use pipeline_parallel_degree = 1 for this model")
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op" and par.pipeline_parallel_schedule in \
            SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError("activation_checkpoint.selective_ac_option", "op",
                          f"{par.pipeline_parallel_schedule} runs each block's backward twice (input, then weight "
                          "gradients), and per-op selective AC allows one backward per checkpointed region",
                          'use activation_checkpoint.mode = "full", a per-layer selective_ac_option (e.g. "2"), '
                          "or a schedule without split backward (1F1B, Interleaved1F1B)")
    if cfg.compile.enable and par.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError("parallelism.pipeline_parallel_schedule", par.pipeline_parallel_schedule,
                          "splits backward into input and weight halves, which torch does not support for "
                          "compiled blocks", "set compile.enable = false, or use Interleaved1F1B / 1F1B")


def _validate_batch(training: Training, parallelism: Parallelism, degrees: dict[str, int]) -> None:
    if training.global_batch_size != -1:
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        step = training.local_batch_size * dp
        if training.global_batch_size % step:
            raise ConfigError(
                "training.global_batch_size", training.global_batch_size,
                f"must be a multiple of local_batch_size({training.local_batch_size}) * dp_replicate"
                f"({degrees['dp_replicate']}) * dp_shard({degrees['dp_shard']}) = {step}; "
                f"{training.global_batch_size} % {step} = {training.global_batch_size % step}",
                f"use a multiple of {step}, or -1 for exactly {step} (no gradient accumulation)",
            )


def _validate_features(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int], check_device: bool) -> None:
    """Feature combinations that cannot work: compile/AC/attention and CUDA-only features."""
    import torch

    if cfg.parallelism.enable_async_tensor_parallel and not cfg.compile.enable:
        raise ConfigError("parallelism.enable_async_tensor_parallel", True, "async TP is implemented by torch.compile",
                          "set compile.enable = true, or enable_async_tensor_parallel = false")
    if cfg.activation_checkpoint.mode == "selective" and args.attn_backend == "flex":
        raise ConfigError("activation_checkpoint.mode", "selective",
                          "selective AC is not supported with attn_backend \"flex\"",
                          'use activation_checkpoint.mode = "full", or model.attn_backend = "sdpa"')
    if degrees["cp"] > 1 and args.attn_backend == "flex":
        raise ConfigError("model.attn_backend", "flex", "context parallelism runs SDPA with masks over global "
                          "positions; FlexAttention is not wired to it", 'use model.attn_backend = "sdpa"')

    device = cfg.training.device
    cuda = torch.cuda.is_available()
    if check_device and device == "cuda" and not cuda:
        raise ConfigError("training.device", device, "CUDA is not available on this machine",
                          'use training.device = "cpu" (or "" to pick automatically)')
    if args.attn_backend == "flex" and (device == "cpu" or (check_device and not cuda)):
        # Its CPU kernel has no backward: training would fail at the first step.
        raise ConfigError("model.attn_backend", "flex", "FlexAttention cannot train on CPU (no backward kernel there)",
                          'use model.attn_backend = "sdpa" on CPU, or run on CUDA')
    if cfg.parallelism.fsdp_cpu_offload:
        from torchmoe.distributed.parallel_dims import ParallelDims

        if not ParallelDims(**degrees, world_size=math.prod(degrees[d] for d in ("pp", "dp_replicate", "dp_shard",
                                                                                 "cp", "tp"))).fsdp_enabled:
            raise ConfigError("parallelism.fsdp_cpu_offload", True, "offloads FSDP's sharded state, but this layout "
                              "applies no FSDP (dp_shard * cp = 1 and no expert sharding)",
                              "set fsdp_cpu_offload = false, or shard with data_parallel_shard_degree > 1")
    # CPU offload moves FSDP state off an accelerator: FSDP2 refuses it when there is none.
    cuda_only = (("float8.enable", cfg.float8.enable),
                 ("parallelism.enable_async_tensor_parallel", cfg.parallelism.enable_async_tensor_parallel),
                 ("parallelism.fsdp_cpu_offload", cfg.parallelism.fsdp_cpu_offload))
    for key, enabled in cuda_only:
        if not enabled:
            continue
        if device == "cpu":
            raise ConfigError(key, True, 'needs CUDA, but training.device = "cpu"',
                              f"set {key} = false, or run on CUDA")
        if check_device and not cuda:
            raise ConfigError(key, True, "needs CUDA, which is not available on this machine",
                              f"set {key} = false, or run on a CUDA machine")


def validate_job_config(cfg: JobConfig, world_size: int, *, check_device: bool = True) -> None:
    """Check every setting of `cfg` for a run on `world_size` ranks.

    Args:
        cfg: the loaded job config.
        world_size: the number of ranks the run (or the dry-run's plan) has.
        check_device: also require that this machine has what the config needs (CUDA for
            float8 / async TP / device "cuda", the folder of checkpoint.initial_load_path).
            The dry-run passes False: it plans for the target cluster from any machine.

    Raises:
        ConfigError: the first problem found, naming the key, the value and the fix.
    """
    validate_job(cfg.job)
    validate_model(cfg.model)
    validate_optimizer(cfg.optimizer)
    validate_lr_scheduler(cfg.lr_scheduler)
    validate_training(cfg.training)
    validate_parallelism(cfg.parallelism)
    validate_checkpoint(cfg.checkpoint)
    validate_comm(cfg.comm)
    validate_activation_checkpoint(cfg.activation_checkpoint)
    validate_float8(cfg.float8)
    validate_metrics(cfg.metrics)
    validate_profiling(cfg.profiling)

    from torchmoe.models.llama4.args import model_args_from_config

    degrees = resolve_degrees(cfg.parallelism, world_size)
    args = model_args_from_config(cfg.model)
    _validate_model_split(args, cfg.model.flavor, degrees, cfg.training.seq_len)
    _validate_batch(cfg.training, cfg.parallelism, degrees)
    _validate_pipeline(cfg, args, degrees, world_size)
    _validate_features(cfg, args, degrees, check_device)
    if check_device:
        validate_initial_load_path(cfg)
        # Before any process group exists, so torchrun prints this once, not once per rank.
        from torchmoe.data.tokenizer import build_tokenizer

        check_tokenizer_fits(build_tokenizer(cfg.model.tokenizer_path).vocab_size, args.vocab_size, cfg.model)


def check_tokenizer_fits(tokenizer_vocab: int, model_vocab: int, model: Model) -> None:
    """Every token id must have an embedding row."""
    if tokenizer_vocab > model_vocab:
        raise ConfigError("model.tokenizer_path", model.tokenizer_path,
                          f"the tokenizer has {tokenizer_vocab} tokens but flavor {model.flavor!r} has vocab_size "
                          f"{model_vocab}", "use a tokenizer that fits the flavor's vocabulary")
