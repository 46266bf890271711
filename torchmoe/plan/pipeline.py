"""Pipeline parallelism, planned: schedules, the stage split, stage costs and the bubble.

    python -c "from torchmoe.plan.pipeline import *; from torchmoe.models.llama4 import FLAVORS; \\
        print(split_by_cost([1, 3, 1, 3], [1, 1, 1, 1], 2))"

One function, `pipeline_layout`, decides which blocks each stage holds and which pp rank runs
each stage; the dry-run printer and the trainer both call it, so the printed split is what runs.

The split. With neither explicit stages (`module_fqns_per_model_part`) nor a fixed count
(`pipeline_parallel_layers_per_stage`), blocks are split into contiguous stages by a cost model
built from `ModelArgs` and the layout alone (no model is built):

    time(stage)   = training FLOPs per token of its blocks (`ModelArgs.layer_flops_per_token`),
                    plus the output head's on the last stage (the embedding lookup costs no FLOPs),
                    plus under Muon its matrices' Newton-Schulz FLOPs per step on one rank over
                    the step's tokens (`plan.muon.ns_flops_per_token`): a stage of larger or more
                    Muon matrices takes fewer blocks
    memory(stage) = bytes of parameters + gradients + AdamW state one rank holds for its blocks
                    after TP/EP/FSDP sharding (`plan.layout.shard_numel`), plus the embedding on
                    the first stage and the final norm + head on the last

A stage's cost is its more loaded resource relative to the mean, ``max(time / mean time,
memory / mean memory)``, and the split minimises the largest stage cost exactly (dynamic
programming over the contiguous splits). Splitting by layer count instead (torchtitan's way)
treats a dense block and an MoE block alike and ignores the head, whose FLOPs are several blocks'
worth at Llama 4's 202k vocabulary.

Stage placement follows torch's schedules: single-stage schedules run stage r on pp rank r;
looped multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) stage s on rank
``s % pp``; V schedules (ZBVZeroBubble, DualPipeV) stages r and ``2 * pp - 1 - r`` on rank r.

The bubble: the idle fraction of the schedule's own action lists (torch builds them for every
rank), replayed with forward = 1, backward = 2 (input and weight halves 1 each) time units and
free communication.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Optimizer, Parallelism, Training
from torchmoe.plan.layout import ParamSpec, unit_sizes
from torchmoe.plan.memo import memoised
from torchmoe.plan.muon import ns_flops_per_token
from torchmoe.plan.parallel_dims import ParallelDims

# torch.distributed.pipelining's schedules (torchtitan's names) and how they place stages.
SCHEDULE_STYLES: dict[str, str] = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
# Schedules that split backward into input and weight halves; torch refuses them with compile.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Stages per rank when the user fixes neither the stages nor their size.
DEFAULT_STAGES_PER_RANK = {"single": 1, "loop": 2, "v": 2}
# Bytes per stored parameter element: fp32 weight + fp32 gradient + two fp32 AdamW moments (pure
# bf16 halves every stage's alike, which leaves the split unchanged: it compares stages).
STATE_BYTES_PER_PARAM = 16
_KEY = "parallelism"


def is_multi_stage(schedule: str) -> bool:
    return SCHEDULE_STYLES[schedule] != "single"


@dataclass(frozen=True)
class PipelineLayout:
    """How the blocks map onto pipeline stages and pp ranks.

    Attributes:
        num_stages: stages in the whole pipeline.
        layers: blocks of each stage (index = stage id).
        ranks: stage ids of each pp rank, ascending (index = pp rank).
    """

    num_stages: int
    layers: list[list[int]]
    ranks: list[list[int]]

    @property
    def key(self) -> tuple:
        """A hashable summary (the planner's memo tables key on it)."""
        return self.num_stages, tuple(map(tuple, self.layers)), tuple(map(tuple, self.ranks))

    def rank_layers(self, pp_rank: int) -> list[int]:
        """Blocks held by `pp_rank`, ascending."""
        return sorted(i for s in self.ranks[pp_rank] for i in self.layers[s])

    def has_first_stage(self, pp_rank: int) -> bool:
        return 0 in self.ranks[pp_rank]

    def has_last_stage(self, pp_rank: int) -> bool:
        return self.num_stages - 1 in self.ranks[pp_rank]

    def stage_fqns(self, stage: int) -> list[str]:
        """The stage's top-level modules as `module_fqns_per_model_part` names them."""
        first = ["tok_embeddings"] if stage == 0 else []
        last = ["norm", "output"] if stage == self.num_stages - 1 else []
        return first + [f"layers.{i}" for i in self.layers[stage]] + last


def stage_ranks(pp: int, num_stages: int, schedule: str) -> list[list[int]]:
    """Stage ids each pp rank runs (ascending), as torch's schedule places them."""
    style = SCHEDULE_STYLES[schedule] if pp > 1 else "single"
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for s in range(num_stages):
        lap, pos = divmod(s, pp)
        ranks[pp - 1 - pos if style == "v" and lap % 2 else pos].append(s)
    return ranks


def rank_units(pipe: PipelineLayout, pp_rank: int) -> list[str]:
    """The FSDP units (`ParamSpec.fsdp_unit`) `pp_rank` holds, in module order: its blocks, plus
    the embedding / the final norm and head on the end stages."""
    return ((["tok_embeddings"] if pipe.has_first_stage(pp_rank) else [])
            + [f"layers.{i}" for i in pipe.rank_layers(pp_rank)]
            + (["head"] if pipe.has_last_stage(pp_rank) else []))


def rank_param_specs(specs: list[ParamSpec], pipe: PipelineLayout, pp_rank: int) -> list[ParamSpec]:
    """The parameters `pp_rank` holds (of its `rank_units`), in module order."""
    units = set(rank_units(pipe, pp_rank))
    return [spec for spec in specs if spec.fsdp_unit in units]


# ---- the cost model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCosts:
    """Per-stage cost of a split (index = stage id).

    Attributes:
        flops: training FLOPs per token of the stage (blocks, plus the head on the last).
        state_bytes: parameter + gradient + optimizer bytes one rank of the stage holds.
    """

    flops: list[int]
    state_bytes: list[int]

    @staticmethod
    def _imbalance(values: list[int]) -> float:
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    @property
    def flops_imbalance(self) -> float:
        """max / mean stage FLOPs (1.0 = perfectly balanced)."""
        return self._imbalance(self.flops)

    @property
    def memory_imbalance(self) -> float:
        """max / mean stage state bytes."""
        return self._imbalance(self.state_bytes)


def layer_costs(args: ModelArgs, dims: ParallelDims, seq_len: int, *,
                state_bytes_per_param: int = STATE_BYTES_PER_PARAM,
                optimizer_flops: Mapping[str, int] | None = None) -> tuple[list[int], list[int], dict[str, int]]:
    """FLOPs per token and per-rank state bytes of every block, and of the ends, at
    `state_bytes_per_param` bytes per stored parameter element.

    Args:
        optimizer_flops: the optimizer step's matmul FLOPs per token of each FSDP unit
            (`plan.muon.ns_flops_per_token`: Muon's Newton-Schulz), added to its FLOPs.
    Returns:
        (flops per block, state bytes per block, ``{"first_bytes", "last_bytes", "last_flops"}``):
        the embedding's bytes (first stage), the final norm + head's bytes and FLOPs (last stage).
    """
    units = unit_sizes(args, dims)
    step = optimizer_flops or {}
    blocks = range(args.n_layers + args.mtp_layers)  # the multi-token prediction blocks last
    state = [state_bytes_per_param * units[f"layers.{i}"].stored for i in blocks]
    ends = {"first_bytes": state_bytes_per_param * units["tok_embeddings"].stored,
            "last_bytes": state_bytes_per_param * units["head"].stored,
            "last_flops": args.head_flops_per_token() + step.get("head", 0)}
    flops = [args.layer_flops_per_token(i, seq_len) + step.get(f"layers.{i}", 0) for i in blocks]
    # The embedding's step (Muon only when a glob makes it so) runs where block 0 runs: stage 0.
    flops[0] += step.get("tok_embeddings", 0)
    return flops, state, ends


def _with_ends(stage: int, num_stages: int, flops: int, nbytes: int, ends: dict[str, int]) -> tuple[int, int]:
    """A stage's FLOPs and state bytes with what it holds besides blocks: the embedding on the
    first stage, the final norm and head on the last (both on a single stage)."""
    if stage == 0:
        nbytes += ends["first_bytes"]
    if stage == num_stages - 1:
        flops += ends["last_flops"]
        nbytes += ends["last_bytes"]
    return flops, nbytes


def stage_costs(layers: list[list[int]], flops: list[int], state: list[int], ends: dict[str, int]) -> StageCosts:
    """The costs of a split `layers` (blocks per stage) under per-block `flops` and `state`."""
    totals = [_with_ends(s, len(layers), sum(flops[i] for i in stage), sum(state[i] for i in stage), ends)
              for s, stage in enumerate(layers)]
    return StageCosts([f for f, _ in totals], [m for _, m in totals])


def split_by_cost(flops: list[int], state: list[int], num_stages: int,
                  ends: dict[str, int] | None = None) -> list[list[int]]:
    """Contiguous, non-empty stages minimising the largest ``max(time / mean, memory / mean)``.

    Exact: a dynamic program over split points, O(num_stages * n_layers^2), one (n+1, n+1)
    array operation per stage (the layout search asks for hundreds of splits of 48 blocks).
    Ties go to the split whose earlier stages are shorter (deterministic, so every rank computes
    the same split).
    """
    ends = ends or {"first_bytes": 0, "last_bytes": 0, "last_flops": 0}
    n, last = len(flops), num_stages - 1
    mean_f = (sum(flops) + ends["last_flops"]) / num_stages or 1.0
    mean_m = (sum(state) + ends["first_bytes"] + ends["last_bytes"]) / num_stages or 1.0
    # int64 sums stay exact (a 2T-parameter model's state is ~3e13 bytes) and convert to float
    # as Python's int / float does, so the split is the same on every rank and every platform.
    pre_f = np.concatenate(([0], np.cumsum(flops, dtype=np.int64)))
    pre_m = np.concatenate(([0], np.cumsum(state, dtype=np.int64)))
    span_f = pre_f[None, :] - pre_f[:, None]  # [i, j]: blocks i..j-1 (meaningful for i < j)
    span_m = pre_m[None, :] - pre_m[:, None]
    empty = np.tri(n + 1, dtype=bool)  # i >= j: an empty or reversed stage

    def cost(stage: int) -> np.ndarray:
        """(n+1, n+1): the cost of blocks i..j-1 as `stage`, inf where i >= j."""
        f = span_f + (ends["last_flops"] if stage == last else 0)
        m = span_m + (ends["first_bytes"] if stage == 0 else 0) + (ends["last_bytes"] if stage == last else 0)
        return np.where(empty, np.inf, np.maximum(f / mean_f, m / mean_m))

    # best[j]: the smallest max cost of the first j blocks as stages 0..s (inf where they cannot
    # fill s + 1 non-empty stages and leave one block for each later stage); start[s][j]: where
    # stage s then begins. argmin takes the first minimum over ascending starts: the tie rule.
    reachable = np.arange(n + 1)
    best = np.where((reachable >= 1) & (reachable <= n - last), cost(0)[0], np.inf)
    starts = [np.zeros(n + 1, dtype=np.int64)]
    for s in range(1, num_stages):
        candidates = np.maximum(best[:, None], cost(s))
        start = np.argmin(candidates, axis=0)
        best = candidates[start, reachable]
        best[(reachable < s + 1) | (reachable > n - last + s)] = np.inf
        starts.append(start)
    bounds = [n]
    for s in range(last, -1, -1):
        bounds.append(int(starts[s][bounds[-1]]))
    bounds.reverse()
    return [list(range(bounds[s], bounds[s + 1])) for s in range(num_stages)]


def split_by_count(n_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous blocks of near-equal count (the first ``n_layers % num_stages`` get one more):
    the layer-count split, for comparison with the cost model."""
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (s < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


# ---- the layout -------------------------------------------------------------------------------


def _explicit_stages(fqns: list[list[str]], n_layers: int) -> list[list[int]]:
    """Blocks per stage from `module_fqns_per_model_part`, checked to cover the model once, in
    order, with the embedding first and the final norm and head last."""
    key = f"{_KEY}.module_fqns_per_model_part"
    example = '[["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]'
    layers, seen = [], []
    for s, part in enumerate(fqns):
        blocks = []
        for name in part:
            if name in ("tok_embeddings", "norm", "output"):
                where = 0 if name == "tok_embeddings" else len(fqns) - 1
                if s != where:
                    raise ConfigError(key, fqns, f"{name!r} is in stage {s}, but it belongs to the "
                                      f"{'first' if where == 0 else 'last'} stage", f"move it, e.g. {example}")
                continue
            prefix, _, index = name.partition(".")
            if prefix != "layers" or not index.isdigit() or int(index) >= n_layers:
                raise ConfigError(key, fqns, f"{name!r} is not a module of the model (it has layers.0 .. "
                                  f"layers.{n_layers - 1}, tok_embeddings, norm, output)", f"write it like {example}")
            blocks.append(int(index))
        if not blocks:
            raise ConfigError(key, fqns, f"stage {s} holds no transformer block",
                              "give every stage at least one layers.N")
        layers.append(blocks)
        seen += blocks
    if seen != list(range(n_layers)):
        raise ConfigError(key, fqns, f"the stages must hold layers.0 .. layers.{n_layers - 1} once each, in "
                          f"order; they hold {seen}", f"list each block once, in order, e.g. {example}")
    return layers


def _num_stages(args: ModelArgs, pp: int, par: Parallelism) -> int:
    if par.module_fqns_per_model_part:
        return len(par.module_fqns_per_model_part)
    if par.pipeline_parallel_layers_per_stage > 0:
        return math.ceil(args.n_layers / par.pipeline_parallel_layers_per_stage)
    return pp * DEFAULT_STAGES_PER_RANK[SCHEDULE_STYLES[par.pipeline_parallel_schedule]]


def _check_stage_count(num_stages: int, pp: int, n_layers: int, par: Parallelism) -> None:
    schedule = par.pipeline_parallel_schedule
    source = ("module_fqns_per_model_part" if par.module_fqns_per_model_part
              else "pipeline_parallel_layers_per_stage" if par.pipeline_parallel_layers_per_stage > 0
              else "pipeline_parallel_degree")
    key, value = f"{_KEY}.{source}", getattr(par, source)
    what = f"{num_stages} pipeline stages ({schedule}) on pp({pp})"
    if num_stages > n_layers:
        raise ConfigError(key, value, f"{what}, but the model has {n_layers} layers",
                          f"use at most {n_layers} stages: a smaller pipeline_parallel_degree, a single-stage "
                          "schedule (GPipe, 1F1B) or more layers per stage")
    if num_stages % pp:
        raise ConfigError(key, value, f"{what}: every pp rank must run the same number of stages",
                          f"use a multiple of {pp} stages")
    per_rank = num_stages // pp
    style = SCHEDULE_STYLES[schedule]
    if style == "single" and per_rank != 1:
        raise ConfigError(key, value, f"{what} = {per_rank} per rank, but {schedule} runs one stage per rank",
                          "use a multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                          f"ZBVZeroBubble, DualPipeV) or {pp} stages")
    if style == "loop" and per_rank < 2:
        raise ConfigError(key, value, f"{what} = one per rank, but {schedule} interleaves several stages per rank",
                          f"use GPipe or 1F1B for one stage per rank, or at least {2 * pp} stages")
    if style == "v" and per_rank != 2:
        raise ConfigError(key, value, f"{what} = {per_rank} per rank, but {schedule} runs exactly two per rank "
                          "(a V)", f"use {2 * pp} stages")


def pipeline_layout(args: ModelArgs, dims: ParallelDims, parallelism_cfg: Parallelism,
                    seq_len: int, *, optimizer_flops: Mapping[str, int] | None = None) -> PipelineLayout:
    """The stage split and placement a job runs (also without PP: one stage with every block).

    Args:
        args: the model's shape.
        dims: the resolved layout (sharding enters the memory cost).
        parallelism_cfg: schedule, `pipeline_parallel_layers_per_stage`, `module_fqns_per_model_part`.
        seq_len: tokens per sequence (attention FLOPs grow with it).
        optimizer_flops: the optimizer step's FLOPs per token of each FSDP unit, which the split
            balances with the blocks' (`plan.muon.ns_flops_per_token`; None or empty: AdamW's,
            elementwise, left out).
    Raises:
        ConfigError: a stage count or explicit split the schedule cannot run.
    """
    pp = dims.pp
    if pp == 1:
        # One stage: every block, the multi-token prediction ones too (refused with pp > 1).
        return PipelineLayout(1, [list(range(args.n_layers + args.mtp_layers))], [[0]])
    num_stages = _num_stages(args, pp, parallelism_cfg)
    _check_stage_count(num_stages, pp, args.n_layers, parallelism_cfg)
    if parallelism_cfg.module_fqns_per_model_part:
        layers = _explicit_stages(parallelism_cfg.module_fqns_per_model_part, args.n_layers)
    elif parallelism_cfg.pipeline_parallel_layers_per_stage > 0:
        size = parallelism_cfg.pipeline_parallel_layers_per_stage
        layers = [list(range(s * size, min((s + 1) * size, args.n_layers))) for s in range(num_stages)]
    else:
        layers = _cost_split(args, dims, seq_len, num_stages, optimizer_flops or {})
    return PipelineLayout(num_stages, layers, stage_ranks(pp, num_stages, parallelism_cfg.pipeline_parallel_schedule))


def job_pipeline_layout(args: ModelArgs, dims: ParallelDims, parallelism_cfg: Parallelism, training_cfg: Training,
                        optimizer_cfg: Optimizer | None) -> PipelineLayout:
    """`pipeline_layout` of a job, with its optimizer step in the split (Muon's NS; None: AdamW):
    what the trainer runs and the planner prints."""
    return pipeline_layout(args, dims, parallelism_cfg, training_cfg.seq_len,
                           optimizer_flops=ns_flops_per_token(args, dims, training_cfg, optimizer_cfg))


def _cost_split(args: ModelArgs, dims: ParallelDims, seq_len: int, num_stages: int,
                optimizer_flops: Mapping[str, int]) -> list[list[int]]:
    """`split_by_cost` over `layer_costs`, memoised: the layout search asks for the same split
    for every variant of a layout."""
    def split() -> list[list[int]]:
        flops, state, ends = layer_costs(args, dims, seq_len, optimizer_flops=optimizer_flops)
        return split_by_cost(flops, state, num_stages, ends)

    key = (repr(args), dims, seq_len, num_stages, tuple(sorted(optimizer_flops.items())))
    return [list(stage) for stage in memoised(_SPLITS, key, split)]


_SPLITS: dict[tuple, list[list[int]]] = {}


# ---- micro-batches and the bubble ------------------------------------------------------------------


def microbatches(training_cfg: Training, parallelism_cfg: Parallelism) -> tuple[int, int]:
    """(count, sequences each) of the pipeline micro-batches one local batch is split into."""
    count = parallelism_cfg.pipeline_parallel_microbatches
    if count > 0:
        return count, training_cfg.local_batch_size // count
    size = parallelism_cfg.pipeline_parallel_microbatch_size
    return training_cfg.local_batch_size // size, size


def check_microbatches(training_cfg: Training, parallelism_cfg: Parallelism, pp: int, num_stages: int) -> None:
    """The micro-batch count must split the local batch and satisfy the schedule (exit 2 otherwise)."""
    local, schedule = training_cfg.local_batch_size, parallelism_cfg.pipeline_parallel_schedule
    size, count = parallelism_cfg.pipeline_parallel_microbatch_size, parallelism_cfg.pipeline_parallel_microbatches
    if count > 0:
        key, value = f"{_KEY}.pipeline_parallel_microbatches", count
        if local % count:
            raise ConfigError(key, count, f"must divide training.local_batch_size({local})",
                              f"use a count that divides {local}")
        if size != 1 and size * count != local:
            raise ConfigError(key, count, f"{count} micro-batches of pipeline_parallel_microbatch_size({size}) "
                              f"!= training.local_batch_size({local})", "set only one of the two")
    else:
        key, value = f"{_KEY}.pipeline_parallel_microbatch_size", size
        if local % size:
            raise ConfigError(key, size, f"must divide training.local_batch_size({local})",
                              f"use a micro-batch size that divides {local}")
    n = microbatches(training_cfg, parallelism_cfg)[0]
    need = {"1F1B": pp, "DualPipeV": num_stages}.get(schedule, 1)
    if n < need:
        raise ConfigError(key, value, f"gives {n} micro-batches (local_batch_size {local}), but {schedule} needs at "
                          f"least {need} ({'stages' if schedule == 'DualPipeV' else 'pp ranks'})",
                          f"raise training.local_batch_size or use smaller micro-batches, so that there are >= {need}")
    rounds = max(1, n // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and n % rounds:
        raise ConfigError(key, value, f"gives {n} micro-batches; {schedule} runs them in rounds of pp({pp}), so "
                          f"the count must be a multiple of {rounds} (= {n} // {pp})",
                          f"use a multiple of {pp} micro-batches, or fewer than {pp}")


@lru_cache(maxsize=64)
def bubble_fraction(schedule: str, pp: int, num_stages: int, n_microbatches: int) -> float:
    """Idle fraction of the slowest pp rank's step under `schedule` (0 without PP).

    Replays torch's own per-rank action lists with forward = 1, full backward = 2, backward
    input = backward weight = 1 and free communication.
    """
    if pp == 1:
        return 0.0
    orders = _pipeline_orders(schedule, pp, num_stages, n_microbatches)
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    pos = [0] * pp
    busy = [0.0] * pp
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, stage, mb = orders[r][pos[r]]
                deps = _dependencies(kind, stage, mb, num_stages)
                if any(d not in done for d in deps):
                    break
                clock[r] = max([clock[r], *(done[d] for d in deps)]) + cost[kind]
                busy[r] += cost[kind]
                done[(kind, stage, mb)] = clock[r]
                if kind in ("B", "I"):  # the gradient the previous stage waits for
                    done[("grad", stage, mb)] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule}: the replay of torch's action lists is stuck")
    makespan = max(clock)
    return 1.0 - min(busy) / makespan


def _dependencies(kind: str, stage: int, mb: int, num_stages: int) -> list[tuple[str, int, int]]:
    """What action (kind, stage, micro-batch) must have finished first."""
    if kind == "F":
        return [("F", stage - 1, mb)] if stage else []
    if kind in ("B", "I"):
        deps = [("F", stage, mb)]
        if stage < num_stages - 1:
            deps.append(("grad", stage + 1, mb))
        return deps
    return [("I", stage, mb)]  # W


@lru_cache(maxsize=64)
def _pipeline_orders(schedule: str, pp: int, num_stages: int, n: int) -> dict[int, list[tuple[str, int, int]]]:
    """Every rank's compute actions (kind F/B/I/W, stage, micro-batch), in torch's order.

    Multi-stage schedules: torch builds the lists for all ranks when the schedule is constructed
    (`_torch_private.pipeline_action_orders`). GPipe and 1F1B have no such lists (their
    order is written in their step loops), so it is restated here: GPipe runs every forward, then
    every backward; 1F1B runs ``min(n, pp - r)`` warm-up forwards on rank r, then alternates
    backward and forward.
    """
    if schedule in ("GPipe", "1F1B"):
        orders = {}
        for r in range(pp):
            warmup = n if schedule == "GPipe" else min(n, pp - r)
            order = [("F", r, i) for i in range(warmup)]
            for i in range(n):
                order.append(("B", r, i))
                if warmup + i < n:
                    order.append(("F", r, warmup + i))
            orders[r] = order
        return orders
    # Torch's generator of the multi-stage schedules' lists: the planner's one use of torch.
    from torchmoe._torch_private import pipeline_action_orders

    return pipeline_action_orders(schedule, pp, stage_ranks(pp, num_stages, schedule)[0], num_stages, n)


def peak_activations_in_flight(schedule: str, pp: int, num_stages: int, n_microbatches: int, pp_rank: int,
                               stage_bytes: dict[int, float]) -> float:
    """The most activation bytes `pp_rank` holds at once over a step: walking its action list,
    a forward of (stage, micro-batch) adds ``stage_bytes[stage]``; the full backward, or the
    weight half of a split backward (the input half keeps the matmul inputs the weight
    gradients need), frees them. Without PP: one stage, one micro-batch at a time."""
    if pp == 1:
        return max(stage_bytes.values())
    live = peak = 0.0
    for kind, stage, _ in _pipeline_orders(schedule, pp, num_stages, n_microbatches)[pp_rank]:
        if kind == "F":
            live += stage_bytes[stage]
            peak = max(peak, live)
        elif kind in ("B", "W"):
            live -= stage_bytes[stage]
    return peak
