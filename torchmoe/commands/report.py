"""`torchmoe report`: one figure of a training run, from its dump folder.

    torchmoe report outputs/debug                     # writes outputs/debug/report.png
    torchmoe report outputs/debug --out debug.html    # one self-contained page: figure + final metrics

Reads `metrics.jsonl` (a step that a resumed run logged again counts once: the later line),
`config.toml` and `run_info.json` (the world size; `--world-size N` for a folder without one) and
draws: a header of the planner's facts (flavor, total / active parameters, world size and mesh,
estimated memory per rank: `plan_job`, what `train --dry-run` prints); loss, gradient norm, LR and
tokens/s over the steps; each MoE layer's share of tokens per expert at the last logged step; and
each MoE layer's imbalance (max / mean tokens per expert) over the logged steps; a dotted line
and a header note at each step where a run resumed a checkpoint (`resumed_from`). Needs the
`report` extra (matplotlib). A missing folder or file, a metrics file without records, a record
or config.toml that is not what `train` writes (`_record_fault`; per-expert counts of another
flavor than config.toml's), a malformed run_info.json or a world size that does not fit the
config, or a missing matplotlib is a `ConfigError` (one message, exit 2).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import importlib.util
import io
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import FLAVORS, model_args_from_config
from torchmoe.commands.arguments import ArgumentParser, parse_args
from torchmoe.config.degrees import resolve_degrees
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.files.output_files import check_output_file, write_output
from torchmoe.config.files.paths import nonempty_path, path_faults
from torchmoe.config.job_config import JobConfig
from torchmoe.config.job_file import load_toml_config
from torchmoe.config.numbers import MAX_RANKS, parse_int
from torchmoe.config.validate import validate_sections
from torchmoe.metrics.metrics import layer_imbalance
from torchmoe.metrics.metrics_records import METRICS_FILE, not_records, read_record_lines
from torchmoe.plan.dry_run import format_count, plan_job
from torchmoe.plan.parallel_dims import MESH_DIMS
from torchmoe.preflight.layout import check_flavor
from torchmoe.run_folders.run_info import RUN_INFO_FILE, read_run_info
from torchmoe.weight_sources.folder_model import with_folder_model

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["RunData", "load_run", "read_records", "render", "report_main", "resumes"]

DEFAULT_OUT = "report.png"
_CURVES = (("loss", "loss"), ("grad_norm", "gradient norm"), ("lr", "learning rate"),
           ("tokens_per_sec", "tokens / s (global)"))
# The final-metrics table of the HTML page, in this order (keys a record lacks are left out).
_TABLE_KEYS = ("step", "loss", "validation_loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu",
               "memory_gib", "elapsed_s", "moe_imbalance", "ep_all_to_all_gib")
# What the report reads of each record besides tokens_per_expert: numbers, or null (non-finite, unknown).
_NUMBERS = tuple(dict.fromkeys([key for key, _ in _CURVES] + [key for key in _TABLE_KEYS if key != "step"]))
# Cells of the expert-load heatmap get their percentage written in up to this many cells.
_MAX_ANNOTATED = 256


@dataclass(frozen=True)
class RunData:
    """What a report shows of one run.

    Attributes:
        name: the dump folder's name.
        records: metrics.jsonl, one record per step in step order.
        facts: the header lines (model, layout, planner estimates, steps).
        moe_layers: the block index of each MoE layer (rows of `tokens_per_expert`).
        skipped: what metrics.jsonl holds that is not a record, left out (`metrics.not_records`).
    """

    name: str
    records: list[dict[str, Any]]
    facts: list[str]
    moe_layers: list[int]
    skipped: str | None = None


def read_records(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[int]]:
    """The records of a metrics.jsonl with their line numbers, one per step in step order; of a
    step logged twice (a resumed run logs again from its checkpoint) the later line. And the
    numbers of the lines that are not records (torn by a kill, or edited), which are skipped."""
    records, skipped = read_record_lines(path)
    by_step = {record["step"]: (number, record) for number, _, record in records}
    return [by_step[s] for s in sorted(by_step)], skipped


def _short(value: Any) -> str:
    text = show_value(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type(): a bool is no number here


def _record_fault(record: dict[str, Any]) -> str | None:
    """Why the report cannot draw `record`, or None: a field it reads is not what torchmoe
    writes: `step` a positive integer, the curves' and the table's fields numbers or null, and
    `tokens_per_expert` one row of counts per MoE layer, each with a count per expert."""
    if type(record["step"]) is not int or record["step"] < 1:
        return f"step is {_short(record['step'])}, not a positive integer"
    resumed = record.get("resumed_from")
    if resumed is not None and not (type(resumed) is int and 0 < resumed < record["step"]):
        return f"resumed_from is {_short(resumed)}, not a checkpoint step before the record's"
    for key in _NUMBERS:
        if record.get(key) is not None and not _is_number(record[key]):
            return f"{key} is {_short(record[key])}, not a number (or null)"
    counts = record.get("tokens_per_expert")
    if counts is None:
        return None
    if not isinstance(counts, list) or not all(isinstance(row, list) for row in counts):
        return f"tokens_per_expert is {_short(counts)}, not a list of per-expert token counts per MoE layer"
    widths = sorted({len(row) for row in counts})
    if len(widths) > 1:
        return f"tokens_per_expert is ragged: its rows hold {' and '.join(map(str, widths))} experts"
    bad = next((v for row in counts for v in row if not (_is_number(v) and v >= 0)), None)
    return None if bad is None else f"tokens_per_expert holds {_short(bad)}, not a token count"


def _counts_shape(args: ModelArgs) -> tuple[int, int]:
    """(MoE layers, experts) of a model of `args`: the shape of the tokens_per_expert it logs."""
    layers = len(args.routed_expert_names())
    return layers, args.num_experts if layers else 0


def _run_facts(cfg: JobConfig, world_size: int, records: list[dict[str, Any]]) -> list[str]:
    """Header lines: the model and the planner's layout and memory facts for `world_size` ranks."""
    plan = plan_job(cfg, world_size).report
    mesh = " x ".join(f"{d} {plan['mesh'][d]}" for d in MESH_DIMS)
    memory = plan["memory_per_rank_gib"]["total"]
    t = cfg.training
    return [
        f"{cfg.model.flavor}: {format_count(plan['params_total'])} parameters, "
        f"{format_count(plan['params_active'])} active per token",
        f"{world_size} rank{'s' * (world_size != 1)}: {mesh}, ep {plan['mesh']['ep']}; "
        f"estimated memory per rank {memory:.3g} GiB (planner)",
        f"steps {records[0]['step']}-{records[-1]['step']} of {t.steps} logged"
        + "".join(f", resumed at step {step}" for step in resumes(records))
        + f"; seq_len {t.seq_len}, {t.mixed_precision_param} compute, {t.dtype} weights",
    ]


_SIZE_FIX = "pass --world-size N, the number of ranks the run was launched with"


def load_run(folder: Path, world_size: int | None) -> RunData:
    """Read a dump folder for the report; `world_size` (if given: ``--world-size``) overrides
    run_info.json's.

    Raises:
        ConfigError: the OS refuses the folder or a file in it (its reason), it holds no
            metrics.jsonl or config.toml, metrics.jsonl holds no record or one the report cannot
            draw (`_record_fault`, or counts of another flavor than config.toml's), config.toml
            is not a valid job config, or the world size is unknown, malformed or does not fit
            config.toml's degrees.
    """
    fix = "pass the job.dump_folder of a `torchmoe train` run (this user must be able to read it)"
    size_key, size_fix = "--world-size", _SIZE_FIX
    with path_faults("DUMP_FOLDER", str(folder), fix):
        names = os.listdir(folder)  # the OS says what is wrong with the folder, if anything
        for name in (METRICS_FILE, "config.toml"):
            if name not in names:
                raise ConfigError("DUMP_FOLDER", str(folder), f"holds no {name}", fix)
        records, skipped = read_records(folder / METRICS_FILE)
        if world_size is None:
            size_key = "DUMP_FOLDER"
            try:
                world_size = (read_run_info(folder) or {}).get("world_size")
            except ValueError as err:  # edited, or cut short
                raise ConfigError("DUMP_FOLDER", str(folder), f"{RUN_INFO_FILE} {err}", size_fix) from None
    if not records:
        raise ConfigError("DUMP_FOLDER", str(folder), f"{METRICS_FILE} holds no records (no step logged yet)",
                          "report once the run has logged a step (the first step is always logged)")
    if world_size is None:
        raise ConfigError("DUMP_FOLDER", str(folder), f"holds no {RUN_INFO_FILE}, which tells the run's world size",
                          size_fix)
    cfg = load_toml_config(folder / "config.toml", key="DUMP_FOLDER")
    # The run's folder is this one, wherever it was moved: its copy of a Hugging Face start's base lies here.
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, dump_folder=str(folder)))
    with _config_faults(folder):  # checked as `train` checks its sections
        validate_sections(cfg)
        cfg = with_folder_model(cfg, absent_ok=True)  # a run from a Hugging Face folder: its config.json's model
        check_flavor(cfg.model)
    try:
        resolve_degrees(cfg.parallelism, world_size)
    except ConfigError as err:
        raise ConfigError(size_key, world_size if size_key == "--world-size" else str(folder),
                          f"world size {world_size} does not fit the run's config.toml: {err.problem}",
                          size_fix) from None
    args = model_args_from_config(cfg.model)
    _check_records(folder, records, cfg.model.flavor, args)
    kept = [record for _, record in records]
    with _config_faults(folder):  # the planner's own checks (a pipeline split)
        facts = _run_facts(cfg, world_size, kept)
    return RunData(folder.resolve().name, kept, facts, sorted(i for i in args.moe_layer_ids if args.is_moe_layer(i)),
                   not_records(folder / METRICS_FILE, skipped) if skipped else None)


@contextmanager
def _config_faults(folder: Path) -> Iterator[None]:
    """A `ConfigError` about a setting meanwhile is a fault of the run's config.toml (edited, or
    written by another version)."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError("DUMP_FOLDER", str(folder), f"its config.toml sets {err.key} = {show_value(err.value)}: "
                          f"{err.problem}", f"{err.fix} (in {folder / 'config.toml'})") from None


def _check_records(folder: Path, records: list[tuple[int, dict[str, Any]]], flavor: str, args: ModelArgs) -> None:
    """Every record drawn must be one torchmoe writes (`_record_fault`), with the tokens_per_expert
    of a model of config.toml's `flavor` (`args`: its MoE layers and experts)."""
    shape = _counts_shape(args)
    for line_no, record in records:
        where = f"{METRICS_FILE} line {line_no}"
        problem = _record_fault(record)
        if problem is not None:
            raise ConfigError("DUMP_FOLDER", str(folder), f"{where}: {problem}",
                              f"fix or delete line {line_no} of {folder / METRICS_FILE} (torchmoe writes numbers, "
                              "null for a non-finite one, and tokens_per_expert as one list of per-expert token "
                              "counts per MoE layer)")
        counts = record.get("tokens_per_expert")
        got = (len(counts), len(counts[0])) if counts else (0, 0)
        if counts is not None and got != shape:
            fits = [name for name, other in FLAVORS[args.family].items() if _counts_shape(other) == got]
            raise ConfigError(
                "DUMP_FOLDER", str(folder), f"{where}: tokens_per_expert holds {got[0]} MoE layers of {got[1]} experts, "
                f"but config.toml's flavor {flavor!r} has {shape[0]} of {shape[1]}: the metrics are another run's",
                "report a dump folder whose metrics.jsonl and config.toml are one run's"
                + (f" (these counts fit flavor {', '.join(fits)})" if fits else ""))


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`; nulls (non-finite values, unknown peaks) as NaN: gaps in a line."""
    rows = [r for r in records if key in r]
    return [r["step"] for r in rows], [math.nan if r[key] is None else r[key] for r in rows]


def _step_axis(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def resumes(records: list[dict[str, Any]]) -> list[int]:
    """The checkpoint steps where the run's curves continue a resumed run (`resumed_from`)."""
    return sorted({r["resumed_from"] for r in records if r.get("resumed_from") is not None})


def _curve(ax: Axes, records: list[dict[str, Any]], key: str, title: str) -> None:
    """One metric over the steps that hold it, with a dotted line at each resume."""
    steps, values = _series(records, key)
    ax.plot(steps, values, marker="." if len(steps) <= 50 else None, color="tab:blue")
    for i, step in enumerate(resumes(records)):
        ax.axvline(step, color="tab:gray", linestyle=":", label="resumed at step " + str(step) if i == 0 else None)
    ax.set_title(title)
    _step_axis(ax)
    ax.grid(alpha=0.3)


def _no_counts(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no per-expert token counts logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _expert_load(fig: Figure, ax: Axes, record: dict[str, Any], labels: list[str]) -> None:
    """Heatmap: rows MoE layers, columns experts, colour the expert's share of its layer's tokens."""
    counts = torch.tensor(record["tokens_per_expert"], dtype=torch.float64)  # (n_layers, n_experts)
    share = counts / counts.sum(dim=1, keepdim=True)  # NaN for a layer that routed nothing
    n_layers, n_experts = share.shape
    image = ax.imshow(share.numpy(), cmap="viridis", vmin=0.0, aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="share of the layer's routed tokens")
    ax.set_title(f"expert load at step {record['step']} (balanced: {1 / n_experts:.1%} each)")
    ax.set_xlabel("expert")
    ax.set_xticks(range(n_experts))
    ax.set_yticks(range(n_layers), labels)
    if n_layers * n_experts <= _MAX_ANNOTATED:
        high = float(share.nan_to_num(0).max())
        for i, row in enumerate(share.tolist()):
            for j, value in enumerate(row):
                if not math.isnan(value):  # dark text on viridis' light (high) end, light on its dark end
                    ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8,
                            color="black" if value > 0.6 * high else "white")


def _imbalance(fig: Figure, ax: Axes, records: list[dict[str, Any]], labels: list[str]) -> None:
    """Heatmap: rows MoE layers, columns logged steps, colour max / mean tokens per expert."""
    steps = [r["step"] for r in records]
    per_step = torch.stack([layer_imbalance(torch.tensor(r["tokens_per_expert"])) for r in records])  # (T, L)
    # Cell edges halfway between logged steps (which log_freq spaces unevenly at the ends).
    mids = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    first, last = (2 * steps[0] - mids[0], 2 * steps[-1] - mids[-1]) if mids else (steps[0] - 0.5, steps[-1] + 0.5)
    edges = [first, *mids, last]
    mesh = ax.pcolormesh(edges, [i - 0.5 for i in range(len(labels) + 1)], per_step.T.numpy(), cmap="magma_r",
                         vmin=1.0, shading="flat")
    fig.colorbar(mesh, ax=ax, label="max / mean tokens per expert (1 = balanced)")
    ax.set_title("MoE imbalance per layer over steps")
    _step_axis(ax)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()  # first layer on top, as in the load heatmap


def render(run: RunData) -> Figure:
    """The report figure: header, four curves, the two expert heatmaps (16 x 13 in, 100 dpi)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 13), dpi=100, layout="constrained")
    fig.suptitle(f"torchmoe report: {run.name}\n" + "\n".join(run.facts), fontsize=13)
    axes = fig.subplots(3, 2)
    for ax, (key, title) in zip(axes[:2].flatten(), _CURVES):
        _curve(ax, run.records, key, title)
    if any("validation_loss" in r for r in run.records):  # [validation]: on the loss panel
        steps, values = _series(run.records, "validation_loss")
        axes[0, 0].plot(steps, values, marker="o", color="tab:orange", label="validation")
        axes[0, 0].lines[0].set_label("training")
    for ax in axes[:2].flatten():
        if ax.get_legend_handles_labels()[1]:  # validation, resumes
            ax.legend()
    moe = [r for r in run.records if r.get("tokens_per_expert")]
    if moe:
        labels = [f"layer {i}" for i in run.moe_layers]
        _expert_load(fig, axes[2, 0], moe[-1], labels)
        _imbalance(fig, axes[2, 1], moe, labels)
    else:
        _no_counts(axes[2, 0], "expert load")
        _no_counts(axes[2, 1], "MoE imbalance per layer over steps")
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    return format(value, ".6g") if isinstance(value, float) else str(value)


def _html(run: RunData, png: bytes) -> str:
    """A self-contained page: the facts, the figure inline (base64 PNG), the last record's metrics."""
    final = run.records[-1]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_cell(final[k]))}</td></tr>\n"
                   for k in _TABLE_KEYS if k in final)
    facts = "".join(f"<li>{html.escape(line)}</li>" for line in run.facts)
    title = html.escape(f"torchmoe report: {run.name}")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body {{ font-family: sans-serif; margin: 2em; }} img {{ max-width: 100%; }}
table {{ border-collapse: collapse; }} th, td {{ border: 1px solid #ccc; padding: 4px 10px; }}
th {{ text-align: left; }} td {{ text-align: right; font-family: monospace; }}</style></head>
<body><h1>{title}</h1><ul>{facts}</ul>
<img alt="loss, gradient norm, learning rate, throughput and expert load of the run"
 src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">
<h2>Final metrics (step {final["step"]})</h2>
<table>
{rows}</table></body></html>
"""


def _out_key(opts: argparse.Namespace) -> tuple[str, str]:
    """The key and value that name the output file: `--out`, or `DUMP_FOLDER` where it goes by default."""
    return ("--out", opts.out) if opts.out else ("DUMP_FOLDER", opts.dump_folder)


_OUT_FIX = "use a path where this user can create and write a file, or move what is in the way"


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="torchmoe report", description="Draw a run's loss, gradient norm, LR, throughput "
                            "and per-expert load from its dump folder, with the planner's facts of its layout.")
    parser.add_argument("dump_folder", metavar="DUMP_FOLDER", help="job.dump_folder of a run")
    parser.add_argument("--out", help=f"FILE.png, or FILE.html for a self-contained page with the "
                        f"final metrics (default: DUMP_FOLDER/{DEFAULT_OUT})")
    parser.add_argument("--world-size", help=f"ranks the run was launched with (default: from "
                        f"{RUN_INFO_FILE}, which runs write)")
    return parser


def report_main(argv: Sequence[str]) -> int:
    """`torchmoe report ...`; returns the exit status (user errors raise `ConfigError`)."""
    opts = parse_args(_parser(), argv)
    if opts is None:  # --help was printed
        return 0
    dump_folder = Path(nonempty_path("DUMP_FOLDER", opts.dump_folder, "pass the job.dump_folder of a run"))
    out = Path(nonempty_path("--out", opts.out, "name the file, or leave --out out")) if opts.out is not None else \
        dump_folder / DEFAULT_OUT
    if out.suffix.lower() not in (".png", ".html"):
        raise ConfigError("--out", str(out), "is neither a .png nor an .html file",
                          "name the output FILE.png (the figure) or FILE.html (figure and final metrics)")
    if importlib.util.find_spec("matplotlib") is None:  # the report extra
        raise ConfigError("torchmoe report", " ".join(argv), "needs the matplotlib package, which is not installed",
                          "pip install 'torchmoe[report]'")
    # Before reading and drawing, which take seconds: the file is one the report may replace, its
    # folder (or the nearest that exists: it is created) takes a new file, and no live run holds
    # it (a running job's report goes elsewhere: --out).
    key, value = _out_key(opts)
    check_output_file(key, value, _OUT_FIX, out)
    world_size = None if opts.world_size is None else \
        parse_int("--world-size", opts.world_size, low=1, high=MAX_RANKS, fix=_SIZE_FIX)
    run = load_run(dump_folder, world_size)
    if run.skipped is not None:
        print(f"warning: {run.skipped}: left out of the report", file=sys.stderr)
    png = _png(render(run))
    write_output(key, out, png if out.suffix.lower() == ".png" else _html(run, png), _OUT_FIX, value)
    print(f"wrote {out}")
    return 0
