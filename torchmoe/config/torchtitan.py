"""torchtitan v0.2.2 job files, as they are: every key of its `JobConfig` has a meaning here.

    python -c "from torchmoe.config.torchtitan import translate; print(translate('debug.seed', 7))"

Most of torchtitan's keys are torchmoe's own under the same name (`training.steps`,
`training.dtype`, `activation_checkpoint.early_stop`, `checkpoint.load_step`, ...) and
`job_file.py` (a file) and `loader.py` (a flag) read them as such. This module holds the other 51, and one model argument its
flavors set (`model.attn_mask_type`, accepted as a key too), each either

- **mapped** onto the torchmoe keys that do the same (`debug.seed` is `training.seed`,
  `[quantize.linear.float8]` is `[float8]`, `model.converters = ["quantize.linear.float8"]` is
  `float8.enable`, `debug.moe_force_load_balance` is `model.moe_force_load_balance`), or
- **refused** unless at torchtitan's default: what its other values do changes the numbers
  trained or the memory of a rank, and torchmoe does not do it (`optimizer.early_step_in_backward`,
  a full-state `checkpoint.initial_load_model_only = false`, the pipeline split and schedule-file
  keys, ...). One `ConfigError` (exit 2) names the key, its value,
  what torchtitan would do and the fix; or
- **without effect** here, with the reason: keys of speed, logging and tooling. Such a key is
  accepted; set to anything but torchtitan's default it gets one warning line saying why it does
  nothing (a default value asks for nothing, so it stays quiet: torchtitan's own files list many
  keys at their defaults). Keys that only tune a feature switched on elsewhere (the MX and
  grouped-GEMM tables, which only a refused converter reads) never warn: the switch does.

Other values that ask for something torchmoe cannot do and that would change what is trained (MX
formats; and, checked with torchmoe's own keys, 2-D expert sharding or another model family) are
`ConfigError`s too, never warnings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchmoe.config.errors import ConfigError, show_value

__all__ = ["TORCHTITAN_KEYS", "Mapped", "NoEffect", "Refused", "translate"]


@dataclass(frozen=True)
class Mapped:
    """A torchtitan key that torchmoe spells differently: `to(value)` gives the torchmoe
    ``{"section.key": value}`` that mean the same, `means` says which (for docs/config.md)."""

    typ: Any
    to: Callable[[Any], dict[str, Any]]
    means: str


@dataclass(frozen=True)
class Refused:
    """A torchtitan key whose other values change what is trained (the numbers, or the memory of
    a rank) in a way torchmoe does not do: any value but torchtitan's `default` is a
    `ConfigError` saying `why` (what torchtitan would do) and the `fix`."""

    typ: Any
    default: Any
    why: str
    fix: str


@dataclass(frozen=True)
class NoEffect:
    """A torchtitan key without a torchmoe meaning; `default` is torchtitan's (`TUNES`: a key
    that tunes a feature another key switches on, which warns instead), `why` the reason."""

    typ: Any
    default: Any
    why: str


TUNES = object()  # NoEffect.default of a key that never warns (see the module docstring)


def _alias(typ: Any, key: str) -> Mapped:
    """torchtitan's name for torchmoe's `key`."""
    return Mapped(typ, lambda value: {key: value}, f"`{key}`")


# model.converters: torchtitan v0.2.2's names, plus the "float8" of its older files and comments.
_FLOAT8_LINEAR = ("quantize.linear.float8", "float8")
# Converts the MoE modules quantize.grouped_mm.float8.fqns (torchmoe's float8.moe_fqns) names.
_FLOAT8_GROUPED = "quantize.grouped_mm.float8"
_CONVERTERS_REFUSED = {
    "quantize.linear.mx": "MX (microscaling) formats are not supported; use quantize.linear.float8",
    "quantize.grouped_mm.mx": "MX (microscaling) formats are not supported",
    "mx": "MX (microscaling) formats are not supported; use quantize.linear.float8",
}


def _converters(names: list[str]) -> dict[str, Any]:
    for name in names:
        if name in _CONVERTERS_REFUSED:
            raise ConfigError("model.converters", names, f"{show_value(name)}: {_CONVERTERS_REFUSED[name]}",
                              'use model.converters = ["quantize.linear.float8"] or []')
        if name not in (*_FLOAT8_LINEAR, _FLOAT8_GROUPED):
            raise ConfigError("model.converters", names, f"unknown converter {show_value(name)}",
                              'the converters torchmoe has are "quantize.linear.float8" (float8 linears) and '
                              '"quantize.grouped_mm.float8" (float8 routed experts)')
    # Both keys, on or off: torchtitan converts only what the list names, so `converters = []` beside
    # torchmoe's `[float8] enable = true` is a contradiction (refused), not float8 silently on.
    return {"float8.enable": any(name in _FLOAT8_LINEAR for name in names),
            "float8.routed_experts": _FLOAT8_GROUPED in names}


_MASK_TYPES = {"causal": False, "block_causal": True}


def _attn_mask_type(value: str) -> dict[str, Any]:
    if value not in _MASK_TYPES:
        raise ConfigError("model.attn_mask_type", value, "torchtitan's mask types are \"causal\" and "
                          "\"block_causal\" (attention within documents)",
                          'use "causal", or "block_causal" (torchmoe\'s training.document_masking = true)')
    return {"training.document_masking": _MASK_TYPES[value]}


_TRACKING = "rank 0 writes the metrics of the whole job (losses and norms are global)"
_LOADER = "torchmoe packs batches in the training process, a few documents ahead, without worker processes"
_CP = "torchmoe's context parallelism has its own load balance (head and tail chunks per rank) and exchange"
_FT = ("with fault_tolerance.enable, every replica group keeps every group's row position in memory (it rides in "
       "each committed step and with the live state, and is saved with checkpoints): a restarted group resumes its "
       "rows from it; without it there is nothing to save")
_PLUGINS = "torchmoe has no plugin modules: its configs and models are its own"
_MX = "MX formats are not supported (a model.converters entry for them is refused)"

TORCHTITAN_KEYS: dict[str, Mapped | Refused | NoEffect] = {
    # [job]
    "job.config_file": NoEffect(str, "", "the file is the one passed with --config (or --job.config_file)"),
    "job.save_config_file": NoEffect(str, "", "every run writes its resolved config to <dump_folder>/config.toml"),
    "job.custom_config_module": NoEffect(str, "", _PLUGINS),
    # [profiling] and [metrics]
    "metrics.save_for_all_ranks": NoEffect(bool, False, _TRACKING),
    # [model]
    "model.converters": Mapped(list[str], _converters, '`float8.enable` for "quantize.linear.float8" (or its old '
                               'name "float8"); `float8.routed_experts` for "quantize.grouped_mm.float8" '
                               '(of the modules `quantize.grouped_mm.float8.fqns` names); each false when the '
                               'list lacks it; the MX converters are refused'),
    # torchtitan's model argument (its flavors set it; the job key where a job file names it)
    "model.attn_mask_type": Mapped(str, _attn_mask_type, '`training.document_masking`: false for "causal", '
                                   'true for "block_causal"; any other value is refused'),
    # [optimizer]
    "optimizer.early_step_in_backward": Refused(
        bool, False, "torchtitan then steps each parameter in its gradient hook during the backward, without "
        "clipping by the global gradient norm: other numbers than torchmoe's clip-then-step",
        "set it to false (torchmoe steps after the backward, clipping at training.max_norm)"),
    # [training]
    "training.enable_cpu_offload": _alias(bool, "parallelism.fsdp_cpu_offload"),
    "training.gc_debug": NoEffect(bool, False, "no debug mode for the garbage collector (training.gc_freq sets "
                                  "how often it runs)"),
    "training.dataloader.num_workers": NoEffect(int, 0, _LOADER),
    "training.dataloader.persistent_workers": NoEffect(bool, TUNES, _LOADER),  # only with num_workers > 0
    "training.dataloader.pin_memory": NoEffect(bool, False, _LOADER),
    "training.dataloader.prefetch_factor": NoEffect(int, TUNES, _LOADER),
    # [parallelism]
    **{f"parallelism.pipeline_parallel_{end}_stage_less_layers": Refused(
        int, 1, f"torchtitan's layer-count split then gives the {end} pipeline stage blocks for that many layers "
        "fewer: another split, and other memory per rank, than torchmoe's cost model",
        "set the stages yourself with parallelism.module_fqns_per_model_part (or pipeline_parallel_layers_per_stage) "
        "and leave this key at 1") for end in ("first", "last")},
    "parallelism.pipeline_parallel_schedule_csv": Refused(
        str, "", "torchtitan then runs the schedule that file lists: another order of micro-batches, and other "
        "activations in flight per rank, than a named schedule", "choose a schedule by name with "
        "parallelism.pipeline_parallel_schedule and leave pipeline_parallel_schedule_csv empty"),
    "parallelism.pipeline_parallel_expert_parallel_overlap": NoEffect(
        bool, True, "torchmoe does not overlap the EP all-to-all with DualPipeV's other micro-batch"),
    "parallelism.context_parallel_load_balancer": NoEffect(str, "headtail", _CP),
    "parallelism.context_parallel_rotate_method": NoEffect(str, "allgather", _CP),
    "parallelism.expert_parallel_comm_backend": NoEffect(str, "standard", "tokens always travel by "
                                                         "all-to-all over the ep group (no DeepEP)"),
    # [checkpoint]
    "checkpoint.enable_ft_dataloader_checkpoints": NoEffect(bool, True, _FT),
    "checkpoint.initial_load_model_only": Refused(
        bool, True, "torchtitan then restores the whole training state (optimizer, schedule, data position, "
        "step) from checkpoint.initial_load_path; torchmoe loads only the weights from there",
        "to continue a run's full state, copy its step-N folder into <job.dump_folder>/<checkpoint.folder>/ (a run "
        "resumes from the newest there); for the weights alone, set initial_load_model_only = true"),
    "checkpoint.initial_load_in_hf_quantized": Refused(
        bool, False, "torchtitan then dequantizes quantized Hugging Face weights (FP8 blocks) as it loads them; "
        "torchmoe reads floating-point safetensors only",
        "load a bf16 or fp32 Hugging Face checkpoint, with initial_load_in_hf_quantized = false"),
    # [activation_checkpoint]
    "activation_checkpoint.memory_budget": NoEffect(float, 0.5, "the memory_budget mode is not supported "
                                                    "(use selective or full)"),
    "activation_checkpoint.visualize_memory_budget_pareto": NoEffect(bool, False, "the memory_budget mode is "
                                                                     "not supported"),
    "activation_checkpoint.preserve_rng_state": NoEffect(bool, True, "a block's recomputation replays its "
                                                         "forward's random draws exactly when it makes any "
                                                         "(LoRA's dropout), and saves no RNG state otherwise"),
    "activation_checkpoint.determinism_check": NoEffect(str, "default", "torch's default check is used"),
    "activation_checkpoint.debug": NoEffect(bool, False, "torch's checkpoint debug mode is not exposed"),
    # [quantize.*] (float8 linears are torchmoe's [float8])
    **{f"quantize.linear.float8.{key}": _alias(typ, f"float8.{key}") for key, typ in (
        ("enable_fsdp_float8_all_gather", bool), ("precompute_float8_dynamic_scale_for_fsdp", bool),
        ("recipe_name", str), ("filter_fqns", list[str]))},
    "quantize.linear.float8.emulate": _alias(bool, "float8.emulate"),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": NoEffect(str, TUNES, _MX),
    "quantize.linear.mx.recipe_name": NoEffect(str, TUNES, _MX),
    "quantize.linear.mx.filter_fqns": NoEffect(list[str], TUNES, _MX),
    "quantize.grouped_mm.float8.fqns": _alias(list[str], "float8.moe_fqns"),
    "quantize.grouped_mm.mx.recipe_name": NoEffect(str, TUNES, _MX),
    "quantize.grouped_mm.mx.fqns": NoEffect(list[str], TUNES, _MX),
    # [comm]
    "comm.mode": NoEffect(str, "default", "to plan a job without GPUs, run torchmoe train --dry-run "
                          "[--world-size N]"),
    # [memory_estimation]
    "memory_estimation.enable": NoEffect(bool, False, "the per-rank memory estimate is torchmoe train --dry-run's "
                                         "(and every real run is checked against it before it starts)"),
    "memory_estimation.disable_fake_mode": NoEffect(bool, False, "see memory_estimation.enable"),
    # [experimental]
    "experimental.custom_import": NoEffect(str, "", _PLUGINS),
    "experimental.custom_args_module": NoEffect(str, "", _PLUGINS),
    # [validation]
    "validation.dataloader.num_workers": NoEffect(int, 0, _LOADER),
    "validation.dataloader.persistent_workers": NoEffect(bool, TUNES, _LOADER),
    "validation.dataloader.pin_memory": NoEffect(bool, False, _LOADER),
    "validation.dataloader.prefetch_factor": NoEffect(int, TUNES, _LOADER),
    # [debug]
    "debug.seed": _alias(int, "training.seed"),
    "debug.deterministic": _alias(bool, "training.deterministic"),
    "debug.deterministic_warn_only": NoEffect(bool, False, "training.deterministic makes a nondeterministic "
                                              "op an error, never a warning"),
    "debug.moe_force_load_balance": _alias(bool, "model.moe_force_load_balance"),
}

# torchtitan's sections that torchmoe lacks; a key under them is looked up in TORCHTITAN_KEYS.
SECTIONS = ("quantize", "memory_estimation", "experimental", "debug")


def translate(key: str, value: Any) -> tuple[dict[str, Any], str | None]:
    """What torchtitan's `key` = `value` (already type-checked) means here: the torchmoe
    ``{"section.key": value}`` to apply, and a warning line (None when there is nothing to say)."""
    entry = TORCHTITAN_KEYS[key]
    if isinstance(entry, Mapped):
        return entry.to(value), None
    if isinstance(entry, Refused):
        if value != entry.default:
            raise ConfigError(key, value, f"{entry.why} (a torchtitan key torchmoe does not implement)", entry.fix)
        return {}, None
    if entry.default is TUNES or value == entry.default:
        return {}, None
    return {}, f"{key} = {show_value(value)} (a torchtitan key) has no effect in torchmoe: {entry.why}"
