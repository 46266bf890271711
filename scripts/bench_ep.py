"""Expert-parallel traffic and throughput: bytes the EP all-to-alls move per step against the
analytical minimum, and tokens/s, for a few EP layouts on CPU/gloo.

    python scripts/bench_ep.py --flavor tiny --steps 8 --out outputs/bench_ep.json

Minimum per rank and step, per MoE layer: routed rows × dim × dtype bytes × (ep − 1)/ep, for the
dispatch and again for the combine, in forward and again in backward (uniform routing sends a
fraction (ep − 1)/ep of the rows to other ranks). The measured bytes come from the trainer's
`ep_all_to_all_gib` metric (rank 0). A ratio above 1 means routing sent more rows off-rank than
uniform routing would (load imbalance); activation-checkpoint recomputation adds a forward's worth.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from torchmoe.launch import read_metrics, run_train
from torchmoe.models.llama4 import FLAVORS

REPO = Path(__file__).resolve().parents[1]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--layouts", nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="outputs/bench_ep.json")
    opts = parser.parse_args()
    results = [run(name, opts.flavor, opts.steps, opts.seq_len, opts.batch) for name in opts.layouts]
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
