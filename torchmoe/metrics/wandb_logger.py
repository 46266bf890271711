"""Weights & Biases tracking, for `MetricsLogger` (rank 0, `metrics.enable_wandb = true`).

    run = WandbRun(dump_folder, cfg.metrics, run_config=dataclasses.asdict(job_config),
                   resuming=start_step > 0)
    run.log(step, scalars, layer_imbalance)   # the numbers of one metrics.jsonl record
    run.close()

What W&B gets: the resolved job config as the run's config; at each logged step every number of
the metrics.jsonl record as `train/<key>` (nulls left out; `validation_loss` as
`validation/loss`) and, with routed-token counts, each MoE
layer's max/mean tokens per expert as `moe/imbalance/layer<i>` (the raw counts stay in
metrics.jsonl: a histogram per layer per step would outweigh everything else in the run).

A resumed run continues the same W&B run: the id is kept in `<dump_folder>/wandb_run_id` and
passed with `resume="allow"`. A run starting at step 0 is a new run (metrics.jsonl starts over
too), so it gets a new id. Steps that a killed run logged after its last checkpoint keep their
first values in W&B, which ignores a step it already has (metrics.jsonl holds the new ones).
W&B keeps its files under `<dump_folder>/wandb`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_writes import write_file
from torchmoe.config.job_config import Metrics as MetricsConfig

__all__ = ["RUN_ID_FILE", "WANDB_FOLDER", "WandbRun", "run_id"]

RUN_ID_FILE = "wandb_run_id"
# wandb.init(dir=D) writes under D/wandb; the name is W&B's.
WANDB_FOLDER = "wandb"


def run_id(dump_folder: Path, *, resuming: bool) -> str:
    """The W&B run id of this run: the one in `<dump_folder>/wandb_run_id` when resuming and
    it exists, else a new one, written there (atomically: a kill leaves the old id or the new)."""
    path = dump_folder / RUN_ID_FILE
    if resuming and path.is_file():
        kept = path.read_text(encoding="utf-8").strip()
        if kept:
            return kept
    new = secrets.token_hex(4)  # W&B ids: up to 64 characters of [a-z0-9_-]
    write_file(path, new + "\n")
    return new


class WandbRun:
    """One W&B run of a training job.

    Args:
        dump_folder: job.dump_folder.
        cfg: the `[metrics]` section (project, run name, tags).
        run_config: the resolved job config (`dataclasses.asdict(JobConfig)`), the run's config.
        resuming: the job resumes from a checkpoint: continue the W&B run it started.
    """

    def __init__(self, dump_folder: Path, cfg: MetricsConfig, *, run_config: Mapping[str, Any] | None,
                 resuming: bool) -> None:
        import wandb  # an optional extra: preflight refuses enable_wandb without it

        try:
            self.run = wandb.init(
                # None lets W&B's own environment variables decide (WANDB_PROJECT, WANDB_TAGS).
                project=cfg.wandb_project or None,
                name=cfg.wandb_run_name or os.environ.get("WANDB_NAME") or dump_folder.resolve().name,
                tags=cfg.wandb_tags or None,
                config=dict(run_config or {}),
                id=run_id(dump_folder, resuming=resuming),
                resume="allow",
                dir=str(dump_folder),
            )
        except wandb.errors.Error as err:  # not logged in, W&B unreachable, a project it refuses
            raise ConfigError("metrics.enable_wandb", True, f"W&B did not start: {err}",
                              "log in with `wandb login` (or set WANDB_API_KEY), log locally with "
                              "WANDB_MODE=offline, or set metrics.enable_wandb = false") from None

    def log(self, step: int, scalars: Mapping[str, float], layer_imbalance: Sequence[float] | None) -> None:
        """Log one step.

        Args:
            scalars: the numbers of its metrics.jsonl record, without the step and nulls.
            layer_imbalance: max/mean tokens per expert of each MoE layer (n_layers values,
                NaN for a layer that routed nothing), or None.
        """
        # validation_loss is W&B's validation/loss, beside the training curves under train/.
        data = {"validation/loss" if k == "validation_loss" else f"train/{k}": v for k, v in scalars.items()}
        for layer, value in enumerate(layer_imbalance or ()):
            data[f"moe/imbalance/layer{layer}"] = value
        self.run.log(data, step=step)

    def close(self) -> None:
        """Finish the run (W&B flushes it to its files, or uploads it)."""
        self.run.finish()
