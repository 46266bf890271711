"""`torchmoe report`: one figure of a training run, from its dump folder.

    torchmoe report outputs/debug                     # writes outputs/debug/report.png
    torchmoe report outputs/debug --out debug.html    # one self-contained page: figure + final metrics

Reads `metrics.jsonl` (a step that a resumed run logged again counts once: the later line),
`config.toml` and `run_info.json` (the world size; `--world-size N` for a folder without one) and
draws: a header of the planner's facts (flavor, total / active parameters, world size and mesh,
estimated memory per rank: `plan_job`, what `train --dry-run` prints); loss, gradient norm, LR and
tokens/s over the steps; each MoE layer's share of tokens per expert at the last logged step; and
each MoE layer's imbalance (max / mean tokens per expert) over the logged steps. Needs the
`report` extra (matplotlib). A missing folder or file, a metrics file without records or a
missing matplotlib is a `ConfigError` (one message, exit 2).
"""

from __future__ import annotations

import argparse
import base64
import html
import importlib.util
import io
import math
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchmoe.argparser import ArgumentParser, parse_args
from torchmoe.components.metrics import METRICS_FILE, layer_imbalance, parse_record
from torchmoe.components.run_info import RUN_INFO_FILE, read_run_info
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import JobConfig
from torchmoe.config.loader import load_toml_config
from torchmoe.config.file_writes import write_file
from torchmoe.config.paths import nonempty_path, path_faults, writable_file, writable_folder
from torchmoe.distributed.parallel_dims import MESH_DIMS
from torchmoe.models.llama4.args import model_args_from_config
from torchmoe.plan.dry_run import format_count, plan_job

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["RunData", "load_run", "read_records", "render", "report_main"]

DEFAULT_OUT = "report.png"
_CURVES = (("loss", "loss"), ("grad_norm", "gradient norm"), ("lr", "learning rate"),
           ("tokens_per_sec", "tokens / s (global)"))
# The final-metrics table of the HTML page, in this order (keys a record lacks are left out).
_TABLE_KEYS = ("step", "loss", "validation_loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu",
               "memory_gib", "elapsed_s", "moe_imbalance", "ep_all_to_all_gib")
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
    """

    name: str
    records: list[dict[str, Any]]
    facts: list[str]
    moe_layers: list[int]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, one per step in step order; of a step logged twice (a
    resumed run logs again from its checkpoint) the later line. A line that is not a record (torn
    by a kill) is skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        record = parse_record(line)
        if record is not None:
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


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
        f"steps {records[0]['step']}-{records[-1]['step']} of {t.steps} logged; "
        f"seq_len {t.seq_len}, {t.mixed_precision_param} compute, {t.dtype} weights",
    ]


def load_run(folder: Path, world_size: int | None) -> RunData:
    """Read a dump folder for the report; `world_size` (if given) overrides run_info.json's.

    Raises:
        ConfigError: the OS refuses the folder or a file in it (its reason), it holds no
            metrics.jsonl or config.toml, metrics.jsonl holds no record or expert counts of
            another model than config.toml's, or the world size is unknown.
    """
    fix = "pass the job.dump_folder of a `torchmoe train` run (this user must be able to read it)"
    with path_faults("DUMP_FOLDER", str(folder), fix):
        names = os.listdir(folder)  # the OS says what is wrong with the folder, if anything
        for name in (METRICS_FILE, "config.toml"):
            if name not in names:
                raise ConfigError("DUMP_FOLDER", str(folder), f"holds no {name}", fix)
        records = read_records(folder / METRICS_FILE)
        if world_size is None:
            world_size = (read_run_info(folder) or {}).get("world_size")
    if not records:
        raise ConfigError("DUMP_FOLDER", str(folder), f"{METRICS_FILE} holds no records (no step logged yet)",
                          "report once the run has logged a step (the first step is always logged)")
    if not isinstance(world_size, int):
        raise ConfigError("DUMP_FOLDER", str(folder), f"holds no {RUN_INFO_FILE}, which tells the run's world size",
                          "pass --world-size N, the number of ranks the run was launched with")
    cfg = load_toml_config(folder / "config.toml", key="DUMP_FOLDER")
    args = model_args_from_config(cfg.model)
    moe_layers = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
    for record in records:  # counts of another model: config.toml is not the run's that logged them
        counts = record.get("tokens_per_expert")
        if counts is not None and [len(row) for row in counts] != [args.num_experts] * len(moe_layers):
            shape = f"{len(counts)} x {len(counts[0]) if counts else 0}"
            raise ConfigError("DUMP_FOLDER", str(folder), f"{METRICS_FILE} at step {record['step']} counts the "
                              f"tokens of {shape} MoE layers x experts, config.toml's flavor {cfg.model.flavor!r} "
                              f"has {len(moe_layers)} x {args.num_experts}: they are not of one run",
                              "report a dump folder as a run left it (its config.toml and its metrics.jsonl)")
    return RunData(folder.resolve().name, records, _run_facts(cfg, world_size, records), moe_layers)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`; nulls (non-finite values, unknown peaks) as NaN: gaps in a line."""
    rows = [r for r in records if key in r]
    return [r["step"] for r in rows], [math.nan if r[key] is None else r[key] for r in rows]


def _step_axis(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _curve(ax: Axes, records: list[dict[str, Any]], key: str, title: str) -> None:
    steps, values = _series(records, key)
    ax.plot(steps, values, marker="." if len(steps) <= 50 else None, color="tab:blue")
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
        axes[0, 0].legend()
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


def _out_faults(opts: argparse.Namespace) -> AbstractContextManager[None]:
    """What the OS refuses about the output file is a fault of `_out_key`."""
    return path_faults(*_out_key(opts), "use a path where this user can create and write a file, or move what is "
                       "in the way")


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="torchmoe report", description="Draw a run's loss, gradient norm, LR, throughput "
                            "and per-expert load from its dump folder, with the planner's facts of its layout.")
    parser.add_argument("dump_folder", metavar="DUMP_FOLDER", help="job.dump_folder of a run")
    parser.add_argument("--out", help=f"FILE.png, or FILE.html for a self-contained page with the "
                        f"final metrics (default: DUMP_FOLDER/{DEFAULT_OUT})")
    parser.add_argument("--world-size", type=int, help=f"ranks the run was launched with (default: from "
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
    run = load_run(dump_folder, opts.world_size)
    # Before drawing, which takes seconds: the file, where it is, opens for writing, and its folder
    # (or the nearest that exists: it is created) takes a new file.
    with _out_faults(opts):
        writable_file(out)  # first: what the OS says of a link to nothing
        writable_folder(out.parent)
        if out.is_symlink():
            raise ConfigError(*_out_key(opts), f"{out} is a symbolic link (to {os.readlink(out)}): the report never "
                              "writes through a link", "remove the link, or name another file with --out")
    png = _png(render(run))
    with _out_faults(opts):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, png if out.suffix.lower() == ".png" else _html(run, png))
    print(f"wrote {out}")
    return 0
