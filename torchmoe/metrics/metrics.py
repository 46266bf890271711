"""Training metrics: metrics.jsonl, a console line with a progress bar, TensorBoard, W&B (reading
metrics.jsonl back, and whether a run may continue a folder's history: `metrics_records.py`).

    metrics = MetricsLogger(job.dump_folder, job_config.metrics, rank=rank, total_steps=steps,
                            peak_flops=device_peak_flops(device, compute_dtype),
                            run_config=dataclasses.asdict(job_config))
    if metrics.should_log(step):
        metrics.log(step, {"loss": loss, "grad_norm": grad_norm, "lr": lr,
                           "tokens_per_sec": global_tps, "tflops": tflops_per_rank,
                           "memory_gib": peak_memory_gib(device)},
                    tokens_per_expert=counts)  # (n_layers, n_experts) or None
    metrics.close()

metrics.jsonl (DESIGN §3, a contract): rank 0 appends one JSON object per step. A step between
logged ones (`record_step`) holds `step, loss, grad_norm, lr, elapsed_s` (and `mtp_loss` with
DeepSeek-V3's multi-token prediction: `loss` is the main next-token loss alone); a logged step (the
first of a process, every log_freq-th, a validated one, the last) also `tokens_per_sec`
(global), `tflops` (achieved per rank), `mfu` (percent of the device's peak dense FLOP/s in the
run's compute dtype; null when the peak is unknown, e.g. on CPU), `memory_gib` (peak per rank),
`moe_imbalance` (max/mean tokens per expert averaged over MoE layers) and, when counts are
given, `tokens_per_expert` (a list per MoE layer); the first step of a run that resumed a
checkpoint also `resumed_from` (the checkpoint's step). `elapsed_s` counts from the logger's
start unless given. Non-finite numbers are written as null so the file stays strict JSON. A
run that continues a dump folder's metrics.jsonl (a resumed checkpoint, a restart before the
first one, a relaunched replica group) drops its records from the step it logs first on, and
appends: each step is in the file once, its latest life's. Records are appended whole or not at
all: one the filesystem refuses (a full disk) is held in memory and written once it can be
(training goes on), up to `_RecordFile.HELD_BYTES`: past that the oldest held are dropped,
counted, and the first record written again says so (`dropped_records`: their count and first and
last steps), as the console does; a run that ends with records still held ends with exit 2 naming
them.

TensorBoard and W&B (`metrics.enable_tensorboard`, `metrics.enable_wandb`; see `wandb_logger`) get
each record's numbers and every MoE layer's `layer_imbalance`; TensorBoard also the per-expert
counts, as histograms.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_writes import append, open_append, write_file
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import WRITE_FIX, path_fault
from torchmoe.config.job_config import Metrics as MetricsConfig
from torchmoe.metrics.metrics_records import METRICS_FILE, not_records, read_record_lines
from torchmoe.metrics.wandb_logger import WandbRun

logger = logging.getLogger(__name__)

# Peak dense FLOP/s per device (bf16 tensor cores, plain fp32), matched against
# torch.cuda.get_device_name() in order (more specific names first). TF32 tensor cores, used for
# fp32 matmuls when torch.get_float32_matmul_precision() is not "highest", run at half the bf16
# rate on every device listed.
_PEAK_FLOPS: list[tuple[str, float, float]] = [
    # name, bf16, fp32
    ("GB200", 2.5e15, 80e12),
    ("B200", 2.25e15, 75e12),
    ("H200", 989e12, 67e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100", 989e12, 67e12),  # SXM
    ("H800", 989e12, 67e12),
    ("A100", 312e12, 19.5e12),
    ("A800", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 30.3e12),
    ("MI325X", 1307e12, 163.4e12),
    ("MI300X", 1307e12, 163.4e12),
]


def device_peak_flops(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """Peak dense FLOP/s of one device for matmuls computing in `dtype` (the run's compute
    dtype): the bf16 tensor-core peak for bf16; for fp32 the plain fp32 peak, or the TF32 one
    when torch lets fp32 matmuls use TF32. None when unknown (CPU, unlisted GPUs)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, bf16, fp32 in _PEAK_FLOPS:
        if key in name:
            if dtype == torch.bfloat16:
                return bf16
            return fp32 if torch.get_float32_matmul_precision() == "highest" else bf16 / 2
    logger.warning("unknown peak FLOP/s for %r; MFU will not be reported", name)
    return None


def peak_memory_gib(device: torch.device | str) -> float:
    """Peak memory of this rank in GiB: CUDA max_memory_allocated, else the process's max RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak-memory window (CUDA; a process's max RSS cannot be reset)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class ThroughputWindow:
    """Tokens per second over the steps since the last log, leaving out this process's first
    step (compilation, allocator and communicator warm-up) unless it is all the window holds."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0
        self.warmup: tuple[float, float] | None = None
        self.started = False

    def add(self, tokens: float, seconds: float) -> None:
        """One step's tokens and seconds (the first `add` is this process's first step)."""
        if not self.started:
            self.started = True
            self.warmup = (tokens, seconds)
        else:
            self.tokens += tokens
            self.seconds += seconds

    def take(self) -> float:
        """The window's tokens per second; starts the next window."""
        tokens, seconds = (self.tokens, self.seconds) if self.seconds else self.warmup
        self.tokens, self.seconds, self.warmup = 0.0, 0.0, None
        return tokens / seconds


def layer_imbalance(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """max / mean tokens per expert of each MoE layer.

    Args:
        tokens_per_expert: (n_layers, n_experts) counts, or (n_experts,) for one layer.

    Returns:
        (n_layers,) float32 on the CPU: 1.0 for perfect balance, n_experts when one expert takes
        every token, NaN for a layer that routed no tokens.
    """
    counts = tokens_per_expert.detach().float().cpu()
    if counts.ndim == 1:
        counts = counts[None]  # (1, n_experts)
    return counts.max(dim=1).values / counts.mean(dim=1)  # 0 / 0 = NaN where nothing was routed


def moe_imbalance(tokens_per_expert: torch.Tensor) -> float:
    """`layer_imbalance` averaged over layers: layers that routed no tokens are skipped; with
    none left the result is 1.0."""
    per_layer = layer_imbalance(tokens_per_expert)
    used = ~per_layer.isnan()
    if not used.any():
        return 1.0
    return per_layer[used].mean().item()


def _summary_writer_cls():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RuntimeError(
            "metrics.enable_tensorboard=true needs the tensorboard package: "
            "pip install 'torchmoe[tensorboard]' (or set metrics.enable_tensorboard=false)"
        ) from e
    return SummaryWriter


def _scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a record other than its step (what TensorBoard and W&B plot): no nulls,
    no per-expert lists."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _number(v: Any) -> Any:
    """A JSON-safe scalar: tensors become Python numbers, non-finite floats null."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _drop_records_from(path: Path, step: int) -> bool:
    """Remove from `path` the records of `step` and after (and the lines that are not records, saying
    so): an earlier life of this run logged them, and this one is about to log them again
    (metrics.jsonl holds each step once). Rewritten to a temporary file and renamed, so a crash
    here loses nothing. Returns whether the file was rewritten."""
    records, skipped = read_record_lines(path)
    kept = [line for _, line, record in records if record["step"] < step]
    if skipped:
        logger.warning("%s: removed from the file", not_records(path, skipped))
    if len(kept) < len(records) or skipped:
        write_file(path, "".join(f"{line}\n" for line in kept))
        return True
    return False


class _RecordFile:
    """metrics.jsonl, appended one whole record at a time (`file_writes.append`). A record the
    filesystem refuses (a full disk) is held in memory, with those after it, and written in order
    with the next record the file takes again: training goes on, the file never holds a torn
    record, and `fault` says why records are held (`MetricsLogger.require_written`). At most
    `HELD_BYTES` are held: past that the oldest go, counted (`dropped`), and the first record the
    file takes again carries their count and steps (`dropped_records`), so a disk full for days
    costs a bounded memory and a known loss.

    An earlier life's records are cut when the first record comes, from its step on: only then
    is the step this process continues from known. A relaunched replica group starts at step 0
    and takes a peer's live state at step N; its records of steps before N, logged before it
    died, are its history (cut at the start, they were lost).
    """

    HELD_BYTES = 64 << 20
    """The records held at most, in bytes (a logged record with tokens_per_expert of 61 layers of
    256 experts is about 100 KB: some 600 of those)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = open_append(path)
        self.held: list[tuple[int, bytes]] = []  # (step, its line), oldest first
        self.held_bytes = 0
        self.dropped: tuple[int, int, int] | None = None  # count, first and last step of the records dropped
        self.fault: OSError | None = None
        self._cut = True  # the earlier life's records from the first record's step on are still there

    def add(self, step: int, line: str) -> None:
        data = line.encode("utf-8")
        self.held.append((step, data))
        self.held_bytes += len(data)
        self.flush()
        while self.held_bytes > self.HELD_BYTES and len(self.held) > 1:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Drop the oldest held record (the file has refused it too long), counting it."""
        step, data = self.held.pop(0)
        self.held_bytes -= len(data)
        count, first, _ = self.dropped or (0, step, step)
        if count == 0:
            logger.warning("%s: the records held back pass %d MiB: the oldest are dropped from the record of step %d "
                           "on (the file will say how many once it takes records again)", self.path,
                           self.HELD_BYTES >> 20, step)
        self.dropped = (count + 1, first, step)

    def flush(self) -> None:
        """Write the held records, oldest first, until the file refuses one."""
        try:
            if self._cut and self.held and self.fd is not None:
                if _drop_records_from(self.path, self.held[0][0]):
                    fd = open_append(self.path)  # the rewrite replaced the file this one appended to
                    os.close(self.fd)
                    self.fd = fd
                self._cut = False
            while self.held and self.fd is not None:
                data = self.held[0][1]
                if self.dropped is not None:  # the first record written after a loss says so
                    count, first, last = self.dropped
                    record = {**json_loads(data.decode("utf-8")), "dropped_records": {"count": count, "first_step": first,
                                                                       "last_step": last}}
                    append(self.fd, json.dumps(record, allow_nan=False).encode("utf-8") + b"\n", self.path)
                    logger.warning("%s takes records again: %d records held back while it could not (steps %d-%d) "
                                   "were dropped; the record of step %d says so", self.path, count, first, last,
                                   self.held[0][0])
                    self.dropped = None
                else:
                    append(self.fd, data, self.path)
                self.held.pop(0)
                self.held_bytes -= len(data)
        except OSError as err:
            if self.fault is None:
                logger.warning("%s: %s: the record of step %d and those after it are held in memory and "
                               "written once the file takes them; training goes on", self.path,
                               err.strerror, self.held[0][0])
            self.fault = err
            return
        if self.fault is not None and not self.held:
            logger.info("%s takes records again: the ones held back are written", self.path)
            self.fault = None

    def close(self) -> None:
        """A last try at the held records, then close the file (what is still held stays in `held`)."""
        if self.fd is not None:
            self.flush()
            os.close(self.fd)
            self.fd = None


class MetricsLogger:
    """Writes metrics on rank 0 (other ranks: every method is a no-op).

    Args:
        dump_folder: job.dump_folder; metrics.jsonl and the TensorBoard and W&B folders go there.
        cfg: the `[metrics]` section.
        rank: global rank of this process.
        total_steps: training.steps, for the progress bar and ETA.
        peak_flops: peak FLOP/s of one device (see `device_peak_flops`); None = no MFU.
        start_step: the step training resumes from (the bar and ETA start there).
        console: where to print; default stdout. The live bar only runs on a terminal;
            otherwise plain lines (with an ETA) are printed.
        run_config: the resolved job config (`dataclasses.asdict(JobConfig)`), the W&B run's
            config (`cfg.enable_wandb`).
    """

    def __init__(
        self,
        dump_folder: str | Path,
        cfg: MetricsConfig,
        *,
        rank: int,
        total_steps: int,
        peak_flops: float | None = None,
        start_step: int = 0,
        console: Console | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.total_steps = total_steps
        self.peak_flops = peak_flops
        self.start_step = start_step
        self._t0 = time.perf_counter()
        # (step, time) of the first step logged: the ETA counts from there, leaving out the first
        # step's loading, compilation and warm-up, which the steps ahead will not repeat.
        self._eta_from: tuple[int, float] | None = None
        self.dump_folder = str(dump_folder)
        self.path = Path(dump_folder) / METRICS_FILE
        self._file: _RecordFile | None = None
        self._tb = None
        self._wandb: WandbRun | None = None
        self._progress: Progress | None = None
        if rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.enable_wandb:  # first: when W&B refuses to start, nothing is open yet
            self._wandb = WandbRun(Path(dump_folder), cfg, run_config=run_config, resuming=start_step > 0)
        self._file = _RecordFile(self.path)
        if cfg.enable_tensorboard:
            self._tb = _summary_writer_cls()(log_dir=str(Path(dump_folder) / cfg.save_tb_folder))
        self.console = console or Console(highlight=False, no_color=cfg.disable_color_printing)
        if self.console.is_terminal and not cfg.disable_color_printing:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step)
            self._progress.start()

    def should_log(self, step: int) -> bool:
        """Log the first step, every log_freq-th and the last (any rank may call this)."""
        return step == 1 or step % self.cfg.log_freq == 0 or step == self.total_steps

    def log(
        self,
        step: int,
        values: Mapping[str, Any],
        *,
        tokens_per_expert: torch.Tensor | None = None,
    ) -> dict[str, Any] | None:
        """Record one step; returns the JSON record (rank 0) or None.

        Args:
            step: the training step just finished.
            values: loss, grad_norm, lr, tokens_per_sec, tflops, memory_gib and any extra
                scalars (floats or 0-dim tensors). mfu, elapsed_s and moe_imbalance are
                derived when absent.
            tokens_per_expert: (n_layers, n_experts) routed-token counts of this step.
        """
        if self.rank != 0:
            return None
        record = self._record(step, values)
        if "mfu" not in record:
            tflops = record.get("tflops")
            record["mfu"] = (
                100.0 * tflops * 1e12 / self.peak_flops if self.peak_flops and tflops is not None else None
            )
        per_layer = None
        if tokens_per_expert is not None:
            per_layer = layer_imbalance(tokens_per_expert).tolist()
            record.setdefault("moe_imbalance", moe_imbalance(tokens_per_expert))
            record["tokens_per_expert"] = tokens_per_expert.detach().cpu().tolist()
        self._file.add(step, json.dumps(record, allow_nan=False) + "\n")
        scalars = _scalars(record)
        if self._tb is not None:
            self._write_tensorboard(step, scalars, tokens_per_expert, per_layer)
        if self._wandb is not None:
            self._wandb.log(step, scalars, per_layer)
        self._print(step, record)
        return record

    def record_step(self, step: int, values: Mapping[str, float]) -> None:
        """Record a step between logged ones in metrics.jsonl only (rank 0): `values` (the loss,
        gradient norm and LR its step read to the host anyway) and `elapsed_s`. The console,
        TensorBoard and W&B keep to the logged steps; the file and `torchmoe report` hold every
        step, at one short line each."""
        if self.rank != 0:
            return
        self._file.add(step, json.dumps(self._record(step, values), allow_nan=False) + "\n")

    def _record(self, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """`step`, `values` as JSON numbers (non-finite: null) and `elapsed_s` unless given."""
        record: dict[str, Any] = {"step": step, **{k: _number(v) for k, v in values.items()}}
        record.setdefault("elapsed_s", round(time.perf_counter() - self._t0, 3))
        return record

    def _write_tensorboard(self, step: int, scalars: dict[str, float], counts: torch.Tensor | None,
                           per_layer: list[float] | None) -> None:
        for k, v in scalars.items():
            self._tb.add_scalar(f"train/{k}", v, step)
        if counts is not None:
            counts = counts.detach().float().cpu()
            for layer, row in enumerate(counts.reshape(-1, counts.shape[-1])):  # row: (n_experts,)
                self._tb.add_histogram(f"moe/tokens_per_expert/layer{layer}", row, step)
                self._tb.add_scalar(f"moe/imbalance/layer{layer}", per_layer[layer], step)
        self._tb.flush()

    def _print(self, step: int, r: dict[str, Any]) -> None:
        width = len(str(self.total_steps))
        parts = [f"[bold]step {step:>{width}}/{self.total_steps}[/]"]

        def add(key: str, fmt: str, style: str) -> None:
            if r.get(key) is not None:
                parts.append(f"[{style}]{fmt.format(r[key])}[/]")

        add("loss", "loss {:.4f}", "cyan")
        add("mtp_loss", "mtp {:.4f}", "cyan")
        add("validation_loss", "val {:.4f}", "bold cyan")
        add("grad_norm", "grad {:.3f}", "magenta")
        add("lr", "lr {:.2e}", "white")
        add("tokens_per_sec", "{:,.0f} tok/s", "green")
        if r.get("tflops") is not None:  # GFLOP/s below 1 TFLOP/s: a CPU's rate read "0.0 TFLOP/s"
            parts.append(f"[green]{_flops(r['tflops'])}[/]")
        add("mfu", "MFU {:.1f}%", "green")
        add("memory_gib", "mem {:.2f} GiB", "yellow")
        # The busiest expert's tokens over the mean (1.00: balanced), averaged over the MoE layers.
        add("moe_imbalance", "expert max/mean {:.2f}", "red")
        sources = {k[len("tokens/"):]: v for k, v in r.items() if k.startswith("tokens/")}
        if sources:  # a mixture: each source's share of the tokens so far
            total = sum(sources.values()) or 1
            parts.append("[blue]" + " ".join(f"{name} {100 * n / total:.0f}%" for name, n in sources.items()) + "[/]")
        if self._progress is not None:
            self._progress.update(self._task, completed=step)
        elif self._eta_from is None:
            self._eta_from = (step, time.perf_counter())
        elif step < self.total_steps:
            first, since = self._eta_from
            eta = (time.perf_counter() - since) / (step - first) * (self.total_steps - step)
            parts.append(f"eta {_duration(eta)}")
        # soft_wrap: one line per step even when the console is not a terminal (80 columns).
        self.console.print("  ".join(parts), soft_wrap=True)

    def say(self, text: str) -> None:
        """Print `text` on rank 0's console (above the progress bar), as the run's own lines."""
        if self.rank == 0:
            self.console.print(text, soft_wrap=True, markup=False)

    def close(self) -> None:
        """Stop the progress bar and close metrics.jsonl, TensorBoard and the W&B run (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._file is not None:
            self._file.close()

    def require_written(self) -> None:
        """Call once the run is done (after `close`): every record is in metrics.jsonl.

        Raises:
            ConfigError: records are still held (the file refused them to the end: a full disk),
                naming the OS's reason and the steps whose records are missing.
        """
        if self._file is None or not self._file.held:
            return
        first, last = self._file.held[0][0], self._file.held[-1][0]
        which = f"record of step {first}" if first == last else f"records of steps {first}-{last}"
        if self._file.dropped is not None:  # held past HELD_BYTES: the oldest went
            count, since, before = self._file.dropped
            which = f"{count} records of steps {since}-{before} (dropped, past {self._file.HELD_BYTES >> 20} MiB " \
                    f"held) and the {which}"
        fault = path_fault("job.dump_folder", self.dump_folder, self._file.fault, WRITE_FIX)
        raise ConfigError(fault.key, fault.value, f"{fault.problem}: the {which} could not be written (training and "
                          "its checkpoints went on)", fault.fix)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flops(tflops: float) -> str:
    """An achieved rate per rank for the console: TFLOP/s from 1 up, else GFLOP/s (3 digits)."""
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.3g} GFLOP/s"


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
