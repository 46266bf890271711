"""`torchmoe train --dry-run`: plan a job without a process group or a single real tensor.

    python -m torchmoe train --config configs/llama4_128e.toml --dry-run --world-size 1024

Prints the mesh (dims, sizes, and for rank 0, a middle rank and the last rank their coordinates
and the members of each of their groups), the parallel plan, total / active / per-rank parameter
counts, FLOPs per token and the per-rank memory estimate, and writes the same as
``<job.dump_folder>/dry_run.json``. Groups come from `parallel_dims.mesh_layout`, the function
the real DeviceMesh is checked against, so what is printed is what runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import model_args_from_config
from torchmoe.config.degrees import resolve_degrees
from torchmoe.config.files.file_writes import write_file
from torchmoe.config.job_config import JobConfig
from torchmoe.config.wording import counted
from torchmoe.plan.context import CPLayout
from torchmoe.plan.float8 import FLOAT8_TILE, float8_tp_enabled, selected_by
from torchmoe.plan.layout import ParamSpec, local_shape, param_specs, shard_numel
from torchmoe.plan.lora import adapter_specs
from torchmoe.plan.memory import (
    GIB,
    MemoryEstimate,
    autocast_enabled,
    compute_dtype_bytes,
    memory_per_pp_rank,
    param_dtype_bytes,
    state_bytes_per_param,
)
from torchmoe.plan.muon import muon_cost, ns_flops_per_token, optimizer_state_elements, step_peak_bytes
from torchmoe.plan.parallel_dims import ALL_NAMES, FLAT_VIEWS, MESH_DIMS, DimLayout, ParallelDims
from torchmoe.plan.pipeline import (
    PipelineLayout,
    bubble_fraction,
    job_pipeline_layout,
    layer_costs,
    microbatches,
    rank_param_specs,
    rank_units,
    stage_costs,
)
from torchmoe.plan.tp_comm import TPGatherBytes, float8_linear_names, tp_gather_bytes

# Longer member lists are abbreviated when printed, and in the JSON beyond _JSON_MEMBERS.
_MAX_LISTED = 8
_JSON_MEMBERS = 1024
# Above this fraction of device memory the estimate is flagged even though it fits.
_TIGHT_FRACTION = 0.9

DRY_RUN_FILE = "dry_run.json"


def format_ranks(members: Sequence[int]) -> str:
    """``0, 1, 2, 3`` or, for long groups, ``0, 8, 16, …, 1016 (128 ranks)`` (a lazy
    `GroupMembers` is read only where printed)."""
    if len(members) <= _MAX_LISTED:
        return ", ".join(map(str, members))
    return f"{', '.join(map(str, members[:3]))}, …, {members[-1]} ({len(members)} ranks)"


def group_json(members: Sequence[int]) -> list[int] | dict:
    """A group for dry_run.json: its members, or for a group of more than `_JSON_MEMBERS` ranks
    its size, first members and last one (a whole list would grow with the world)."""
    if len(members) <= _JSON_MEMBERS:
        return list(members)
    return {"size": len(members), "first": members[:_MAX_LISTED], "last": members[-1]}


def example_ranks(world_size: int) -> list[int]:
    """Rank 0, one in the middle and the last rank (deduplicated for tiny worlds)."""
    return sorted({0, world_size // 2, world_size - 1})


def _linear_specs(specs: list[ParamSpec]) -> list[ParamSpec]:
    """The nn.Linear weights (2-D, not the embedding): what float8 conversion can touch."""
    return [s for s in specs if len(s.shape) == 2 and not s.fqn.startswith("tok_embeddings")]


def describe_plan(cfg: JobConfig, dims: ParallelDims, args: ModelArgs, pipe: PipelineLayout,
                  tp_gathers: TPGatherBytes) -> dict[str, dict]:
    """Each technique: ``{"enabled": bool, "detail": str}``, in the order parallelize applies them;
    `tp_gathers` is what TP's all-gathers move (`plan.tp_comm`)."""
    p = cfg.parallelism
    plan: dict[str, dict] = {}

    def add(name: str, enabled: bool, detail: str) -> None:
        plan[name] = {"enabled": enabled, "detail": detail}

    loss_parallel = dims.tp_enabled and not p.disable_loss_parallel
    add("tensor_parallel", dims.tp_enabled,
        f"tp={dims.tp}: attention heads, dense FFN and shared-expert hidden dims, embedding/output vocab; "
        f"sequence-parallel norms; loss parallel {'on' if loss_parallel else 'off'}; "
        f"async TP {'on' if p.enable_async_tensor_parallel else 'off'}; "
        f"{_tp_comm_detail(cfg, tp_gathers)}" if dims.tp_enabled else "off")
    add("moe_tensor_parallel", dims.moe_tp_enabled,
        f"routed experts' hidden dim over tp={dims.tp} (w1/w3 column-wise, w2 row-wise), router gate "
        "replicated; MoE input all-gathered, output reduce-scattered" if dims.moe_tp_enabled else "off")
    add("expert_parallel", dims.ep_enabled,
        f"ep={dims.ep}: {args.num_experts // dims.ep} of {args.num_experts} experts per rank, dropless "
        f"all-to-all over groups of {dims.ep} consecutive ranks of dp_shard x cp x tp (tp first)"
        if dims.ep_enabled else "off")
    add("context_parallel", dims.cp_enabled, _context_detail(context_report(cfg, dims, args)) if dims.cp_enabled
        else "off")
    add("activation_checkpoint", cfg.activation_checkpoint.mode != "none",
        cfg.activation_checkpoint.mode + (f" ({cfg.activation_checkpoint.selective_ac_option})"
                                          if cfg.activation_checkpoint.mode == "selective" else ""))
    add("compile", cfg.compile.enable, "torch.compile per transformer block" if cfg.compile.enable else "off")
    add("data_parallel", dims.dp_enabled or dims.fsdp_enabled, _data_parallel_detail(cfg, dims))
    add("pipeline_parallel", dims.pp_enabled, _pipeline_detail(cfg, dims, pipe) if dims.pp_enabled else "off")
    on = cfg.float8.enable or cfg.float8.routed_experts
    add("float8", on, _float8_detail(cfg, args) if on else "off")
    return plan


def _tp_comm_detail(cfg: JobConfig, gathers: TPGatherBytes) -> str:
    """Which TP styles run (float8 or plain) and what their all-gathers move per step."""
    if float8_tp_enabled(cfg.float8):
        styles = ("float8 TP styles (tensorwise): attention and dense-FFN inputs gathered in float8, "
                  "wo/w2 output gradients gathered in float8, MoE inputs in high precision")
    elif cfg.float8.enable:
        styles = f"plain TP styles in high precision (float8 recipe {cfg.float8.recipe_name} is not tensorwise)"
    else:
        styles = "plain TP styles"
    saved = (f" (plain styles: {gathers.high_precision / 2**20:.4g} MiB)"
             if gathers.high_precision != gathers.total else "")
    return f"{styles}; all-gathers {gathers.total / 2**20:.4g} MiB/step per rank{saved}"


def tp_report(cfg: JobConfig, gathers: TPGatherBytes) -> dict:
    """The TP all-gather bytes of one step on one rank (`plan.tp_comm`). What `dry_run.json`
    holds under ``tensor_parallel``."""
    return {"float8_styles": float8_tp_enabled(cfg.float8), "all_gather_bytes_per_step": gathers.total,
            "forward": gathers.forward, "backward": gathers.backward, "recompute": gathers.recompute,
            "plain_styles_bytes_per_step": gathers.high_precision}


def context_report(cfg: JobConfig, dims: ParallelDims, args: ModelArgs) -> dict:
    """Which attention layers communicate under CP and how many key/value bytes one rank receives
    per step for them (forward, plus the same amount of gradients sent back in backward; full AC
    repeats the forward's). What `dry_run.json` holds under ``context_parallel``."""
    layout = CPLayout(cfg.training.seq_len, dims.cp)
    a = compute_dtype_bytes(cfg.training)
    kv_per_token = 2 * a * args.n_kv_heads * args.head_dim / dims.tp
    sequences = max(cfg.training.global_batch_size, 0) // dims.dp or cfg.training.local_batch_size
    modes: dict[str, dict] = {}
    for i in range(args.n_layers):
        chunk, window = args.layer_chunk(i), args.layer_window(i)
        mode = layout.mode(chunk, window)
        entry = modes.setdefault(mode, {"layers": [], "bytes_per_step": 0.0})
        entry["layers"].append(i)
        entry["bytes_per_step"] += 2 * sequences * layout.bytes_received(mode, chunk, kv_per_token, window)
    return {"layout": "head-tail", "pieces": 2 * dims.cp, "piece_tokens": layout.piece,
            "tokens_per_rank": cfg.training.seq_len // dims.cp, "modes": modes}


def _context_detail(report: dict) -> str:
    what = {"global": "all-gather K/V", "gather": "all-gather K/V (chunk or sliding window longer than a piece)",
            "halo": "point-to-point halo", "local": "no communication (whole chunks)"}
    parts = [f"layers {_ranges(m['layers'])}: {what[mode]}, {m['bytes_per_step'] / 2**20:.4g} MiB/step"
             for mode, m in report["modes"].items()]
    return (f"cp={report['pieces'] // 2}: {report['tokens_per_rank']} tokens per rank as 2 head-tail pieces of "
            f"{report['piece_tokens']}; " + "; ".join(parts))


def _ranges(ids: list[int]) -> str:
    return ",".join(map(str, ids)) if len(ids) <= 6 else f"{ids[0]},{ids[1]},…,{ids[-1]} ({len(ids)})"


def _data_parallel_detail(cfg: JobConfig, dims: ParallelDims) -> str:
    t = cfg.training
    states = f"{t.dtype} weights, gradients and {cfg.optimizer.name} state"
    if dims.fsdp_enabled:
        kind = f"HSDP (replicate over dp_replicate={dims.dp_replicate}, shard within)" if dims.hsdp_enabled else "FSDP"
        return (f"{kind}: dense params over dp_shard_cp={dims.dp_shard_cp}, routed experts over "
                f"efsdp={dims.efsdp}; {states}; compute {t.mixed_precision_param}, reduce "
                f"{t.mixed_precision_reduce}; reshard after forward: {cfg.parallelism.fsdp_reshard_after_forward}"
                + ("; CPU offload" if cfg.parallelism.fsdp_cpu_offload else ""))
    if dims.ddp_enabled:
        return (f"DDP over dp_replicate={dims.dp_replicate}; {states}; compute {t.mixed_precision_param}, "
                f"reduce {t.mixed_precision_reduce}")
    autocast = " under torch.autocast" if autocast_enabled(dims, t) else ""
    return (f"off (one data-parallel rank); {states}; compute {t.mixed_precision_param}{autocast} (nothing to "
            "reduce: mixed_precision_reduce has no effect)")


def _pipeline_detail(cfg: JobConfig, dims: ParallelDims, pipe: PipelineLayout) -> str:
    p = cfg.parallelism
    n, size = microbatches(cfg.training, p)
    return (f"pp={dims.pp}, schedule {p.pipeline_parallel_schedule}: {pipe.num_stages} stages "
            f"({pipe.num_stages // dims.pp} per rank), layers per stage {[len(l) for l in pipe.layers]}; "
            f"{n} micro-batches of {size}; bubble "
            f"{bubble_fraction(p.pipeline_parallel_schedule, dims.pp, pipe.num_stages, n):.1%}")


def pipeline_report(cfg: JobConfig, dims: ParallelDims, args: ModelArgs, pipe: PipelineLayout) -> dict:
    """Per stage: its blocks, pp rank, FLOPs per token (under Muon with its NS per token, as the
    split counts them) and per-rank state bytes; their max/mean imbalance; the schedule's
    bubble. What `dry_run.json` holds under ``pipeline``."""
    flops, state, ends = layer_costs(args, dims, cfg.training.seq_len,
                                     state_bytes_per_param=state_bytes_per_param(cfg.training),
                                     optimizer_flops=ns_flops_per_token(args, dims, cfg.training, cfg.optimizer))
    costs = stage_costs(pipe.layers, flops, state, ends)
    rank_of = {s: r for r, stages in enumerate(pipe.ranks) for s in stages}
    n, _ = microbatches(cfg.training, cfg.parallelism)
    return {
        "schedule": cfg.parallelism.pipeline_parallel_schedule,
        "microbatches": n,
        "bubble_fraction": bubble_fraction(cfg.parallelism.pipeline_parallel_schedule, dims.pp, pipe.num_stages, n),
        "stages": [{"stage": s, "pp_rank": rank_of[s], "layers": pipe.layers[s],
                    "moe_layers": sum(args.is_moe_layer(i) for i in pipe.layers[s]),
                    "flops_per_token": costs.flops[s], "state_gib": costs.state_bytes[s] / GIB}
                   for s in range(pipe.num_stages)],
        "flops_imbalance": costs.flops_imbalance,
        "memory_imbalance": costs.memory_imbalance,
    }


def _float8_detail(cfg: JobConfig, args: ModelArgs) -> str:
    """What `distributed/float8.py` converts: nn.Linear layers outside filter_fqns whose in and
    out features are multiples of 16 (float8 GEMM tiles), and the routed experts moe_fqns names."""
    f8 = cfg.float8
    parts = []
    if f8.enable:
        linears = _linear_specs(param_specs(args))
        filtered = [s for s in linears if any(name in s.fqn for name in f8.filter_fqns)]
        converted = len(float8_linear_names(args, f8.filter_fqns))
        matched = [name for name in f8.filter_fqns if any(name in s.fqn for s in filtered)]
        parts.append(f"recipe {f8.recipe_name}{' (emulated)' if f8.emulate else ''}: {converted} of {len(linears)} "
                     f"nn.Linear layers in float8 ({len(filtered)} kept by filter_fqns {matched}, "
                     f"{len(linears) - len(filtered) - converted} with dims not multiples of {FLOAT8_TILE}); "
                     "FSDP float8 all-gather "
                     f"{'on' if f8.enable_fsdp_float8_all_gather else 'off'}")
    names = args.routed_expert_names()
    experts = [name for name in names if selected_by(name, f8.moe_fqns)] if f8.routed_experts else []
    parts.append(f"routed experts: {len(experts)} of {len(names)} MoE layers' grouped GEMMs in "
                 "float8 (rowwise scales, 16-row expert blocks)" if experts else "routed experts in high precision")
    return "; ".join(parts)


def _mesh_rows(layout: dict[str, DimLayout]) -> list[tuple[str, int, str]]:
    composed = {**{v: " x ".join(d) for v, d in FLAT_VIEWS.items()},
                "ep": "innermost ranks of the expert region", "efsdp": "expert region / ep"}
    return [(name, layout[name].size, composed.get(name, "world dim")) for name in ALL_NAMES]


@dataclass(frozen=True)
class JobPlan:
    """What the planner works out for a job: `report` is what ``dry_run.json`` holds; the rest
    is what the printed report needs besides it."""

    report: dict
    dims: ParallelDims
    layout: dict[str, DimLayout]
    ranks: list[int]  # the example ranks whose coordinates and groups are shown
    params_local: int  # parameters of the fullest pp rank after TP/EP, before FSDP sharding
    memory: MemoryEstimate  # of the fullest pp rank
    device_gib: float | None


def plan_job(cfg: JobConfig, world_size: int, *, machine_device_gib: float | None = None) -> JobPlan:
    """Plan `cfg` on `world_size` ranks (a validated config; nothing is printed or written).

    Args:
        machine_device_gib: this machine's memory per device (`preflight.device_memory_gib`),
            what the fit is checked against when `job.device_memory_gib` is not set; None:
            unknown (the planner reads no hardware).
    """
    degrees = resolve_degrees(cfg.parallelism, world_size)
    dims = ParallelDims(**degrees, world_size=world_size)
    args = model_args_from_config(cfg.model, lora=cfg.lora.enable)  # the model the run trains
    layout = dims.layout()
    ranks = example_ranks(world_size)

    counts = args.param_counts()
    specs = param_specs(args)
    pipe = job_pipeline_layout(args, dims, cfg.parallelism, cfg.training, cfg.optimizer)
    per_pp_rank = [rank_param_specs(specs, pipe, r) for r in range(dims.pp)]
    params_per_rank = max(sum(shard_numel(s, dims) for s in local) for local in per_pp_rank)
    params_local = max(sum(math.prod(local_shape(s, dims)) for s in local) for local in per_pp_rank)
    expert_params_per_rank = max(sum(shard_numel(s, dims) for s in local if s.expert) for local in per_pp_rank)
    # Weights and gradients, and the optimizer's states (AdamW: two; Muon: its momentum buffer).
    expert_state_elements = max(2 * sum(shard_numel(s, dims) for s in local if s.expert)
                                + optimizer_state_elements([s for s in local if s.expert], dims, cfg.optimizer)
                                for local in per_pp_rank)
    memory = max(memory_per_pp_rank(args, dims, cfg.training, cfg.activation_checkpoint, cfg.parallelism,
                                    compiled=cfg.compile.enable, lora=cfg.lora, optimizer_cfg=cfg.optimizer), key=lambda e: e.total)
    device_gib = cfg.job.device_memory_gib if cfg.job.device_memory_gib > 0 else machine_device_gib
    tp_gathers = tp_gather_bytes(cfg, dims, args, pipe)
    plan = describe_plan(cfg, dims, args, pipe, tp_gathers)

    report = {
        "world_size": world_size,
        "mesh": {name: layout[name].size for name in ALL_NAMES},
        "params_total": counts["total"],
        "params_active": counts["active"],
        "params_mtp": counts["mtp"],  # the multi-token prediction modules', part of the total
        "params_per_rank": params_per_rank,
        "expert_params_per_rank": expert_params_per_rank,
        "expert_state_per_rank_gib": expert_state_elements * param_dtype_bytes(cfg.training) / GIB,
        "flops_per_token": args.flops_per_token(cfg.training.seq_len),
        "memory_per_rank_gib": memory.gib(),
        "lora": lora_report(cfg, args, dims, memory) if cfg.lora.enable else None,
        "memory_pp_rank": memory.pp_rank,
        "device_memory_gib": device_gib,
        "plan": plan,
        "pipeline": pipeline_report(cfg, dims, args, pipe) if dims.pp_enabled else None,
        "context_parallel": context_report(cfg, dims, args) if dims.cp_enabled else None,
        "tensor_parallel": tp_report(cfg, tp_gathers) if dims.tp_enabled else None,
        "muon": muon_report(cfg, dims, args, pipe) if cfg.optimizer.name == "Muon" else None,
        "coordinates": {str(r): {d: layout[d].coordinate(r) for d in MESH_DIMS} for r in ranks},
        "groups": {str(r): {name: group_json(layout[name].members(r)) for name in ALL_NAMES} for r in ranks},
    }
    return JobPlan(report, dims, layout, ranks, params_local, memory, device_gib)


def muon_report(cfg: JobConfig, dims: ParallelDims, args: ModelArgs, pipe: PipelineLayout) -> dict:
    """Muon's step on the pp rank with the most Newton-Schulz work (`plan.muon`): its FLOPs, the
    bytes its per-matrix gathers receive, per rank and step, and its transient peak (the most of
    any pp rank: the gathered matrix and NS temporaries of the largest, in the memory estimate)."""
    costs = [muon_cost(args, dims, cfg.optimizer, rank_units(pipe, r)) for r in range(dims.pp)]
    cost = max(costs, key=lambda c: c.ns_flops)
    peak = max(step_peak_bytes(args, dims, cfg.optimizer, param_dtype_bytes(cfg.training), rank_units(pipe, r))
               for r in range(dims.pp))
    return {"ns_dtype": cfg.optimizer.ns_dtype, "ns_flops_per_step": cost.ns_flops,
            "gather_bytes_received_per_step": cost.received_bytes, "muon_params_stored": cost.muon_stored,
            "step_peak_bytes": peak}


def run_dry_run(cfg: JobConfig, world_size: int, *, console: Console | None = None,
                machine_device_gib: float | None = None) -> dict:
    """Plan `cfg` on `world_size` ranks: print the report and write ``dry_run.json``.

    Args:
        cfg: a validated job config.
        world_size: ranks to plan for.
        console: where to print (default: stdout).
        machine_device_gib: as `plan_job`'s.
    Returns:
        The report written to ``<job.dump_folder>/dry_run.json``.
    """
    console = console or Console(highlight=False)
    job = plan_job(cfg, world_size, machine_device_gib=machine_device_gib)
    _print_report(console, cfg, job, compute_dtype_bytes(cfg.training))
    out = Path(cfg.job.dump_folder)
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / DRY_RUN_FILE, json.dumps(job.report, indent=2) + "\n")
    console.print(f"wrote {out / DRY_RUN_FILE}")
    return job.report


def _print_report(console: Console, cfg: JobConfig, job: JobPlan, compute_bytes: int) -> None:
    dims, layout, ranks, report, memory = job.dims, job.layout, job.ranks, job.report, job.memory
    console.rule(f"[bold]dry run: {cfg.model.flavor} on {counted(dims.world_size, 'rank')}")

    mesh = Table(title="mesh (ranks row-major over pp, dp_replicate, dp_shard, cp, tp)", title_justify="left")
    for col in ("name", "size", "made of"):
        mesh.add_column(col)
    for name, size, composed in _mesh_rows(layout):
        mesh.add_row(name, str(size), composed)
    console.print(mesh)

    groups = Table(title=escape("groups of example ranks: [local rank] members"), title_justify="left")
    groups.add_column("name")
    for r in ranks:
        coords = ", ".join(f"{d}={report['coordinates'][str(r)][d]}" for d in MESH_DIMS)
        groups.add_column(f"rank {r}\n({coords})")
    for name in ALL_NAMES:
        groups.add_row(name, *(escape(f"[{layout[name].coordinate(r)}] {format_ranks(layout[name].members(r))}")
                               for r in ranks))
    console.print(groups)

    plan = Table(title="parallel plan", title_justify="left")
    plan.add_column("technique")
    plan.add_column("")
    for name, entry in report["plan"].items():
        style = "" if entry["enabled"] else "dim"
        plan.add_row(name, entry["detail"], style=style)
    console.print(plan)
    if report["pipeline"] is not None:
        _print_pipeline(console, report["pipeline"])

    dtype = {2: "bf16", 4: "fp32"}[compute_bytes]
    console.print(
        f"parameters: total {format_count(report['params_total'])}"
        + (f" (multi-token prediction {format_count(report['params_mtp'])})" if report["params_mtp"] else "")
        + f", active {format_count(report['params_active'])}; per rank {format_count(report['params_per_rank'])} "
        f"stored ({format_count(job.params_local)} after TP/EP, before FSDP sharding)")
    console.print(f"routed experts per rank: {format_count(report['expert_params_per_rank'])} stored; with their "
                  f"gradients and {cfg.optimizer.name} state {report['expert_state_per_rank_gib']:.2f} GiB (included below)")
    console.print(f"FLOPs per token (fwd+bwd, seq_len {cfg.training.seq_len}): {report['flops_per_token']:.4g}")
    if report["muon"]:
        mu = report["muon"]
        console.print(f"Muon per rank and step: Newton-Schulz {mu['ns_flops_per_step'] / 1e9:.4g} GFLOP "
                      f"({mu['ns_dtype']}), gathers receive {mu['gather_bytes_received_per_step'] / 2**20:.4g} MiB; "
                      f"{format_count(mu['muon_params_stored'])} stored elements with one state (momentum_buffer); "
                      f"step transients (gathered matrix + NS) peak at {mu['step_peak_bytes'] / 2**20:.4g} MiB")

    gib = memory.gib()
    console.print(f"memory per rank (estimate for the fullest pp rank, {memory.pp_rank}; compute dtype {dtype}, "
                  f"parameters, gradients and optimizer state {cfg.training.dtype}):")
    table = Table()
    table.add_column("part")
    table.add_column("GiB", justify="right")
    # Tiny models need more digits than real ones to show anything but zeros.
    digits = 2 if gib["total"] >= 1 else 4
    for part in ("params", "grads", "optimizer", "fsdp_buffers", "activations"):
        table.add_row(part, f"{gib[part]:.{digits}f}")
    if memory.optimizer_step:  # after backward: the total counts the larger of it and the two above
        table.add_row("optimizer_step (after backward)", f"{gib['optimizer_step']:.{digits}f}")
    table.add_row("total", f"{gib['total']:.{digits}f}", style="bold")
    if memory.host:
        table.add_row("host (CPU offload)", f"{gib['host']:.{digits}f}", style="dim")
    console.print(table)
    lora = report["lora"]
    if lora is not None:
        console.print(f"LoRA: {format_count(lora['adapter_params'])} adapter parameters train; the frozen base has no "
                      f"gradients and no optimizer state: {lora['saved_gib']:.2f} GiB less per rank than training "
                      f"every parameter ({lora['full_fine_tuning_gib']:.2f} GiB)")
    _print_memory_verdict(console, gib["total"], job.device_gib)


def lora_report(cfg: JobConfig, args: ModelArgs, dims: ParallelDims, memory: MemoryEstimate) -> dict:
    """LoRA's adapters and what freezing the base saves on the fullest rank: the memory the same
    layout needs to train every parameter, beside this run's."""
    full = memory_per_pp_rank(args, dims, cfg.training, cfg.activation_checkpoint, cfg.parallelism,
                              compiled=cfg.compile.enable)[memory.pp_rank]
    return {"adapter_params": sum(math.prod(s.shape) for s in adapter_specs(args, cfg.lora)),
            "full_fine_tuning_gib": full.gib()["total"], "saved_gib": (full.total - memory.total) / GIB}


def _print_pipeline(console: Console, pipeline: dict) -> None:
    table = Table(title=f"pipeline stages ({pipeline['schedule']}, {pipeline['microbatches']} micro-batches, "
                        f"bubble {pipeline['bubble_fraction']:.1%})", title_justify="left")
    for col in ("stage", "pp rank", "layers", "MoE", "GFLOP/token", "state GiB/rank"):
        table.add_column(col, justify="left" if col == "layers" else "right")
    for st in pipeline["stages"]:
        layers = st["layers"]
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
        table.add_row(str(st["stage"]), str(st["pp_rank"]), f"{span} ({len(layers)})", str(st["moe_layers"]),
                      f"{st['flops_per_token'] / 1e9:.4g}", f"{st['state_gib']:.4g}")
    console.print(table)
    console.print(f"stage imbalance (max / mean): FLOPs {pipeline['flops_imbalance']:.3f}, "
                  f"memory {pipeline['memory_imbalance']:.3f}")


def _print_memory_verdict(console: Console, total_gib: float, device_gib: float | None) -> None:
    if device_gib is None:
        console.print("[dim]device memory unknown (no CUDA here): set job.device_memory_gib to check the fit[/]")
    elif total_gib > device_gib:
        console.print(f"[bold red]warning: estimated {total_gib:.1f} GiB per rank exceeds the device's "
                      f"{device_gib:.1f} GiB: expect OOM; raise sharding (dp_shard, tp, ep, pp), enable "
                      "activation checkpointing, or lower local_batch_size / seq_len[/]")
    elif total_gib > _TIGHT_FRACTION * device_gib:
        console.print(f"[yellow]warning: estimated {total_gib:.1f} GiB per rank is within "
                      f"{100 * (1 - _TIGHT_FRACTION):.0f}% of the device's {device_gib:.1f} GiB "
                      "(allocator fragmentation and NCCL buffers are not counted)[/]")
    else:
        console.print(f"[green]fits: {total_gib:.1f} of {device_gib:.1f} GiB per device[/]")


def format_count(n: float) -> str:
    """A parameter count with a readable unit: 2.40 M, 107.77 B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"
