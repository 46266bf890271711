"""The layout search behind `torchmoe plan`: every valid layout of a job, kept if it fits, ranked
by predicted step time.

    python -c "from torchmoe.config import load_job_config; from torchmoe.plan.search import search; \\
        from torchmoe.plan.hardware import load_profile; \\
        r = search(load_job_config(['--config', 'configs/debug_model.toml']), 4, load_profile('h100')); \\
        print(r.best.flags(), r.best.prediction.summary())"

What is searched (`PLAN_KEYS`): the six parallel degrees, the pipeline schedule and micro-batch
size, the local batch size (where a global batch size is set: it trades activation memory for
fewer accumulation steps), activation checkpointing, FSDP's reshard-after-forward policy and
float8 (only where the profile has float8 rates and the job computes in bf16). A key the user set
in the config or a flag stays fixed unless `free` releases it (a key, its section, or "all");
``data_parallel_shard_degree = -1`` is never fixed (it means "the rest"); explicit pipeline stages
(``module_fqns_per_model_part``, ``pipeline_parallel_layers_per_stage``) fix the pp degree.

Which layouts are valid is the training preflight's decision, handed in as `check` (the planner
stays below the preflight, which imports torch): a layout `torchmoe train` would refuse is not
scored. Tensor parallelism stays within a node (`gpus_per_node`): a TP group across nodes puts
four collectives per block on the network.

Fit: the memory estimate of the fullest rank (`plan.memory`) must stay under ``(1 - margin)`` of
the device (allocator fragmentation and communication buffers are not in the estimate).

Speed, in three phases (`search`):
  1. every family (an assignment of the degrees; dp_replicate 1, and plain DDP) is estimated in
     its most frugal layout (full AC, resharding, the smallest micro-batches and local batch); a
     family that does not fit even then is pruned whole, with that estimate as the reason;
  2. the `_TUNED_FAMILIES` fastest of them are tuned by a coordinate search over their knobs;
  3. the `_REPLICATED_FAMILIES` best are tried with data-parallel replicas (HSDP) at their knobs.
Context parallelism keeps at least `_MIN_CP_TOKENS` per rank and pipelining two blocks per pp
rank. Maverick on 1,024 GPUs: about 900 layouts estimated; the whole command takes about 7 s
(`scripts/bench_planner.py --phase search`, docs/planner.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torchmoe.arch.registry import model_args_from_config
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import JobConfig
from torchmoe.plan.hardware import HardwareProfile
from torchmoe.plan.memory import GIB, compute_dtype, memory_per_pp_rank
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import SCHEDULE_STYLES, job_pipeline_layout
from torchmoe.plan.step_time import StepPrediction, predict_layout

__all__ = ["DEFAULT_MARGIN", "PLAN_KEYS", "Layout", "SearchResult", "free_keys", "search"]

# Keys the planner chooses, in the order flags are written.
DEGREE_KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
}
SCHEDULE, MICROBATCH = "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size"
LOCAL_BATCH, AC, RESHARD, FLOAT8 = ("training.local_batch_size", "activation_checkpoint.mode",
                                    "parallelism.fsdp_reshard_after_forward", "float8.enable")
PLAN_KEYS = (*DEGREE_KEYS.values(), SCHEDULE, MICROBATCH, LOCAL_BATCH, AC, RESHARD, FLOAT8)
# Follows the degrees: experts tensor-parallel over tp (a config's choice) only without EP.
ETP = "parallelism.expert_tensor_parallel_degree"
AC_MODES = ("none", "selective", "full")
# The fraction of device memory left for what the estimate does not count.
DEFAULT_MARGIN = 0.10

Check = Callable[[JobConfig, int], None]
# Tokens a context-parallel rank keeps at least: below that its two head-tail pieces are shorter
# than an attention kernel's tiles, and the key/value all-gathers move more than it computes.
_MIN_CP_TOKENS = 512


@dataclass(frozen=True)
class Layout:
    """One scored layout: the keys it sets, its config, memory and prediction."""

    overrides: dict[str, object]
    cfg: JobConfig
    dims: ParallelDims
    memory_gib: float
    prediction: StepPrediction

    def flags(self) -> list[str]:
        """``--section.key value`` pairs that reproduce the layout from the user's config."""
        out = []
        for key, value in self.overrides.items():
            out += [f"--{key}", show_value(value).strip('"')]
        return out

    @property
    def family(self) -> str:
        return family_name(self.dims.degrees)

    def as_dict(self) -> dict:
        return {"family": self.family, "overrides": dict(self.overrides), "flags": self.flags(),
                "memory_per_rank_gib": self.memory_gib, **self.prediction.as_dict()}


@dataclass
class SearchResult:
    """Scored layouts (fastest first), one reason per pruned family, what stayed fixed."""

    scored: list[Layout]
    pruned: dict[str, str]
    fixed: list[str]
    evaluated: int = 0
    seconds: float = 0.0
    device_gib: float = 0.0
    refused: dict[str, str] = field(default_factory=dict)  # family -> first preflight refusal
    refusals: dict[str, ConfigError] = field(default_factory=dict)  # family -> that refusal itself
    unfit: dict[str, float] = field(default_factory=dict)  # family -> GiB of its most frugal layout

    @property
    def best(self) -> Layout | None:
        return self.scored[0] if self.scored else None

    def config_refusal(self) -> ConfigError | None:
        """The one refusal every family met, when no layout was scored and each family was refused
        alike (the same key and problem: the job's own setting, which no layout changes); else None."""
        errors = [self.refusals.get(name) for name in self.pruned]
        if self.scored or not errors or None in errors or len({(e.key, e.problem) for e in errors}) != 1:
            return None
        return errors[0]


def family_name(degrees: dict[str, int]) -> str:
    """``dp_shard 8 × tp 8 × ep 8``: the degrees above 1 (``one rank`` without any)."""
    return " × ".join(f"{k} {degrees[k]}" for k in DEGREE_KEYS if degrees[k] > 1) or "one rank"


def fixed_keys(cfg: JobConfig, set_keys: set[str], free: Iterable[str]) -> set[str]:
    """The planner keys a search keeps at `cfg`'s values: those its file or flags set
    (`set_keys`, from `load_job_config`), but what `free` releases; never
    ``data_parallel_shard_degree = -1`` (it means "the rest"). `torchmoe plan` and the dry run's
    comparison search alike."""
    fixed = {k for k in PLAN_KEYS if k in set_keys} - free_keys(free)
    if cfg.parallelism.data_parallel_shard_degree == -1:
        fixed.discard(DEGREE_KEYS["dp_shard"])
    return fixed


def free_keys(free: Iterable[str]) -> set[str]:
    """The planner keys `free` releases: each entry a key, a section or "all".

    Raises:
        ConfigError: an entry that names none of `PLAN_KEYS`.
    """
    out: set[str] = set()
    for entry in free:
        keys = [k for k in PLAN_KEYS if entry == "all" or k == entry or k.partition(".")[0] == entry]
        if not keys:
            raise ConfigError("--free", entry, "names no key the planner chooses",
                              f"pass keys or sections among: {', '.join(PLAN_KEYS)}; or all")
        out.update(keys)
    return out


def _value(cfg: JobConfig, key: str) -> object:
    section, _, leaf = key.partition(".")
    return getattr(getattr(cfg, section), leaf)


def _with(cfg: JobConfig, overrides: dict[str, object]) -> JobConfig:
    sections: dict[str, dict[str, object]] = {}
    for key, value in overrides.items():
        section, _, leaf = key.partition(".")
        sections.setdefault(section, {})[leaf] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _degree_options(cfg: JobConfig, world: int, gpus_per_node: int, fixed: set[str], *,
                    replicas: Iterable[int] | None = None) -> Iterable[dict[str, int]]:
    """Every assignment of the six degrees with product `world` (ep dividing its region), with
    dp_replicate among `replicas` when it is free (default: every divisor)."""
    args = model_args_from_config(cfg.model)
    fixed_value = {short: _value(cfg, key) for short, key in DEGREE_KEYS.items() if key in fixed}
    if fixed_value.get("dp_shard") == -1:
        del fixed_value["dp_shard"]

    def options(short: str, limit: int) -> list[int]:
        if short in fixed_value:
            return [fixed_value[short]]
        if short == "dp_replicate" and replicas is not None:
            return list(replicas)
        return [d for d in _divisors(world) if d <= limit]

    for pp in options("pp", max(1, args.n_layers // 2)):
        for tp in options("tp", gpus_per_node):
            for cp in options("cp", max(1, cfg.training.seq_len // _MIN_CP_TOKENS)):
                for rep in options("dp_replicate", world):
                    if world % (pp * tp * cp * rep):
                        continue
                    shard = world // (pp * tp * cp * rep)
                    if "dp_shard" in fixed_value and fixed_value["dp_shard"] != shard:
                        continue
                    region = shard * cp * tp
                    for ep in options("ep", region):
                        if region % ep == 0 and args.num_experts % ep == 0:
                            yield {"dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp, "ep": ep, "pp": pp}


def _choices(cfg: JobConfig, degrees: dict[str, int], fixed: set[str], profile: HardwareProfile
             ) -> dict[str, list[object]] | None:
    """The values each free knob may take in one family (its degrees set), the most memory-frugal
    first; None when the global batch does not split over the family's data-parallel ranks."""
    t, par = cfg.training, cfg.parallelism
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    out: dict[str, list[object]] = {k: [v] for k, v in zip(DEGREE_KEYS.values(), (
        degrees[k] for k in DEGREE_KEYS))}
    if t.global_batch_size > 0:
        if t.global_batch_size % dp:
            return None
        out[LOCAL_BATCH] = [t.local_batch_size] if LOCAL_BATCH in fixed else _divisors(t.global_batch_size // dp)
    if degrees["pp"] > 1:
        # 1F1B first: it holds the fewest micro-batches in flight of the single-stage schedules.
        out[SCHEDULE] = [par.pipeline_parallel_schedule] if SCHEDULE in fixed else \
            sorted(SCHEDULE_STYLES, key=lambda name: name != "1F1B")
        out[MICROBATCH] = [par.pipeline_parallel_microbatch_size] if MICROBATCH in fixed else \
            _divisors(max(out.get(LOCAL_BATCH, [t.local_batch_size])))
    out[ETP] = [degrees["tp"] if par.expert_tensor_parallel_degree > 1 and degrees["ep"] == 1 else 1]
    out[AC] = [cfg.activation_checkpoint.mode] if AC in fixed else ["full", "selective", "none"]
    fsdp = degrees["dp_shard"] * degrees["cp"] > 1 or degrees["ep"] > 1
    out[RESHARD] = [par.fsdp_reshard_after_forward] if RESHARD in fixed or not fsdp else ["always", "never"]
    float8 = profile.has_float8 and compute_dtype(t) == "bfloat16" and FLOAT8 not in fixed
    out[FLOAT8] = [cfg.float8.enable, not cfg.float8.enable] if float8 else [cfg.float8.enable]
    return out


def _memory_gib(cfg: JobConfig, dims: ParallelDims) -> float:
    args = model_args_from_config(cfg.model)
    return max(e.total for e in memory_per_pp_rank(args, dims, cfg.training, cfg.activation_checkpoint,
                                                   cfg.parallelism, compiled=cfg.compile.enable, lora=cfg.lora,
                                                   optimizer_cfg=cfg.optimizer)) / GIB


def _loss_reason(layout: Layout) -> str:
    """Why a family that fits lost: its largest cost beyond compute."""
    p = layout.prediction
    costs = {**{f"exposed {k.upper() if k != 'fsdp' else 'FSDP'} traffic": v for k, v in p.comm.items()},
             "bubble": p.bubble}
    part, seconds = max(costs.items(), key=lambda kv: kv[1])
    share = seconds / p.step_s
    if part == "bubble":
        o = layout.overrides
        n = layout.cfg.training.local_batch_size // int(o.get(MICROBATCH, 1))
        return f"{share:.0%} bubble with {n} micro-batch{'es' if n != 1 else ''}"
    if share < 0.05:
        return f"compute-bound: {p.compute_s / p.step_s:.0%} of its step computes"
    return f"{part}: {share:.0%} of its step ({seconds:.3g} s)"


class _Family:
    """One family (its degrees set) and the layouts of it scored so far.

    Coordinate search over its knobs: start from the most frugal values; then, knob by knob (in
    `choices`' order), try each value with the others at the best found so far and keep the
    fastest that fits. One pass visits sum(values) layouts rather than prod(values) (about 40
    instead of 2,000 for a pipelined family); the knobs interact mostly through memory, which
    the frugal start keeps feasible while each is tried.
    """

    def __init__(self, cfg: JobConfig, world_size: int, dims: ParallelDims, choices: dict[str, list[object]],
                 env: tuple[HardwareProfile, int, Check | None, float], result: SearchResult,
                 start: dict[str, object] | None = None) -> None:
        self.cfg, self.world_size, self.dims, self.choices = cfg, world_size, dims, choices
        self.profile, self.gpn, self.check, self.limit = env
        self.result, self.name = result, family_name(dims.degrees)
        self.scored: dict[tuple, Layout] = {}
        self.smallest: float | None = None
        self.current = start if start is not None else {k: v[0] for k, v in choices.items()}
        self.best = self.evaluate(self.current)
        # A start training refuses (1F1B with fewer micro-batches than stages, say): larger local
        # batches, until one is estimated.
        for local in choices.get(LOCAL_BATCH, [])[1:] if start is None else []:
            if self.best is not None or self.smallest is not None:
                break
            self.current = {**self.current, LOCAL_BATCH: local}
            self.best = self.evaluate(self.current)

    @property
    def hopeless(self) -> bool:
        """The most frugal layout was estimated and does not fit: no layout of the family does."""
        return self.best is None and self.smallest is not None

    def evaluate(self, values: dict[str, object]) -> Layout | None:
        key = tuple(values.items())
        if key in self.scored:
            return self.scored[key]
        cfg = self.cfg
        overrides = {k: v for k, v in values.items() if k not in (FLOAT8, ETP) or v != _value(cfg, k)}
        candidate = _with(cfg, overrides)
        try:
            if self.check is not None:
                self.check(candidate, self.world_size)
            pipe = job_pipeline_layout(model_args_from_config(candidate.model), self.dims, candidate.parallelism,
                                       candidate.training, candidate.optimizer)
        except ConfigError as err:
            self.result.refused.setdefault(self.name, f"{err.key} = {show_value(err.value)}: {err.problem}")
            self.result.refusals.setdefault(self.name, err)
            return None
        gib = _memory_gib(candidate, self.dims)
        self.result.evaluated += 1
        self.smallest = gib if self.smallest is None else min(self.smallest, gib)
        if gib > self.limit:
            return None
        prediction = predict_layout(candidate, self.dims, self.profile, self.gpn, pipe=pipe)
        self.scored[key] = Layout(overrides, candidate, self.dims, gib, prediction)
        return self.scored[key]

    def coordinate_search(self) -> None:
        for knob, values in self.choices.items():
            if len(values) < 2:
                continue
            for value in values:
                layout = self.evaluate({**self.current, knob: value})
                if layout is not None and (self.best is None or layout.prediction.tokens_per_s_per_gpu
                                           > self.best.prediction.tokens_per_s_per_gpu):
                    self.best, self.current = layout, {**self.current, knob: value}


# Families tuned by the coordinate search: the fastest by their most frugal layout. Beyond
# them a family is reported by that layout only (the knobs move throughput far less than the
# degrees do: see docs/planner.md).
_TUNED_FAMILIES = 24
# The tuned families whose best layouts are tried with data-parallel replicas (HSDP) as well.
_REPLICATED_FAMILIES = 8


def search(cfg: JobConfig, world_size: int, profile: HardwareProfile, *, gpus_per_node: int | None = None,
           fixed: set[str] | None = None, check: Check | None = None, margin: float = DEFAULT_MARGIN) -> SearchResult:
    """Score every valid layout of `cfg` on `world_size` ranks of `profile`.

    Args:
        cfg: a job config that passed `validate_sections`.
        world_size: ranks (GPUs) to plan for.
        profile: the hardware (rates, links, memory per device).
        gpus_per_node: ranks per node (default: the profile's).
        fixed: the planner keys that keep `cfg`'s values (default: none).
        check: the preflight's layout check (`preflight.validate_layout`); raises ConfigError
            for a layout training would refuse. None: no check beyond the degree arithmetic.
        margin: fraction of device memory kept free.
    """
    began = time.perf_counter()
    gpn = gpus_per_node or profile.gpus_per_node
    fixed = set(fixed or ())
    par = cfg.parallelism
    if par.module_fqns_per_model_part or par.pipeline_parallel_layers_per_stage > 0:
        # Stages written out for one pp degree: the split would not fit another.
        fixed.add(DEGREE_KEYS["pp"])
    limit = profile.memory_gib * (1 - margin)
    result = SearchResult([], {}, sorted(fixed), device_gib=profile.memory_gib)
    env = (profile, gpn, check, limit)

    def families(options: Iterable[dict[str, int]],
                 start: Callable[[dict[str, int]], dict[str, object]] | None = None) -> list[_Family]:
        """A `_Family` per degree assignment, its first layout evaluated (the most frugal, or
        `start(degrees)`)."""
        out = []
        for degrees in options:
            name = family_name(degrees)
            try:
                dims = ParallelDims(**degrees, world_size=world_size)
            except ConfigError as err:
                result.pruned[name] = f"{err.key} = {show_value(err.value)}: {err.problem}"
                continue
            choices = _choices(cfg, degrees, fixed, profile)
            if choices is None:
                result.pruned[name] = (f"global batch {cfg.training.global_batch_size} does not split over "
                                       f"dp {dims.dp}")
                continue
            family = _Family(cfg, world_size, dims, choices, env, result, start=start(degrees) if start else None)
            if family.hopeless:
                result.unfit[name] = family.smallest
                result.pruned[name] = (f"does not fit: {family.smallest:.1f} GiB per rank at best, over "
                                       f"{limit:.1f} of {profile.memory_gib:g} GiB")
            out.append(family)
        return out

    def speed(family: _Family) -> float:
        return family.best.prediction.tokens_per_s_per_gpu if family.best is not None else 0.0

    # 1. Every family without replicas (and plain DDP), in its most frugal layout.
    replicate_free = DEGREE_KEYS["dp_replicate"] not in fixed
    found = families(_degree_options(cfg, world_size, gpn, fixed, replicas=[1] if replicate_free else None))
    if replicate_free and world_size > 1:
        found += families(d for d in _degree_options(cfg, world_size, gpn, fixed, replicas=[world_size]))
    # 2. The fastest families (and those whose frugal layout training refused), tuned.
    ranked = sorted((f for f in found if not f.hopeless), key=speed, reverse=True)
    tuned = ranked[:_TUNED_FAMILIES]
    for family in tuned:
        family.coordinate_search()
    # 3. The best of them with replicas: their best knobs, then tuned again.
    if replicate_free:
        for family in sorted(tuned, key=speed, reverse=True)[:_REPLICATED_FAMILIES]:
            d = family.dims
            known = {f.name for f in found}
            options = [{**d.degrees, "dp_replicate": r, "dp_shard": d.dp_shard // r} for r in _divisors(d.dp_shard)[1:]
                       if d.dp_shard // r * d.cp * d.tp % d.ep == 0]
            options = [o for o in options if family_name(o) not in known]
            knobs = dict(family.current)
            found += families(options, start=lambda degrees: {**knobs, **{DEGREE_KEYS[k]: v for k, v in degrees.items()}})
    for family in found:
        result.scored += family.scored.values()
        if not family.scored and not family.hopeless and family.name in result.refused:
            result.pruned[family.name] = result.refused[family.name]
    result.scored.sort(key=lambda l: -l.prediction.tokens_per_s_per_gpu)
    winners: dict[str, Layout] = {}
    for layout in result.scored:
        winners.setdefault(layout.family, layout)
    best = result.best
    for name, layout in winners.items():
        if best is not None and layout is not best:
            slower = 1 - layout.prediction.tokens_per_s_per_gpu / best.prediction.tokens_per_s_per_gpu
            result.pruned[name] = f"{slower:.0%} slower at best: {_loss_reason(layout)}"
    result.seconds = time.perf_counter() - began
    return result
