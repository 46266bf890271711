"""The suite's cost ledger: each test module's CPU seconds, printed at the end of every run.

A module's cost is the CPU (user + system) that its tests' process tree spent while the module
ran: the pytest worker itself, the processes it reaped (torchrun and its ranks, `python -m
torchmoe` subprocesses) and its live descendants with what they reaped (the fork server and its
forked children). It is read from /proc at the module's first test and after its last, so it costs
two walks of /proc a module, not a test. xdist's workers take whole modules (`--dist loadscope`),
so a module's tests run back to back on one worker; each worker sends its ledger to the controller
(`workeroutput`), which prints the costliest modules and the total (docs/testing.md keeps the
budgets per tier). Where /proc is missing (not Linux) the ledger says so and counts nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

__all__ = ["CostLedger"]

_SHOWN = 15
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of process `root`, the children it reaped, and every live descendant of it
    with the children each reaped: utime + stime + cutime + cstime of /proc/PID/stat."""
    parents: dict[int, int] = {}
    spent: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked: its parent's cutime holds it once reaped
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3
        parents[int(entry.name)] = int(fields[1])
        spent[int(entry.name)] = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += spent.get(pid, 0)
        stack.extend(children.get(pid, ()))
    return total / _TICK


class CostLedger:
    """A pytest plugin: per test module, (CPU seconds, wall seconds, tests)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.rows: dict[str, list[float]] = {}
        self.available = _PROC.is_dir()
        self._start: tuple[float, float] | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        module = item.nodeid.split("::")[0]
        if self.available and self._start is None:
            self._start = (tree_cpu_seconds(os.getpid()), time.monotonic())
        yield
        row = self.rows.setdefault(module, [0.0, 0.0, 0])
        row[2] += 1
        if self.available and (nextitem is None or nextitem.nodeid.split("::")[0] != module):
            cpu, wall = self._start
            row[0] += tree_cpu_seconds(os.getpid()) - cpu
            row[1] += time.monotonic() - wall
            self._start = None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workeroutput"):  # an xdist worker: the controller prints
            self.config.workeroutput["cost_ledger"] = json.dumps(self.rows)

    def pytest_testnodedown(self, node, error) -> None:
        """The controller: a worker's ledger joins the run's."""
        for module, (cpu, wall, tests) in json.loads(node.workeroutput.get("cost_ledger", "{}")).items():
            row = self.rows.setdefault(module, [0.0, 0.0, 0])
            row[0], row[1], row[2] = row[0] + cpu, row[1] + wall, row[2] + tests

    @pytest.hookimpl(trylast=True)  # after pytest's own summaries: the run's last lines
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workeroutput") or not self.rows:
            return
        write = terminalreporter.write_line
        terminalreporter.write_sep("=", f"cost ledger: the {_SHOWN} costliest test modules in CPU seconds")
        if not self.available:
            write("no /proc on this machine: CPU seconds not counted")
            return
        for tier in ("distributed", "integration", "unit"):
            cpu = sum(r[0] for m, r in self.rows.items() if m.startswith(f"tests/{tier}/"))
            write(f"{tier} tier: {cpu:7.0f} CPU-s")
        write(f"all modules: {sum(r[0] for r in self.rows.values()):7.0f} CPU-s over {len(self.rows)} modules")
        write(f"{'CPU-s':>7} {'wall-s':>7} {'tests':>5}  module")
        for module, (cpu, wall, tests) in sorted(self.rows.items(), key=lambda kv: -kv[1][0])[:_SHOWN]:
            write(f"{cpu:7.0f} {wall:7.0f} {tests:5d}  {module}")
