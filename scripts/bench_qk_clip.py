"""What QK-Clip (`optimizer.qk_clip_threshold`) costs a training step, on one process: the forward
and backward of a batch with and without the logit watch (`nn.logit_max`), and the clip after
the step (`QKClip.reduce` + `QKClip.apply`), on each family whose attention it watches.

    python scripts/bench_qk_clip.py --out outputs/bench_qk_clip.json
    python scripts/bench_qk_clip.py --families deepseek_v3 --seq-len 256 --repeats 3

Each measurement is the median of `--repeats` after one warm-up; the two forward-backward
variants alternate, so that a change in the machine's load falls on both. The watch's extra work
is one more QK^T per watched layer (no softmax, no PV, no backward), so its share is largest
where attention dominates: long rows, few experts. Writes JSON and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchmoe.arch.registry import FLAVORS  # noqa: E402
from torchmoe.models.decoder.model import Transformer  # noqa: E402
from torchmoe.optim.qk_clip import QKClip, watch_attention_logits  # noqa: E402

# Each family's debug flavor (Qwen3 is left out: QK-norm on every layer, nothing to watch).
DEBUG = {"deepseek_v3": "debugmodel", "gpt_oss": "debugmodel", "llama4": "debugmodel"}


def _model(family: str, flavor: str, watch: bool) -> tuple[Transformer, QKClip | None]:
    args = FLAVORS[family][flavor]
    with torch.device("meta"):
        model = Transformer(args)
    watched = watch_attention_logits(model, args.n_heads) if watch else []
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    clip = QKClip(model, watched, 1e-3, args.n_heads, torch.device("cpu")) if watch else None
    return model.train(), clip


def _step(model: Transformer, clip: QKClip | None, tokens: torch.Tensor) -> float:
    """Seconds of one forward and backward (the clip's step start included)."""
    began = time.perf_counter()
    if clip is not None:
        clip.begin_step()
    model(tokens).float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - began


def _clip_s(clip: QKClip) -> float:
    began = time.perf_counter()
    clip.reduce()
    clip.apply()
    return time.perf_counter() - began


def bench(family: str, flavor: str, *, batch: int, seq_len: int, repeats: int) -> dict:
    torch.manual_seed(0)
    plain, _ = _model(family, flavor, watch=False)
    watched, clip = _model(family, flavor, watch=True)
    tokens = torch.randint(0, FLAVORS[family][flavor].vocab_size, (batch, seq_len))
    _step(plain, None, tokens), _step(watched, clip, tokens)  # warm-up
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        times["off"].append(_step(plain, None, tokens))
        times["on"].append(_step(watched, clip, tokens))
    clip_times = [_clip_s(clip) for _ in range(repeats)]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"family": family, "flavor": flavor, "watched_layers": len(clip.layers),
            "layers": FLAVORS[family][flavor].n_layers, "tokens": batch * seq_len,
            "forward_backward_s": {"off": off, "on": on}, "watch_overhead": on / off - 1,
            "clip_s": statistics.median(clip_times), "clip_share_of_step": statistics.median(clip_times) / on}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=sorted(DEBUG), default=sorted(DEBUG))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="outputs/bench_qk_clip.json")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    results = [bench(f, DEBUG[f], batch=opts.batch, seq_len=opts.seq_len, repeats=opts.repeats)
               for f in opts.families]
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "batch": opts.batch, "seq_len": opts.seq_len,
                               "threads": opts.threads, "results": results}, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
