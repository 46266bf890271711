"""Which trained weights `torchmoe generate` and `torchmoe eval` read, and the model they are.

    weights = trained_weights(cfg, "--checkpoint", path="", step=None, base="")
    cfg, note = with_weights_model(cfg, weights, flag_keys={"model.attn_backend"})

`path` may be a run's `step-N/` folder, any DCP folder of the model (`torchmoe convert
hf-to-dcp`'s output, a seed checkpoint), a Hugging Face folder (config.json + safetensors) or a
PEFT adapter folder (adapter_config.json + adapter_model.safetensors), told apart by those files.
Without it, the job's `<job.dump_folder>/<checkpoint.folder>/` gives its newest complete
checkpoint, or step-`step`. The folder is read, never written.

The weights say which model they are where they can, and the commands that read them take it from
there (`with_weights_model`) rather than asking for it again:

- a run's `step-N/`: the model the run trained (`run_job`: its config.toml; for a start from a
  Hugging Face folder, the model that folder's config.json describes, from the run's saved copy
  where the folder is gone). A LoRA run's step holds adapters, which go over the run's base, with
  the run's `[lora]` (`TrainedWeights.lora_step`; `training.adapter_checkpoint`);
- a Hugging Face folder: its config.json, and its tokenizer when it holds one;
- a PEFT adapter folder: its base's config.json (``--base``, else its adapter_config.json's
  ``base_model_name_or_path``) and the `[lora]` its tensors are (`hf_files.adapter_folder`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from torchmoe.arch.registry import FolderModel
from torchmoe.checkpoints.checkpoint import complete_checkpoints
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.flags import Integer
from torchmoe.config.job_config import JobConfig, LoRA, Model
from torchmoe.config.job_file import load_toml_config
from torchmoe.config.numbers import INT64_MAX
from torchmoe.hf_files.adapter_folder import adapter_base, adapter_lora, is_adapter_folder
from torchmoe.nn.lora import is_adapter_name
from torchmoe.weight_sources.folder_model import run_folder_model, with_folder_model
from torchmoe.weights.weight_files import model_tensors, read_dcp_metadata

__all__ = ["STEP", "TrainedWeights", "run_config_file", "run_job", "trained_weights", "with_weights_model"]

STEP = Integer(0, INT64_MAX, "100", fix="name a saved step (a step-N folder), or leave --step out for the newest")
"""The `--step` flag of the commands that read trained weights."""


@dataclass(frozen=True)
class TrainedWeights:
    """Weights a command reads (`trained_weights`)."""

    folder: Path
    form: str
    """"hf" (a Hugging Face folder), "dcp" (a DCP folder) or "adapter" (a PEFT adapter folder)."""
    run: JobConfig | None = None
    """A "dcp" folder's run (`run_job`), where it is a run's checkpoint; else None."""
    lora_step: bool = False
    """The folder is a LoRA run's checkpoint: the run's adapters, which go over its base."""
    base: Path | None = None
    """An "adapter" folder's base: a Hugging Face folder."""

    @property
    def in_hf(self) -> bool:
        return self.form == "hf"


_PATH_FIX = ("point it at a run's step-N folder, the output of `torchmoe convert hf-to-dcp`, a Hugging Face model "
             "folder, or a PEFT adapter folder")


def trained_weights(cfg: JobConfig, key: str, *, path: str, step: int | None, base: str = "") -> TrainedWeights:
    """The weights to read and what they are.

    Args:
        key: the flag that named `path`, for messages (``--checkpoint``).
        path: a checkpoint folder, or "" for the job's own newest (or step `step`).
        base: the Hugging Face folder a PEFT adapter folder `path` goes on (``--base``); "" for
            the one its adapter_config.json names.

    Raises:
        ConfigError: `path` is not a folder of weights; the job has no complete checkpoint (at
            `step`); `step` given with `path`; `base` given for weights that are no adapter; an
            adapter's base cannot be found (`adapter_folder.adapter_base`); a LoRA checkpoint
            outside its run's folder; the run's model cannot be built (`run_job`).
    """
    if path:
        if step is not None:
            raise ConfigError("--step", step, f"picks a checkpoint of the job's run, and {key} names one already",
                              f"pass {key} or --step, not both")
        folder = Path(path)
        if is_adapter_folder(folder):
            return TrainedWeights(folder, "adapter", base=adapter_base(folder, base=base, key=key))
        if base:
            raise ConfigError("--base", base, f"names the base of a PEFT adapter folder, and {key} {path} is none "
                              "(no adapter_config.json): it holds a whole model", "leave --base out")
        if (folder / "config.json").is_file():
            return TrainedWeights(folder, "hf")
        if (folder / ".metadata").is_file():
            return _dcp_weights(folder, key)
        raise ConfigError(key, path, "is neither a DCP checkpoint folder (no .metadata file), a Hugging Face folder "
                          "(no config.json) nor a PEFT adapter folder (no adapter_config.json)", _PATH_FIX)
    if base:
        raise ConfigError("--base", base, "names the base of a PEFT adapter folder, and no --checkpoint names one",
                          "pass --checkpoint ADAPTER_FOLDER with it, or leave --base out")
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
    return _dcp_weights(found[-1][1], key)


def _dcp_weights(folder: Path, key: str) -> TrainedWeights:
    """The DCP folder `folder` as weights: with its run where it is a run's checkpoint, and
    whether it holds a LoRA run's adapters (over the base, which the run's job finds).

    Raises:
        ConfigError: a LoRA checkpoint outside its run's folder (nothing says which base and
            adapters it has); what `run_job` raises.
    """
    toml = run_config_file(folder)
    fix = "point it at a run's step-N folder, or the output of `torchmoe convert hf-to-dcp`"
    lora_step = any(is_adapter_name(name) for name in model_tensors(read_dcp_metadata(key, folder, fix)))
    if lora_step and toml is None:
        raise ConfigError(key, str(folder), "is a LoRA run's checkpoint (its adapters, not the frozen base) outside "
                          "its run's folder: no config.toml there says which base and adapters it has",
                          "pass the step-N folder where the run saved it (<job.dump_folder>/<checkpoint.folder>/)")
    return TrainedWeights(folder, "dcp", run=None if toml is None else run_job(toml, key=key), lora_step=lora_step)


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


def run_job(toml: Path, *, key: str) -> JobConfig:
    """The job of the run whose config.toml is `toml`, as the run trained: `job.dump_folder` the
    folder that holds the file (wherever the run was moved), and the model it trained
    (`folder_model.run_folder_model`: a Hugging Face start's config.json).

    Raises:
        ConfigError: the file cannot be read (named as `key`'s), or the model cannot be built.
    """
    cfg = load_toml_config(toml, key=key)
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, dump_folder=str(toml.parent)))
    return run_folder_model(cfg)


def with_weights_model(cfg: JobConfig, weights: TrainedWeights, *, flag_keys: set[str]) -> tuple[JobConfig, str]:
    """`cfg` with the model of `weights` and the adapters over it (`[lora]`: the run's for a
    LoRA run's checkpoint, an adapter folder's own, else none), but the `[model]` keys the
    command line set by name (`flag_keys`, ``model.flavor``...); and a note naming the keys that
    changed and where they were read ("" when none did, or the weights do not tell: a bare DCP
    folder, whose model is the job's).

    A Hugging Face folder's config.json (or an adapter's base's) holds the architecture only: the
    job's other `[model]` settings stand, and its tokenizer where the folder holds none. A
    run's `[model]` is the run's whole. A `model.name` or `model.flavor` set by name is a claim
    about the weights, which their load then checks (a folder's model becomes that flavor's).

    Raises:
        ConfigError: the Hugging Face config.json cannot be used; the adapter is not one of whole
            `lora.targets` of its base's model (`adapter_folder.adapter_lora`).
    """
    lora = LoRA()
    if weights.form == "dcp":
        if weights.run is None:
            return dataclasses.replace(cfg, lora=lora), ""
        model, sources = weights.run.model, [str(Path(weights.run.job.dump_folder) / "config.toml")]
        keep = set()
        if weights.lora_step:
            lora = weights.run.lora
    else:
        hf = weights.folder if weights.in_hf else weights.base
        model = _folder_model(cfg, hf, key="--checkpoint" if weights.in_hf else "--base")
        sources = [str(hf / "config.json")]
        # The job's training settings stand; not its hf_assets_path, whose tokenizer (kept where the
        # folder holds none) and weights the folder replaces.
        keep = {f.name for f in dataclasses.fields(Model)} - {"name", "flavor", "tokenizer_path", "hf_assets_path"}
        tokenizers = [folder for folder in (weights.folder, hf) if (folder / "tokenizer.json").is_file()]
        model = dataclasses.replace(model, hf_assets_path="")
        if tokenizers:
            model = dataclasses.replace(model, tokenizer_path=str(tokenizers[0]))
        else:
            keep.add("tokenizer_path")
        if weights.form == "adapter":
            lora = adapter_lora(weights.folder, model.architecture, key="--checkpoint")
            sources.append(str(weights.folder / "adapter_config.json"))
    keep |= {f.name for f in dataclasses.fields(Model) if f"model.{f.name}" in flag_keys}
    model = dataclasses.replace(model, **{name: getattr(cfg.model, name) for name in keep})
    if keep & {"name", "flavor"}:  # a claim about the weights: the flavor's model, which the load checks
        model = Model(**{f.name: getattr(model, f.name) for f in dataclasses.fields(Model)})
    changed = [f"model.{f.name} = {show_value(getattr(model, f.name))}" for f in dataclasses.fields(Model)
               if getattr(model, f.name) != getattr(cfg.model, f.name)]
    if lora.enable:
        changed += [f"lora.{f.name} = {show_value(getattr(lora, f.name))}" for f in dataclasses.fields(LoRA)
                    if getattr(lora, f.name) != getattr(cfg.lora, f.name)]
    note = f"the model is the weights' own, from {' and '.join(sources)}: {', '.join(changed)}" if changed else ""
    return dataclasses.replace(cfg, model=model, lora=lora), note


def _folder_model(cfg: JobConfig, folder: Path, *, key: str) -> FolderModel:
    """The model of the Hugging Face folder `folder`, named by `key` (`with_folder_model`)."""
    ckpt = dataclasses.replace(cfg.checkpoint, initial_load_path=str(folder), initial_load_in_hf=True)
    model = cfg.model if type(cfg.model) is Model else Model(**{f.name: getattr(cfg.model, f.name)
                                                                 for f in dataclasses.fields(Model)})
    return with_folder_model(dataclasses.replace(cfg, model=model, checkpoint=ckpt), key=key).model
