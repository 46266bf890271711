"""Which trained weights `torchmoe generate` and `torchmoe eval` read: a folder named on the
command line, or the newest checkpoint of the job's own run.

    folder, in_hf = trained_weights(cfg, "--checkpoint", path="", step=None)

    cfg, changed = with_weights_model(cfg, folder, in_hf, flag_keys={"model.attn_backend"})

`path` may be a run's `step-N/` folder, any DCP folder of the model (`torchmoe convert
hf-to-dcp`'s output, a seed checkpoint) or a Hugging Face folder (config.json + safetensors, told
apart by its config.json). Without it, the job's `<job.dump_folder>/<checkpoint.folder>/` gives
its newest complete checkpoint, or step-`step`. The folder is read, never written.

The weights say which model they are where they can (`weights_model`): a run's `step-N/` through
the run's own config.toml, a Hugging Face folder through its config.json. The commands that read
them take the model from there (`with_weights_model`) rather than asking for it again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchmoe.components.checkpoint import complete_checkpoints
from torchmoe.components.flavor_fit import matching_flavor
from torchmoe.components.hf_storage import read_hf_args
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.flags import Integer
from torchmoe.config.job_config import JobConfig, Model
from torchmoe.config.loader import load_toml_config
from torchmoe.config.numbers import INT64_MAX

__all__ = ["STEP", "run_config_file", "trained_weights", "weights_model", "with_weights_model"]

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


def run_config_file(folder: Path) -> Path | None:
    """The config.toml of the run whose checkpoint `folder` is (``<dump>/<checkpoint.folder>/step-N``
    with that run's relative checkpoint.folder), or None (any other folder).

    Raises:
        ConfigError: that config.toml cannot be read (named as ``--checkpoint``'s).
    """
    run = folder.parent.parent
    candidate = run / "config.toml"
    if not candidate.is_file():
        return None
    ckpt = load_toml_config(candidate, key="--checkpoint").checkpoint.folder
    return candidate if not Path(ckpt).is_absolute() and (run / ckpt).resolve() == folder.parent.resolve() else None


def weights_model(folder: Path, in_hf: bool) -> tuple[Model, str] | None:
    """The `[model]` section the weights in `folder` were trained with, and the file it was read
    from: the run's config.toml for a run's step-N folder (`run_config_file`), or a Hugging Face
    folder's config.json: its family, the built-in flavor with its architecture and the folder as
    the tokenizer when it holds a tokenizer.json. None when the folder does not tell (a bare DCP
    folder), or no built-in flavor has the config's architecture (the load then names the fix).

    Raises:
        ConfigError: the config.toml or config.json cannot be read or used.
    """
    if in_hf:
        args = read_hf_args(folder, key="--checkpoint", fix="point it at a Hugging Face folder of a family torchmoe "
                            "trains (config.json + *.safetensors)")
        flavor = matching_flavor(args)
        if flavor is None:
            return None
        tokenizer = str(folder) if (folder / "tokenizer.json").is_file() else ""
        return Model(name=args.family, flavor=flavor, tokenizer_path=tokenizer), str(folder / "config.json")
    toml = run_config_file(folder)
    return None if toml is None else (load_toml_config(toml, key="--checkpoint").model, str(toml))


def with_weights_model(cfg: JobConfig, folder: Path, in_hf: bool, *, flag_keys: set[str]) -> tuple[JobConfig, str]:
    """`cfg` with the model of the weights in `folder` (`weights_model`), but the `[model]` keys the
    command line set by name (`flag_keys`, ``model.flavor``...); and a note naming the keys that
    changed and where the model was read ("" when none did, or the weights do not tell). A Hugging
    Face folder without a tokenizer.json keeps the job's tokenizer."""
    found = weights_model(folder, in_hf)
    if found is None:
        return cfg, ""
    model, source = found
    keep = {name for name in (f.name for f in dataclasses.fields(Model)) if f"model.{name}" in flag_keys}
    if in_hf:  # config.json holds the architecture only: the job's other settings stand
        keep |= {f.name for f in dataclasses.fields(Model)} - {"name", "flavor", "tokenizer_path"}
        if not model.tokenizer_path:
            keep.add("tokenizer_path")
    model = dataclasses.replace(model, **{name: getattr(cfg.model, name) for name in keep})
    changed = [f"model.{f.name} = {show_value(getattr(model, f.name))}" for f in dataclasses.fields(Model)
               if getattr(model, f.name) != getattr(cfg.model, f.name)]
    note = f"the model is the weights' own, from {source}: {', '.join(changed)}" if changed else ""
    return dataclasses.replace(cfg, model=model), note
