"""Expert-parallel traffic and throughput: bytes the EP all-to-alls move per step against the
analytical minimum, and tokens/s, for a few EP layouts on CPU/gloo.

    python scripts/bench_ep.py --flavor tiny --steps 8 --out outputs/bench_ep.json

Minimum per rank and step, per MoE layer: routed rows × dim × dtype bytes × (ep − 1)/ep, for the
dispatch and again for the combine, in forward and again in backward (uniform routing sends a
fraction (ep − 1)/ep of the rows to other ranks). The measured bytes come from the trainer's
`ep_all_to_all_gib` metric (rank 0). A ratio above 1 means routing sent more rows off-rank than
uniform routing would (load imbalance); activation-checkpoint recomputation adds a forward's worth.

    python scripts/bench_ep.py --overlap --steps 8 --out outputs/bench_ep_overlap.json

`--overlap` measures instead how much of the EP all-to-alls the shared expert hides, on EP 2 over
2 ranks (FSDP 2 x EP 2): per rank, the mean step time of the unprofiled steps, then from a
profiled step (`overlap_report`) the shared expert's compute while a gloo all-to-all runs on
gloo's thread (hidden), and the time the training thread waits for all-to-alls (exposed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchmoe.models.llama4 import FLAVORS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/launch.py: test-harness code, not in the installed package
from tests.launch import cli_env, free_port, read_metrics, run_train  # noqa: E402

LAYOUTS = {
    # name: (ranks, ep, tp, flags)
    "ep2": (2, 2, 1, ["--parallelism.expert_parallel_degree", "2"]),
    "ep4": (4, 4, 1, ["--parallelism.expert_parallel_degree", "4"]),
    "tp2_ep2": (2, 2, 2, ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2_ep4": (4, 4, 2, ["--parallelism.expert_parallel_degree", "4",
                                "--parallelism.tensor_parallel_degree", "2"]),
}


def run(layout: str, flavor: str, steps: int, seq_len: int, batch: int) -> dict:
    nproc, ep, tp, flags = LAYOUTS[layout]
    dp = nproc // tp
    with tempfile.TemporaryDirectory() as tmp:
        run_train(["--config", str(REPO / "configs" / "debug_model.toml"), "--model.flavor", flavor,
                   "--training.steps", str(steps), "--training.seq_len", str(seq_len),
                   "--training.global_batch_size", str(batch), "--training.local_batch_size", str(batch // dp),
                   "--metrics.log_freq", "1", *flags], dump_folder=tmp, nproc=nproc)
        rows = read_metrics(tmp)
    args = FLAVORS[flavor]
    warm = rows[2:] or rows
    measured = sum(r["ep_all_to_all_gib"] for r in warm) / len(warm) * 2**30
    routed_rows = batch * seq_len * args.top_k / nproc  # each rank routes its own token shard
    minimum = routed_rows * args.dim * 4 * (ep - 1) / ep * 2 * 2 * len(args.moe_layer_ids)
    return {"layout": layout, "ranks": nproc, "ep": ep, "tp": tp,
            "bytes_per_step_rank0": measured, "min_bytes_per_step": minimum, "ratio": measured / minimum,
            "tokens_per_sec": sum(r["tokens_per_sec"] for r in warm) / len(warm),
            "moe_imbalance": warm[-1]["moe_imbalance"]}


SHARED_LABEL = "shared_expert"  # profiler range of each shared-expert projection's forward
_LAUNCH, _WAIT = "_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor"
_GLOO_ALL_TO_ALL = "gloo:all_to_all"  # the collective itself, on gloo's worker thread
_BACKWARD = "autograd::engine::evaluate_function: "


def label_shared_experts(model: torch.nn.Module) -> None:
    """Wrap the forward of every shared-expert projection (w1, w3, w2) of `model` in a profiler
    range named `SHARED_LABEL`."""
    for moe in model.moe_layers():
        for proj in (moe.shared_experts.w1, moe.shared_experts.w3, moe.shared_experts.w2):
            ranges = []
            proj.register_forward_pre_hook(lambda mod, args, ranges=ranges: ranges.append(
                torch.profiler.record_function(SHARED_LABEL).__enter__()))
            proj.register_forward_hook(lambda mod, args, out, ranges=ranges: ranges.pop().__exit__(None, None, None))


def overlap_report(events) -> dict:
    """How one profiled step's shared-expert work (labelled by `label_shared_experts`) lies
    against its all-to-alls.

    Args:
        events: ``torch.profiler.profile().events()`` of the step.
    Returns:
        windows: [launch end, wait start] (µs) of each all-to-all on the training thread (one
            all-to-all is waited on before the next launches).
        shared: the shared expert's intervals (µs): the labelled forward ranges, and the backward
            of the autograd nodes their ops created (matched by sequence number).
        shared_in_window: how many of `shared` lie inside a window.
        hidden_ms: time of `shared` during which an all-to-all ran on gloo's thread.
        exposed_ms: time the training thread spent in all-to-all waits.
    """
    labels = [e for e in events if e.name == SHARED_LABEL]
    thread = labels[0].thread
    ops = [e for e in events if e.thread == thread]
    nodes = {e.sequence_nr for e in ops for lab in labels
             if e.sequence_nr >= 0 and lab.time_range.start <= e.time_range.start <= lab.time_range.end}
    shared = sorted([(e.time_range.start, e.time_range.end) for e in labels]
                    + [(e.time_range.start, e.time_range.end) for e in ops
                       if e.name.startswith(_BACKWARD) and e.sequence_nr in nodes])
    # Each all-to-all's wait is the first wait after its launch (other collectives wait too).
    waits, pending = [], None
    for e in sorted(ops, key=lambda e: e.time_range.start):
        if e.name == _LAUNCH:
            pending = e
        elif e.name == _WAIT and pending is not None:
            waits.append((pending, e))
            pending = None
    windows = [(launch.time_range.end, wait.time_range.start) for launch, wait in waits]
    flights = [(e.time_range.start, e.time_range.end) for e in events if e.name == _GLOO_ALL_TO_ALL]
    hidden = sum(max(0.0, min(end, f_end) - max(start, f_start)) for start, end in shared for f_start, f_end in flights)
    return {"windows": windows, "shared": shared,
            "shared_in_window": sum(any(a <= start and end <= b for a, b in windows) for start, end in shared),
            "hidden_ms": hidden / 1e3, "exposed_ms": sum(wait.time_range.elapsed_us() for _, wait in waits) / 1e3}


def _overlap_worker(out_dir: Path, flavor: str, steps: int, seq_len: int, batch: int) -> None:
    """One rank of `overlap`: train `steps` steps of FSDP 2 x EP 2, profile one more; write
    ``rank<r>.json``."""
    import torch.distributed as dist

    from torchmoe.config.loader import load_job_config
    from torchmoe.training.loop import Trainer

    dist.init_process_group("gloo")
    cfg = load_job_config(["--config", str(REPO / "configs" / "debug_model.toml"), "--model.flavor", flavor,
                           "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch // 2),
                           "--parallelism.expert_parallel_degree", "2", "--job.dump_folder", str(out_dir / "job")])
    trainer = Trainer(cfg)
    label_shared_experts(trainer.model)
    trainer.train_step(trainer.dataloader.next_batch())  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(trainer.dataloader.next_batch())
    step_ms = (time.perf_counter() - start) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train_step(trainer.dataloader.next_batch())
    report = overlap_report(prof.events())
    record = {"step_ms": step_ms, **{k: report[k] for k in ("hidden_ms", "exposed_ms", "shared_in_window")},
              "shared_intervals": len(report["shared"]), "windows": len(report["windows"])}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def overlap(flavor: str, steps: int, seq_len: int, batch: int) -> list[dict]:
    """Run `_overlap_worker` on 2 gloo ranks; returns each rank's record."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", __file__, "--overlap-worker", tmp, "--flavor", flavor,
                        "--steps", str(steps), "--seq-len", str(seq_len), "--batch", str(batch)],
                       env={**cli_env(), "PYTHONPATH": str(REPO)}, check=True)
        return [{"rank": r, **json.loads((Path(tmp) / f"rank{r}.json").read_text())} for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--layouts", nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--overlap", action="store_true", help="measure the shared expert's overlap instead")
    parser.add_argument("--overlap-worker", type=Path, help=argparse.SUPPRESS)  # a rank of --overlap
    parser.add_argument("--out", default="outputs/bench_ep.json")
    opts = parser.parse_args()
    if opts.overlap_worker:
        _overlap_worker(opts.overlap_worker, opts.flavor, opts.steps, opts.seq_len, opts.batch)
        return
    if opts.overlap:
        results = overlap(opts.flavor, opts.steps, opts.seq_len, opts.batch)
    else:
        results = [run(name, opts.flavor, opts.steps, opts.seq_len, opts.batch) for name in opts.layouts]
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
