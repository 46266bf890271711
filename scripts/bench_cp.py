"""Context parallelism on CPU: tokens/s and peak memory of cp 2 vs one process at long sequences,
and the key/value bytes each attention layer kind sends against the analytic minimum.

    python scripts/bench_cp.py                           # tiny flavor, seq 4096, 8192, 16384
    python scripts/bench_cp.py --seqs 8192 --steps 3

Throughput and memory: the real CLI in a subprocess (fp32, one thread per rank, checkpoints off),
one sequence per step, cp 1 in one process vs cp 2 on 2 gloo ranks; tokens per median step time
after the first step, and the peak RSS of rank 0 (`memory_gib` of metrics.jsonl: on CPU the
process's max RSS, which includes the Python runtime, about 0.4 GiB).

Bytes: a 2-rank torchrun worker (this script with --bytes-worker) runs one forward and backward of
a context-parallel tiny model per sequence length and reads the bytes each rank sent per mode
(`ContextParallelAttention.sent`, forward; backward sends the gradients back, the same again),
against `CPLayout.bytes_received` of the other rank (the minimum for the layout).
The tiny flavor's chunked layers (64-token chunks) are "local" at the benchmark lengths (pieces of
>= 1024 tokens hold whole chunks), "gather" at 128 and "halo" at 384; its NoPE layer "global". Writes JSON (default outputs/bench_cp.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/launch.py: test-harness code, not in the installed package


def _run(seq: int, cp: int, steps: int) -> dict:
    from tests.launch import read_metrics, run_train

    with tempfile.TemporaryDirectory() as tmp:
        run_train(["--config", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", str(seq),
                   "--training.local_batch_size", "1", "--training.steps", str(steps),
                   "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--checkpoint.enable", "false",
                   "--parallelism.context_parallel_degree", str(cp)], dump_folder=tmp, nproc=cp, timeout=3600)
        records = read_metrics(tmp)
    step = statistics.median(seq / r["tokens_per_sec"] for r in records[1:])
    return {"tokens_per_sec": seq / step, "peak_rss_gib_rank0": max(r["memory_gib"] for r in records)}


def _bytes_worker(seqs: list[int], out: str) -> None:
    """Runs on each of 2 torchrun ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchmoe.models.decoder.parallelize import apply_cp
    from torchmoe.models.llama4 import FLAVORS, Transformer

    dist.init_process_group("gloo")
    args = FLAVORS["tiny"]
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    result = {}
    for seq in seqs:
        torch.manual_seed(0)  # for the tokens below
        model = Transformer(args)
        model.init_weights(seed=0)
        apply_cp(model, mesh, seq)
        layout = model.context_parallel.layout
        model(torch.randint(0, args.vocab_size, (1, seq // 2))).float().pow(2).mean().backward()
        kv_per_token = 2 * 4 * args.n_kv_heads * args.head_dim
        per_mode = {}
        for i in range(args.n_layers):
            chunk, window = args.layer_chunk(i), args.layer_window(i)
            mode = layout.mode(chunk, window)
            entry = per_mode.setdefault(mode, {"layers": 0, "minimum_bytes": 0.0})
            entry["layers"] += 1
            entry["minimum_bytes"] += layout.bytes_received(mode, chunk, kv_per_token, window)
        for mode, entry in per_mode.items():
            entry["sent_bytes"] = model.context_parallel.sent.get(mode, 0)
            entry["sent_over_minimum"] = entry["sent_bytes"] / entry["minimum_bytes"] if entry["minimum_bytes"] else None
        result[seq] = per_mode
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def bench_bytes(seqs: list[int]) -> dict:
    from tests.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bytes.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", __file__, "--bytes-worker", str(out),
                        "--seqs", *map(str, seqs)], env=env, check=True, capture_output=True, timeout=3600)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="*", default=[4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="outputs/bench_cp.json")
    parser.add_argument("--bytes-worker", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.bytes_worker:
        _bytes_worker(a.seqs, a.bytes_worker)
        return
    # 128 and 384 add the modes long sequences do not reach: chunks longer than pieces, halos.
    result = {"flavor": "tiny", "bytes_per_mode": bench_bytes([128, 384, *a.seqs]), "runs": {}}
    for seq in a.seqs:
        one, two = _run(seq, 1, a.steps), _run(seq, 2, a.steps)
        result["runs"][seq] = {"cp1": one, "cp2": two, "speedup": two["tokens_per_sec"] / one["tokens_per_sec"]}
        print(seq, json.dumps(result["runs"][seq]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
