"""torch.profiler traces land under iteration_<step>/ on CPU; memory snapshots no-op on CPU."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from torchmoe.config.job_config import Profiling as ProfilingConfig
from torchmoe.performance.profiling import maybe_memory_snapshot, maybe_profile


def _train(prof, steps: int) -> None:
    x = torch.randn(16, 16)
    for _ in range(steps):
        (x @ x).relu().sum()
        prof.step()


# Expected: the profiler notes once that each cycle's trace holds only that cycle's events.
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_trace_every_profile_freq_steps(tmp_path: Path) -> None:
    cfg = ProfilingConfig(enable_profiling=True, profile_freq=2, save_traces_folder="traces")
    with maybe_profile(cfg, tmp_path, rank=0, start_step=2) as prof:
        _train(prof, 4)  # training steps 3..6
    traced = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert traced == ["iteration_4", "iteration_6"]
    trace = json.loads((tmp_path / "traces" / "iteration_4" / "rank0_trace.json").read_text())
    assert trace["traceEvents"]


def test_disabled_writes_nothing(tmp_path: Path) -> None:
    with maybe_profile(ProfilingConfig(), tmp_path, rank=0) as prof:
        _train(prof, 2)
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU no-op")
def test_memory_snapshot_is_a_noop_on_cpu(tmp_path: Path, caplog) -> None:
    cfg = ProfilingConfig(enable_memory_snapshot=True, profile_freq=1)
    with caplog.at_level(logging.INFO), maybe_memory_snapshot(cfg, tmp_path, rank=0) as mem:
        _train(mem, 2)
    assert "needs CUDA" in caplog.text
    assert not any(tmp_path.iterdir())
