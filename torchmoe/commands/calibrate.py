"""Measure the machine this runs on as a hardware profile (`plan.hardware`'s schema) for the planner.

    python -c "from torchmoe.commands.calibrate import calibrate; from torchmoe.config.loader import load_job_config; \\
        calibrate(load_job_config(['--config', 'configs/debug_model.toml']), 'cpu.json', budget_s=20)"

`torchmoe plan --calibrate OUT.json` runs `calibrate`, in one process or under torchrun (every
launched rank measures; rank 0 writes the file). Every rank runs the same measurements at the same
time (a barrier before each), so a rate includes the contention between the ranks that share the
machine: four ranks on two CPU cores each reach about half of one core. Threads are training's
(torch's setting is left alone; the tests' launcher runs ranks with one thread each).

Compute runs at the job's shapes (``tokens = local_batch_size * seq_len``), forward + backward
through autograd as training runs them, shrunk (`calibrate_steps.shrink`, the order given per op) only where one
step would exceed `_STEP_FLOPS` / `_STEP_BYTES` (a 17B model's shapes on a CPU); the shapes measured
are in ``measurements.shapes``. FLOPs counted:

    matmul      6 * tokens * dim * ffn_hidden_dim          an nn.Linear of the dense FFN (float8 on
                                                            CUDA >= 8.9: the three tensorwise-scaled
                                                            GEMMs float8 training runs, casts included)
    attention   12 * n_heads * head_dim * (seq_len / 2) per token    causal: the planner's count
    grouped_mm  18 * dim * moe_hidden_dim * routed rows     the routed experts' SwiGLU (3 GEMMs),
                                                            tokens * top_k rows spread evenly

``memory_bandwidth_gbs``: an elementwise ``silu(x) * w`` forward and its gradient, 11 tensor passes
(silu 2, mul 3, the mul's gradient 3, silu's 3) over tensors larger than the caches.
``kernel_overhead_us``: a chain of multiplications of 1-element tensors, forward and backward, per
kernel. Rates are the mean over ranks, times the slowest rank's, so every rank returns one dict.

Collectives (more than one rank; float32 tensors on the compute device, messages of 4 KiB up to
4 MiB on CPU, 64 MiB on CUDA): all-gather, reduce-scatter, all-reduce, all-to-all and p2p (each rank
sends to the next and receives from the previous). `fit_link` fits `Link.seconds`'s model to each
one's (bytes, seconds) table; the all-gather's fit is both ``links`` (one node is measured: its
inter-node link is unknown, and said so in ``source``). ``overlap``: matmuls while an asynchronous
all-gather of about the same duration is in flight, against each alone (1.0 in one process: there
is nothing to hide). One process measures no link: a known GPU keeps its built-in profile's
links, anything else gets a stand-in (its memory bandwidth and kernel overhead), said in ``source``.

Time: each measurement runs once to warm up, once to count, then as many times as its share of
`budget_s` allows (at most `_MAX_ITERS`); the ranks agree on the count.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe.arch.registry import model_args_from_config
from torchmoe.commands.calibrate_steps import (
    World,
    attention_step,
    collective_step,
    fit_link,
    float8_step,
    grouped_step,
    matmul_step,
    message_sizes,
    overlap_fraction,
    shrink,
    stream_step,
    tiny_step,
)
from torchmoe.config.files.output_files import write_output
from torchmoe.config.job_config import JobConfig
from torchmoe.config.launch_env import launch_int
from torchmoe.distributed.process_groups import backend_spec
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.plan.hardware import (
    BUILTIN_PROFILES,
    COLLECTIVES,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    Link,
    in_profile_range,
    profile_from_dict,
    profile_to_dict,
)
from torchmoe.plan.memory import compute_dtype
from torchmoe.preflight import train_device

__all__ = ["calibrate"]

# One compute step at most this many FLOPs and bytes of tensors (per rank): 20-100 ms on a CPU
# core, tens of ms on a datacenter GPU. A 17B model's shapes are shrunk to it.
_STEP_FLOPS = {"cpu": 2e9, "cuda": 5e13}
_STEP_BYTES = {"cpu": 2**28, "cuda": 2**33}
# Elements of the elementwise measurement's tensors: 32 MiB (fp32) is past a CPU's last-level
# cache share; 256 MiB past any GPU's L2.
_STREAM_ELEMENTS = {"cpu": 2**23, "cuda": 2**26}
_MAX_ITERS = 100  # timed repetitions of one measurement at most
_BATCHES = 5  # ... timed in this many batches
_OVERLAP_ROUNDS = (3, 20)  # the fewest and most rounds of the overlap measurement
# Shares of the budget: a compute measurement 1, a collective's message size 0.3, the overlap 3;
# together 60% of it, the rest is warm-up, counting runs and start-up.
_COMPUTE_SHARE, _MESSAGE_SHARE, _OVERLAP_SHARE, _TIMED_SHARE = 1.0, 0.3, 3.0, 0.6


def _seconds(world: World, step: Callable[[], object], slot_s: float) -> float:
    """Seconds one call of `step` takes on this rank while every rank runs it: once to warm up
    (allocations, kernel choice), once to count, then as often as `slot_s` allows (every rank
    the same number of times: the slowest rank's count), in up to `_BATCHES` batches: the
    fastest batch's time per call (processes outside the job only ever slow a batch down)."""
    step()
    world.barrier()
    start = time.perf_counter()
    step()
    world.sync()
    once = world.slowest({"once": time.perf_counter() - start})["once"]
    n = max(1, min(_MAX_ITERS, int(slot_s / max(once, 1e-9))))
    batches = [n // _BATCHES + (b < n % _BATCHES) for b in range(min(n, _BATCHES))]
    world.barrier()
    per_call = []
    for calls in batches:
        start = time.perf_counter()
        for _ in range(calls):
            step()
        world.sync()
        per_call.append((time.perf_counter() - start) / calls)
    return min(per_call)


# ---- the overlap of compute and communication --------------------------------------------------


def _overlap(world: World, matmul: Callable[[], object], matmul_s: float, link: Link, sizes: list[int],
             slot_s: float) -> tuple[float, dict]:
    """Overlap of matmuls with an asynchronous all-gather of about the same duration (`link`'s
    prediction; at most the largest message's), over rounds of: the matmuls alone, the all-gather
    alone, both (as many rounds as `slot_s` holds, `_OVERLAP_ROUNDS`). `matmul_s`: the slowest
    rank's seconds per matmul. Returns `overlap_fraction` of each time's fastest round (the
    slowest rank's), and the times."""
    n = world.size
    fewest, most = _OVERLAP_ROUNDS
    target_s = min(slot_s / fewest / 3, link.seconds("all_gather", sizes[-1], n))
    count = max(1, min(_MAX_ITERS, round(target_s / matmul_s)))
    wanted = (count * matmul_s - (n - 1) * link.latency_us * 1e-6) * link.bandwidth_gbs * 1e9 * n / (n - 1)
    size = int(min(max(wanted, sizes[0]), sizes[-1]))
    one_round_s = 3 * max(count * matmul_s, link.seconds("all_gather", size, n))  # the same on every rank
    rounds = max(fewest, min(most, int(slot_s / one_round_s)))
    shard = torch.zeros(size // 4 // n, device=world.device)
    full = torch.empty(shard.numel() * n, device=world.device)

    def compute():
        for _ in range(count):
            matmul()

    def comm():
        dist.all_gather_single(full, shard)

    def both():
        work = dist.all_gather_single(full, shard, async_op=True)
        compute()
        work.wait()

    both()  # warm-up
    spent = dict.fromkeys(("compute_s", "comm_s", "both_s"), math.inf)
    for _ in range(rounds):
        for key, run in (("compute_s", compute), ("comm_s", comm), ("both_s", both)):
            world.barrier()
            start = time.perf_counter()
            run()
            world.sync()
            spent[key] = min(spent[key], time.perf_counter() - start)
    spent = world.slowest(spent)
    overlap = overlap_fraction(spent["compute_s"], spent["comm_s"], spent["both_s"])
    return overlap, {**spent, "bytes": full.numel() * 4, "matmuls": count, "rounds": rounds}


# ---- the profile -----------------------------------------------------------------------------------


def _job_shapes(cfg: JobConfig, device_type: str) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """(the job's shapes per op, the shapes measured: `shrink`ed to `_STEP_FLOPS` / `_STEP_BYTES`).
    Bytes are counted at 4 per element (tensors, their gradients, intermediates)."""
    args = model_args_from_config(cfg.model)
    batch, seq = cfg.training.local_batch_size, cfg.training.seq_len
    group, hd = args.n_heads // args.n_kv_heads, args.head_dim
    max_flops, max_bytes = _STEP_FLOPS[device_type], _STEP_BYTES[device_type] / 4

    def matmul_fits(s):
        t, i, o = s["tokens"], s["in"], s["out"]
        return 6 * t * i * o <= max_flops and 2 * (t * i + i * o + t * o) <= max_bytes

    def attention_fits(s):
        heads = s["kv_heads"] * group
        return (12 * heads * hd * s["seq"] / 2 * s["batch"] * s["seq"] <= max_flops
                and 4 * s["batch"] * s["seq"] * hd * (heads + s["kv_heads"]) <= max_bytes)

    def grouped_fits(s):
        e, r, d, m = s["experts"], s["rows_per_expert"], s["dim"], s["hidden"]
        return 18 * d * m * e * r <= max_flops and 6 * e * m * d + e * r * (4 * d + 6 * m) <= max_bytes

    job = {
        "matmul": {"tokens": batch * seq, "in": args.dim, "out": args.ffn_hidden_dim},
        "attention": {"batch": batch, "kv_heads": args.n_kv_heads, "heads_per_kv": group, "seq": seq, "head_dim": hd},
        "grouped_mm": {"experts": args.num_experts, "rows_per_expert": -(-batch * seq * args.top_k // args.num_experts),
                       "dim": args.dim, "hidden": args.moe_hidden_dim},
    }
    # Shrunk first where the rate depends least on it: rows before weights, batch and heads
    # before the sequence, experts (whole ones, two kept: still a grouped GEMM) before an
    # expert's shape.
    measured = {
        "matmul": shrink(job["matmul"], (("tokens", 128), ("out", 256), ("in", 256)), matmul_fits),
        "attention": shrink(job["attention"], (("batch", 1), ("kv_heads", 1), ("seq", 128)), attention_fits),
        "grouped_mm": shrink(job["grouped_mm"],
                              (("experts", 2), ("rows_per_expert", 16), ("hidden", 128), ("dim", 128)), grouped_fits),
    }
    return job, measured


def _builtin(device_name: str) -> str | None:
    """The built-in profile of a GPU named `device_name` ("NVIDIA H100 80GB HBM3": h100), if any."""
    return next((key for key in BUILTIN_PROFILES if key.upper() in device_name.upper()), None)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


# A measured value's unit in a profile and its kind there (`plan.hardware.in_profile_range`); the
# values not named are compute rates: FLOP/s, held in TFLOP/s.
_UNITS = {"memory_bandwidth": (1e-9, "rate"), "kernel_overhead": (1e6, "microseconds")}


def _profile_value(key: str, value: float) -> float:
    """`value` (FLOP/s, bytes/s or seconds) moved into the range a profile holds for `key`."""
    scale, kind = _UNITS.get(key, (1e-12, "rate"))
    held = in_profile_range(value * scale, kind)
    return value if held == value * scale else held / scale


def _round(x: float) -> float:
    """Four significant digits: what one calibration can tell apart."""
    return float(f"{x:.4g}")


def _measure(cfg: JobConfig, world: World, budget_s: float) -> dict:
    """Every measurement, aggregated over the ranks, as a profile document."""
    begin = time.perf_counter()
    args = model_args_from_config(cfg.model)
    dev = world.device
    cuda = dev.type == "cuda"
    compute = compute_dtype(cfg.training)
    dtypes = list(dict.fromkeys((compute, "float32", "bfloat16")))
    float8 = cuda and torch.cuda.get_device_capability(dev) >= (8, 9)
    job, shapes = _job_shapes(cfg, dev.type)
    sizes = message_sizes(dev.type) if world.size > 1 else []
    shares = (_COMPUTE_SHARE * (3 * len(dtypes) + float8 + 2)
              + _MESSAGE_SHARE * len(COLLECTIVES) * len(sizes) + _OVERLAP_SHARE * (world.size > 1))
    unit = budget_s * _TIMED_SHARE / shares

    # Each value's step (built when measured: one step's tensors at a time), in the order measured.
    steps: dict[str, Callable[[], tuple[Callable[[], object], float]]] = {}
    for name in dtypes:
        steps[f"matmul.{name}"] = functools.partial(matmul_step, shapes["matmul"], torch_dtype(name), dev)
    if float8:
        steps["matmul.float8"] = functools.partial(float8_step, shapes["matmul"], dev)
    for name in dtypes:
        steps[f"attention.{name}"] = functools.partial(attention_step, shapes["attention"], torch_dtype(name), dev)
    for name in dtypes:
        steps[f"grouped_mm.{name}"] = functools.partial(grouped_step, shapes["grouped_mm"], args.top_k,
                                                        args.use_grouped_mm, torch_dtype(name), dev)
    steps["memory_bandwidth"] = functools.partial(stream_step, _STREAM_ELEMENTS[dev.type], dev)
    steps["kernel_overhead"] = functools.partial(tiny_step, dev)
    per_step: dict[str, float] = {}  # this rank's seconds per step

    def measure(keys: Sequence[str]) -> dict[str, float]:
        """The mean over the ranks of each value: a rate (FLOP/s, bytes/s), or seconds per kernel."""
        local = {}
        for key in keys:
            step, work = steps[key]()
            per_step[key] = _seconds(world, step, _COMPUTE_SHARE * unit)
            local[key] = per_step[key] / work if key == "kernel_overhead" else \
                work / per_step[key] if per_step[key] > 0 else math.inf
        return world.mean(local)

    rates = measure(list(steps))
    # A value no profile holds (a rate below 1 GFLOP/s on a loaded machine): measured once more,
    # then moved to the nearest bound, and said so.
    outside = [key for key, value in rates.items() if _profile_value(key, value) != value]
    rates.update(measure(outside))
    bounded = {key: value for key in outside if _profile_value(key, value := rates[key]) != value}
    rates.update({key: _profile_value(key, value) for key, value in bounded.items()})
    matmul_s = {name: per_step[f"matmul.{name}"] for name in dtypes}

    measurements: dict = {"world_size": world.size, "budget_s": budget_s, "shapes": shapes}
    # What was measured of each value bounded, in the profile's unit (null: no time measurable).
    out_of_range = {key: _round(v * _UNITS.get(key, (1e-12,))[0]) if math.isfinite(v) else None
                    for key, v in bounded.items()}
    fits: dict[str, Link] = {}
    overlap = 1.0
    if world.size > 1:
        times = {}
        for name in COLLECTIVES:
            for size in sizes:
                step, nbytes = collective_step(name, size, world)
                times[f"{name}:{nbytes}"] = _seconds(world, step, _MESSAGE_SHARE * unit)
        times = world.slowest(times)
        tables: dict[str, list[list[float]]] = {name: [] for name in COLLECTIVES}
        for key, seconds in times.items():
            name, nbytes = key.split(":")
            tables[name].append([int(nbytes), seconds])
        fits = {name: fit_link(name, world.size, table) for name, table in tables.items()}
        out_of_range.update({f"collectives.{name}": {"latency_us": _round(link.latency_us),
                                                     "bandwidth_gbs": _round(link.bandwidth_gbs)}
                             for name, link in fits.items() if link.in_profile_range() != link})
        fits = {name: link.in_profile_range() for name, link in fits.items()}
        matmul = matmul_step(shapes["matmul"], torch_dtype(compute), dev)[0]
        slowest_matmul = world.slowest({"s": matmul_s[compute]})["s"]
        overlap, measurements["overlap"] = _overlap(world, matmul, slowest_matmul, fits["all_gather"], sizes,
                                                    _OVERLAP_SHARE * unit)
        measurements["collectives"] = tables
    if out_of_range:
        measurements["bounded"] = out_of_range
    measurements["elapsed_s"] = world.slowest({"s": time.perf_counter() - begin})["s"]
    return _document(world, rates, fits, overlap, job, shapes, measurements)


def _document(world: World, rates: dict[str, float], fits: dict[str, Link], overlap: float,
              job: dict, shapes: dict, measurements: dict) -> dict:
    """The profile document of the aggregated measurements (checked by `profile_from_dict`)."""
    dev = world.device
    achieved: dict[str, dict[str, float]] = {"matmul": {}, "attention": {}, "grouped_mm": {}}
    for key, value in rates.items():
        op, _, dtype = key.partition(".")
        if op in achieved:
            achieved[op][dtype] = _round(value / 1e12)
    bandwidth_gbs, overhead_us = _round(rates["memory_bandwidth"] / 1e9), _round(rates["kernel_overhead"] * 1e6)
    if dev.type == "cuda":
        device_name = torch.cuda.get_device_name(dev)
        memory_gib = torch.cuda.get_device_properties(dev).total_memory / 2**30
        described = device_name
    else:
        device_name = "cpu"
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world.local_size
        described = f"{_cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s) per rank"
    builtin = _builtin(device_name) if dev.type == "cuda" else None
    notes = []
    if builtin:
        peak = dict(BUILTIN_PROFILES[builtin]["peak_tflops"])
        notes.append(f"peak_tflops: the built-in {builtin} profile's (datasheet)")
    else:
        peak = dict(achieved["matmul"])
        notes.append("peak_tflops: the measured matmul rates (" +
                     ("CPUs publish no useful peak)" if dev.type == "cpu" else "no built-in profile of this GPU)"))
    if fits:
        links = {"intra_node": fits["all_gather"], "inter_node": fits["all_gather"]}
        notes.append("links: the all-gather's fit; inter_node = intra_node (one node measured)")
    elif builtin:
        links = {side: Link(**BUILTIN_PROFILES[builtin]["links"][side]) for side in ("intra_node", "inter_node")}
        notes.append(f"links: the built-in {builtin} profile's (one process measures no link)")
    else:
        links = dict.fromkeys(("intra_node", "inter_node"), Link(overhead_us, bandwidth_gbs))
        notes.append("links: a stand-in (memory bandwidth, kernel overhead): one process measures no link, "
                     "calibrate under torchrun for real ones")
    if measurements.get("bounded"):
        notes.append(f"{', '.join(measurements['bounded'])} measured outside what a profile holds (compute twice: a "
                     "loaded machine?), written as the nearest bound (measurements.bounded: what was measured)")
    shrunk = [op for op in shapes if shapes[op] != job[op]]
    if shrunk:
        notes.append(f"{', '.join(shrunk)} measured at smaller shapes than the job's (measurements.shapes)")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"torchmoe calibrate on {socket.gethostname()}, {date}, torch {torch.__version__}, "
              f"{world.size} rank(s) on {described}; " + "; ".join(notes))
    rounded = lambda link: {"latency_us": _round(link.latency_us), "bandwidth_gbs": _round(link.bandwidth_gbs)}
    doc = {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": "calibrated-" + _slug(device_name),
        "source": source, "memory_gib": _round(memory_gib), "gpus_per_node": world.local_size, "peak_tflops": peak,
        "achieved_tflops": achieved, "attention_head_dim": shapes["attention"]["head_dim"],
        "memory_bandwidth_gbs": bandwidth_gbs, "kernel_overhead_us": overhead_us, "overlap": _round(overlap),
        "links": {side: rounded(link) for side, link in links.items()},
        "collectives": {name: rounded(link) for name, link in fits.items()},
        "measurements": measurements, "device": dev.type,
        **({"compute_capability": list(torch.cuda.get_device_capability(dev))} if dev.type == "cuda" else {}),
    }
    return profile_to_dict(profile_from_dict(doc))


def _slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def calibrate(cfg: JobConfig, out: str | os.PathLike, *, budget_s: float = 90.0) -> dict:
    """Measure this machine (under torchrun: all launched ranks together) and write its profile
    JSON to `out` (rank 0, atomically: `output_files.write_output`). Returns the profile document (the same on
    every rank; `plan.hardware.profile_from_dict` reads it).

    Args:
        cfg: the job whose shapes, compute dtype and device (``training.device``) are measured.
        budget_s: about how long the measurements may take (> 0); start-up comes on top.
    Raises:
        ConfigError: rank 0 could not write `out` (`--calibrate`'s fault: the OS refused it, or it
            is no regular file, or inside a live run's folder).
    """
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, not {budget_s}")
    device = train_device(cfg.training.device)
    created = launch_int("WORLD_SIZE", 1) > 1 and not dist.is_initialized()
    if created:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend_spec(device.type, host_collectives=False),
                                device_id=device if device.type == "cuda" else None)
    try:
        size = dist.get_world_size() if dist.is_initialized() else 1
        world = World(rank=dist.get_rank() if dist.is_initialized() else 0, size=size,
                       local_size=launch_int("LOCAL_WORLD_SIZE", size), device=device)
        doc = _measure(cfg, world, budget_s)
        if world.size > 1:  # rank 0's host name and date
            shared = [doc]
            dist.broadcast_object_list(shared, src=0)
            doc = shared[0]
        if world.rank == 0:
            # Looked at again first: the measurements took the budget's time.
            write_output("--calibrate", Path(os.fspath(out)), json.dumps(doc, indent=2) + "\n",
                         "pass a file path this user can write")
        return doc
    finally:
        if created:
            dist.destroy_process_group()
