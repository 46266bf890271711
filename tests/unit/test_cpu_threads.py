"""A CPU run's threads: the CPUs the process has to itself (affinity within the cgroup quota,
less the load average), at least one, at most torch's default; OMP_NUM_THREADS decides when set;
the opening lines say which and why.

    python -m pytest -q tests/unit/test_cpu_threads.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from torchmoe.arch.registry import FLAVORS
from torchmoe.config.loader import load_job_config
from torchmoe.training import cpu_threads as threads_module
from torchmoe.training.console import opening
from torchmoe.training.cpu_threads import _quota, choose_threads, cpu_threads


@pytest.mark.parametrize(("usable", "load", "default", "want"), [
    (2.0, 0.1, 2, 2),    # an idle 2-core machine: torch's default
    (2.0, 0.6, 2, 1),    # another process keeps most of a core busy
    (2.0, 5.3, 2, 1),    # the shared CI machine at load 5: one thread, never zero
    (64.0, 10.0, 32, 32),  # 54 idle CPUs, but torch's default (the physical cores) is the most
    (64.0, 40.2, 32, 24),
    (1.5, 0.0, 8, 2),    # a cgroup quota of 1.5 CPUs rounds to 2
])
def test_threads_are_the_idle_cpus_between_one_and_torchs_default(usable, load, default, want) -> None:
    assert choose_threads(usable=usable, load=load, default=default) == want


def test_the_cgroup_quota_is_read_in_either_version(tmp_path: Path) -> None:
    v2 = tmp_path / "cpu.max"
    v1 = (tmp_path / "cpu.cfs_quota_us", tmp_path / "cpu.cfs_period_us")
    v2.write_text("150000 100000\n")
    assert _quota(v2, v1) == 1.5
    v2.write_text("max 100000\n")
    assert _quota(v2, v1) is None
    v2.unlink()
    v1[0].write_text("-1\n")
    v1[1].write_text("100000\n")
    assert _quota(v2, v1) is None  # v1's "no quota"
    v1[0].write_text("300000\n")
    assert _quota(v2, v1) == 3.0
    v1[1].unlink()
    assert _quota(v2, v1) is None  # unreadable: no quota known


def test_omp_num_threads_decides_else_the_load_does(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert cpu_threads() == (before, "as OMP_NUM_THREADS says")
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(threads_module, "usable_cpus", lambda: 2.0)
        monkeypatch.setattr(threads_module.os, "getloadavg", lambda: (5.25, 0.0, 0.0))
        threads, why = cpu_threads()
        assert threads == torch.get_num_threads() == 1
        assert why == "the 2 CPUs this process may use, less a load average of 5.2; OMP_NUM_THREADS=N chooses"
    finally:
        torch.set_num_threads(before)


def test_the_opening_lines_say_the_threads_and_why() -> None:
    cfg = load_job_config(["--config", DEBUG_CONFIG], notes=[])
    lines = opening(cfg, FLAVORS["llama4"]["tiny"], step=0, global_batch_size=8, world_size=1, device_type="cpu",
                    dump_folder=Path("out"), threads=(1, "as OMP_NUM_THREADS says")).splitlines()
    assert lines[2] == "CPU threads: 1 (as OMP_NUM_THREADS says)"
    assert len(opening(cfg, FLAVORS["llama4"]["tiny"], step=0, global_batch_size=8, world_size=1, device_type="cuda",
                       dump_folder=Path("out")).splitlines()) == 2  # a GPU run: no CPU line
