"""A run that starts from a Hugging Face folder builds the model its config.json describes.

    cfg = with_folder_model(cfg, set_keys=set_keys)   # torchmoe train / plan, before the preflight
    cfg = with_folder_model(cfg, key="--checkpoint")  # eval / generate on a Hugging Face folder
    cfg = run_folder_model(run_cfg)                   # what a finished run trained (eval, generate, convert)

With ``checkpoint.initial_load_in_hf``, the folder decides the model: any checkpoint of a family
torchmoe trains, of any size, not only the shipped flavors (`model.flavor` sizes runs from
scratch). The `[model]` section becomes an `arch.registry.FolderModel` holding the folder's
architecture, which every later step (preflight, dry run, planner, trainer) reads through
`model_args_from_config`, as it reads a flavor's.

The job may still name the model; what it names must be the folder's, or the run is refused
(exit 2) rather than guessed at: `model.name` set to another family, or `model.flavor` set to a
flavor whose architecture is not the folder's (a demanding user who wrote ``30B-A3B`` and points
at another checkpoint has the wrong folder or the wrong job). Left at their defaults, they are no
claim and the folder's family and architecture are used. `eval` and `generate --checkpoint`
judge the weights they are pointed at, with the run's job file for context: there the folder
decides without a check.

A LoRA run with `lora.checkpoint_base` keeps the folder's config.json, generation config and
tokenizer files in its `base/`: once the folder is gone, its model, tokenizer and
`hf_assets_path` are the copy's (its resume and every reader of it need the folder no more). A
run that kept no copy is refused by name (`start_gone`) by whatever reads it: a resume, a report,
`run_folder_model`'s readers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection
from pathlib import Path

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import FLAVORS, FolderModel, check_model, model_args_from_config
from torchmoe.checkpoints.checkpoint import complete_checkpoints, saved_base
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.files.paths import path_faults, source_key
from torchmoe.config.job_config import JobConfig, Model
from torchmoe.hf_files.hf_storage import read_hf_args
from torchmoe.models.registry import family_titles, hf_mapping
from torchmoe.weights.flavor_fit import matching_flavor

__all__ = ["base_config_folder", "folder_flavor", "hf_folder", "run_folder_model", "start_gone", "with_folder_model"]

logger = logging.getLogger(__name__)


def with_folder_model(cfg: JobConfig, *, set_keys: Collection[str] | None = None, key: str = "",
                      absent_ok: bool = False) -> JobConfig:
    """`cfg` with its `[model]` built from the Hugging Face folder a run starts from
    (``checkpoint.initial_load_in_hf`` with ``checkpoint.initial_load_path``); `cfg` itself
    otherwise, or when that is done already.

    Args:
        set_keys: the keys the job file and the flags set (`config.load_job_config`'s): a
            `model.name` or `model.flavor` among them must agree with the folder. None: the
            folder decides without a check (`eval`, `generate`).
        key: the setting that named the folder, for messages (default: the one that did,
            ``checkpoint.initial_load_path`` or ``model.hf_assets_path``).
        absent_ok: a folder without config.json on this machine leaves `cfg` as it is (its
            flavor): the dry run and the planner plan a job for machines that hold the folder.

    Raises:
        ConfigError: config.json is missing or holds what the family cannot represent (naming
            the field, its value and the fix: `hf_files.hf_storage.read_hf_args`), or a set
            `model.name` / `model.flavor` contradicts it; the folder of a run that saved
            checkpoints (a resume, a report) is gone, and its flavor is no built-in one to plan
            instead (`start_gone`).
    """
    ckpt = cfg.checkpoint
    if not (ckpt.initial_load_in_hf and ckpt.initial_load_path) or isinstance(cfg.model, FolderModel):
        return cfg
    key = key or source_key(cfg, "checkpoint.initial_load_path")
    folder = Path(ckpt.initial_load_path)
    saved = saved_base(Path(cfg.job.dump_folder) / ckpt.folder)
    fields = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(Model)}
    if not (folder / "config.json").is_file() and saved is not None and (saved / "config.json").is_file():
        # A LoRA run's own copy of the base (`lora.checkpoint_base`) holds the folder's config.json:
        # its resume needs the folder no more (the trainer loads the base from there too).
        logger.info("%s %s holds no config.json here: the model is the run's saved base's, %s", key, folder, saved)
        folder = saved
        fields |= _saved_copies(cfg.model, saved)
    if not (folder / "config.json").is_file():
        planned = absent_ok and cfg.model.flavor in FLAVORS.get(cfg.model.name, {})
        if not planned and complete_checkpoints(Path(cfg.job.dump_folder) / ckpt.folder):
            raise start_gone(cfg)  # a run of the folder's model (its resume, a report), which nothing describes now
        if absent_ok:
            logger.warning("%s %s holds no config.json here: planning model.flavor %s", key, folder, cfg.model.flavor)
            return cfg
    if not folder.is_dir():  # the OS says first what is wrong with the path
        with path_faults(key, str(folder), f"point it at {_wanted(cfg.model)}, or leave it empty to start from "
                         "random weights"):
            os.listdir(folder)
    fix = (f"use a checkpoint of a family torchmoe trains ({family_titles()}) in a form it computes exactly "
           "(docs/models.md lists, family by family, the config.json settings it reads and those it refuses)")
    args = read_hf_args(folder, key=key, fix=fix)
    given = set_keys or ()
    if "model.name" in given:
        _require_family(cfg.model, args, key, folder)
    label = folder_flavor(args, Path(ckpt.initial_load_path))  # the run's name for it, wherever config.json was
    if "model.flavor" in given and cfg.model.flavor != label:
        check_model(args.family, cfg.model.flavor)  # a flavor of the folder's family, or the error says whose
        _require_flavor(cfg.model.flavor, args, key, folder)
    model = FolderModel(**{**fields, "name": args.family, "flavor": label}, architecture=args, source=str(folder))
    logger.info("model: %s from %s/config.json (%.1f M parameters)", hf_mapping(args).title, folder,
                args.param_counts()["total"] / 1e6)
    return dataclasses.replace(cfg, model=model)


def _saved_copies(model: Model, saved: Path) -> dict[str, str]:
    """The `[model]` paths that the run's saved base `saved` stands for once the folder they named
    is gone: the tokenizer, whose files it keeps (`Checkpoints.load_initial_weights`), and
    `hf_assets_path`, which filled the paths it now holds."""
    copies = {}
    if model.tokenizer_path and not os.path.exists(model.tokenizer_path) and (saved / "tokenizer.json").is_file():
        copies["tokenizer_path"] = str(saved)
    if model.hf_assets_path and not os.path.exists(model.hf_assets_path):
        copies["hf_assets_path"] = ""
    return copies


def run_folder_model(cfg: JobConfig) -> JobConfig:
    """The job of a finished run (`cfg`: its config.toml, `job.dump_folder` the folder that holds
    it) with the model the run trained: for a start from a Hugging Face folder, the one its
    config.json describes (`with_folder_model`), from the run's saved copy of it
    (`lora.checkpoint_base`) where the folder is gone; `cfg` itself otherwise.

    Raises:
        ConfigError: the folder is gone and the run kept no copy (`start_gone`); what
            `with_folder_model` raises.
    """
    ckpt = cfg.checkpoint
    folder = Path(ckpt.initial_load_path)
    if ckpt.initial_load_in_hf and ckpt.initial_load_path and not (folder / "config.json").is_file():
        saved = saved_base(Path(cfg.job.dump_folder) / ckpt.folder)
        if saved is None or not (saved / "config.json").is_file():
            raise start_gone(cfg)
    return with_folder_model(cfg)


def start_gone(cfg: JobConfig) -> ConfigError:
    """What refuses to read a run (`cfg`, `job.dump_folder` its folder) whose start,
    `checkpoint.initial_load_path`, is gone, where the run kept no copy of what it needs of it: a
    LoRA run its frozen base, a full fine-tuning its config.json (which describes the model). The
    fix names the run's Hugging Face exports, which describe the model themselves."""
    ckpt = cfg.checkpoint
    folder = Path(cfg.job.dump_folder) / ckpt.folder
    if cfg.lora.enable:
        problem = (f"is gone, and {folder} holds no copy of the frozen base (lora.checkpoint_base was false): the "
                   "run's adapters cannot be put back on their base")
        fix = "restore the folder the run started from there"
    else:
        problem = (f"holds no config.json here, and {folder} keeps no copy of it: the model the run trained (its "
                   "config.json's) cannot be built")
        exports = sorted(folder.glob("step-*-hf/config.json"), key=lambda path: path.stat().st_mtime_ns)
        fix = "restore the folder the run started from there" + (
            f", or use the run's Hugging Face export {exports[-1].parent}, which describes the model itself"
            if exports else "")
    return ConfigError(source_key(cfg, "checkpoint.initial_load_path"), ckpt.initial_load_path, problem,
                       f"{fix}; lora.checkpoint_base = true makes future LoRA runs keep the base with their "
                       "checkpoints")


def base_config_folder(model: Model) -> Path | None:
    """The folder whose config.json `model` was built from (a Hugging Face start's, or the run's
    saved copy of it: `with_folder_model`), whose other fields and generation config an export
    keeps; None for a flavor's model."""
    return Path(model.source) if isinstance(model, FolderModel) else None


def hf_folder(model: Model) -> str:
    """What a Hugging Face start of `model`'s family needs, for messages' fixes."""
    return f"a Hugging Face {hf_mapping(model_args_from_config(model)).title} folder (config.json + *.safetensors)"


def _wanted(model: Model) -> str:
    """`hf_folder` of the job's model, or of any family where the job names none torchmoe builds
    (a flavor named after a folder that is gone)."""
    try:
        return hf_folder(model)
    except ConfigError:
        return "a Hugging Face checkpoint folder (config.json + *.safetensors)"


def folder_flavor(args: ModelArgs, folder: Path) -> str:
    """What messages and the run's config.toml call the folder's model in `model.flavor`: the
    shipped flavor with its architecture, else the folder's name (which a rerun of that
    config.toml then names, and `with_folder_model` accepts as the folder's own)."""
    return matching_flavor(args) or folder.resolve().name


def _require_family(model: Model, args: ModelArgs, key: str, folder: Path) -> None:
    """A set `model.name` must be the folder's family."""
    if model.name == args.family:
        return
    fits = matching_flavor(args)
    fix = (f"pass --model.name {args.family} --model.flavor {fits}" if fits else
           f"pass --model.name {args.family}, or leave model.name out of the job (--model.name none drops the job "
           "file's): the folder decides the model")
    title = hf_mapping(args).title
    other = hf_mapping(next(iter(FLAVORS[model.name].values()))).title if model.name in FLAVORS else model.name
    raise ConfigError("model.name", model.name, f"{key} {folder} holds a {title} model ({args.family}), not a "
                      f"{other} one", fix)


def _require_flavor(flavor: str, args: ModelArgs, key: str, folder: Path) -> None:
    """A set `model.flavor` must have the folder's architecture: it is a claim about the folder."""
    shipped = FLAVORS[args.family][flavor]
    differ = shipped.architecture_differences(args)
    if not differ:
        return
    shown = ", ".join(f"{name} {_value(args, name)} (the flavor: {_value(shipped, name)})" for name in differ[:4])
    more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
    fits = matching_flavor(args)
    fix = (f"set model.flavor = {show_value(fits)} (the folder's flavor)" if fits else
           "leave model.flavor out of the job (--model.flavor none drops the job file's): the folder decides the "
           "model, model.flavor sizes runs from scratch")
    raise ConfigError("model.flavor", flavor, f"contradicts {key} {folder}: its config.json differs from the "
                      f"flavor in {shown}{more}", f"{fix}; or point {key} at a checkpoint of flavor {flavor}")


def _value(args: ModelArgs, name: str) -> object:
    value = getattr(args, name)
    return sorted(value) if isinstance(value, frozenset) else value
