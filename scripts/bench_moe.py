"""Benchmark the MoE layer (grouped GEMM vs per-expert loop) and a full training step against
transformers' Llama 4 on the same config and weights.

    python scripts/bench_moe.py --flavor tiny --batch 8 --seq 256 --out outputs/bench_moe.json

Reports tokens/s for: MoE layer forward+backward (grouped, loop); model forward+backward;
a full training step (forward, backward, AdamW) for torchmoe eager, torchmoe with its blocks
compiled as `compile.enable` compiles them, and transformers (eager, as its trainer runs by
default) when installed. Every training step uses fused AdamW (torchmoe's default), so the
comparison is of the models.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from torchmoe.config.job_config import Compile
from torchmoe.distributed.compile import apply_compile
from torchmoe.models.llama4 import FLAVORS, MoE, Transformer
from torchmoe.nn.init import init_parameters


def _time(fn, warmup: int, iters: int) -> float:
    """Median seconds per call after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench_moe_layer(args, batch: int, seq: int, grouped: bool, warmup: int, iters: int) -> float:
    torch.manual_seed(0)  # for the inputs below
    moe = MoE(args.replace(use_grouped_mm=grouped))
    init_parameters(moe, moe.param_inits(0.02), seed=0)
    moe.reset_router_state("cpu")
    x = torch.randn(batch, seq, args.dim, requires_grad=True)

    def step():
        moe(x).sum().backward()

    return batch * seq / _time(step, warmup, iters)


def _train_step_fn(model, tokens, logits_of):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    labels = torch.roll(tokens, -1, dims=1)

    def step():
        logits = logits_of(model, tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cpu_sized = sorted(name for name, args in FLAVORS.items() if args.dim <= 256)
    parser.add_argument("--flavor", default="tiny", choices=cpu_sized)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--out", default="outputs/bench_moe.json")
    opts = parser.parse_args()
    args = FLAVORS[opts.flavor]
    tokens_per_step = opts.batch * opts.seq
    result: dict = {"flavor": opts.flavor, "batch": opts.batch, "seq": opts.seq, "threads": torch.get_num_threads(),
                    "torch": torch.__version__}

    for grouped in (True, False):
        key = "moe_layer_grouped_tok_s" if grouped else "moe_layer_loop_tok_s"
        result[key] = bench_moe_layer(args, opts.batch, opts.seq, grouped, opts.warmup, opts.iters)

    torch.manual_seed(0)  # for the tokens below
    model = Transformer(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (opts.batch, opts.seq))
    fwd_bwd = lambda: model(tokens).float().logsumexp(-1).mean().backward()  # noqa: E731
    result["model_fwd_bwd_tok_s"] = tokens_per_step / _time(fwd_bwd, opts.warmup, opts.iters)
    result["train_step_tok_s"] = tokens_per_step / _time(
        _train_step_fn(model, tokens, lambda m, t: m(t)), opts.warmup, opts.iters)
    compiled = Transformer(args)
    compiled.load_state_dict(model.state_dict())
    apply_compile(compiled, Compile(enable=True), fullgraph=True)
    result["compiled_train_step_tok_s"] = tokens_per_step / _time(
        _train_step_fn(compiled, tokens, lambda m, t: m(t)), opts.warmup, opts.iters)

    try:
        from transformers import Llama4ForCausalLM

        from torchmoe.hf import save_model
    except ImportError:
        result["transformers"] = "not installed"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            save_model(model, tmp)
            hf = Llama4ForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").train()
        result["transformers_train_step_tok_s"] = tokens_per_step / _time(
            _train_step_fn(hf, tokens, lambda m, t: m(t).logits), opts.warmup, opts.iters)
        hf_tok_s = result["transformers_train_step_tok_s"]
        result["speedup_vs_transformers"] = result["train_step_tok_s"] / hf_tok_s
        result["compiled_speedup_vs_transformers"] = result["compiled_train_step_tok_s"] / hf_tok_s
    result["grouped_vs_loop"] = result["moe_layer_grouped_tok_s"] / result["moe_layer_loop_tok_s"]

    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
