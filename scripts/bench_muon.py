"""Muon against AdamW on CPU: optimizer step time and state memory on each family's debug flavor
(one process, and FSDP x EP on 4 gloo ranks), and the loss after a fixed number of tokens, each
optimizer at the best learning rate of a small sweep.

    python scripts/bench_muon.py --out outputs/bench_muon.json
    python scripts/bench_muon.py --parts step --families deepseek_v3 --flavor tiny --out /tmp/m.json

- ``step`` (one process, in-process): the model of each family's flavor, random gradients, the
  median seconds of `--steps` optimizer steps after one warm-up step, and the bytes of the
  optimizer's state (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``), for AdamW and for Muon
  (its defaults: bf16 Newton-Schulz, nesterov, 5 steps).
- ``layout``: `torchmoe train` on 4 ranks with ``dp_shard = 4, ep = 2`` (the routed experts FSDP
  2 x EP 2, the dense parameters FSDP 4), profiled with the step breakdown: rank 0's optimizer
  seconds per step and peak memory, for each optimizer.
- ``loss``: `torchmoe train` of `--loss-flavor` in one process for `--loss-steps` steps of the
  debug config's batch, per optimizer per LR of its sweep (`LR_SWEEP`); the final loss of each
  and the best per optimizer (Muon with ``adjust_lr = "match_rms_adamw"``, so both sweep the
  same range).

Writes JSON and prints it. On a shared CPU the times are noisy; the state bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchmoe.arch.registry import FLAVORS
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.models.decoder.model import Transformer
from torchmoe.optim.optimizer import build_optimizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/launch.py: test-harness code, not in the installed package
from tests.launch import read_metrics, run_train  # noqa: E402

DEBUG = {"llama4": "debugmodel", "qwen3": "debugmodel_moe", "deepseek_v3": "debugmodel", "gpt_oss": "debugmodel"}
OPTIMIZERS = {"AdamW": [], "Muon": ["--optimizer.name", "Muon", "--optimizer.adjust_lr", "match_rms_adamw"]}
LR_SWEEP = {"AdamW": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1), "Muon": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)}
DEBUG_BATCH_TOKENS = 8 * 128  # configs/debug_model.toml: local_batch_size x seq_len
LAYOUT_FLAGS = ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.expert_parallel_degree", "2"]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (its step counters left out)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for key, t in state.items() if key != "step")


def optimizer_step(family: str, flavor: str, name: str, steps: int) -> dict:
    """Median seconds of `steps` optimizer steps (after one warm-up) and the state's bytes."""
    model = Transformer(FLAVORS[family][flavor])
    model.init_weights(seed=0)
    optimizer = build_optimizer(model, OptimizerConfig(name=name))
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    optimizer.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return {"family": family, "flavor": flavor, "optimizer": name, "step_s": statistics.median(times),
            "state_bytes": state_bytes(optimizer), "params": sum(p.numel() for p in model.parameters())}


def _train(flags: list[str], nproc: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as dump:
        run_train(["--config", str(REPO / "configs" / "debug_model.toml"), "--training.steps", str(steps),
                   "--checkpoint.enable", "false", "--metrics.log_freq", "1", *flags],
                  dump_folder=dump, nproc=nproc, timeout=3600)
        rows = read_metrics(dump)
        traced = Path(dump) / "profile_traces" / f"iteration_{steps}" / "rank0_breakdown.json"
        if traced.exists():
            rows[-1]["breakdown"] = json.loads(traced.read_text())
    return rows


def layout_step(family: str, flavor: str, name: str, steps: int) -> dict:
    """Rank 0's optimizer seconds per step and peak memory on 4 ranks (FSDP 4, EP 2)."""
    profile = ["--profiling.enable_step_breakdown", "true", "--profiling.profile_freq", str(steps),
               "--profiling.profiler_active", str(steps - 1), "--profiling.profiler_warmup", "1"]
    rows = _train(["--model.name", family, "--model.flavor", flavor, *OPTIMIZERS[name], *LAYOUT_FLAGS,
                   "--training.local_batch_size", "1", "--training.global_batch_size", "4", *profile], 4, steps)
    categories = rows[-1]["breakdown"]["categories"]
    return {"family": family, "flavor": flavor, "optimizer": name, "layout": "dp_shard=4, ep=2 (experts FSDP 2 x EP 2)",
            "optimizer_s_per_step": categories["optimizer"]["seconds_per_step"],
            "step_s_per_step": rows[-1]["breakdown"]["seconds_per_step"], "memory_gib_rank0": rows[-1]["memory_gib"]}


def loss_sweep(flavor: str, steps: int) -> dict:
    """Final loss per optimizer per LR, and each optimizer's best."""
    runs: dict[str, dict[str, float]] = {}
    for name, lrs in LR_SWEEP.items():
        for lr in lrs:
            rows = _train(["--model.flavor", flavor, *OPTIMIZERS[name], "--optimizer.lr", str(lr)], 1, steps)
            runs.setdefault(name, {})[str(lr)] = rows[-1]["loss"]
    tokens = steps * DEBUG_BATCH_TOKENS
    best = {name: min(losses.items(), key=lambda kv: kv[1]) for name, losses in runs.items()}
    return {"flavor": flavor, "steps": steps, "tokens": tokens, "final_loss": runs,
            "best": {name: {"lr": float(lr), "loss": loss} for name, (lr, loss) in best.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=("step", "layout", "loss"), default=["step", "layout", "loss"])
    parser.add_argument("--families", nargs="+", choices=sorted(DEBUG), default=sorted(DEBUG))
    parser.add_argument("--flavor", default="", help="one flavor for every family (default: each one's debug flavor)")
    parser.add_argument("--steps", type=int, default=5, help="measured optimizer steps (step) / trained steps (layout)")
    parser.add_argument("--loss-flavor", default="tiny", help="llama4 flavor of the loss sweep")
    parser.add_argument("--loss-steps", type=int, default=40)
    parser.add_argument("--out", default="outputs/bench_muon.json")
    opts = parser.parse_args()
    flavor = {f: opts.flavor or DEBUG[f] for f in opts.families}
    result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if "step" in opts.parts:
        result["step"] = [optimizer_step(f, flavor[f], name, opts.steps) for f in opts.families for name in OPTIMIZERS]
    if "layout" in opts.parts:
        result["layout"] = [layout_step(f, flavor[f], name, opts.steps) for f in opts.families for name in OPTIMIZERS]
    if "loss" in opts.parts:
        result["loss"] = loss_sweep(opts.loss_flavor, opts.loss_steps)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
