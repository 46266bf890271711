"""The machine calibration (`torchmoe.commands.calibrate`): the link fit, the shapes it measures, float8's
GEMMs, and a one-process calibration read back as a profile.

    python -m pytest -q tests/unit/test_calibrate.py

Its multi-rank half (collectives, overlap, one writer) is tests/distributed/test_calibrate_world.py.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import REPO
from torchmoe.commands.calibrate import _job_shapes, calibrate
from torchmoe.commands.calibrate_steps import attention_step as _attention_step
from torchmoe.commands.calibrate_steps import fit_link, float8_linear_matmuls
from torchmoe.commands.calibrate_steps import grouped_step as _grouped_step
from torchmoe.commands.calibrate_steps import matmul_step as _matmul_step
from torchmoe.commands.calibrate_steps import overlap_fraction
from torchmoe.commands.calibrate_steps import stream_step as _stream_step
from torchmoe.config.loader import load_job_config
from torchmoe.plan.hardware import COLLECTIVES, Link, load_profile

DEBUG_JOB = ["--config", str(REPO / "configs" / "debug_model.toml")]
SIZES = [4096 * 4**i for i in range(6)]  # 4 KiB .. 4 MiB, as the calibration sends on CPU


def _model_seconds(collective: str, nbytes: int, ranks: int, latency_s: float, bytes_per_s: float) -> float:
    """The ring model, written out here (not through `Link.seconds`, which the fit reads)."""
    if collective == "p2p":
        return latency_s + nbytes / bytes_per_s
    factor = 2.0 if collective == "all_reduce" else 1.0
    return (ranks - 1) * latency_s + factor * (ranks - 1) / ranks * nbytes / bytes_per_s


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_fit_recovers_latency_and_bandwidth(collective, ranks):
    table = [(size, _model_seconds(collective, size, ranks, 37e-6, 2.5e9)) for size in SIZES]
    link = fit_link(collective, ranks, table)
    assert link.latency_us == pytest.approx(37.0, rel=1e-9)
    assert link.bandwidth_gbs == pytest.approx(2.5, rel=1e-9)


def test_fit_of_a_negative_intercept_has_no_latency():
    """Times proportional to size, less a constant: the unconstrained latency would be negative;
    the fit through the origin is the relative-least-squares slope."""
    table = [(size, _model_seconds("all_gather", size, 2, 0.0, 1e9) - 1e-6) for size in SIZES]
    link = fit_link("all_gather", 2, table)
    assert link.latency_us == 0.0
    # min over B of sum((S_i / 2 / B - t_i) / t_i)^2: with q_i = S_i / 2 / t_i, B = sum(q^2) / sum(q)
    q = [size / 2 / t for size, t in table]
    assert link.bandwidth_gbs * 1e9 == pytest.approx(sum(v * v for v in q) / sum(q), rel=1e-9)


def test_fit_of_times_that_do_not_grow_is_all_latency():
    """Flat times: the latency alone fits; the bandwidth is the largest message's rate."""
    table = [(size, 300e-6) for size in SIZES]
    link = fit_link("all_reduce", 4, table)
    assert link.latency_us == pytest.approx(100.0, rel=1e-9)  # 3 steps of 100 us
    assert link.bandwidth_gbs == pytest.approx(2 * 3 / 4 * SIZES[-1] / 300e-6 / 1e9, rel=1e-9)


@pytest.mark.parametrize(("compute", "comm", "both", "expected"), [
    (1.0, 1.0, 1.0, 1.0),    # all hidden
    (1.0, 1.0, 2.0, 0.0),    # one after the other
    (2.0, 0.5, 2.25, 0.5),   # half of the shorter one hidden
    (1.0, 1.0, 2.5, 0.0),    # slower together than apart: none (clipped)
    (1.0, 1.0, 0.8, 1.0),    # faster than the longer alone (noise): all (clipped)
])
def test_overlap_fraction(compute, comm, both, expected):
    assert overlap_fraction(compute, comm, both) == pytest.approx(expected, abs=1e-12)


def test_matmul_flops_are_what_torch_counts():
    """6 * tokens * in * out: the forward GEMM and the two of its backward, as torch's counter sees them."""
    step, flops = _matmul_step({"tokens": 64, "in": 32, "out": 48}, torch.float32, torch.device("cpu"))
    with FlopCounterMode(display=False) as counter:
        step()
    assert flops == counter.get_total_flops() == 6 * 64 * 32 * 48


def test_attention_grouped_and_stream_work():
    """Counts torch cannot make here (its counter misses the CPU flash kernel and hooks autograd.grad
    badly): attention 12 * B * H * S^2 * hd (QK^T and PV forward, twice that backward) halved for
    causality; grouped experts 3 GEMMs x 3 (forward, two backward) x 2 * rows * dim * hidden; the
    stream 11 passes of 4-byte elements."""
    cpu = torch.device("cpu")
    attention = {"batch": 2, "kv_heads": 2, "heads_per_kv": 3, "seq": 64, "head_dim": 16}
    assert _attention_step(attention, torch.float32, cpu)[1] == 12 * 2 * 6 * 64**2 * 16 / 2
    grouped = {"experts": 4, "rows_per_expert": 16, "dim": 32, "hidden": 48}
    assert _grouped_step(grouped, 1, True, torch.float32, cpu)[1] == 9 * 2 * 64 * 32 * 48
    assert _stream_step(1000, cpu)[1] == 11 * 4 * 1000


def test_the_job_shapes_are_measured_when_they_fit():
    job, measured = _job_shapes(load_job_config(DEBUG_JOB), "cpu")
    assert measured == job == {
        "matmul": {"tokens": 8 * 128, "in": 128, "out": 384},
        "attention": {"batch": 8, "kv_heads": 4, "heads_per_kv": 2, "seq": 128, "head_dim": 16},
        "grouped_mm": {"experts": 8, "rows_per_expert": 128, "dim": 128, "hidden": 256},
    }


def test_a_17b_model_is_shrunk_to_one_cpu_step():
    """Rows before weights; batch and heads before the sequence; whole experts (down to two) first."""
    cfg = load_job_config([*DEBUG_JOB, "--model.flavor", "17bx16e", "--training.local_batch_size", "2",
                           "--training.seq_len", "8192"])
    job, measured = _job_shapes(cfg, "cpu")
    assert job["matmul"] == {"tokens": 16384, "in": 5120, "out": 16384}
    # 6 * 128 * 5120 * 256 = 1.0e9 <= 2e9 (out 512 would be 2.01e9)
    assert measured["matmul"] == {"tokens": 128, "in": 5120, "out": 256}
    # one KV head of 5 query heads: 12 * 5 * 128 * 256 * 512 = 1.0e9
    assert measured["attention"] == {"batch": 1, "kv_heads": 1, "heads_per_kv": 5, "seq": 512, "head_dim": 128}
    # two experts: 18 * 5120 * 8192 * 2048 rows is 1.5e12, so 16 rows each, then hidden 512: 1.5e9
    assert measured["grouped_mm"] == {"experts": 2, "rows_per_expert": 16, "dim": 5120, "hidden": 512}


def test_float8_linear_matmuls_are_the_three_products():
    """x @ w.T, g @ w, g.T @ x within float8's precision (e4m3: 3 mantissa bits, e5m2: 2), on the
    CPU kernel of the public `F.scaled_mm`."""
    gen = torch.Generator().manual_seed(0)
    # Magnitudes far apart, so that each product needs its own operands' scales.
    x, w, g = ((torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)
               for shape, scale in (((64, 32), 8.0), ((48, 32), 0.25), ((64, 48), 0.01)))
    got = float8_linear_matmuls(x, w, g)
    for out, ref in zip(got, (x.float() @ w.float().T, g.float() @ w.float(), g.float().T @ x.float())):
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        assert (out.float() - ref).norm() / ref.norm() < 0.08


def test_one_process_calibration_writes_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    doc = calibrate(load_job_config(DEBUG_JOB), out, budget_s=1.0)
    assert json.loads(out.read_text()) == doc
    profile = load_profile(str(out))
    assert profile.name == "calibrated-cpu" and profile.gpus_per_node == 1
    for op in ("matmul", "attention", "grouped_mm"):
        assert set(profile.achieved_tflops[op]) == {"float32", "bfloat16"}
        assert all(rate > 0 for rate in profile.achieved_tflops[op].values())
    assert profile.peak_tflops == profile.achieved_tflops["matmul"]  # a CPU publishes no peak
    assert profile.attention_head_dim == 16
    assert profile.memory_bandwidth_gbs > 0 and profile.kernel_overhead_us > 0 and profile.memory_gib > 0
    assert profile.overlap == 1.0 and profile.collectives == {}
    # One process measures no link: the stand-in is the device's own copy rate and kernel cost.
    assert profile.intra_node.bandwidth_gbs == profile.memory_bandwidth_gbs
    assert profile.intra_node.latency_us == profile.kernel_overhead_us
    assert "one process measures no link" in profile.source
    assert profile.measurements["elapsed_s"] > 0  # how long is the load's: no bound here


# The order `calibrate` measures in, for the debug job (float32 compute) in one process.
MEASURED = ["matmul.float32", "matmul.bfloat16", "attention.float32", "attention.bfloat16", "grouped_mm.float32",
            "grouped_mm.bfloat16", "memory_bandwidth", "kernel_overhead"]


def _noisy_calibration(monkeypatch, tmp_path, times: list[float]) -> tuple[dict, list[str]]:
    """A one-process calibration whose measurements took `times` seconds per call, in the order
    made (1 ms each after them): a loaded machine, injected. Returns the profile document and
    what `torchmoe plan --calibrate` printed after writing it."""
    import torchmoe.commands.calibrate as calibration
    from torchmoe.commands import plan as planner

    calls = iter(times)
    monkeypatch.setattr(calibration, "_seconds", lambda world, step, slot_s: next(calls, 1e-3))
    printed = io.StringIO()
    console = Console(file=printed, width=1000, highlight=False)
    monkeypatch.setattr(planner, "_report_console", lambda: console)
    out = tmp_path / "noisy.json"
    assert planner.plan_main(["--calibrate", str(out), *DEBUG_JOB]) == 0
    doc = json.loads(out.read_text())
    load_profile(str(out))  # a profile the planner reads
    return doc, printed.getvalue().splitlines()


def test_a_rate_below_what_a_profile_holds_is_measured_again(monkeypatch, tmp_path):
    """attention.bfloat16 took 1e6 s the first time (0 GFLOP/s: another process had the core),
    1 ms the second: the profile holds the second, and nothing is bounded."""
    times = [1e-3] * len(MEASURED)
    times[MEASURED.index("attention.bfloat16")] = 1e6
    doc, printed = _noisy_calibration(monkeypatch, tmp_path, times + [1e-3])
    assert doc["achieved_tflops"]["attention"]["bfloat16"] == doc["achieved_tflops"]["attention"]["float32"] > 1e-3
    assert "bounded" not in doc["measurements"] and "outside what a profile holds" not in doc["source"]
    assert len(printed) == 1 and printed[0].startswith(f"wrote {tmp_path / 'noisy.json'}: "), printed


@pytest.mark.parametrize(("key", "seconds", "written", "measured"), [
    ("grouped_mm.float32", 1e6, ("achieved_tflops", "grouped_mm", "float32", 1e-3), None),  # ~0 FLOP/s twice
    ("matmul.bfloat16", 0.0, ("achieved_tflops", "matmul", "bfloat16", 1e12), None),  # no time measurable
    ("memory_bandwidth", 1e9, ("memory_bandwidth_gbs", None, None, 1e-3), None),  # 0.4 bytes/s
    ("kernel_overhead", 3600.0, ("kernel_overhead_us", None, None, 1e7), 3600 / 64 * 1e6),  # an hour per call
])
def test_a_value_measured_outside_a_profile_twice_is_bounded_and_said(monkeypatch, tmp_path, key, seconds, written,
                                                                      measured):
    times = [1e-3] * len(MEASURED)
    times[MEASURED.index(key)] = seconds
    doc, printed = _noisy_calibration(monkeypatch, tmp_path, times + [seconds])
    field, op, dtype, value = written
    held = doc[field][op][dtype] if op else doc[field]
    assert held == pytest.approx(value, rel=1e-12)
    bounded = doc["measurements"]["bounded"]
    assert list(bounded) == [key]
    if measured is not None:
        assert bounded[key] == pytest.approx(measured, rel=1e-3)
    elif seconds == 0:
        assert bounded[key] is None  # infinite: JSON holds no inf
    else:
        assert 0 < bounded[key] < 1e-3 * 1e-3
    assert f"{key} measured outside what a profile holds (compute twice: a loaded machine?)" in doc["source"]
    assert printed[-1].startswith(f"warning: {key} measured outside what a profile holds (compute twice), written "
                                  "as the nearest bound: calibrate again on an idle machine"), printed


def test_a_link_fit_outside_a_profile_is_bounded():
    """Times of a link so slow its fit is 0.5 MB/s and 20 s of latency (a rank descheduled for
    seconds): the fit is kept in the profile's range, so that the profile still loads."""
    table = [(size, _model_seconds("all_gather", size, 2, 20.0, 5e5)) for size in SIZES]
    fit = fit_link("all_gather", 2, table)
    assert fit.latency_us > 1e7 and fit.bandwidth_gbs < 1e-3
    assert fit.in_profile_range() == Link(1e7, 1e-3)
    assert Link(37.0, 2.5).in_profile_range() == Link(37.0, 2.5)
