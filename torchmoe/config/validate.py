"""Validation of each `JobConfig` section on its own (the parallel-degree arithmetic: `degrees`).

    python -c "from torchmoe.config import JobConfig, validate_sections as v; v(JobConfig())"

A leaf: it imports nothing of torchmoe outside `torchmoe.config`, so every layer can use it.
The checks that need the model, the data, the layout, the device or the files of a run sit
above what they check, in `torchmoe.preflight`, which runs these first.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Sequence

from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.files.paths import READ_KEYS, WRITTEN_FOLDER_KEYS, key_value, nonempty_path
from torchmoe.config.job_config import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    FaultTolerance,
    Float8,
    Job,
    JobConfig,
    LoRA,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from torchmoe.config.numbers import INT64_MAX, INT64_MIN

OPTIMIZERS = ("AdamW", "Adam", "Muon")
MUON_ADJUST_LR = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn
NS_DTYPES = ("bfloat16", "float32")
OPTIMIZER_IMPLEMENTATIONS = ("for-loop", "foreach", "fused")
DECAY_TYPES = ("linear", "sqrt", "cosine")
DATASETS = ("python_docs", "local", "tokens", "hf", "chat", "c4", "c4_test", "c4_validation")
LOSS_ON = ("assistant", "last", "all")  # training.loss_on (`data.chat.chat_masks`)
CHAT_OVERLONG = ("truncate", "drop")  # training.chat_overlong (`data.chat.chat`)
PARAM_DTYPES = ("bfloat16", "float32")
LOG_LEVELS = ("warning", "info", "debug")  # metrics.log_level
REDUCE_DTYPES = ("float32", "bfloat16")
DEVICES = ("", "cpu", "cuda")
ATTN_BACKENDS = ("", "sdpa", "flex")
# torch.distributed.pipelining's schedules (`plan.pipeline.SCHEDULE_STYLES` says how each places stages).
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")
RESHARD_POLICIES = ("default", "always", "never")
CHECKPOINT_ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
# The parts of a checkpoint that checkpoint.exclude_from_loading can leave out.
CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "rng")
COMPILE_COMPONENTS = ("model", "loss")
AC_MODES = ("none", "selective", "full")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
LORA_TARGETS = ("attention", "mlp", "shared_experts", "experts", "router")
LORA_EXPORTS = ("adapter", "merged")
# The range of lora.alpha / lora.rank, the scale of the adapters' output: recipes use 1/64 (a rank
# of 1024 at alpha 16) to 64 (rank 1 at alpha 64); this admits 16 times more either way.
LORA_SCALING = (1 / 1024, 1024.0)
# QK-Clip's smallest threshold (tau): a logit of 0.01 between a head's favourite key and any
# other is a softmax weight ratio of 1.01; a head clipped below that attends uniformly, and each
# step scales its query and key weights further towards 0 (1e-300 zeroed every head). Small
# models' heads (logits of 0.1 to 0.7: the layout tests') clip at 0.1 (docs/muon.md, "QK-Clip").
MIN_QK_CLIP_THRESHOLD = 0.01
# Targets whose PEFT form is a parameter adapter (`target_parameters`), which takes no dropout.
LORA_PARAMETER_TARGETS = ("experts", "router")
FT_PROCESS_GROUPS = ("gloo", "nccl")
SEMI_SYNC_METHODS = ("", "local_sgd", "diloco")
GRADIENT_AVERAGES = ("auto", "backward", "after_backward")

MAX_TIMEOUT_SECONDS = 2**31 - 1

# ---- small checkers --------------------------------------------------------------------------


def one_of(key: str, value: str, choices: Sequence[str]) -> None:
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


def validate_int64(cfg: JobConfig) -> None:
    """Every integer setting must fit in 64 bits: TOML integers are unbounded in Python, but
    seeds, step counts and sizes end up in tensors and C++ (torch.manual_seed fails at 2**64)."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
                raise ConfigError(f"{section.name}.{f.name}", value, f"does not fit in 64 bits "
                                  f"(allowed: {INT64_MIN} .. {INT64_MAX})", "use a smaller number")


# ---- per-section checks ----------------------------------------------------------------------


def validate_paths(cfg: JobConfig) -> None:
    """A folder the run writes into is never empty or blank: the OS would take it for the current
    directory (or, under job.dump_folder, the dump folder itself), whatever is kept there. A path
    the run reads may be empty (not set) but not blank."""
    for key in WRITTEN_FOLDER_KEYS:
        means = "the current directory" if key == "job.dump_folder" else "the dump folder itself"
        nonempty_path(key, key_value(cfg, key), f'name the folder ("." if you mean {means})', means=means)
    for key in READ_KEYS:
        if value := key_value(cfg, key):
            nonempty_path(key, value, "name the path, or leave the key out (it is then not set)",
                          means="a file named by blanks")


def validate_job(job: Job) -> None:
    _at_least("job.device_memory_gib", job.device_memory_gib, 0, "set the GiB per device, or 0 to detect")
    one_of("job.folder_lock", job.folder_lock, ("auto", "flock", "heartbeat"))


def validate_model(model: Model) -> None:
    """The family and flavor names are checked with the model's shape (`torchmoe.preflight`)."""
    one_of("model.attn_backend", model.attn_backend, ATTN_BACKENDS)
    if model.load_balance_coeff != -1.0:
        _at_least("model.load_balance_coeff", model.load_balance_coeff, 0,
                  "use 0 to disable, a positive rate, or -1 for the flavor's default")
    if model.aux_loss_coeff != -1.0:
        _at_least("model.aux_loss_coeff", model.aux_loss_coeff, 0,
                  "use 0 to disable, a positive coefficient, or -1 for the family's default")
    _at_least("model.z_loss_coeff", model.z_loss_coeff, 0, "use 0 to disable or a positive coefficient")
    _at_least("model.mtp_layers", model.mtp_layers, 0, "use 0 to disable multi-token prediction, or a depth")
    _at_least("model.mtp_loss_coeff", model.mtp_loss_coeff, 0, "use a non-negative weight (DeepSeek-V3: 0.1)")


def validate_optimizer(optimizer: Optimizer) -> None:
    one_of("optimizer.name", optimizer.name, OPTIMIZERS)
    _positive("optimizer.lr", optimizer.lr)
    _positive("optimizer.eps", optimizer.eps)
    _at_least("optimizer.weight_decay", optimizer.weight_decay, 0, "use 0 to disable weight decay")
    for key, beta in (("optimizer.beta1", optimizer.beta1), ("optimizer.beta2", optimizer.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(key, beta, "must lie in [0, 1)", "typical values are beta1 = 0.9, beta2 = 0.95")
    one_of("optimizer.implementation", optimizer.implementation, OPTIMIZER_IMPLEMENTATIONS)
    tau = optimizer.qk_clip_threshold
    if tau != 0 and not MIN_QK_CLIP_THRESHOLD <= tau < math.inf:
        raise ConfigError("optimizer.qk_clip_threshold", tau, f"must be 0 (off) or a finite logit >= "
                          f"{MIN_QK_CLIP_THRESHOLD:g}: a head held below it attends uniformly (its favourite key at most "
                          "1.01 times any other's weight), and a tiny tau scales its query and key weights towards 0 "
                          "(1e-300 zeroed every head)",
                          "use 0 to turn QK-Clip off, or a logit above which heads are clipped (Kimi K2: 100)")
    if optimizer.name != "Adam":  # decoupled: Adam's is an L2 term of the gradient instead
        _check_decay_factor("optimizer.weight_decay", optimizer.weight_decay, "optimizer.lr", optimizer.lr)
    if optimizer.name == "Muon":
        _validate_muon(optimizer)



def _check_decay_factor(key: str, weight_decay: float, lr_key: str, lr: float) -> None:
    """Decoupled weight decay multiplies each weight by 1 - lr * weight_decay per step: at 1 or
    more (at the peak LR) it zeroes or flips the sign of every decayed weight."""
    if lr * weight_decay >= 1:
        raise ConfigError(key, weight_decay, f"each step multiplies the decayed weights by 1 - {lr_key} * "
                          f"weight_decay = 1 - {lr:g} * {weight_decay:g} = {1 - lr * weight_decay:.3g} at the peak LR: "
                          "they would be zeroed or change sign every step", f"use a weight decay below 1 / {lr_key} "
                          f"= {1 / lr:.4g} (typical: 0.1), or lower {lr_key}")


def _validate_muon(optimizer: Optimizer) -> None:
    """The Muon keys (the ranges torch.optim.Muon accepts) and the AdamW twins of lr and weight_decay."""
    if not 0 <= optimizer.momentum < 1:  # the buffer's weight on its past: at 1 or more it never forgets, or grows
        raise ConfigError("optimizer.momentum", optimizer.momentum, "must lie in [0, 1): the momentum buffer keeps "
                          "momentum times its past each step, which at 1 never forgets a gradient and above 1 grows "
                          "without bound", "typical: 0.95 (torch.optim.Muon's default)")
    if not 1 <= optimizer.ns_steps < 100:
        raise ConfigError("optimizer.ns_steps", optimizer.ns_steps, "must lie in 1 .. 99 (torch.optim.Muon's range)",
                          "use 5, torch.optim.Muon's default")
    coefficients = optimizer.ns_coefficients
    if len(coefficients) != 3 or not all(math.isfinite(c) for c in coefficients):
        raise ConfigError("optimizer.ns_coefficients", coefficients, "must be three finite numbers (a, b, c)",
                          "use [3.4445, -4.775, 2.0315], torch.optim.Muon's default")
    _positive("optimizer.ns_eps", optimizer.ns_eps)
    one_of("optimizer.ns_dtype", optimizer.ns_dtype, NS_DTYPES)
    one_of("optimizer.adjust_lr", optimizer.adjust_lr, MUON_ADJUST_LR)
    if optimizer.adamw_lr != -1:
        _positive("optimizer.adamw_lr", optimizer.adamw_lr)
    if optimizer.adamw_weight_decay != -1:
        _at_least("optimizer.adamw_weight_decay", optimizer.adamw_weight_decay, 0,
                  "use 0 to disable, or -1 for optimizer.weight_decay")
    adamw_lr_key = "optimizer.adamw_lr" if optimizer.adamw_lr != -1 else "optimizer.lr"
    adamw_key = "optimizer.adamw_weight_decay" if optimizer.adamw_weight_decay != -1 else "optimizer.weight_decay"
    _check_decay_factor(adamw_key, optimizer.adamw_weight_decay if optimizer.adamw_weight_decay != -1 else
                        optimizer.weight_decay, adamw_lr_key,
                        optimizer.adamw_lr if optimizer.adamw_lr != -1 else optimizer.lr)
    for key in ("optimizer.muon_params", "optimizer.adamw_params"):
        for pattern in getattr(optimizer, key.rpartition(".")[2]):
            if not pattern.strip():
                raise ConfigError(key, pattern, "is an empty pattern", "remove it, or name parameters, e.g. "
                                  '"layers.*.moe.router.gate.weight"')


def validate_lr_scheduler(sched: LRScheduler) -> None:
    _at_least("lr_scheduler.warmup_steps", sched.warmup_steps, 0, "use 0 for no warmup")
    _in_unit_interval("lr_scheduler.decay_ratio", sched.decay_ratio, allow=(-1,))
    one_of("lr_scheduler.decay_type", sched.decay_type, DECAY_TYPES)
    _in_unit_interval("lr_scheduler.min_lr_factor", sched.min_lr_factor)
    if sched.total_steps != -1:
        _at_least("lr_scheduler.total_steps", sched.total_steps, 1,
                  "set the schedule's length, or -1 for training.steps")


def validate_training(training: Training) -> None:
    _at_least("training.local_batch_size", training.local_batch_size, 1)
    if training.global_batch_size != -1:
        _at_least("training.global_batch_size", training.global_batch_size, 1,
                  "set a positive batch size, or -1 for local_batch_size * dp")
    _at_least("training.seq_len", training.seq_len, 1)
    _at_least("training.steps", training.steps, 1)
    # torch.manual_seed takes -1 as 2**64 - 1: a negative seed has no meaning of its own.
    _at_least("training.seed", training.seed, 0, "set a seed from 0 (the default) upward")
    if not math.isfinite(training.max_norm):  # <= 0 disables clipping; NaN would poison every gradient
        raise ConfigError("training.max_norm", training.max_norm, "must be a finite number",
                          "set a positive clipping norm, or 0 to disable clipping")
    check_dataset("training", training.dataset, training.dataset_path)
    one_of("training.loss_on", training.loss_on, LOSS_ON)
    one_of("training.chat_overlong", training.chat_overlong, CHAT_OVERLONG)
    if training.add_bos and training.dataset == "chat":  # a template that writes BOS would get two
        raise ConfigError("training.add_bos", True, 'would put BOS before chat data (training.dataset = "chat"), '
                          "whose tokens are exactly its chat template's rendering (which writes BOS where the "
                          "model wants one)", "set training.add_bos = false")
    for ext in training.dataset_extensions:
        if not re.fullmatch(r"\.[^./\\*?\[\]\s]+(\.[^./\\*?\[\]\s]+)*", ext):
            suffix = "." + ext.strip().strip("*").lstrip(".") if ext.strip().strip("*.") else ".txt"
            raise ConfigError("training.dataset_extensions", training.dataset_extensions,
                              f"{show_value(ext)} is not a file extension (a dot and a name without "
                              "slashes, wildcards or spaces)", f"write it as {show_value(suffix)}")
    one_of("training.dtype", training.dtype, PARAM_DTYPES)
    one_of("training.mixed_precision_param", training.mixed_precision_param, PARAM_DTYPES)
    if training.dtype == "bfloat16" and training.mixed_precision_param != "bfloat16":
        # FSDP/DDP would all-gather fp32 copies of bf16 weights: memory spent, no precision gained.
        raise ConfigError("training.mixed_precision_param", training.mixed_precision_param,
                          'would compute in float32 from bf16 parameters (training.dtype = "bfloat16"): '
                          "the upcast copies cost memory and give back no precision the weights lost",
                          'set mixed_precision_param = "bfloat16" for pure bf16, or training.dtype = "float32" '
                          "for fp32 weights")
    one_of("training.mixed_precision_reduce", training.mixed_precision_reduce, REDUCE_DTYPES)
    one_of("training.device", training.device, DEVICES)
    _at_least("training.gc_freq", training.gc_freq, 0, "collect every N steps, or 0 for Python's automatic collection")


def check_dataset(section: str, dataset: str, dataset_path: str) -> None:
    """`section`'s dataset is a kind torchmoe reads, with the path that kind needs."""
    one_of(f"{section}.dataset", dataset, DATASETS)
    if dataset in ("local", "tokens", "hf", "chat") and not dataset_path:
        what = {"local": "files (a file, folder or glob)", "tokens": "a folder written by `torchmoe prepare-data`",
                "hf": "the hub dataset ('name' or 'name:config')",
                "chat": "chat rows (.jsonl/.json/.parquet files, a folder or glob of them, or a saved dataset)"}[dataset]
        raise ConfigError(f"{section}.dataset_path", dataset_path, f"dataset = {show_value(dataset)} needs a path",
                          f"set dataset_path to {what}")


def validate_validation(validation: Validation) -> None:
    check_dataset("validation", validation.dataset, validation.dataset_path)
    for key in ("local_batch_size", "seq_len", "freq"):
        _at_least(f"validation.{key}", getattr(validation, key), 1)
    if validation.steps != -1:
        _at_least("validation.steps", validation.steps, 1, "set a number of batches, or -1 for one pass over the data")


def _check_stage_keys_agree(parallelism: Parallelism) -> None:
    """Both `pipeline_parallel_layers_per_stage` and `module_fqns_per_model_part` split the model
    into stages; the explicit stages are what runs (as in torchtitan, whose own presets set both,
    saying the same). Set together, they must agree: every explicit stage holds that many blocks,
    the last one at most that many. Otherwise one would be silently ignored."""
    per_stage, parts = parallelism.pipeline_parallel_layers_per_stage, parallelism.module_fqns_per_model_part
    if per_stage == -1 or not parts:
        return
    blocks = [sum(fqn.startswith("layers.") for fqn in part) for part in parts]
    if all(n == per_stage for n in blocks[:-1]) and 0 < blocks[-1] <= per_stage:
        return
    raise ConfigError("parallelism.pipeline_parallel_layers_per_stage", per_stage,
                      f"parallelism.module_fqns_per_model_part also sets the stages, with {blocks} blocks per stage: "
                      "the explicit stages would run and this be ignored",
                      "set only one (pipeline_parallel_layers_per_stage = -1 keeps the explicit stages), or make them "
                      "agree")


def validate_parallelism(parallelism: Parallelism) -> None:
    """The non-degree settings; the degrees are checked by `degrees.resolve_degrees`."""
    one_of("parallelism.pipeline_parallel_schedule", parallelism.pipeline_parallel_schedule, PIPELINE_SCHEDULES)
    _at_least("parallelism.pipeline_parallel_microbatch_size", parallelism.pipeline_parallel_microbatch_size, 1)
    for key in ("pipeline_parallel_microbatches", "pipeline_parallel_layers_per_stage"):
        if getattr(parallelism, key) != -1:
            _at_least(f"parallelism.{key}", getattr(parallelism, key), 1, "set a positive value, or -1 for the default")
    _check_stage_keys_agree(parallelism)
    one_of("parallelism.fsdp_reshard_after_forward", parallelism.fsdp_reshard_after_forward, RESHARD_POLICIES)
    etp, tp, ep = (parallelism.expert_tensor_parallel_degree, parallelism.tensor_parallel_degree,
                   parallelism.expert_parallel_degree)
    if etp not in (1, tp):
        raise ConfigError("parallelism.expert_tensor_parallel_degree", etp,
                          f"must be 1 or tensor_parallel_degree ({tp})", "set it to 1 (or leave it out)")
    if etp > 1 and ep > 1:
        raise ConfigError("parallelism.expert_tensor_parallel_degree", etp,
                          f"experts sharded over ep({ep}) and tp({tp}) at once (2-D) are not supported",
                          "set expert_tensor_parallel_degree = 1: EP then borrows the tp ranks")


def validate_comm(comm: Comm) -> None:
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        _timeout(f"comm.{key}", getattr(comm, key))
    _at_least("comm.trace_buf_size", comm.trace_buf_size, 0, "use 0 to turn the flight recorder off")


def _timeout(key: str, value: int, alternative: str = "") -> None:
    """A collective timeout in seconds: at least 1, and within what c10d can hold."""
    _at_least(key, value, 1, "set it to 1 or more" + (f", or {alternative}" if alternative else ""))
    # timedelta and c10d's millisecond counts overflow beyond this (2**31 s is 68 years).
    if value > MAX_TIMEOUT_SECONDS:
        raise ConfigError(key, value, f"must be <= {MAX_TIMEOUT_SECONDS} seconds", "set a timeout in seconds, e.g. 600")


def validate_checkpoint(checkpoint: Checkpoint) -> None:
    _at_least("checkpoint.interval", checkpoint.interval, 1)
    if checkpoint.timeout_seconds != -1:
        _timeout("checkpoint.timeout_seconds", checkpoint.timeout_seconds, "-1 for comm.init_timeout_seconds")
    _at_least("checkpoint.keep_latest_k", checkpoint.keep_latest_k, 0, "use 0 to keep every checkpoint")
    one_of("checkpoint.async_mode", checkpoint.async_mode, CHECKPOINT_ASYNC_MODES)
    one_of("checkpoint.export_dtype", checkpoint.export_dtype, EXPORT_DTYPES)
    if checkpoint.load_step != -1:
        _at_least("checkpoint.load_step", checkpoint.load_step, 0, "name a saved step, or -1 for the newest")
    for part in checkpoint.exclude_from_loading:
        if part == "train_state":  # torchtitan's step counter: here the step is the checkpoint's name
            raise ConfigError("checkpoint.exclude_from_loading", part, "the step count always continues from the "
                              "checkpoint (a run's step-N folders must keep growing)",
                              "leave train_state out; to start counting again, start a run in a new job.dump_folder "
                              "with checkpoint.initial_load_path")
        one_of("checkpoint.exclude_from_loading", part, CHECKPOINT_PARTS)
    if checkpoint.load_only and checkpoint.create_seed_checkpoint:
        raise ConfigError("checkpoint.load_only", True, "a seed checkpoint is a save, which load_only forbids",
                          "set load_only = false to write the seed checkpoint")
    if checkpoint.create_seed_checkpoint and not checkpoint.enable:
        raise ConfigError("checkpoint.create_seed_checkpoint", True, "needs checkpoint.enable = true",
                          "add --checkpoint.enable true")
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf", True, "no checkpoint.initial_load_path to load from",
                          "set initial_load_path to a Hugging Face folder of model.name's family, or "
                          "initial_load_in_hf = false")


def validate_activation_checkpoint(ac: ActivationCheckpoint) -> None:
    one_of("activation_checkpoint.mode", ac.mode, AC_MODES)
    option = ac.selective_ac_option
    if option != "op" and not (option.isdecimal() and option.isascii() and int(option) >= 1):
        raise ConfigError("activation_checkpoint.selective_ac_option", option,
                          "must be 'op' or a positive integer n", 'use "op" or e.g. "2" (every 2nd block)')


def validate_compile(compile_cfg: Compile) -> None:
    for component in compile_cfg.components:
        one_of("compile.components", component, COMPILE_COMPONENTS)
    if not compile_cfg.backend:
        raise ConfigError("compile.backend", "", "must name a torch.compile backend", 'use "inductor"')


def validate_float8(float8: Float8) -> None:
    one_of("float8.recipe_name", float8.recipe_name, FLOAT8_RECIPES)
    if float8.enable and float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        raise ConfigError("float8.enable_fsdp_float8_all_gather", True,
                          f"only works with recipe_name = \"tensorwise\", not {show_value(float8.recipe_name)}",
                          "set enable_fsdp_float8_all_gather = false or recipe_name = \"tensorwise\"")


def validate_lora(lora: LoRA) -> None:
    if not lora.enable:
        return
    if not lora.targets:
        raise ConfigError("lora.targets", lora.targets, "names nothing to adapt",
                          f"list one or more of {', '.join(show_value(t) for t in LORA_TARGETS)}")
    for target in lora.targets:
        one_of("lora.targets", target, LORA_TARGETS)
    if len(set(lora.targets)) != len(lora.targets):
        raise ConfigError("lora.targets", lora.targets, "names a target twice", "list each target once")
    if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or lora.rank < 1:
        raise ConfigError("lora.rank", lora.rank, "must be an integer >= 1", "set a rank such as 16")
    _positive("lora.alpha", lora.alpha)
    low, high = LORA_SCALING
    if not low <= lora.alpha / lora.rank <= high:
        raise ConfigError("lora.alpha", lora.alpha, f"scales the adapters' output by alpha / rank = {lora.alpha:g} / "
                          f"{lora.rank} = {lora.alpha / lora.rank:.4g}, outside [{low:g}, {high:g}]: below it the "
                          "adapters' gradients sink under the optimizer's eps and they barely train; above it their "
                          "first steps swamp the frozen weights (alpha 1e308 overflowed to NaN at step 1)",
                          f"set alpha between {low * lora.rank:g} and {high * lora.rank:g} for rank {lora.rank} "
                          "(PEFT's recipes use alpha = rank to 2 * rank)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError("lora.dropout", lora.dropout, "must lie in [0, 1)", "set a value such as 0.05, or 0")
    one_of("lora.export", lora.export, LORA_EXPORTS)
    parameter_targets = [t for t in lora.targets if t in LORA_PARAMETER_TARGETS]
    if lora.dropout and lora.export == "adapter" and parameter_targets:
        raise ConfigError("lora.dropout", lora.dropout, f"PEFT's adapters on {' and '.join(parameter_targets)} "
                          "(target_parameters) take no dropout, so the adapter export could not say how they "
                          "trained", 'set lora.dropout = 0, or lora.export = "merged"')


def validate_fault_tolerance(ft: FaultTolerance) -> None:
    """The `[fault_tolerance]` keys among themselves (torchtitan's files set them with enable
    false too, so the names and ranges are checked either way); the layout's side is the
    preflight's (`preflight.fault_tolerance`)."""
    one_of("fault_tolerance.process_group", ft.process_group, FT_PROCESS_GROUPS)
    one_of("fault_tolerance.semi_sync_method", ft.semi_sync_method, SEMI_SYNC_METHODS)
    one_of("fault_tolerance.gradient_average", ft.gradient_average, GRADIENT_AVERAGES)
    for key, example in (("process_group_timeout_ms", 10000), ("lighthouse_timeout_ms", 10000)):
        value = getattr(ft, key)
        if not 1 <= value <= MAX_TIMEOUT_SECONDS * 1000:
            raise ConfigError(f"fault_tolerance.{key}", value, f"must lie in 1 .. {MAX_TIMEOUT_SECONDS * 1000} "
                              "milliseconds", f"set a timeout in milliseconds, e.g. {example}")
    if ft.async_quorum and ft.semi_sync_method:
        raise ConfigError("fault_tolerance.async_quorum", True,
                          f"is for groups that meet every step; semi_sync_method = {show_value(ft.semi_sync_method)} "
                          "meets at syncs, whose quorum must form before the parameters are averaged",
                          "set async_quorum = false, or semi_sync_method = \"\"")
    _at_least("fault_tolerance.sync_steps", ft.sync_steps, 1)
    _at_least("fault_tolerance.num_fragments", ft.num_fragments, 1)
    if ft.num_fragments > 1 and ft.semi_sync_method != "diloco":
        raise ConfigError("fault_tolerance.num_fragments", ft.num_fragments,
                          "splits DiLoCo's syncs (streaming DiLoCo), and semi_sync_method is "
                          f"{show_value(ft.semi_sync_method)}", 'set semi_sync_method = "diloco", or num_fragments = 1')
    if ft.sync_steps % ft.num_fragments:
        raise ConfigError("fault_tolerance.sync_steps", ft.sync_steps,
                          f"must be a multiple of num_fragments ({ft.num_fragments}): a fragment syncs every "
                          "sync_steps / num_fragments steps", f"use a multiple of {ft.num_fragments}")
    period = ft.sync_steps // ft.num_fragments
    if not 0 <= ft.fragment_sync_delay < period:
        raise ConfigError("fault_tolerance.fragment_sync_delay", ft.fragment_sync_delay,
                          f"must lie in 0 .. sync_steps / num_fragments - 1 = {period - 1}: a fragment's sync "
                          "completes before the next one starts", f"use 0 .. {period - 1}")
    if not 0.0 <= ft.fragment_update_alpha <= 1.0:
        raise ConfigError("fault_tolerance.fragment_update_alpha", ft.fragment_update_alpha, "must lie in [0, 1]",
                          "use 0 (the outer step's parameters) .. 1 (this group's own)")
    _positive("fault_tolerance.outer_lr", ft.outer_lr)
    if not 0.0 <= ft.outer_momentum < 1.0:
        raise ConfigError("fault_tolerance.outer_momentum", ft.outer_momentum, "must lie in [0, 1)",
                          "set a momentum such as 0.9 (0 for none)")
    if not ft.enable:
        return
    if ft.group_size < 1:
        raise ConfigError("fault_tolerance.group_size", ft.group_size, "must be >= 1 with fault_tolerance.enable "
                          "(the replica groups of the job)", "set the number of replica groups, e.g. 2")
    if not 0 <= ft.replica_id < ft.group_size:
        raise ConfigError("fault_tolerance.replica_id", ft.replica_id,
                          f"must lie in 0 .. group_size - 1 = {ft.group_size - 1}",
                          "give each group's launch its own id, e.g. --fault_tolerance.replica_id 1")
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise ConfigError("fault_tolerance.min_replica_size", ft.min_replica_size,
                          f"must lie in 1 .. group_size = {ft.group_size}",
                          "set how many groups must join a step for it to commit, e.g. 1")


def validate_metrics(metrics: Metrics) -> None:
    _at_least("metrics.log_freq", metrics.log_freq, 1)
    one_of("metrics.log_level", metrics.log_level, LOG_LEVELS)


def validate_profiling(profiling: Profiling, training_steps: int) -> None:
    """Ranges of the profiler's schedule; a step breakdown needs a traced step within the run."""
    _at_least("profiling.profile_freq", profiling.profile_freq, 1)
    _at_least("profiling.profiler_active", profiling.profiler_active, 1)
    _at_least("profiling.profiler_warmup", profiling.profiler_warmup, 0)
    if profiling.profiler_active > profiling.profile_freq:
        raise ConfigError("profiling.profiler_active", profiling.profiler_active,
                          f"more traced steps than the cycle has (profile_freq = {profiling.profile_freq})",
                          "trace fewer steps per cycle, or raise profile_freq")
    if profiling.enable_step_breakdown and profiling.profile_freq > training_steps:
        raise ConfigError("profiling.profile_freq", profiling.profile_freq,
                          f"traces no step of a {training_steps}-step run (training.steps), so "
                          "profiling.enable_step_breakdown would report nothing",
                          f"set profile_freq to at most {training_steps}")


def validate_sections(cfg: JobConfig) -> None:
    """Check each section of `cfg` on its own (ranges, allowed names, 64-bit integers).

    Raises:
        ConfigError: the first problem found, naming the key, the value and the fix.
    """
    validate_int64(cfg)
    validate_paths(cfg)
    validate_job(cfg.job)
    validate_model(cfg.model)
    validate_optimizer(cfg.optimizer)
    validate_lr_scheduler(cfg.lr_scheduler)
    validate_training(cfg.training)
    validate_parallelism(cfg.parallelism)
    validate_checkpoint(cfg.checkpoint)
    validate_comm(cfg.comm)
    validate_activation_checkpoint(cfg.activation_checkpoint)
    validate_compile(cfg.compile)
    validate_float8(cfg.float8)
    validate_lora(cfg.lora)
    if cfg.lora.enable and cfg.optimizer.name == "Muon":
        # Muon orthogonalises whole weight matrices; an adapter's rank-r factors are no such
        # matrix, and PEFT's recipe trains them with AdamW.
        raise ConfigError("optimizer.name", "Muon", "with lora.enable = true: Muon is for training whole weight "
                          "matrices, not LoRA's low-rank adapters", 'set optimizer.name = "AdamW" for LoRA, or '
                          "lora.enable = false to train every weight with Muon")
    validate_metrics(cfg.metrics)
    validate_profiling(cfg.profiling, cfg.training.steps)
    validate_validation(cfg.validation)
    validate_fault_tolerance(cfg.fault_tolerance)
