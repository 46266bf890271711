"""Which trained weights `torchmoe generate` and `torchmoe eval` read: a folder named on the
command line, or the newest checkpoint of the job's own run.

    folder, in_hf = trained_weights(cfg, "--checkpoint", path="", step=None)

`path` may be a run's `step-N/` folder, any DCP folder of the model (`torchmoe convert
hf-to-dcp`'s output, a seed checkpoint) or a Hugging Face folder (config.json + safetensors, told
apart by its config.json). Without it, the job's `<job.dump_folder>/<checkpoint.folder>/` gives
its newest complete checkpoint, or step-`step`. The folder is read, never written.
"""

from __future__ import annotations

from pathlib import Path

from torchmoe.components.checkpoint import complete_checkpoints
from torchmoe.config.errors import ConfigError
from torchmoe.config.flags import Integer
from torchmoe.config.job_config import JobConfig
from torchmoe.config.numbers import INT64_MAX

__all__ = ["STEP", "trained_weights"]

STEP = Integer(0, INT64_MAX, "100", fix="name a saved step (a step-N folder), or leave --step out for the newest")
"""The `--step` flag of the commands that read trained weights."""


def trained_weights(cfg: JobConfig, key: str, *, path: str, step: int | None) -> tuple[Path, bool]:
    """(folder, whether it is a Hugging Face folder) of the weights to read.

    Args:
        key: the flag that named `path`, for messages (``--checkpoint``).
        path: a checkpoint folder, or "" for the job's own newest (or step `step`).

    Raises:
        ConfigError: `path` is not a folder of weights; the job has no complete checkpoint (at
            `step`); `step` given with `path`.
    """
    if path:
        if step is not None:
            raise ConfigError("--step", step, f"picks a checkpoint of the job's run, and {key} names one already",
                              f"pass {key} or --step, not both")
        folder = Path(path)
        if (folder / "config.json").is_file():
            return folder, True
        if (folder / ".metadata").is_file():
            return folder, False
        raise ConfigError(key, path, "is neither a DCP checkpoint folder (no .metadata file) nor a Hugging Face "
                          "folder (no config.json)", "point it at a run's step-N folder, the output of "
                          "`torchmoe convert hf-to-dcp`, or a Hugging Face model folder")
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    found = complete_checkpoints(folder)
    if step is not None:
        found = [(n, p) for n, p in found if n == step]
    if not found:
        saved = ", ".join(f"step-{n}" for n, _ in complete_checkpoints(folder)) or "none"
        which = f"no complete checkpoint step-{step}" if step is not None else "no complete checkpoint"
        raise ConfigError(key, "(not given)", f"{which} in {folder} (found: {saved})",
                          f"pass {key} FOLDER, or --config the job file (and --job.dump_folder) of a run that "
                          "saved checkpoints (checkpoint.enable = true)")
    return found[-1][1], False
