"""gpt-oss's attention (`nn.sink_attention`) against plain causal attention and the masked math
definition (what transformers' eager gpt-oss computes): forward + backward time per call, and the
bytes autograd keeps for the backward, at growing lengths.

    python scripts/bench_sink_attention.py                       # seq 1024, 4096, 8192; window 128
    python scripts/bench_sink_attention.py --seqs 2048 --heads 64 --kv-heads 8 --steps 5

Variants per length: "causal" (the operator with no sink and no window: the fused kernel alone),
"sinks" (plain causal with sinks: the merge's cost), "sinks_window" (the sliding-window layer:
two kernel calls over the window's blocks), "math_window" (scores masked to the window, a sink
column, softmax: a (seq x seq) score matrix per head, kept for the backward; skipped past
`--math-max-seq`). The time is the median of `--steps` calls after one warm-up. Writes JSON
(default outputs/bench_sink_attention.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from torchmoe.nn.sink_attention import sink_attention
from torchmoe.performance.saved_tensors import saved_bytes

REPO = Path(__file__).resolve().parents[1]


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int) -> torch.Tensor:
    """The definition, with an explicit (seq x seq) mask and the sink as one more column."""
    b, h, s, hd = q.shape
    keys, values = (t.repeat_interleave(h // t.shape[1], 1) for t in (k, v))
    scores = q @ keys.transpose(-1, -2) * hd**-0.5
    i, j = torch.arange(s).unsqueeze(-1), torch.arange(s)
    scores = scores.masked_fill((j > i) | (j <= i - window), float("-inf"))
    scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(b, h, s, 1)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., :s] @ values


def bench(seq: int, *, heads: int, kv_heads: int, head_dim: int, window: int, steps: int, math_max_seq: int,
          dtype: torch.dtype = torch.float32) -> dict:
    """{variant: {"ms": median forward + backward, "saved_mib": what autograd keeps}} at `seq`."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, heads, head_dim, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    sinks = torch.randn(heads, generator=g, dtype=dtype).requires_grad_()
    variants = {"causal": lambda: sink_attention(q, k, v, None, None),
                "sinks": lambda: sink_attention(q, k, v, sinks, None),
                "sinks_window": lambda: sink_attention(q, k, v, sinks, window)}
    if seq <= math_max_seq:
        variants["math_window"] = lambda: _math(q, k, v, sinks, window)
    result = {}
    for name, fn in variants.items():
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            fn().sum().backward()
            times.append(time.perf_counter() - start)
        result[name] = {"ms": 1e3 * statistics.median(times[1:]), "saved_mib": saved_bytes(fn) / 2**20}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--math-max-seq", type=int, default=4096)
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench_sink_attention.json"))
    args = parser.parse_args()
    results = {str(seq): bench(seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                               window=args.window, steps=args.steps, math_max_seq=args.math_max_seq)
               for seq in args.seqs}
    report = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "window": args.window,
              "dtype": "float32", "device": "cpu", "threads": torch.get_num_threads(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
