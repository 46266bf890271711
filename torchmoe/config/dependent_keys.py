"""The settings that only matter under another setting: one rule per dependency, in one table.

    warnings = check_dependent_keys(cfg, flags={"lora.rank": "--lora.rank"}, file={})  # ConfigError

``--lora.rank 4 --lora.targets attention`` without ``--lora.enable true`` trained the whole model
and wrote a merged full checkpoint, without a word. Every key of `RULES` does something only
while its rule holds (its section's switch is on, its mode is chosen, the data it reads is
read); a key set where its rule does not hold is:

- given as a **flag**: refused (`ConfigError`, exit 2), naming the flag, what it needs, the job's
  value of that, and both ways out (``add --lora.enable true, or drop --lora.rank``): a flag is
  typed for this run, so the run it asks for is not the one that would train;
- written in a **job file**: one warning line per key, the file still runs (a file may keep a
  switched-off section's settings for later, as torchtitan's own files do). A key at its default
  asks for nothing and stays quiet, and so does one whose switch a flag set (the command line
  turned the section off on purpose). A run's own config.toml writes every key out
  (`job_file.RESOLVED_HEADER`): the run said its warnings when it started, so reading it back
  (`eval`, `generate`, a resume from it) says none.

Keys that are wrong rather than idle are refused by `validate` instead, file or flag (a seed
checkpoint without `checkpoint.enable`, `checkpoint.initial_load_in_hf` without a folder,
`fault_tolerance.num_fragments` without DiLoCo), and the ones that need the model or the layout
by `preflight` (QK-Clip on a model whose every layer has QK-norm, FSDP's CPU offload without
FSDP, multi-token prediction outside DeepSeek-V3). A mixture's sources (`training.dataset_mix`)
are parsed by `data`, which this leaf cannot import: with a mixture, every data key counts as read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.files.paths import key_value
from torchmoe.config.job_config import JobConfig

__all__ = ["RULES", "Needs", "check_dependent_keys", "unused_rule"]


@dataclass(frozen=True)
class Needs:
    """`keys` do something only while `holds(cfg)`.

    Attributes:
        keys: the dependent ``section.key`` names.
        when: the condition as a user reads it, e.g. ``lora.enable = true``.
        reads: the keys `holds` reads: messages show their values, and a switch among them set by
            a flag silences the job file's warnings.
        holds: whether the job uses `keys`.
        turn_on: settings that make it hold (the first way out a message offers), or empty where
            no one value is the way (a warmup of some length).
    """

    keys: tuple[str, ...]
    when: str
    reads: tuple[str, ...]
    holds: Callable[[JobConfig], bool]
    turn_on: tuple[tuple[str, Any], ...] = ()


def _switch(key: str, dependents: tuple[str, ...]) -> Needs:
    """`dependents` need the boolean `key` to be true."""
    return Needs(dependents, f"{key} = true", (key,), lambda cfg: key_value(cfg, key) is True, ((key, True),))


def _section(section: str, *, but: tuple[str, ...]) -> tuple[str, ...]:
    """Every key of `section` but those of `but` (its switch)."""
    fields = {f.name: f for f in dataclasses.fields(JobConfig)}
    return tuple(f"{section}.{f.name}" for f in dataclasses.fields(fields[section].default_factory())
                 if f.name not in but)


_CHAT = "chat"


def _kinds(cfg: JobConfig, *, validation: bool) -> set[str] | None:
    """The dataset kinds the job reads (with `validation`, its validation data's too, which reads
    [training]'s text field, extensions and chat settings); None where a mixture names them."""
    if cfg.training.dataset_mix:
        return None
    kinds = {cfg.training.dataset}
    if validation and cfg.validation.enable:
        kinds.add(cfg.validation.dataset)
    return kinds


def _reads(kinds: tuple[str, ...], *, validation: bool) -> Callable[[JobConfig], bool]:
    """Whether the job reads data of one of `kinds`."""
    def holds(cfg: JobConfig) -> bool:
        read = _kinds(cfg, validation=validation)
        return read is None or bool(read & set(kinds))
    return holds


def _data(keys: tuple[str, ...], kinds: tuple[str, ...], what: str, *, validation: bool = True) -> Needs:
    """`keys` of [training] that only a data kind of `kinds` reads."""
    both = "training.dataset or validation.dataset" if validation else "training.dataset"
    shown = " or ".join(show_value(k) for k in kinds)
    return Needs(keys, f"{what} ({both} {shown}, or a training.dataset_mix)",
                 ("training.dataset", "training.dataset_mix", *(("validation.dataset",) if validation else ())),
                 _reads(kinds, validation=validation))


def _adamw_decay(cfg: JobConfig) -> float:
    """The weight decay of the parameters decay_all_params puts under it (with Muon: the AdamW ones)."""
    opt = cfg.optimizer
    return opt.adamw_weight_decay if opt.name == "Muon" and opt.adamw_weight_decay != -1 else opt.weight_decay


_MUON_KEYS = ("optimizer.momentum", "optimizer.nesterov", "optimizer.ns_steps", "optimizer.ns_coefficients",
              "optimizer.ns_eps", "optimizer.ns_dtype", "optimizer.adjust_lr", "optimizer.muon_router",
              "optimizer.muon_params", "optimizer.adamw_params", "optimizer.adamw_lr", "optimizer.adamw_weight_decay")
_PP_KEYS = ("parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size",
            "parallelism.pipeline_parallel_microbatches", "parallelism.pipeline_parallel_layers_per_stage",
            "parallelism.module_fqns_per_model_part")
_CHECKPOINT_KEYS = ("checkpoint.interval", "checkpoint.keep_latest_k", "checkpoint.async_mode",
                    "checkpoint.last_save_model_only", "checkpoint.load_step", "checkpoint.exclude_from_loading",
                    "checkpoint.enable_first_step_checkpoint", "checkpoint.load_only")
_SEMI_SYNC = ("local_sgd", "diloco")

def _assets_read(cfg: JobConfig) -> bool:
    """Whether `model.hf_assets_path` gave the tokenizer or the weights (`loader._with_hf_assets`
    filled them with it where they were not set; a path given as well is the same one)."""
    assets, ckpt = cfg.model.hf_assets_path, cfg.checkpoint
    return cfg.model.tokenizer_path == assets or (ckpt.initial_load_in_hf and ckpt.initial_load_path == assets)


RULES: tuple[Needs, ...] = (
    # [model]
    Needs(("model.hf_assets_path",), "model.tokenizer_path not set (the folder's tokenizer), or "
          "checkpoint.initial_load_in_hf = true without checkpoint.initial_load_path (its weights)",
          ("model.tokenizer_path", "checkpoint.initial_load_in_hf", "checkpoint.initial_load_path"), _assets_read),
    Needs(("model.mtp_loss_coeff",), "model.mtp_layers > 0", ("model.mtp_layers",),
          lambda cfg: cfg.model.mtp_layers > 0, (("model.mtp_layers", 1),)),
    # [optimizer]
    Needs(_MUON_KEYS, 'optimizer.name = "Muon"', ("optimizer.name",), lambda cfg: cfg.optimizer.name == "Muon",
          (("optimizer.name", "Muon"),)),
    Needs(("optimizer.decay_all_params",), "a weight decay to apply (optimizer.weight_decay > 0; with Muon, "
          "optimizer.adamw_weight_decay's)", ("optimizer.weight_decay", "optimizer.adamw_weight_decay"),
          lambda cfg: _adamw_decay(cfg) > 0),
    # [lr_scheduler]
    Needs(("lr_scheduler.warmup_reaches_peak",), "a warmup (lr_scheduler.warmup_steps > 0)",
          ("lr_scheduler.warmup_steps",), lambda cfg: cfg.lr_scheduler.warmup_steps > 0),
    Needs(("lr_scheduler.decay_type", "lr_scheduler.min_lr_factor", "lr_scheduler.total_steps"),
          "a decay (lr_scheduler.decay_ratio other than 0)", ("lr_scheduler.decay_ratio",),
          lambda cfg: cfg.lr_scheduler.decay_ratio != 0, (("lr_scheduler.decay_ratio", -1.0),)),
    Needs(("lr_scheduler.decay_type",), "a decay that lowers the LR (lr_scheduler.min_lr_factor < 1)",
          ("lr_scheduler.min_lr_factor",), lambda cfg: cfg.lr_scheduler.min_lr_factor < 1),
    # [training]: what each data kind reads
    Needs(("training.dataset",), "no training.dataset_mix (a mixture names each source's dataset)",
          ("training.dataset_mix",), lambda cfg: not cfg.training.dataset_mix),
    # (beside a mixture it is the preflight's: "set together with training.dataset_mix")
    Needs(("training.dataset_path",), 'a dataset read from a path (training.dataset other than "python_docs")',
          ("training.dataset",), lambda cfg: cfg.training.dataset != "python_docs" or bool(cfg.training.dataset_mix)),
    _data(("training.loss_on", "training.chat_overlong"), (_CHAT,), "chat data"),
    _data(("training.dataset_split",), ("hf", _CHAT), "a hub dataset or a saved chat dataset", validation=False),
    _data(("training.dataset_text_field",), ("local", "hf", "c4", "c4_validation", "c4_test"), "rows with fields"),
    _data(("training.dataset_extensions",), ("local", _CHAT, "c4_test"), "folders or globs of files"),
    # [parallelism]
    Needs(_PP_KEYS, "pipeline parallelism (parallelism.pipeline_parallel_degree > 1)",
          ("parallelism.pipeline_parallel_degree",), lambda cfg: cfg.parallelism.pipeline_parallel_degree > 1),
    Needs(("parallelism.enable_async_tensor_parallel", "parallelism.disable_loss_parallel"),
          "tensor parallelism (parallelism.tensor_parallel_degree > 1)", ("parallelism.tensor_parallel_degree",),
          lambda cfg: cfg.parallelism.tensor_parallel_degree > 1),
    # [checkpoint]
    _switch("checkpoint.enable", _CHECKPOINT_KEYS),
    _switch("checkpoint.last_save_model_only", ("checkpoint.export_dtype",)),
    Needs(("checkpoint.folder",), "checkpoint.enable = true or checkpoint.last_save_in_hf = true",
          ("checkpoint.enable", "checkpoint.last_save_in_hf"),
          lambda cfg: cfg.checkpoint.enable or cfg.checkpoint.last_save_in_hf, (("checkpoint.enable", True),)),
    _switch("checkpoint.last_save_in_hf", ("checkpoint.hf_drop_expert_bias",)),
    # [activation_checkpoint]
    Needs(("activation_checkpoint.early_stop",), 'activation checkpointing (activation_checkpoint.mode other than '
          '"none")', ("activation_checkpoint.mode",), lambda cfg: cfg.activation_checkpoint.mode != "none",
          (("activation_checkpoint.mode", "selective"),)),
    Needs(("activation_checkpoint.selective_ac_option",
           "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns"), 'activation_checkpoint.mode = "selective"', ("activation_checkpoint.mode",),
          lambda cfg: cfg.activation_checkpoint.mode == "selective", (("activation_checkpoint.mode", "selective"),)),
    Needs(("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",),
          'activation_checkpoint.selective_ac_option = "op"', ("activation_checkpoint.selective_ac_option",),
          lambda cfg: cfg.activation_checkpoint.selective_ac_option == "op",
          (("activation_checkpoint.selective_ac_option", "op"),)),
    # [compile], [float8], [lora]
    _switch("compile.enable", _section("compile", but=("enable",))),
    _switch("float8.enable", ("float8.recipe_name", "float8.enable_fsdp_float8_all_gather", "float8.filter_fqns",
                              "float8.emulate")),
    _switch("float8.enable_fsdp_float8_all_gather", ("float8.precompute_float8_dynamic_scale_for_fsdp",)),
    _switch("float8.routed_experts", ("float8.moe_fqns",)),
    _switch("lora.enable", _section("lora", but=("enable",))),
    _switch("checkpoint.enable", ("lora.checkpoint_base",)),
    # [comm], [metrics], [profiling]
    Needs(("comm.save_traces_folder", "comm.save_traces_file_prefix"), "the flight recorder (comm.trace_buf_size > 0)",
          ("comm.trace_buf_size",), lambda cfg: cfg.comm.trace_buf_size > 0, (("comm.trace_buf_size", 20000),)),
    _switch("metrics.enable_tensorboard", ("metrics.save_tb_folder",)),
    _switch("metrics.enable_wandb", ("metrics.wandb_project", "metrics.wandb_run_name", "metrics.wandb_tags")),
    Needs(("profiling.profile_freq", "profiling.profiler_active", "profiling.profiler_warmup",
           "profiling.save_traces_folder"),
          "profiling.enable_profiling = true or profiling.enable_step_breakdown = true",
          ("profiling.enable_profiling", "profiling.enable_step_breakdown"),
          lambda cfg: cfg.profiling.enable_profiling or cfg.profiling.enable_step_breakdown,
          (("profiling.enable_profiling", True),)),
    _switch("profiling.enable_memory_snapshot", ("profiling.save_memory_snapshot_folder",)),
    # [validation]
    _switch("validation.enable", _section("validation", but=("enable",))),
    Needs(("validation.dataset_split",), 'a hub dataset or a saved chat dataset (validation.dataset "hf" or "chat")',
          ("validation.dataset",), lambda cfg: cfg.validation.dataset in ("hf", _CHAT)),
    # [fault_tolerance]
    _switch("fault_tolerance.enable", _section("fault_tolerance", but=("enable",))),
    Needs(("fault_tolerance.sync_steps",), 'fault_tolerance.semi_sync_method = "local_sgd" or "diloco"',
          ("fault_tolerance.semi_sync_method",), lambda cfg: cfg.fault_tolerance.semi_sync_method in _SEMI_SYNC,
          (("fault_tolerance.semi_sync_method", "diloco"),)),
    Needs(("fault_tolerance.should_quantize",), 'fault_tolerance.semi_sync_method = "local_sgd" or "diloco"',
          ("fault_tolerance.semi_sync_method",), lambda cfg: cfg.fault_tolerance.semi_sync_method in _SEMI_SYNC,
          (("fault_tolerance.semi_sync_method", "diloco"),)),
    Needs(("fault_tolerance.outer_lr", "fault_tolerance.outer_momentum", "fault_tolerance.outer_nesterov",
           "fault_tolerance.num_fragments"), 'fault_tolerance.semi_sync_method = "diloco"',
          ("fault_tolerance.semi_sync_method",), lambda cfg: cfg.fault_tolerance.semi_sync_method == "diloco",
          (("fault_tolerance.semi_sync_method", "diloco"),)),
    Needs(("fault_tolerance.fragment_sync_delay", "fault_tolerance.fragment_update_alpha"),
          "streaming DiLoCo (fault_tolerance.num_fragments > 1)", ("fault_tolerance.num_fragments",),
          lambda cfg: cfg.fault_tolerance.num_fragments > 1),
)


def unused_rule(cfg: JobConfig, key: str) -> Needs | None:
    """The first rule of `key` that `cfg` does not meet (the key then does nothing), else None."""
    return next((rule for rule in RULES if key in rule.keys and not rule.holds(cfg)), None)


def _state(cfg: JobConfig, rule: Needs) -> str:
    return ", ".join(f"{key} = {show_value(key_value(cfg, key))}" for key in rule.reads)


def _flag_value(value: Any) -> str:
    """`value` as a flag takes it: ``true``, ``Muon``, ``-1.0``."""
    return show_value(value) if isinstance(value, (bool, list)) else str(value)


def check_dependent_keys(cfg: JobConfig, *, flags: Mapping[str, str], file: Mapping[str, str],
                         runs_with: Mapping[str, Any] | None = None) -> list[str]:
    """Refuse a flag that sets a key the job does not use; return one warning line per such key of
    the job file (module docstring).

    Args:
        cfg: the job, flags applied.
        flags: ``section.key`` -> the flag that set it, as typed (a torchtitan flag names the key it maps to).
        file: ``section.key`` -> the name the job file gives it (torchtitan's, for a key it maps).
        runs_with: settings the command applies whatever the job says (``torchmoe eval``:
            ``validation.enable = true``), against which the rules are judged.

    Raises:
        ConfigError: naming the first flag that does nothing, what it needs and the fix.
    """
    judged = _with(cfg, runs_with or {})
    for key, flag in flags.items():
        rule = unused_rule(judged, key)
        if rule is None:
            continue
        on = " ".join(f"--{k} {_flag_value(v)}" for k, v in rule.turn_on)
        fix = f"add {on}, or drop {flag}" if on else f"drop {flag}, or give the job {rule.when}"
        raise ConfigError(flag, key_value(cfg, key), f"has no effect: it only matters with {rule.when}, and this job "
                          f"has {_state(cfg, rule)}", fix)
    defaults = JobConfig()  # a file's key at its default asks for nothing
    warnings = []
    for key, name in file.items():
        rule = unused_rule(judged, key)
        if rule is None or key in flags or key_value(cfg, key) == key_value(defaults, key) or \
                any(read in flags for read in rule.reads):
            continue
        on = "".join(f"set {k} = {show_value(v)}, or " for k, v in rule.turn_on)
        warnings.append(f"{name} = {show_value(key_value(cfg, key))} in the job file has no effect: it only matters "
                        f"with {rule.when}, and the job has {_state(cfg, rule)} ({on}remove {name})")
    return warnings


def _with(cfg: JobConfig, settings: Mapping[str, Any]) -> JobConfig:
    """`cfg` with `settings` (``section.key`` -> value) applied."""
    for key, value in settings.items():
        section, _, leaf = key.partition(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{leaf: value})})
    return cfg
