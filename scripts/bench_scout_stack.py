"""Training throughput and MFU of a Scout-shaped layer stack on one GPU: bf16, torch.compile,
fused AdamW; the ready-made script for a GPU machine (target: MFU >= 45% on one H200), and the
bf16 vs float8 comparison.

    python scripts/bench_scout_stack.py                      # 2 Scout layers, seq 8192, on cuda
    python scripts/bench_scout_stack.py --precisions bf16 float8-linears float8-experts float8
    python scripts/bench_scout_stack.py --layers 3 --seq 16384 --batch 1
    python scripts/bench_scout_stack.py --device cpu --flavor tiny --seq 64 --steps 3 --warmup 1 --no-compile

The stack is `--layers` blocks of `--flavor` (Scout: dim 5120, 40 query / 8 KV heads of 128, 16
routed experts top-1 plus a shared expert, every block MoE, QK norm, 8192-token chunked attention),
the last of them a NoPE layer with full causal attention (Scout has one in four), between
Scout's embedding and head with a `--vocab`-token vocabulary (Scout's 202,048 rows would hold
a fifth of the memory). Two layers are 4.74 B parameters, ~76 GB with fp32 master weights,
gradients and AdamW state; three (7.0 B, ~112 GB) should still fit an H200's 141 GB.

Each step is what `torchmoe train` runs on one GPU: forward under bf16 autocast with fp32 master
weights, fp32 cross entropy, backward, gradient clipping, fused AdamW, the expert-bias update. The
blocks are compiled as `compile.enable` compiles them (`fullgraph=True`). Tokens are random (the
router still sees varying loads). Steps are timed with the device synchronised; the first
`--warmup` steps (compilation) are left out; weights are drawn on the device (`fast_init`). The
peak memory is reported against the planner's estimate (``memory_vs_planner``). MFU is against the device's dense bf16 peak
(`torchmoe.metrics.metrics.device_peak_flops`), with `ModelArgs.flops_per_token`: the PaLM
convention (`mfu_pct`) and attention counted causally (`mfu_causal_pct`).

`--precisions` runs the stack once per entry, each from the same weights: ``bf16``; ``float8-linears``
(attention and shared-expert projections as torchao Float8Linear, tensorwise, what
`float8.enable` converts); ``float8-experts`` (the routed experts' grouped GEMMs in float8,
`float8.routed_experts`; compute capability 9.0 / 10.x); ``float8`` (both). MFU stays against
the bf16 peak, so float8's gain shows as a higher figure. ``--emulate`` emulates the float8
linears (a CPU smoke run). Writes JSON (default outputs/bench_scout_stack.json): each run's
numbers under ``runs`` and tokens/s relative to bf16; and prints it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchmoe.config.job_config import ActivationCheckpoint, Compile, Float8
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.config.job_config import Parallelism, Training
from torchmoe.distributed.compile import apply_compile
from torchmoe.distributed.data_parallel import apply_autocast
from torchmoe.distributed.float8 import convert_float8_experts, convert_float8_linears
from torchmoe.metrics.metrics import device_peak_flops, peak_memory_gib, reset_peak_memory
from torchmoe.models.llama4 import FLAVORS, ModelArgs, Transformer, update_expert_bias
from torchmoe.optim.optimizer import build_optimizer, clip_grad_norm_
from torchmoe.plan.memory import estimate_memory


def stack_args(flavor: str, layers: int, vocab: int) -> ModelArgs:
    """`layers` blocks of `flavor`, the last one NoPE (full attention), with a `vocab`-row
    embedding and head."""
    return FLAVORS[flavor].replace(n_layers=layers, vocab_size=vocab,
                                   no_rope_layers=[int(i < layers - 1) for i in range(layers)])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PRECISIONS = {"bf16": (False, False), "float8-linears": (True, False), "float8-experts": (False, True),
              "float8": (True, True)}  # name: (float8 linears, float8 routed experts)


def fast_init(args: ModelArgs, device: torch.device, seed: int = 0) -> Transformer:
    """The model on `device`, its weights drawn there from `seed` (matrices normal(0, 0.02), norm
    scales 1): seconds for billions of parameters, where `Transformer.init_weights`' layout-
    independent draws on the host take minutes. The same weights for every run of one seed."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_buffers(device)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.fill_(1.0)
    return model.train()


def planned_memory_gib(args: ModelArgs, *, dtype: str, compiled: bool, batch: int, seq: int) -> float:
    """The planner's peak for this run (one rank, no parallelism, no activation checkpointing)."""
    training = Training(local_batch_size=batch, seq_len=seq, mixed_precision_param=dtype)
    degrees = dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1)
    return estimate_memory(args, degrees, training, ActivationCheckpoint(mode="none"), Parallelism(),
                           compiled=compiled)["total"]


def bench(args: ModelArgs, *, device: torch.device, dtype: str, compiled: bool, batch: int, seq: int,
          steps: int, warmup: int, precision: str = "bf16", emulate: bool = False) -> dict:
    """Train `steps` steps on random tokens; throughput over the steps after `warmup`, and the
    peak memory against the planner's."""
    model = fast_init(args, device)
    float8_linears, float8_experts = PRECISIONS[precision]
    if float8_linears:  # as parallelize does: before autocast and compile
        convert_float8_linears(model, Float8(enable=True, emulate=emulate))
    if float8_experts:
        convert_float8_experts(model, ["experts"])
    apply_autocast(model, Training(mixed_precision_param=dtype))  # fp32 weights, `dtype` compute
    if compiled:
        apply_compile(model, Compile(enable=True), fullgraph=True)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-4))
    params = list(model.parameters())
    generator = torch.Generator(device).manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), device=device, generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_bias(model.moe_layers())
        _sync(device)
        times.append(time.perf_counter() - start)
    tokens_per_sec = batch * seq / statistics.median(times[warmup:])
    peak = device_peak_flops(device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    result = {
        "params": sum(p.numel() for p in params), "first_step_s": round(times[0], 2),
        "step_s": [round(t, 4) for t in times[warmup:]], "tokens_per_sec": tokens_per_sec,
        "final_loss": loss.item(), "memory_gib": peak_memory_gib(device),
        "memory_planned_gib": planned_memory_gib(args, dtype=dtype, compiled=compiled, batch=batch, seq=seq),
    }
    result["memory_vs_planner"] = result["memory_gib"] / result["memory_planned_gib"]
    for key, causal in (("", False), ("_causal", True)):
        flops = args.flops_per_token(seq, causal=causal) * tokens_per_sec
        result[f"tflops{key}"] = flops / 1e12
        result[f"mfu{key}_pct"] = 100 * flops / peak if peak else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="scout", choices=sorted(FLAVORS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (compilation, allocator)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=["bf16"],
                        help="run the stack once per entry (bf16 first when listed, the reference)")
    parser.add_argument("--emulate", action="store_true", help="emulate float8 linears (CPU smoke runs)")
    parser.add_argument("--out", default="outputs/bench_scout_stack.json")
    opts = parser.parse_args()
    if opts.steps <= opts.warmup or opts.layers < 1:
        parser.error("--steps must be larger than --warmup, and --layers at least 1")
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or pass --device cpu for a smoke run")
    args = stack_args(opts.flavor, opts.layers, opts.vocab)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", **{k: v for k, v in vars(opts).items() if k != "out"}}
    result["runs"] = {}
    for precision in opts.precisions:
        result["runs"][precision] = bench(args, device=device, dtype=opts.dtype, compiled=opts.compile,
                                          batch=opts.batch, seq=opts.seq, steps=opts.steps, warmup=opts.warmup,
                                          precision=precision, emulate=opts.emulate)
        # The next run starts from an empty device: no graphs, cached blocks or peak of this one.
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_memory(device)
    if "bf16" in result["runs"]:
        base = result["runs"]["bf16"]["tokens_per_sec"]
        result["tokens_per_sec_vs_bf16"] = {name: run["tokens_per_sec"] / base for name, run in result["runs"].items()}
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
