"""Training throughput of `torchmoe train` on CPU: tokens/s, TFLOP/s, and MFU against this
machine's measured dense fp32 matmul rate.

    python scripts/bench_train.py                                   # tiny + bench256, one process
    python scripts/bench_train.py --flavors bench256 --layouts fsdp2 ep2 --compile both

Each run is the real CLI in a subprocess (fp32, activation checkpointing off, checkpoints off),
seq 2048 x global batch 8 by default; throughput comes from its metrics.jsonl, skipping the first
`--warmup` steps, as tokens per median step time. `--compile both` runs every layout eager and
compiled and reports the speed-up, the compiled run's first step (compilation included) and the
graphs and graph breaks dynamo reported. Model FLOPs are `ModelArgs.flops_per_token`: `mfu_pct`
in the PaLM convention (6N + the full attention square), `mfu_causal_pct` counting attention as
causal (half the square: the work a causal kernel does). CPUs publish no useful peak, so the MFU
denominator is measured in the same invocation: the median rate of 2048 x 2048 fp32 matmuls on
all the threads the runs get. Writes JSON (default outputs/bench_train.json) and prints it.

`--breakdown` profiles the measured steps (`[profiling] enable_step_breakdown`) and adds, per
rank, where their time went (attention, routed experts, FFN, router, communication, optimizer,
data, other: seconds per step and share; `performance/step_breakdown.py`), printed as tables too.
The profiler's overhead is then in the measured steps' time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchmoe.models.llama4 import FLAVORS
from torchmoe.performance.step_breakdown import format_breakdown

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/launch.py: test-harness code, not in the installed package
from tests.launch import read_metrics, run_train  # noqa: E402

# name: (ranks, local batch for the default global batch of 8, parallelism flags)
LAYOUTS: dict[str, tuple[int, int, list[str]]] = {
    "single": (1, 8, []),
    "fsdp2": (2, 4, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    "hsdp2x2": (4, 2, ["--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2"]),
    "ep2": (2, 4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]),
}


def matmul_flops(threads: int, n: int = 2048, iters: int = 10) -> float:
    """Median FLOP/s of an n x n fp32 matmul on `threads` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def breakdown_flags(steps: int, warmup: int) -> list[str]:
    """Profile steps `warmup + 1 .. steps` as one cycle (traced folder `iteration_<steps>`)."""
    return ["--profiling.enable_step_breakdown", "true", "--profiling.profile_freq", str(steps),
            "--profiling.profiler_active", str(steps - warmup), "--profiling.profiler_warmup", str(min(warmup, 1))]


def run_layout(flavor: str, layout: str, *, compiled: bool, seq: int, batch: int, steps: int, warmup: int,
               threads: int, breakdown: bool = False) -> dict:
    """Train `steps` steps of `flavor` under `layout`; returns throughput over the steps after
    `warmup` and, with `breakdown`, each rank's step-time breakdown of them."""
    nproc, local_batch, flags = LAYOUTS[layout]
    local_batch = local_batch * batch // 8
    threads_per_rank = max(1, threads // nproc)  # the ranks share the cores
    with tempfile.TemporaryDirectory() as dump:
        run_train(["--config", str(REPO / "configs" / "debug_model.toml"), "--model.flavor", flavor,
                   "--training.seq_len", str(seq), "--training.global_batch_size", str(batch),
                   "--training.local_batch_size", str(local_batch), "--training.steps", str(steps),
                   "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none",
                   "--checkpoint.enable", "false", "--metrics.log_freq", "1",
                   "--compile.enable", str(compiled).lower(), *flags,
                   *(breakdown_flags(steps, warmup) if breakdown else [])],
                  dump_folder=dump, nproc=nproc, threads=threads_per_rank, timeout=3600)
        rows = read_metrics(dump)
        traced = Path(dump) / "profile_traces" / f"iteration_{steps}"
        tables = {f"rank{r}": json.loads((traced / f"rank{r}_breakdown.json").read_text())
                  for r in range(nproc)} if breakdown else None
    tokens_per_step = batch * seq
    step_s = [tokens_per_step / r["tokens_per_sec"] for r in rows if r["step"] > warmup]
    tokens_per_sec = tokens_per_step / statistics.median(step_s)
    args = FLAVORS[flavor]
    run = {
        "flavor": flavor, "layout": layout, "compile": compiled, "nproc": nproc, "threads_per_rank": threads_per_rank,
        "seq_len": seq, "global_batch": batch, "local_batch": local_batch, "measured_steps": len(step_s),
        "first_step_s": round(tokens_per_step / rows[0]["tokens_per_sec"], 2),
        "step_s": [round(s, 3) for s in step_s], "tokens_per_sec": tokens_per_sec,
        "tflops": args.flops_per_token(seq) * tokens_per_sec / 1e12,  # all ranks together
        "tflops_causal": args.flops_per_token(seq, causal=True) * tokens_per_sec / 1e12,
        "memory_gib_per_rank": rows[-1]["memory_gib"],
        **({"breakdown": tables} if tables else {}),
    }
    if compiled:
        run.update(graphs=rows[0]["compile_graphs"], graph_breaks=rows[0]["compile_graph_breaks"])
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["tiny", "bench256"], choices=sorted(FLAVORS))
    parser.add_argument("--layouts", nargs="+", default=["single"], choices=sorted(LAYOUTS),
                        help="parallel layouts: ranks and flags under torchrun (default: one process)")
    parser.add_argument("--compile", choices=["off", "on", "both"], default="off",
                        help="torch.compile the blocks; 'both' runs each layout eager and compiled")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step); a multiple of 8")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the measurement")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads over all ranks")
    parser.add_argument("--out", default="outputs/bench_train.json")
    parser.add_argument("--breakdown", action="store_true",
                        help="profile the measured steps and report where their time went, per rank")
    opts = parser.parse_args()
    if opts.batch % 8 or opts.steps <= opts.warmup:
        parser.error("--batch must be a multiple of 8 and --steps larger than --warmup")

    peak = matmul_flops(opts.threads)
    result: dict = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "threads": opts.threads,
                    "matmul_fp32_tflops": peak / 1e12, "runs": []}
    modes = {"off": [False], "on": [True], "both": [False, True]}[opts.compile]
    for flavor in opts.flavors:
        for layout in opts.layouts:
            runs = {}
            for compiled in modes:
                run = run_layout(flavor, layout, compiled=compiled, seq=opts.seq, batch=opts.batch, steps=opts.steps,
                                 warmup=opts.warmup, threads=opts.threads, breakdown=opts.breakdown)
                run["mfu_pct"] = 100 * run["tflops"] * 1e12 / peak
                run["mfu_causal_pct"] = 100 * run["tflops_causal"] * 1e12 / peak
                result["runs"].append(run)
                runs[compiled] = run
                for rank, table in run.get("breakdown", {}).items():
                    print(f"{flavor}, {layout}, compile {compiled}, {rank}: {format_breakdown(table)}")
            if len(runs) == 2:
                result.setdefault("compiled_vs_eager", {})[f"{flavor}/{layout}"] = \
                    runs[True]["tokens_per_sec"] / runs[False]["tokens_per_sec"]
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
