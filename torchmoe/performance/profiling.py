"""torch.profiler traces and CUDA memory snapshots, every `profile_freq` steps.

    with maybe_profile(job_config.profiling, job.dump_folder, rank=rank, start_step=step) as prof, \\
         maybe_memory_snapshot(job_config.profiling, job.dump_folder, rank=rank, start_step=step) as mem:
        for step in range(step + 1, steps + 1):
            train_step(...)
            prof.step()
            mem.step()

Traces: `<dump_folder>/<save_traces_folder>/iteration_<N>/rank<r>_trace.json` (open in
chrome://tracing or https://ui.perfetto.dev), one per traced step N = profile_freq, 2*profile_freq...
Step breakdowns (`enable_step_breakdown`, `step_breakdown.py`): `rank<r>_breakdown.json` in the
same folder, and the table in rank 0's log.
Memory snapshots: `<dump_folder>/<save_memory_snapshot_folder>/iteration_<N>/rank<r>_memory_snapshot.pickle`
(drag into https://pytorch.org/memory_viz); an exception inside the block (e.g. CUDA OOM) dumps
`iteration_<N>_exit/` before propagating.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from torchmoe import _torch_private as private
from torchmoe.config.files.file_writes import os_cause, write_fault, write_file
from torchmoe.config.job_config import Profiling as ProfilingConfig
from torchmoe.performance.step_breakdown import format_breakdown, step_breakdown

logger = logging.getLogger(__name__)

# Entries of allocation history kept for a memory snapshot (about the last few steps' worth).
_MEMORY_HISTORY_ENTRIES = 100_000


class _NoOp:
    def step(self) -> None:
        """Nothing to record."""


class _Profiler:
    """Steps a torch.profiler whose step numbers are training steps."""

    def __init__(self, prof: profile) -> None:
        self._prof = prof

    def step(self) -> None:
        """Call once after every training step."""
        self._prof.step()


@contextlib.contextmanager
def maybe_profile(
    cfg: ProfilingConfig, dump_folder: str | Path, *, rank: int, start_step: int = 0
) -> Iterator[_Profiler | _NoOp]:
    """Yield an object whose `step()` the loop calls after each training step.

    When `cfg.enable_profiling` or `cfg.enable_step_breakdown`, each cycle of `cfg.profile_freq`
    steps traces its last `cfg.profiler_active` steps (with the default 1: every step N that is a
    multiple of profile_freq), after up to `cfg.profiler_warmup` warmup steps (the profiler's own
    start-up cost would otherwise show in the trace). The trace folder is named by the cycle's
    last step; it gets the trace (enable_profiling) and the traced steps' breakdown
    (enable_step_breakdown).

    Args:
        cfg: the `[profiling]` section.
        dump_folder: job.dump_folder.
        rank: global rank, part of the trace file name.
        start_step: the step training resumes from, so trace folders are named by true step.
    """
    if not (cfg.enable_profiling or cfg.enable_step_breakdown):
        yield _NoOp()
        return
    folder = Path(dump_folder) / cfg.save_traces_folder
    active = cfg.profiler_active
    warmup = min(cfg.profiler_warmup, cfg.profile_freq - active)
    wait = cfg.profile_freq - warmup - active
    base = schedule(wait=wait, warmup=warmup, active=active)

    def on_trace_ready(prof: profile) -> None:
        # prof.step_num counts step() calls; it equals the training step just traced.
        step = prof.step_num + start_step
        out = folder / f"iteration_{step}"
        trace = out / f"rank{rank}_trace.json"
        with _skipped_if_refused(f"the profiler trace of step {step}", trace):
            out.mkdir(parents=True, exist_ok=True)
            if cfg.enable_profiling:
                t0 = time.perf_counter()
                _export_trace(prof, trace)
                logger.info("profiler trace of step %d written to %s in %.1fs", step, out, time.perf_counter() - t0)
            if cfg.enable_step_breakdown:
                table = step_breakdown(prof.events()).to_dict()
                write_file(out / f"rank{rank}_breakdown.json",
                           json.dumps({"rank": rank, "step": step, **table}, indent=2) + "\n")
                if rank == 0:
                    logger.info("rank 0, traced steps to step %d (every rank's in %s):\n%s", step, out,
                                format_breakdown(table))

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    # The schedule sees training-step indices (0-based) so that the traced steps stay multiples
    # of profile_freq after a resume.
    with profile(
        activities=activities,
        schedule=lambda i: base(i + start_step),
        on_trace_ready=on_trace_ready,
        record_shapes=cfg.enable_profiling,  # shapes are for the trace; the breakdown needs none
    ) as prof:
        yield _Profiler(prof)


class _MemorySnapshotter:
    def __init__(self, folder: Path, freq: int, rank: int, start_step: int) -> None:
        self.folder = folder
        self.freq = freq
        self.rank = rank
        self.step_num = start_step

    def step(self) -> None:
        """Call once after every training step; dumps a snapshot every profile_freq steps."""
        self.step_num += 1
        if self.step_num % self.freq == 0:
            self.dump(f"iteration_{self.step_num}")

    def dump(self, name: str) -> None:
        out = self.folder / name
        snapshot = out / f"rank{self.rank}_memory_snapshot.pickle"
        with _skipped_if_refused(f"the memory snapshot {name}", snapshot):
            out.mkdir(parents=True, exist_ok=True)
            private.dump_memory_snapshot(str(snapshot))
            logger.info("memory snapshot written to %s", out)


def _export_trace(prof: profile, trace: Path) -> None:
    """`prof`'s chrome trace to `trace`. Kineto writes it to `<trace>.tmp` and renames that, but a
    write the filesystem refuses (a full disk) it ignores, leaving no trace and an empty `.tmp`:
    that is an `OSError` here, with the free space (kineto gives no reason).

    Raises:
        OSError: no trace was written.
    """
    prof.export_chrome_trace(str(trace))
    if not trace.exists():
        Path(f"{trace}.tmp").unlink(missing_ok=True)
        st = os.statvfs(trace.parent)
        raise OSError(errno.EIO, f"the profiler wrote none and does not say why; {st.f_bavail * st.f_frsize // 1024} "
                      "KiB are free there", str(trace))


@contextlib.contextmanager
def _skipped_if_refused(what: str, partial: Path) -> Iterator[None]:
    """Traces and snapshots are diagnostics: one the filesystem refuses (a full disk) is skipped
    with one warning and its partial file removed; training goes on."""
    try:
        yield
    except Exception as err:
        if os_cause(err) is None:
            raise
        partial.unlink(missing_ok=True)
        logger.warning("%s was not written (%s): skipped; training goes on", what, write_fault(err))


@contextlib.contextmanager
def maybe_memory_snapshot(
    cfg: ProfilingConfig, dump_folder: str | Path, *, rank: int, start_step: int = 0
) -> Iterator[_MemorySnapshotter | _NoOp]:
    """Record the CUDA allocator's history and dump snapshots every `cfg.profile_freq` steps.

    A no-op (with one info message) when disabled or without CUDA: the CPU allocator keeps no
    such history.
    """
    if not cfg.enable_memory_snapshot:
        yield _NoOp()
        return
    if not torch.cuda.is_available():
        logger.info("profiling.enable_memory_snapshot: needs CUDA; no memory snapshots on CPU")
        yield _NoOp()
        return
    snap = _MemorySnapshotter(
        Path(dump_folder) / cfg.save_memory_snapshot_folder, max(cfg.profile_freq, 1), rank, start_step
    )
    private.record_memory_history(True, _MEMORY_HISTORY_ENTRIES)
    try:
        yield snap
    except BaseException:
        # The history right before a failure (typically an OOM) is the most useful one.
        snap.dump(f"iteration_{snap.step_num + 1}_exit")
        raise
    finally:
        private.record_memory_history(False)
