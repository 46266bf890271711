"""The run's story on the console: its opening lines, its closing line, and what the first step
compiled."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from torchmoe.arch.model_args import ModelArgs
from torchmoe.checkpoints.checkpoint import CheckpointManager
from torchmoe.config.datasets import unmasked_examples_note
from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.compile import DynamoCounts
from torchmoe.metrics.metrics import MetricsLogger
from torchmoe.metrics.metrics_records import METRICS_FILE
from torchmoe.metrics.run_logs import LogFile
from torchmoe.plan.dry_run import format_count
from torchmoe.plan.lora import adapter_specs
from torchmoe.training.log import logger
from torchmoe.training.step import StepResult


def say(metrics: MetricsLogger, log_file: LogFile | None, text: str) -> None:
    """`text` on rank 0's console (`MetricsLogger.say`) and in this rank's log file."""
    metrics.say(text)
    if log_file is not None:
        log_file.note(text)


def opening(cfg: JobConfig, model_args: ModelArgs, *, step: int, global_batch_size: int, world_size: int,
            device_type: str, dump_folder: Path, optimizer_lines: Sequence[str] = (),
            threads: tuple[int, str] | None = None) -> str:
    """The run's first console lines: its description, what trains where, where it writes, then
    a CPU run's threads and why (`cpu_threads.cpu_threads`), LoRA's adapters, `optimizer_lines`
    (`Optimization.description`: which parameters which algorithm updates), and a line when
    separate examples (chat data) are packed without document masking."""
    counts = model_args.param_counts()
    tokens = global_batch_size * cfg.training.seq_len
    steps = f"steps {step + 1}-{cfg.training.steps}, {tokens:,} tokens each" if step < cfg.training.steps \
        else f"finished at step {step} already, nothing to train (raise training.steps to train on)"
    line = (f"training {cfg.model.name} {cfg.model.flavor} ({counts['total'] / 1e6:,.1f} M parameters, "
            f"{counts['active'] / 1e6:,.1f} M active) on {world_size} x {device_type}: {steps}; "
            f"writing to {dump_folder}")
    cpu = [f"CPU threads: {threads[0]} ({threads[1]})"] if threads is not None else []
    unmasked = unmasked_examples_note(cfg.training)
    return "\n".join([*([cfg.job.description] if cfg.job.description else []), line, *cpu, *_lora_line(cfg, model_args),
                      *optimizer_lines, *([unmasked] if unmasked else [])])


def _lora_line(cfg: JobConfig, model_args: ModelArgs) -> list[str]:
    """Under LoRA, what trains: the adapters (as the planner counts them), the base frozen."""
    if not cfg.lora.enable:
        return []
    lora = cfg.lora
    adapters = sum(math.prod(spec.shape) for spec in adapter_specs(model_args, lora))
    return [f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.targets)}: {format_count(adapters)} "
            f"adapter parameters train; the base's {format_count(model_args.param_counts()['total'])} are frozen"]


def closing(cfg: JobConfig, result: StepResult | None, *, step: int, first_step: int, seconds: float,
            global_batch_size: int, validation_loss: float | None, checkpoints: CheckpointManager,
            log_file: LogFile | None, dump_folder: Path) -> str:
    """The run's last console line: how far it got (to `step`, from `first_step`, with `result`
    its newest step), its loss, time and throughput, and where its metrics, log files and newest
    checkpoint are."""
    if result is None:
        return f"no step trained; {dump_folder} holds what the run wrote"
    trained = step - first_step
    tokens = trained * global_batch_size * cfg.training.seq_len
    saved = checkpoints.complete_checkpoints() if checkpoints.folder.is_dir() else []
    where = f"metrics in {dump_folder / METRICS_FILE}" + \
        (f", logs in {log_file.path.parent}" if log_file is not None else "") + \
        (f", newest checkpoint {saved[-1][1]}" if saved else "")
    return (f"{'done' if step == cfg.training.steps else 'stopped'}: step {step}/"
            f"{cfg.training.steps}, loss {result.loss:.4f}"
            + (f", validation loss {validation_loss:.4f}" if validation_loss is not None else "")
            + f"; {trained} steps in {seconds:,.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s); {where}")


def chat_report(stats: dict[str, dict[str, int]]) -> str | None:
    """A line of what this rank's chat rows did with their conversations (`DataLoader.chat_stats`:
    per chat source, packed, truncated, dropped, without targets, target tokens), so no
    truncation or drop is silent; None without chat data."""
    if not stats:
        return None
    parts = [f"{name}: {s['packed']:,} conversations packed ({s['truncated']:,} truncated), {s['dropped']:,} "
             f"dropped as longer than a row, {s['unsupervised']:,} without targets, {s['targets']:,} target tokens"
             for name, s in stats.items()]
    return "chat data on this rank: " + "; ".join(parts)


def compile_report(compiled: DynamoCounts, step_s: float, *, rank: int) -> dict[str, float]:
    """Log what the first step compiled; the metrics record's keys for it. Under EP each MoE
    block breaks once, at the split sizes' host read (`distributed/compile.py`)."""
    if rank == 0:
        logger.info("torch.compile: %d graphs, %d graph breaks; the first step took %.1f s, compilation "
                    "included", compiled.graphs, compiled.graph_breaks, step_s)
    return {"compile_graphs": compiled.graphs, "compile_graph_breaks": compiled.graph_breaks,
            "first_step_s": step_s}
