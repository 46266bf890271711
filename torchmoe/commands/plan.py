"""`torchmoe plan`: how to run a job on N GPUs: the fastest layout that fits, and why the others lost.

    python -m torchmoe plan --config configs/llama4_128e.toml --gpus 512 --free parallelism
    python -m torchmoe plan --config configs/debug_model.toml --gpus 4 --hardware cpu.json --free all \\
        --out best.toml --json all.json
    torchrun --nproc-per-node 4 -m torchmoe plan --calibrate cpu.json --config configs/debug_model.toml

Searches the layouts (`plan.search`) that training's own preflight accepts
(`preflight.validate_layout`), keeps those whose memory estimate fits the profile's device,
and ranks them by predicted step time (`plan.step_time`). Prints the top layouts, one line per
family that lost (and why), writes the winner as a full job TOML (`--out`: `torchmoe train
--config best.toml` runs it unchanged) and every scored layout as JSON (`--json`).
`--calibrate OUT.json` instead measures this machine (`torchmoe.commands.calibrate`) into a profile that
`--hardware OUT.json` reads. No process group and no GPU are needed to plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torchmoe.arch.registry import model_args_from_config
from torchmoe.config import ConfigError, JobConfig, load_job_config, validate_sections
from torchmoe.config.files.output_files import check_output_file, write_output
from torchmoe.config.files.paths import free_folder_name
from torchmoe.config.job_file import resolved_config_text
from torchmoe.config.numbers import MAX_RANKS, parse_int, parse_number
from torchmoe.metrics.metrics_records import METRICS_FILE
from torchmoe.nn.attention_kernel_choice import MATH
from torchmoe.plan.hardware import BUILTIN_PROFILES, load_profile
from torchmoe.plan.memory import compute_dtype
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import bubble_fraction, job_pipeline_layout, microbatches
from torchmoe.plan.search import DEFAULT_MARGIN, PLAN_KEYS, Layout, SearchResult, fixed_keys, search
from torchmoe.plan.step_time import predict
from torchmoe.preflight import validate_layout
from torchmoe.weight_sources.folder_model import with_folder_model

__all__ = ["PLAN_DESCRIPTION", "dry_run_advice", "plan_main", "run_plan"]

PLAN_DESCRIPTION = f"""\
Choose the fastest layout that fits for a job on N GPUs, from a hardware profile.

  --gpus N             ranks (GPUs) to plan for (required unless --calibrate)
  --gpus-per-node N    ranks per node (default: the profile's, 8 for the built-in GPUs)
  --hardware NAME      {', '.join(BUILTIN_PROFILES)}, or a profile JSON (default h100)
  --top K              layouts to print (default 5; --json has every one)
  --out FILE           write the winner as a job TOML that `torchmoe train --config FILE` runs
  --json FILE          write every scored layout: prediction, memory, the flags that reproduce it
  --free KEY ...       release keys the config sets: a key, its section, or all (the planner's
                       keys: {', '.join(PLAN_KEYS)})
  --margin F           fraction of device memory kept free (default {DEFAULT_MARGIN})
  --calibrate FILE     measure this machine into a profile JSON instead (under torchrun: over
                       the launched ranks); --budget S bounds its seconds (default 90)
  --config FILE and --section.key VALUE as for `torchmoe train`.
"""

_VALUE_FLAGS = ("--gpus", "--gpus-per-node", "--hardware", "--top", "--out", "--json", "--margin",
                "--calibrate", "--budget")


def _split_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """(planner flags with one value, --free's values, the config's argv)."""
    flags: dict[str, str] = {}
    free: list[str] = []
    rest: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        flag, eq, value = tokens[i].partition("=")
        flag = flag.replace("_", "-") if flag.startswith("--") and "." not in flag else flag
        if flag in _VALUE_FLAGS:
            if not eq:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
            if not value or (value.startswith("--") and not eq):
                raise ConfigError(flag, value, "expects a value", f"pass {flag} VALUE (see torchmoe plan --help)")
            if flag in flags:
                raise ConfigError(flag, value, "given more than once", f"pass {flag} once")
            flags[flag] = value
        elif flag == "--free":
            values = [value] if eq else []
            while not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                i += 1
                values.append(tokens[i])
            if not values:
                raise ConfigError("--free", "", "expects keys", "pass --free KEY ..., a section, or all")
            free += values
        else:
            rest.append(tokens[i])
        i += 1
    return flags, free, rest


def _count(key: str, text: str, high: int = MAX_RANKS) -> int:
    return parse_int(key, text, low=1, high=high, fix=f"pass e.g. {key} 8")


def _fraction(key: str, text: str) -> float:
    """A fraction of memory kept free: all of it (1) would leave nothing to plan with."""
    return parse_number(key, text, low=0.0, high=0.99, fix=f"pass e.g. {key} 0.1")


def _seconds(key: str, text: str) -> float:
    """A time budget: at most a day (what calibration takes is minutes)."""
    return parse_number(key, text, low=0.0, high=86_400.0, above_low=True, fix=f"pass e.g. {key} 60")


_OUT_FIX = "pass a file path this user can write, in a folder that exists or can be made"


def plan_main(argv: Sequence[str]) -> int:
    """`torchmoe plan ARGS`; returns the exit status (ConfigError propagates: exit 2)."""
    if any(a in ("-h", "--help") for a in argv):
        print(PLAN_DESCRIPTION)
        return 0
    flags, free, config_argv = _split_flags(argv)
    set_keys: set[str] = set()
    cfg = load_job_config(config_argv, prog="torchmoe plan", set_keys=set_keys)
    validate_sections(cfg)
    cfg = with_folder_model(cfg, set_keys=set_keys, absent_ok=True)  # from a Hugging Face folder: its config.json
    if "--calibrate" in flags:
        # Calibration measures this machine; a planning flag beside it would be ignored.
        ignored = next((f for f in flags if f not in ("--calibrate", "--budget")), "--free" if free else None)
        if ignored is not None:
            raise ConfigError(ignored, flags.get(ignored, " ".join(free)), "has no effect with --calibrate, which "
                              "measures this machine and plans nothing",
                              f"leave it out; then plan with the profile: torchmoe plan --hardware "
                              f"{flags['--calibrate']} --gpus N")
        return _calibrate(cfg, flags)
    if "--budget" in flags:
        raise ConfigError("--budget", flags["--budget"], "only times --calibrate",
                          "leave it out, or measure this machine with --calibrate FILE")
    if "--gpus" not in flags:
        raise ConfigError("--gpus", "", "missing", "pass the number of GPUs to plan for, e.g. --gpus 512")
    gpus = _count("--gpus", flags["--gpus"])
    profile = load_profile(flags.get("--hardware", "h100"))
    gpn = _count("--gpus-per-node", flags["--gpus-per-node"]) if "--gpus-per-node" in flags else \
        min(profile.gpus_per_node, gpus)
    top = _count("--top", flags.get("--top", "5"))
    margin = _fraction("--margin", flags.get("--margin", str(DEFAULT_MARGIN)))
    outputs = {k: check_output_file(k, flags[k], _OUT_FIX) for k in ("--out", "--json") if k in flags}
    if len(set(map(os.path.realpath, outputs.values()))) < len(outputs):
        raise ConfigError("--json", flags["--json"], "is the file --out names too: one would overwrite the other",
                          "name two files, e.g. --out best.toml --json all.json")
    fixed = fixed_keys(cfg, set_keys, free)
    run_plan(cfg, gpus, profile_name=flags.get("--hardware", "h100"), gpus_per_node=gpn, fixed=fixed, top=top,
             margin=margin, out=outputs.get("--out"), json_out=outputs.get("--json"))
    return 0


def run_plan(cfg: JobConfig, gpus: int, *, profile_name: str = "h100", gpus_per_node: int | None = None,
             fixed: set[str] | None = None, top: int = 5, margin: float = DEFAULT_MARGIN,
             out: Path | None = None, json_out: Path | None = None, console: Console | None = None) -> SearchResult:
    """Search, print the report, write `out` (the winner's TOML) and `json_out` (every layout).

    Raises:
        ConfigError: no layout fits (naming the closest family's memory), or a write fails.
    """
    console = console or _report_console()
    profile = load_profile(profile_name)
    result = search(cfg, gpus, profile, gpus_per_node=gpus_per_node, fixed=fixed, margin=margin,
                    check=lambda candidate, world: validate_layout(candidate, world))
    _print(console, cfg, gpus, profile.name, result, top)
    if json_out is not None:
        write_output("--json", json_out, json.dumps(_report(cfg, gpus, profile.name, result), indent=1) + "\n",
                     _OUT_FIX)
        console.print(f"wrote {json_out} ({len(result.scored)} layouts)", soft_wrap=True)
    best = result.best
    if best is None and (refusal := result.config_refusal()) is not None:
        raise refusal  # as the dry run of the job would
    if best is None:
        if result.unfit:
            name = min(result.unfit, key=result.unfit.__getitem__)
            closest = f"the closest, {name}, {result.pruned[name]}"
        else:
            closest = next(iter(result.pruned.values()), "no layout is valid")
        raise ConfigError("--gpus", gpus, f"no layout of {cfg.model.flavor} fits {gpus} x {profile.name} "
                          f"({profile.memory_gib:g} GiB each, margin {margin:.0%}); {closest}",
                          ("plan for more GPUs, " if gpus < MAX_RANKS else "") + "a device with more memory, a "
                          "shorter seq_len or smaller batch, or --free the keys the config fixes")
    if out is not None:
        job = _own_dump_folder(best.cfg, out)
        # Looked at again before the write: the search took seconds.
        write_output("--out", out, resolved_config_text(job, out), _OUT_FIX)
        console.print(f"wrote {out}: torchmoe train --config {out}" +
                      (f" (torchrun --nproc-per-node {gpus_per_node or profile.gpus_per_node} ...)" if gpus > 1 else "")
                      + f", writing to {job.job.dump_folder}", soft_wrap=True)  # paths unbroken
    return result


def _own_dump_folder(cfg: JobConfig, out: Path) -> JobConfig:
    """`cfg` with a dump folder its run may write: the source job's while no run is there yet,
    else a free one beside it named after `out` (``outputs/debug-best``), so that the command
    printed is not refused for a folder another run holds or finished in. A folder that holds no
    run's history or checkpoints (only the shared data indexes, say) is the job's still."""
    folder = cfg.job.dump_folder
    dump = Path(folder)
    if os.path.lexists(folder) and (not dump.is_dir() or any(
            os.path.lexists(dump / name) for name in (METRICS_FILE, cfg.checkpoint.folder))):
        folder = free_folder_name(f"{folder.rstrip('/') or folder}-{out.stem}")
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, dump_folder=folder))


def _report(cfg: JobConfig, gpus: int, profile: str, result: SearchResult) -> dict:
    return {"flavor": cfg.model.flavor, "gpus": gpus, "hardware": profile, "fixed": result.fixed,
            "search_seconds": result.seconds, "layouts_estimated": result.evaluated,
            "layouts": [layout.as_dict() for layout in result.scored], "pruned_families": result.pruned}


def _print(console: Console, cfg: JobConfig, gpus: int, profile: str, result: SearchResult, top: int) -> None:
    console.rule(f"[bold]plan: {cfg.model.flavor} on {gpus} x {profile}")
    if result.fixed:
        console.print(f"[dim]fixed by the config or flags (release with --free): {', '.join(result.fixed)}[/]")
    table = Table(title=f"fastest layouts ({len(result.scored)} fit of {result.evaluated} estimated, "
                        f"{result.seconds:.1f} s)", title_justify="left")
    for col in ("#", "layout", "knobs", "tok/s/GPU", "MFU", "step s", "compute", "exposed comm", "bubble",
                "GiB/rank", "headroom"):
        table.add_column(col, justify="left" if col in ("layout", "knobs") else "right")
    for i, layout in enumerate(result.scored[:top], 1):
        p = layout.prediction
        comm = ", ".join(f"{k} {v:.2g}" for k, v in p.comm.items() if v > 0.005 * p.step_s) or "-"
        table.add_row(str(i), layout.family, escape(_knobs(layout)), f"{p.tokens_per_s_per_gpu:,.0f}", f"{p.mfu:.1%}",
                      f"{p.step_s:.3g}", f"{p.compute_s:.3g}", f"{p.comm_s:.2g} ({comm})", f"{p.bubble:.2g}",
                      f"{layout.memory_gib:.1f}", f"{result.device_gib - layout.memory_gib:.1f}")
    console.print(table)
    if result.best is not None:
        console.print("best: " + escape(" ".join(result.best.flags())))
        console.print(f"attention kernel: {result.best.prediction.attention_kernel} (torchmoe/nn/attention_kernel_choice.py)")
    if result.pruned:
        console.print(f"[bold]families that lost ({len(result.pruned)}; each with its reason in --json)[/]")
        for line in _pruned_summary(result.pruned):
            console.print(f"  {escape(line)}")


def _report_console() -> Console:
    """stdout at the terminal's width; written to a file or a pipe, wide enough that the table
    is never cut (rich would assume 80 columns)."""
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=220)


def _pruned_summary(pruned: dict[str, str]) -> list[str]:
    """One line per reason families lost for: slower (how many, the closest), not fitting (how
    many, the smallest), refused by training (how many per refusing key, an example)."""
    slower = sorted((r, n) for n, r in pruned.items() if _order(r) == 0)
    unfit = sorted((r, n) for n, r in pruned.items() if _order(r) == 1)
    refused: dict[str, list[str]] = {}
    for name, reason in pruned.items():
        if _order(reason) == 2:
            refused.setdefault(reason.split(" = ", 1)[0], []).append(name)
    lines = []
    if slower:
        closest = min(slower, key=lambda rn: _leading_percent(rn[0]))
        lines.append(f"slower: {len(slower)} families; the closest, {closest[1]}: {closest[0]}")
    if unfit:
        lines.append(f"does not fit: {len(unfit)} families; e.g. {unfit[0][1]}: {unfit[0][0]}")
    for key, names in sorted(refused.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"refused by {key}: {len(names)} families; e.g. {names[0]}: {pruned[names[0]]}")
    return lines


def _leading_percent(reason: str) -> float:
    """The N of a reason starting "N% slower"."""
    head = reason.split("%", 1)[0]
    return float(head) if head.replace(".", "", 1).isdigit() else float("inf")


def _order(reason: str) -> int:
    """Lost on speed first (closest first, as found), then on memory, then refused by training."""
    return 0 if "slower" in reason else 1 if reason.startswith("does not fit") else 2


def _knobs(layout: Layout) -> str:
    o = layout.overrides
    parts = [f"ac {o.get('activation_checkpoint.mode', layout.cfg.activation_checkpoint.mode)}"]
    if layout.dims.pp > 1:
        t = layout.cfg
        n = t.training.local_batch_size // t.parallelism.pipeline_parallel_microbatch_size
        parts.append(f"{t.parallelism.pipeline_parallel_schedule} x{n}")
    parts.append(f"batch {layout.cfg.training.local_batch_size}")
    if layout.dims.fsdp_enabled:
        parts.append(f"reshard {layout.cfg.parallelism.fsdp_reshard_after_forward}")
    if layout.cfg.float8.enable:
        parts.append("float8")
    return ", ".join(parts)


def _calibrate(cfg: JobConfig, flags: dict[str, str]) -> int:
    from torchmoe.commands.calibrate import calibrate  # imported here: it builds kernels and process groups

    out = check_output_file("--calibrate", flags["--calibrate"], _OUT_FIX)
    budget = _seconds("--budget", flags.get("--budget", "90"))
    profile = calibrate(cfg, out, budget_s=budget)
    if os.environ.get("RANK") in (None, "0"):
        rates = profile["achieved_tflops"]
        _report_console().print(  # one line, also in a file
            f"wrote {escape(str(out))}: " + "; ".join(f"{op} " + ", ".join(f"{d} {v:.3g}" for d, v in r.items())
                                                    + " TFLOP/s" for op, r in rates.items())
            + f"; {len(profile.get('collectives', {}))} collectives; plan with --hardware {escape(str(out))}")
        bounded = profile["measurements"].get("bounded")
        if bounded:  # the machine was too busy to measure them: `calibrate` notes it in the profile
            _report_console().print(f"[yellow]warning:[/] {', '.join(bounded)} measured outside what a profile "
                                    "holds (compute twice), written as the nearest bound: calibrate again on an idle "
                                    "machine for a profile that predicts it", soft_wrap=True)
    return 0


# The dry run warns when the configured layout is predicted this much slower than the planner's
# best, or idles this much of its step in the pipeline bubble.
SLOWER_WARNING = 0.20
BUBBLE_WARNING = 0.25


def dry_run_advice(cfg: JobConfig, world_size: int, *, hardware: str = "", gpus_per_node: int | None = None,
                   set_keys: set[str] | None = None, console: Console | None = None) -> list[str]:
    """The dry run's warnings about speed: one line each, printed and returned.

    - the layout's pipeline bubble is over `BUBBLE_WARNING` of its step (hardware-free: the
      schedule's own idle fraction);
    - its predicted tokens/s per GPU is more than `SLOWER_WARNING` below the planner's best on
      `hardware` (default h100; a CPU job is compared only when `hardware` is given, as GPU
      rates say nothing about it), with the flags of the best. The search is `torchmoe plan`'s
      for the same config: the planner keys the file or the flags set (`set_keys`) stay fixed,
      so a layout `plan` wrote is never flagged, and both commands give one verdict.
    """
    console = console or Console(stderr=True, highlight=False, soft_wrap=True)
    lines = []
    if cfg.parallelism.pipeline_parallel_degree > 1:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        pipe = job_pipeline_layout(model_args_from_config(cfg.model), dims, cfg.parallelism, cfg.training,
                                   cfg.optimizer)
        n = microbatches(cfg.training, cfg.parallelism)[0]
        bubble = bubble_fraction(cfg.parallelism.pipeline_parallel_schedule, dims.pp, pipe.num_stages, n)
        if bubble > BUBBLE_WARNING:
            lines.append(f"pipeline bubble {bubble:.0%} ({cfg.parallelism.pipeline_parallel_schedule}, pp {dims.pp}, "
                         f"{n} micro-batch{'es' if n != 1 else ''}): over {BUBBLE_WARNING:.0%} of each step idles; "
                         "use more micro-batches (a smaller pipeline_parallel_microbatch_size), an interleaved "
                         "schedule, or a smaller pp")
    if hardware or cfg.training.device != "cpu":
        profile = load_profile(hardware or "h100")
        gpn = gpus_per_node or min(profile.gpus_per_node, world_size)
        mine = predict(cfg, world_size, profile, gpn)
        if mine.attention_kernel == MATH:
            lines.append(f"on {profile.name} no fused attention kernel takes {compute_dtype(cfg.training)} with "
                         f"head_dim {model_args_from_config(cfg.model).head_dim}: attention runs torchmoe's math "
                         "definition, which materialises each call's score matrix (predicted in the step time); "
                         "train in bfloat16 with a head_dim that is a multiple of 8 for the flash kernel")
        result = search(cfg, world_size, profile, gpus_per_node=gpn, fixed=fixed_keys(cfg, set_keys or set(), ()),
                        check=lambda candidate, world: validate_layout(candidate, world))
        best = result.best
        if best is not None and mine.tokens_per_s_per_gpu < (1 - SLOWER_WARNING) * best.prediction.tokens_per_s_per_gpu:
            slower = 1 - mine.tokens_per_s_per_gpu / best.prediction.tokens_per_s_per_gpu
            lines.append(f"on {world_size} x {profile.name} this layout is predicted {slower:.0%} slower than the "
                         f"planner's best ({mine.tokens_per_s_per_gpu:,.0f} vs "
                         f"{best.prediction.tokens_per_s_per_gpu:,.0f} tok/s/GPU): {best.family}: "
                         + " ".join(best.flags()) + " (see torchmoe plan)")
    for line in lines:
        console.print(f"[yellow]warning:[/] {escape(line)}")
    return lines
