"""How many threads a CPU run computes with: the CPUs this process really gets, not the machine's.

    threads, why = cpu_threads()   # before the first op; the run's opening lines say `why`

torch's default is one intra-op thread per physical core of the machine. A process that shares
those cores (other jobs, the CI's second test worker, a container's CPU quota) then runs an
OpenMP team bigger than its share, and each op waits for its slowest thread: measured
2026-12-07 on this project's 2-core x86_64 CPU machine at a load average of 5 to 11, LoRA's
forward and backward of a tiny Qwen3-MoE took 33.1 s with torch's 2 threads and 1.18 s with one.
So a run uses as many threads as it has CPUs to itself: the CPUs it may run on (its affinity,
within the cgroup's CPU quota), less what the other processes keep busy (the load average), at
least one and never more than torch's default. `OMP_NUM_THREADS`, when set, decides instead
(torchrun sets it to 1 per rank when it starts several).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

__all__ = ["choose_threads", "cpu_threads", "usable_cpus"]

# cgroup v2's limit ("max 100000" or "200000 100000"), then v1's quota and period.
_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


# torch's own choice (the physical cores), read once: a second call must not lower it further.
_TORCH_DEFAULT = torch.get_num_threads()

def _quota(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> float | None:
    """The cgroup's CPU quota in CPUs (200000/100000 -> 2.0), or None: no quota, or none readable."""
    try:
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period)
        quota, period = (int(p.read_text()) for p in v1)
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity, within the cgroup's quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _quota()
    return min(float(cpus), quota) if quota is not None else float(cpus)


def choose_threads(*, usable: float, load: float, default: int) -> int:
    """The intra-op threads for `usable` CPUs of which the other processes keep `load` busy (the
    1-minute load average, which counts this process only as far as it ran already): the idle
    ones, rounded, at least 1, at most `default` (torch's choice: the physical cores)."""
    return max(1, min(default, math.floor(usable - load + 0.5)))


def cpu_threads() -> tuple[int, str]:
    """Set torch's intra-op threads for this CPU process; returns them and a clause saying why,
    for the opening lines. `OMP_NUM_THREADS` wins when set (torch read it already)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "as OMP_NUM_THREADS says"
    usable = usable_cpus()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = choose_threads(usable=usable, load=load, default=_TORCH_DEFAULT)
    torch.set_num_threads(threads)
    return threads, (f"the {usable:g} CPUs this process may use, less a load average of {load:.1f}; "
                     "OMP_NUM_THREADS=N chooses")
