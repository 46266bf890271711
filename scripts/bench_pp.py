"""Pipeline parallelism on CPU: tokens/s per schedule, measured vs theoretical bubble, and the
stage balance of the cost-model split against a layer-count split for Maverick.

    python scripts/bench_pp.py                       # bench256, 2 gloo ranks, every schedule
    python scripts/bench_pp.py --schedules 1F1B ZBVZeroBubble --seq 512

Each run is the real CLI in a subprocess (fp32, one thread per rank, checkpoints off): first one
process (pp 1), then pp 2 under each schedule, same global batch (8 sequences, 8 pipeline
micro-batches of 1). Throughput is tokens per median step time after `--warmup` steps.

Measured bubble: the share of the two ranks' time not spent on the single process's work,
``1 - T_single / (pp * T_pp)`` (it also holds stage imbalance and communication, which the
theoretical number, `plan.pipeline.bubble_fraction`, leaves out).

Balance: for Maverick on 512 ranks (TP 8, EP 8, FSDP over the rest) at pp 4 and 8, the max/mean
stage FLOPs and per-rank state bytes of `pipeline_layout` (the cost model) and of equal layer
counts. Writes JSON (default outputs/bench_pp.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from torchmoe.config.job_config import Parallelism
from torchmoe.models.llama4 import FLAVORS
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import (
    SCHEDULE_STYLES,
    bubble_fraction,
    layer_costs,
    pipeline_layout,
    split_by_count,
    stage_costs,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/launch.py: test-harness code, not in the installed package
from tests.launch import read_metrics, run_train  # noqa: E402

PP = 2
MICROBATCHES = 8


def _step_time(flavor: str, flags: list[str], *, nproc: int, seq: int, steps: int, warmup: int) -> float:
    """Median seconds per step after `warmup` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        run_train(["--config", str(REPO / "configs" / "debug_model.toml"), "--model.flavor", flavor,
                   "--training.seq_len", str(seq), "--training.local_batch_size", str(MICROBATCHES),
                   "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
                   "--checkpoint.enable", "false", *flags], dump_folder=tmp, nproc=nproc, timeout=3600)
        records = read_metrics(tmp)[warmup:]
    return statistics.median(MICROBATCHES * seq / r["tokens_per_sec"] for r in records)


def bench_schedules(flavor: str, schedules: list[str], *, seq: int, steps: int, warmup: int) -> dict:
    tokens = MICROBATCHES * seq
    single = _step_time(flavor, [], nproc=1, seq=seq, steps=steps, warmup=warmup)
    out = {"single": {"tokens_per_sec": tokens / single}}
    args = FLAVORS[flavor]
    for schedule in schedules:
        flags = ["--parallelism.pipeline_parallel_degree", str(PP), "--parallelism.pipeline_parallel_schedule",
                 schedule]
        t = _step_time(flavor, flags, nproc=PP, seq=seq, steps=steps, warmup=warmup)
        dims = ParallelDims(pp=PP, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1, world_size=PP)
        pipe = pipeline_layout(args, dims, Parallelism(pipeline_parallel_schedule=schedule), seq)
        out[schedule] = {
            "tokens_per_sec": tokens / t,
            "speedup_vs_single": single / t,
            "bubble_measured": 1 - single / (PP * t),
            "bubble_theoretical": bubble_fraction(schedule, PP, pipe.num_stages, MICROBATCHES),
            "layers_per_stage": [len(layers) for layers in pipe.layers],
        }
        print(schedule, json.dumps(out[schedule]), flush=True)
    return out


def maverick_balance() -> dict:
    """Cost-model vs layer-count split of Maverick at pp 4 and 8 (512 ranks, TP 8, EP 8)."""
    args, out = FLAVORS["maverick"], {}
    for pp in (4, 8):
        dims = ParallelDims(pp=pp, dp_replicate=1, dp_shard=512 // (8 * pp), cp=1, tp=8, ep=8, world_size=512)
        flops, state, ends = layer_costs(args, dims, 8192)
        for schedule in ("1F1B", "Interleaved1F1B"):
            pipe = pipeline_layout(args, dims, Parallelism(pipeline_parallel_schedule=schedule), 8192)
            row = {}
            for name, layers in (("cost_model", pipe.layers), ("layer_count", split_by_count(args.n_layers,
                                                                                             pipe.num_stages))):
                costs = stage_costs(layers, flops, state, ends)
                row[name] = {"layers_per_stage": [len(s) for s in layers],
                             "flops_imbalance": round(costs.flops_imbalance, 4),
                             "memory_imbalance": round(costs.memory_imbalance, 4)}
            out[f"pp{pp}_{schedule}"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="bench256")
    parser.add_argument("--schedules", nargs="*", default=list(SCHEDULE_STYLES))
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="outputs/bench_pp.json")
    a = parser.parse_args()
    result = {"flavor": a.flavor, "seq_len": a.seq, "microbatches": MICROBATCHES, "pp": PP,
              "maverick_balance": maverick_balance(),
              "schedules": bench_schedules(a.flavor, a.schedules, seq=a.seq, steps=a.steps, warmup=a.warmup)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
