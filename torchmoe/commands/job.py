"""The job a command runs: its job file and `--section.key` overrides, each section checked, and
the world size it runs on; for `generate` and `eval`, the trained weights and the job they were
trained by (`checkpoint_job`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from torchmoe.config import ConfigError, JobConfig, load_job_config, validate_sections
from torchmoe.config.files.paths import replica_group_config
from torchmoe.config.job_config import Parallelism
from torchmoe.config.launch_env import launch_int
from torchmoe.config.loader import CONFIG_FLAGS

if TYPE_CHECKING:
    from torchmoe.weight_sources.trained_weights import TrainedWeights


def _env_world_size() -> int | None:
    return launch_int("WORLD_SIZE", 1) if "WORLD_SIZE" in os.environ else None


def _degree_product(parallelism: Parallelism) -> int:
    """The world size the degrees describe, counting dp_shard = -1 as 1 (for the dry-run)."""
    degrees = (parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree,
               parallelism.context_parallel_degree, parallelism.tensor_parallel_degree,
               parallelism.pipeline_parallel_degree)
    # Invalid degrees count as 1 here so that validation reports them by name.
    return math.prod(max(d, 1) for d in degrees)


def resolve_world_size(flag: int | None, dry_run: bool, parallelism: Parallelism) -> int:
    """World size for `train`: `--world-size`, else WORLD_SIZE, else (dry-run) the degrees' product.

    A real run always uses the launched world (WORLD_SIZE, or 1 without torchrun), so a
    `--world-size` that disagrees with it is an error rather than silently ignored.
    """
    env = _env_world_size()
    if dry_run:
        if flag is not None:
            return flag
        return env if env is not None else _degree_product(parallelism)
    launched = env if env is not None else 1
    if flag is not None and flag != launched:
        raise ConfigError("--world-size", flag, f"this run was launched with {launched} process(es) (WORLD_SIZE)",
                          "use --world-size only with --dry-run; launch a real run with torchrun --nproc-per-node N")
    return launched


_FILE_FIX = ("pass a job file: --config configs/debug_model.toml is the tiny job (CPU, 21 s); configs/ holds the "
             "others (an empty .toml file trains the defaults)")


def job_config(config_argv: list[str], prog: str, description: str, *,
                require_file: Callable[[JobConfig], str] | None = None, fix: str = _FILE_FIX,
                set_keys: set[str] | None = None, runs_with: Mapping[str, Any] | None = None) -> JobConfig | int:
    """The job file and overrides of `config_argv`, each section checked; an int when --help was
    printed (the exit status). Notes (torchtitan keys mapped, settings of the file without
    effect) are printed once, by rank 0.

    Args:
        require_file: what the command would do with the defaults, when it needs a job file (a
            missing --config is then a `ConfigError`, with `fix`).
        set_keys: filled with the keys the file and the flags set.
        runs_with: settings the command applies whatever the job says (`load_job_config`).
    """
    notes: list[str] = []
    try:
        cfg = load_job_config(config_argv, prog=prog, description=description, notes=notes, set_keys=set_keys,
                              runs_with=runs_with)
    except SystemExit as exit_:  # --help was printed
        return int(exit_.code or 0)
    if os.environ.get("RANK") in (None, "0"):  # the same on every rank: rank 0 says it once
        for note in notes:
            Console(stderr=True, soft_wrap=True, highlight=False).print(f"[yellow]warning:[/] {escape(note)}")
    validate_sections(cfg)  # answers a typo at once: what follows imports torch and the model
    if require_file is not None and not any(token.partition("=")[0] in CONFIG_FLAGS for token in config_argv):
        raise ConfigError("--config", "(not given)", f"without a job file torchmoe would {require_file(cfg)}", fix)
    return cfg


def _needs_a_run(cfg: JobConfig) -> str:
    return f"read the newest checkpoint of {cfg.job.dump_folder}/, which holds no run (no config.toml)"


_WEIGHTS_FIX = ("name the weights: --job.dump_folder of a run that saved checkpoints (its config.toml gives the "
                "model), --checkpoint FOLDER (a run's step-N, a Hugging Face folder or a PEFT adapter folder), or a "
                "job file: --config FILE")


def checkpoint_job(config_argv: list[str], prog: str, description: str, *, checkpoint: str,
                   step: int | None, base: str = "",
                   runs_with: Mapping[str, Any] | None = None) -> tuple[JobConfig, TrainedWeights] | int:
    """The job whose trained weights `generate` and `eval` read, and the weights
    (`trained_weights`: a folder, what it is, the run it is a checkpoint of); an int when --help
    was printed.

    Without a job file the job is the run's own config.toml: that of the run whose step-N
    `checkpoint` is, else that of `--job.dump_folder`. The model, and the adapters over it, are
    the weights' own wherever they tell it (`with_weights_model`: a run's config.toml and the
    Hugging Face folder it started from, a Hugging Face config.json, a PEFT adapter on its `base`),
    but for the `--model.*` flags given; a job file that says otherwise gets one note. Under fault
    tolerance the dump folder is the replica group's own (`replica_group_config`). `runs_with`:
    the settings the command applies whatever the job says (`load_job_config`).
    """
    from torchmoe.weight_sources.trained_weights import run_config_file, trained_weights, with_weights_model

    if not any(token.partition("=")[0] in CONFIG_FLAGS for token in config_argv):
        run = run_config_file(Path(checkpoint)) if checkpoint else None
        if run is None and not checkpoint and not any(token in ("-h", "--help") for token in config_argv):
            own = Path(load_job_config(config_argv, notes=[], runs_with=runs_with).job.dump_folder) / "config.toml"
            run = own if own.is_file() else None
        if run is not None:
            config_argv = ["--config", str(run), *config_argv]
    cfg = job_config(config_argv, prog, description, require_file=None if checkpoint else _needs_a_run,
                     fix=_WEIGHTS_FIX, runs_with=runs_with)
    if isinstance(cfg, int):
        return cfg
    cfg = replica_group_config(cfg)
    weights = trained_weights(cfg, "--checkpoint", path=checkpoint, step=step, base=base)
    flags = {token[2:].partition("=")[0].replace("-", "_") for token in config_argv if token.startswith("--model.")}
    cfg, note = with_weights_model(cfg, weights, flag_keys=flags)
    if note and os.environ.get("RANK") in (None, "0"):
        Console(stderr=True, soft_wrap=True, highlight=False).print(f"[yellow]note:[/] {escape(note)}")
    return cfg, weights
