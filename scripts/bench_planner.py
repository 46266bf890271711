"""Check the planner's predictions against measured runs on this machine (CPU, gloo).

    python scripts/bench_planner.py                       # calibrate, measure, compare (~15 min)
    python scripts/bench_planner.py --phase compare       # re-predict the layouts measured before
    python scripts/bench_planner.py --phase search        # time `torchmoe plan` at GPU scale (~1 min)

For each flavor (tiny, debugmodel) and world size (2, 4): calibrate this machine under torchrun
with that many ranks (`torchmoe plan --calibrate`), let the planner enumerate and score the job's
layouts on that profile (`--free all`), take at least `--layouts` of them (each family's best,
then other activation-checkpointing modes of the families, so that dp, DDP, tp, ep, cp, pp and AC
all appear), run each for a few steps with the real CLI and compare measured tokens/s per rank
with the prediction:

    spearman        rank correlation of predicted vs measured tokens/s (target >= 0.8 per world)
    best_gap        1 - measured(predicted best) / measured best           (target <= 10%)
    median_error    median |predicted - measured| / measured               (target <= 25%)

Measuring is the slow part, so the measured step times are kept in the JSON (default
outputs/bench_planner.json) and `--phase compare` predicts the same layouts again with the
current model. Run it on a quiet machine: other processes change both calibration and runs.

`--phase search` times the whole `torchmoe plan` command (Python start, imports, the search over
every key, the table) on the h100 profile for the shipped Scout and Maverick configs at GPU
scale, `SEARCH_REPEATS` times each, and keeps the median under "search" (target: Maverick on
1,024 GPUs in under 10 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torchmoe.config import load_job_config
from torchmoe.plan.hardware import load_profile
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.search import search
from torchmoe.plan.step_time import predict_layout
from torchmoe.preflight import validate_layout

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/launch.py: test-harness code, not in the installed package
from tests.launch import read_metrics, run_cli, run_train  # noqa: E402

# Per flavor: sequence length and global batch (sequences per step) of the measured job.
JOBS = {"tiny": (1024, 8), "debugmodel": (1024, 4)}
STEPS, WARMUP = 8, 2
# `--phase search`: (config, GPUs) planned, and runs of each.
SEARCH_JOBS = [("configs/llama4_16e.toml", 64), ("configs/llama4_128e.toml", 256), ("configs/llama4_128e.toml", 1024)]
SEARCH_REPEATS = 3


def base_args(flavor: str) -> list[str]:
    seq, batch = JOBS[flavor]
    return ["--config", str(REPO / "configs/debug_model.toml"), "--model.flavor", flavor, "--training.seq_len", str(seq),
            "--training.global_batch_size", str(batch), "--training.local_batch_size", str(batch),
            "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1"]


def calibrate(flavor: str, world: int, out: Path) -> float:
    start = time.perf_counter()
    run_cli(["plan", "--calibrate", out, "--budget", "45", *base_args(flavor)], nproc=world)
    return time.perf_counter() - start


def choose(flavor: str, world: int, profile_path: Path, count: int) -> list[dict]:
    """At least `count` layouts the planner scores: each family's best, then other AC modes."""
    cfg = load_job_config(base_args(flavor))
    result = search(cfg, world, load_profile(str(profile_path)), gpus_per_node=world, fixed=set(),  # all free
                    check=lambda c, w: validate_layout(c, w))
    chosen, seen = [], set()
    for layout in result.scored:  # fastest first: each family's best
        if layout.family not in seen:
            seen.add(layout.family)
            chosen.append(layout)
    for mode in ("full", "selective", "none"):  # then other AC modes, one per (family, mode), full first
        for layout in result.scored:
            key = (layout.family, layout.cfg.activation_checkpoint.mode)
            if len(chosen) < count and key[1] == mode and key not in {
                    (l.family, l.cfg.activation_checkpoint.mode) for l in chosen}:
                chosen.append(layout)
    return [{"family": l.family, "flags": l.flags(), "overrides": l.overrides} for l in chosen]


def measure(flavor: str, world: int, flags: list[str]) -> float:
    """Median step seconds of a short run of the layout, first `WARMUP` steps skipped."""
    with tempfile.TemporaryDirectory() as tmp:
        run_train([*base_args(flavor), *flags], dump_folder=tmp, nproc=world)
        rows = read_metrics(tmp)
    seq, batch = JOBS[flavor]
    return statistics.median(seq * batch / r["tokens_per_sec"] for r in rows if r["step"] > WARMUP)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for position, i in enumerate(order):
            r[i] = float(position)
        return r

    ra, rb = ranks(a), ranks(b)
    mean = (len(a) - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var = sum((x - mean) ** 2 for x in ra)
    return cov / var


def compare(flavor: str, world: int, profile_path: Path, layouts: list[dict]) -> dict:
    """Predict every measured layout with the current model; the three figures."""
    profile = load_profile(str(profile_path))
    seq, batch = JOBS[flavor]
    rows = []
    for entry in layouts:
        layout_cfg = load_job_config([*base_args(flavor), *entry["flags"]])
        dims = ParallelDims.from_config(layout_cfg.parallelism, world)
        predicted = predict_layout(layout_cfg, dims, profile, world)
        measured = seq * batch / entry["step_s"] / world
        rows.append({**entry, "predicted_tokens_per_s": predicted.tokens_per_s_per_gpu,
                     "measured_tokens_per_s": measured,
                     "error": (predicted.tokens_per_s_per_gpu - measured) / measured})
    predicted = [r["predicted_tokens_per_s"] for r in rows]
    measured = [r["measured_tokens_per_s"] for r in rows]
    pick = max(range(len(rows)), key=predicted.__getitem__)
    return {"flavor": flavor, "world": world, "layouts": rows, "spearman": spearman(predicted, measured),
            "best_gap": 1 - measured[pick] / max(measured),
            "median_error": statistics.median(abs(r["error"]) for r in rows)}


def time_search() -> list[dict]:
    """Median wall seconds of `torchmoe plan --free all` per `SEARCH_JOBS` entry."""
    rows = []
    for config, gpus in SEARCH_JOBS:
        seconds = []
        for _ in range(SEARCH_REPEATS):
            start = time.perf_counter()
            run_cli(["plan", "--config", REPO / config, "--gpus", str(gpus), "--hardware", "h100", "--free", "all"],
                    threads=None)
            seconds.append(time.perf_counter() - start)
        rows.append({"config": config, "gpus": gpus, "seconds": statistics.median(seconds), "runs": seconds})
        print(f"plan {config} on {gpus} GPUs: {rows[-1]['seconds']:.1f} s (runs {', '.join(f'{x:.1f}' for x in seconds)})",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavors", nargs="+", default=list(JOBS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--layouts", type=int, default=12)
    parser.add_argument("--phase", choices=("all", "compare", "search"), default="all")
    parser.add_argument("--out", default="outputs/bench_planner.json")
    opts = parser.parse_args()
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Runs of other flavors and world sizes already in the file are kept (measure one again alone).
    state = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    if opts.phase == "search":
        state["search"] = time_search()
        out.write_text(json.dumps(state, indent=1))
        print(f"wrote {out}")
        return
    for flavor in opts.flavors:
        for world in opts.worlds:
            key = f"{flavor}/{world}"
            profile_path = out.parent / f"profile_{flavor}_{world}.json"
            if opts.phase == "all":
                seconds = calibrate(flavor, world, profile_path)
                layouts = choose(flavor, world, profile_path, opts.layouts)
                for entry in layouts:
                    entry["step_s"] = measure(flavor, world, entry["flags"])
                    print(f"{key} {entry['family']}: {entry['step_s']:.3f} s/step", flush=True)
                state["runs"][key] = {"calibration_s": seconds, "layouts": layouts}
                out.write_text(json.dumps(state, indent=1))
            run = state["runs"][key]
            run["result"] = compare(flavor, world, profile_path, run["layouts"])
            r = run["result"]
            print(f"{key}: spearman {r['spearman']:.2f}, best gap {r['best_gap']:.1%}, "
                  f"median error {r['median_error']:.1%} over {len(r['layouts'])} layouts", flush=True)
            for row in sorted(r["layouts"], key=lambda x: -x["measured_tokens_per_s"]):
                print(f"   {row['family']:<32} {' '.join(row['flags'][-6:]):<70} measured "
                      f"{row['measured_tokens_per_s']:>9,.0f}  predicted {row['predicted_tokens_per_s']:>9,.0f} "
                      f"({row['error']:+.0%})")
    out.write_text(json.dumps(state, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
