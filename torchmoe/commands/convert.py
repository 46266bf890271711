"""`torchmoe convert`: model weights between Hugging Face folders and DCP checkpoints.

    torchmoe convert hf-to-dcp path/to/Llama-4-Scout-17B-16E-Instruct outputs/scout-dcp --dtype bfloat16
    torchmoe train --config configs/llama4_16e.toml --checkpoint.initial_load_path outputs/scout-dcp
    torchmoe convert dcp-to-hf outputs/debug/checkpoint/step-200 outputs/debug-hf   # the run's model and tokenizer
    torchmoe convert dcp-to-hf outputs/qwen-dcp outputs/qwen-hf --model-name qwen3 --flavor tiny
    torchmoe convert dcp-to-hf outputs/lora/checkpoint/step-200 outputs/lora-hf --lora-export merged

    torchrun --nproc_per_node=8 -m torchmoe convert hf-to-dcp path/to/Llama-4-Maverick out/maverick-dcp

`hf-to-dcp` writes the model's state dict under its own names (no `model.` prefix): the layout
`checkpoint.initial_load_path` loads. A DCP folder records no architecture, so the command says
which built-in family and flavor the weights belong to (the family is config.json's
``model_type``). `dcp-to-hf` reads a torchmoe `step-N/` folder (only its `model.*` entries) or such
a bare model folder and writes a Hugging Face folder of the family (`Llama4ForCausalLM`,
`Qwen3MoeForCausalLM`, `DeepseekV3ForCausalLM`, `GptOssForCausalLM`). The family, flavor and
tokenizer are the run's (its config.toml) for a run's step-N folder, else the one built-in flavor
the tensors fit; `--model-name`, `--flavor` and `--tokenizer` say otherwise.

A LoRA run's step-N folder holds the adapters, not the frozen base: `dcp-to-hf` puts the run's
base (its saved `base/`, else its `checkpoint.initial_load_path`, checked against the fingerprint
the checkpoint recorded) and the step's adapters together and writes what the run's `lora.export`
says, or `--lora-export` (`training/adapter_checkpoint.py`), in one process (refused under
torchrun with more than one).

Both directions run in one process, or as a sharded job under torchrun (gloo: this is host
work): every tensor with at least one row per rank is split by rows over the ranks, and each
rank reads and writes only its rows (DCP on both sides, `hf_files/hf_storage.py` for Hugging
Face), so the host memory of a rank is about the model over the world size. User errors
(missing folders, a file that is missing, unreadable or damaged, a flavor that does not fit the
checkpoint, an unsupported Hugging Face config, an output folder that cannot be written) raise
`ConfigError`, which the CLI prints as one message with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import tensor as dtensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import FLAVORS, FolderModel, check_model
from torchmoe.commands.arguments import ArgumentParser, parse_args
from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_writes import os_cause, write_fault
from torchmoe.config.files.paths import (
    UserPath,
    nonempty_path,
    path_fault,
    path_faults,
    user_path_faults,
    writable_folder,
)
from torchmoe.config.job_config import JobConfig, Model
from torchmoe.config.launch_env import launch_int
from torchmoe.config.validate import LORA_EXPORTS, PARAM_DTYPES
from torchmoe.hf_files.base_files import keep_base_files
from torchmoe.hf_files.hf_storage import (
    ExpertBiasDrop,
    load_hf_weights,
    read_hf_args,
    require_hf_form,
    save_hf_weights,
)
from torchmoe.hf_files.tokenizer_files import copy_tokenizer_files
from torchmoe.models.decoder.model import Transformer
from torchmoe.models.registry import family_titles
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.nn.lora import is_adapter_name
from torchmoe.run_folders.run_lock import LOCK_NAMES, lock_folders
from torchmoe.training.adapter_checkpoint import export_checkpoint
from torchmoe.weight_sources.folder_model import base_config_folder
from torchmoe.weight_sources.trained_weights import run_config_file, run_job
from torchmoe.weights.checksums import ChecksummingWriter
from torchmoe.weights.finite import refuse_bad_values
from torchmoe.weights.flavor_fit import (
    flavors_fitting,
    matching_flavor,
    meta_state,
    require_fit,
    stored_mtp_layers,
)
from torchmoe.weights.weight_files import load_dcp, model_prefix, model_tensors, non_float, read_dcp_metadata

__all__ = ["convert_main", "dcp_to_hf", "hf_to_dcp", "matching_flavor"]

_HF_FIX = "pass a Hugging Face checkpoint folder of a family torchmoe trains (config.json + *.safetensors)"
_BIAS_DROP_FIX = ("pass --drop-expert-bias to write the model without its expert bias (the folder then selects "
                  "other experts), or keep the DCP checkpoint: torchmoe trains, evaluates and generates from it")


# ---- helpers -----------------------------------------------------------------------------------


_OUT_FIX = "pass a new folder (it is created) or an empty one, where this user can write"


def _require_dir(key: str, path: Path, fix: str) -> None:
    """`path` must be a folder this user can list: what the OS says otherwise is the message."""
    with path_faults(key, str(path), fix):
        os.listdir(path)


def _require_writable_out(path: Path) -> None:
    """Refuse an output folder that cannot be created or written (what the OS says:
    `config.files.paths.writable_folder`); creates nothing (`_owning` does)."""
    with path_faults("OUT_DIR", str(path), _OUT_FIX):
        writable_folder(path)


@contextmanager
def _owning(out_dir: Path) -> Iterator[None]:
    """Hold `out_dir` (created) as a run holds its folders (`run_lock`): a live run's folder, or
    another conversion's output, is refused naming its holder; then it must be empty (leftover
    shards of another model would mix in). A conversion that fails leaves no partial output (a
    folder it created is removed), and a write the filesystem refused (a full disk) is one
    `ConfigError` naming `OUT_DIR` and the OS's reason; the lock file goes when the conversion ends."""
    created = not os.path.lexists(out_dir)
    locks = lock_folders([UserPath("OUT_DIR", str(out_dir), str(out_dir), _OUT_FIX)])
    failed = False
    try:
        with path_faults("OUT_DIR", str(out_dir), _OUT_FIX):
            if set(os.listdir(out_dir)) - set(LOCK_NAMES):
                raise ConfigError("OUT_DIR", str(out_dir), "is not empty", _OUT_FIX)
        try:
            yield
        except BaseException as err:
            failed = True
            if not dist.is_initialized() or dist.get_rank() == 0:
                for entry in os.scandir(out_dir):  # all this conversion's: the folder was empty
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    elif entry.name not in LOCK_NAMES:
                        os.unlink(entry.path)
            cause = os_cause(err) if not isinstance(err, ConfigError) else None
            if cause is None:
                raise
            # A full disk (DCP's exceptions wrap the OSError): one message, naming the output.
            fault = path_fault("OUT_DIR", str(out_dir), cause, _OUT_FIX)
            raise ConfigError(fault.key, fault.value, f"{write_fault(err)}: nothing of the conversion is left there",
                              fault.fix) from None
    finally:
        locks.release(remove=True)
        if failed and created and (not dist.is_initialized() or dist.get_rank() == 0):
            out_dir.rmdir()


def _world() -> DeviceMesh | None:
    """Join torchrun's world (gloo: conversion is host work) as a 1-D mesh; None in one process."""
    if launch_int("WORLD_SIZE", 1) == 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _say(*args, **kwargs) -> None:
    """print on rank 0 only: under torchrun it reports for the whole job."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs)


def _empty_state(args: ModelArgs, dtype: torch.dtype, mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """The state dict of a model of `args` on CPU, uninitialised: parameters in `dtype`, router
    buffers fp32 zeros. Under a mesh every tensor with at least one row per rank is a DTensor
    split by rows (`Shard(0)`), so a rank holds about 1/world of the model; smaller ones are
    whole on every rank."""
    with torch.device("meta"):
        model = Transformer(args)
    buffers = {name for name, _ in model.named_buffers()}
    state = {}
    for name, t in model.state_dict().items():
        dt = t.dtype if name in buffers else dtype
        if mesh is not None and t.shape[0] >= mesh.size():
            state[name] = dtensor.empty(t.shape, dtype=dt, device_mesh=mesh, placements=[Shard(0)])
        else:
            state[name] = torch.empty(t.shape, dtype=dt)
        if name in buffers:  # fresh router state, as a model's init_buffers gives
            state[name].zero_()
    return state


# ---- the two directions ----------------------------------------------------------------------


def hf_to_dcp(hf_dir: str | Path, out_dir: str | Path, *,
              dtype: torch.dtype = torch.float32) -> tuple[str, str | None]:
    """Write the weights of a Hugging Face folder (of any family torchmoe trains) as a DCP folder of the
    bare model state dict (parameters in `dtype`, zero router state).

    Returns:
        The checkpoint's family (`model.name`) and the built-in flavor with its architecture (what
        `model.flavor` must be when training from it), or None when no flavor has it.

    Raises:
        ConfigError: `hf_dir` is missing, has a file that is missing, unreadable or damaged, is
            not a supported checkpoint or holds NaN, inf or values beyond `WEIGHT_BOUND`;
            `out_dir` is not empty, held by a live run, or cannot be written.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    fix = _HF_FIX
    _require_dir("HF_DIR", hf_dir, fix)
    args = read_hf_args(hf_dir, key="HF_DIR", fix=fix)
    _require_writable_out(out_dir)
    mesh = _world()
    with _owning(out_dir):
        state = _empty_state(args, dtype, mesh)
        # Checks what it loaded (in `dtype`): exactly the tensors written next, so nothing non-finite is.
        load_hf_weights(state, hf_dir, args, key="HF_DIR", fix=fix)
        dcp.save(state, storage_writer=ChecksummingWriter(out_dir), no_dist=mesh is None)
    return args.family, matching_flavor(args)


def dcp_to_hf(ckpt_dir: str | Path, out_dir: str | Path, *, flavor: str, name: str = "llama4",
              drop_expert_bias: bool = False, architecture: ModelArgs | None = None) -> torch.dtype:
    """Write the model weights of a DCP folder (a torchmoe `step-N/` or a bare model state dict)
    of family `name` as a Hugging Face folder of that family (`Llama4ForCausalLM`,
    `Qwen3MoeForCausalLM`), keeping the checkpoint's parameter dtype. A non-zero expert bias the
    family's Hugging Face model has no place for is refused, or with `drop_expert_bias` left out.
    `architecture`: the model's, where it is no flavor's (a run from a Hugging Face folder,
    which `flavor` then only names: `weight_sources.folder_model`).

    Returns:
        The dtype written.

    Raises:
        ConfigError: an unknown family or flavor, a missing, non-DCP or damaged `ckpt_dir`, a checkpoint
            whose tensors do not fit `flavor` (the fix names a flavor that fits, if one does), are
            not floating point or hold NaN, inf or values beyond `WEIGHT_BOUND`, or hold an
            expert bias the folder cannot (``--drop-expert-bias``), or an `out_dir` that is not
            empty, held by a live run, or cannot be written.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if architecture is None:
        check_model(name, flavor, name_key="--model-name", flavor_key="--flavor")
        architecture = FLAVORS[name][flavor]
    require_hf_form("--flavor", flavor, architecture, flavor, "keep the DCP checkpoint (torchmoe trains "
                    "and evaluates from it), or train a flavor the Hugging Face model can express")
    fix = "pass a step-N checkpoint folder, or a folder written by `torchmoe convert hf-to-dcp`"
    _require_dir("CKPT_DIR", ckpt_dir, fix)
    metadata = read_dcp_metadata("CKPT_DIR", ckpt_dir, fix)
    stored = model_tensors(metadata)
    args = architecture.replace(mtp_layers=stored_mtp_layers(stored))  # written as the release does
    require_fit("--flavor", flavor, args, stored, str(ckpt_dir), family_key="--model-name")
    problem = non_float(meta_state(args), stored)
    if problem is not None:
        raise ConfigError("CKPT_DIR", str(ckpt_dir), problem, fix)
    _require_writable_out(out_dir)
    dtype = stored["tok_embeddings.weight"].properties.dtype
    mesh = _world()
    with _owning(out_dir):
        state = _empty_state(args, dtype, mesh)
        prefix = model_prefix(metadata)  # a step-N folder keeps the model under "model." next to optimizer state
        load_dcp({prefix + k: v for k, v in state.items()}, ckpt_dir, metadata, key="CKPT_DIR", fix=fix)
        refuse_bad_values(state, key="CKPT_DIR", path=ckpt_dir)
        # Checks them again, as every writer of weights does, and refuses a bias the folder cannot hold.
        save_hf_weights(state, args, out_dir, bias_drop=ExpertBiasDrop(drop_expert_bias, "--drop-expert-bias",
                                                                        _BIAS_DROP_FIX))
    return dtype


# ---- command line ------------------------------------------------------------------------------


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="torchmoe convert", description="Convert model weights between Hugging Face "
                            f"folders ({family_titles()}) and DCP checkpoints (see `torchmoe convert DIRECTION "
                            "--help`).")
    sub = parser.add_subparsers(dest="direction", required=True, metavar="{hf-to-dcp,dcp-to-hf}")
    to_dcp = sub.add_parser("hf-to-dcp", help="Hugging Face folder -> DCP folder for checkpoint.initial_load_path")
    to_dcp.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face folder (config.json + *.safetensors)")
    to_dcp.add_argument("out_dir", metavar="OUT_DIR", help="DCP folder to create (must not hold files)")
    to_dcp.add_argument("--dtype", choices=PARAM_DTYPES, default="float32", help="parameter dtype (default: float32)")
    to_hf = sub.add_parser("dcp-to-hf", help="torchmoe step-N (or bare model DCP) folder -> Hugging Face folder")
    to_hf.add_argument("ckpt_dir", metavar="CKPT_DIR", help="step-N checkpoint folder or bare model DCP folder")
    to_hf.add_argument("out_dir", metavar="OUT_DIR", help="Hugging Face folder to create (must not hold files)")
    to_hf.add_argument("--model-name", default="", metavar="NAME",
                       help=f"model family of the checkpoint (model.name): {', '.join(FLAVORS)} (default: the run's "
                            "config.toml for a run's step-N, else the one family whose flavor its tensors fit)")
    to_hf.add_argument("--flavor", default="", help="model flavor of the checkpoint (model.flavor; default as for "
                       "--model-name): " + "; ".join(f"{name}: {', '.join(flavors)}" for name, flavors in FLAVORS.items()))
    to_hf.add_argument("--drop-expert-bias", action="store_true",
                       help="write a checkpoint whose aux-loss-free expert bias is non-zero without it, where the "
                            "family's Hugging Face model has no place for it (llama4, qwen3, gpt_oss): the folder "
                            "then selects other experts than the checkpoint (default: refused)")
    to_hf.add_argument("--tokenizer", default=None, metavar="PATH",
                       help="the tokenizer.json (or its folder) the model trained with: copied into OUT_DIR with its "
                            "tokenizer_config.json and special_tokens_map.json (default: the run's model.tokenizer_path "
                            "for a run's step-N, else none: the byte tokenizer)")
    to_hf.add_argument("--lora-export", choices=LORA_EXPORTS, default=None,
                       help="for a LoRA run's step-N: write the PEFT adapter (adapter_config.json + "
                            "adapter_model.safetensors) or the merged model (default: the run's lora.export); "
                            "the base is the run's saved copy (lora.checkpoint_base), else its "
                            "checkpoint.initial_load_path")
    return parser


def _checkpoint_model(ckpt_dir: Path, name: str, flavor: str, tokenizer: str | None) -> tuple[Model, str]:
    """The model of the DCP checkpoint `ckpt_dir` (its family, flavor and tokenizer; the
    architecture of a run from a Hugging Face folder: a `FolderModel`), and where it came from:
    what the flags give, the rest from the run's job for a run's step-N folder (`run_job`), else
    from its tensors' shapes when they fit exactly one built-in flavor (of `name`'s family when
    given); the tokenizer from the run, else none (the byte tokenizer).

    Raises:
        ConfigError: the checkpoint does not tell (its tensors fit no flavor, or several that differ
            in what they compute): naming ``--flavor`` (or ``--model-name``) and the flavors that fit;
            the run's model cannot be built (`run_job`: the folder it started from is gone).
    """
    if name and flavor:
        return Model(name=name, flavor=flavor, tokenizer_path=tokenizer or ""), ""
    if name and name not in FLAVORS:  # a family spelled otherwise: said before anything is read
        check_model(name, flavor, name_key="--model-name", flavor_key="--flavor")
    fix = "pass a step-N checkpoint folder, or a folder written by `torchmoe convert hf-to-dcp`"
    _require_dir("CKPT_DIR", ckpt_dir, fix)
    run = run_config_file(ckpt_dir)
    if run is not None:
        model = run_job(run, key="CKPT_DIR").model
        if name or flavor:  # a claim about the weights: the flavor's model, whose fit the load checks
            model = Model(name=name or model.name, flavor=flavor or model.flavor, tokenizer_path=model.tokenizer_path)
        return dataclasses.replace(model, tokenizer_path=model.tokenizer_path if tokenizer is None else tokenizer), \
            f" from {run}"
    shapes = {k: md.size for k, md in model_tensors(read_dcp_metadata("CKPT_DIR", ckpt_dir, fix)).items()}
    everywhere = [(family, found) for family in FLAVORS for found in flavors_fitting(shapes, family)]
    families = list(dict.fromkeys(family for family, _ in everywhere))
    if flavor and not name and len(families) == 1:  # the tensors' family; the flavor's fit is the load's to check
        return Model(name=families[0], flavor=flavor, tokenizer_path=tokenizer or ""), ""
    fits = [(family, found) for family, found in everywhere if name in ("", family) and flavor in ("", found)]
    if len(fits) == 1:
        return Model(name=fits[0][0], flavor=fits[0][1], tokenizer_path=tokenizer or ""), \
            ", the one flavor its tensors fit"
    # The setting that does not fit, else the one missing.
    key, value = ("--model-name", name) if name and everywhere and not fits else ("--flavor", flavor or "(not given)")
    shown = "; ".join(f"{family} {found}" for family, found in everywhere) or "none of the built-in flavors"
    raise ConfigError(key, value, f"{ckpt_dir} holds no run's config.toml that names its model, and its tensors "
                      f"fit {shown}", f"pass --model-name {everywhere[0][0]} --flavor {everywhere[0][1]}"
                      if len(everywhere) == 1 else "pass --model-name and --flavor of the model it holds")


def _lora_run(ckpt_dir: Path, export: str | None) -> tuple[JobConfig, Path] | None:
    """(the run's job, its config.toml) when `ckpt_dir` is a LoRA run's checkpoint (its model
    tensors are adapters), with `export` (``--lora-export``) for its `lora.export` if given and
    its `job.dump_folder` where the checkpoint lies; else None.

    Raises:
        ConfigError: it lies outside its run's folder (no config.toml that names it), or the
            conversion runs under torchrun with more than one process.
    """
    if not ckpt_dir.is_dir():  # what is wrong with the path, and with the flavor asked for, is said later
        return None
    fix = "pass a step-N checkpoint folder, or a folder written by `torchmoe convert hf-to-dcp`"
    if not any(is_adapter_name(k) for k in model_tensors(read_dcp_metadata("CKPT_DIR", ckpt_dir, fix))):
        return None
    run = run_config_file(ckpt_dir)
    if run is None:
        raise ConfigError("CKPT_DIR", str(ckpt_dir), "is a LoRA run's checkpoint (its adapters, not the frozen base) "
                          "outside its run's folder: no config.toml there says which base and adapters it has",
                          "pass the step-N folder where the run saved it (<job.dump_folder>/<checkpoint.folder>/)")
    if launch_int("WORLD_SIZE", 1) > 1:  # the model is put together whole in one process, as the run's export does
        raise ConfigError("CKPT_DIR", str(ckpt_dir), "is a LoRA run's checkpoint, which convert writes in one "
                          "process", "run `torchmoe convert` without torchrun")
    cfg = run_job(run, key="CKPT_DIR")
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, export=export or cfg.lora.export)), run


def _lora_to_hf(cfg: JobConfig, ckpt_dir: Path, out_dir: Path, *, drop_expert_bias: bool) -> None:
    """Write the LoRA checkpoint `ckpt_dir` of the run `cfg` as its `lora.export` says
    (`training.adapter_checkpoint.export_checkpoint`), owning `out_dir` as `dcp_to_hf` does."""
    _require_writable_out(out_dir)
    with _owning(out_dir):
        export_checkpoint(cfg, ckpt_dir, out_dir,
                          bias_drop=ExpertBiasDrop(drop_expert_bias, "--drop-expert-bias", _BIAS_DROP_FIX))


def convert_main(argv: list[str]) -> int:
    """`torchmoe convert ...`; returns the exit status (user errors raise `ConfigError`)."""
    opts = parse_args(_parser(), argv)
    if opts is None:  # --help was printed
        return 0
    key, source = ("HF_DIR", opts.hf_dir) if opts.direction == "hf-to-dcp" else ("CKPT_DIR", opts.ckpt_dir)
    nonempty_path(key, source, "pass the folder to convert")
    nonempty_path("OUT_DIR", opts.out_dir, "pass the folder to write (it is created)")
    paths = [UserPath(key, source, source, "pass a folder this user can read"),
             UserPath("OUT_DIR", opts.out_dir, opts.out_dir, _OUT_FIX)]
    try:
        with user_path_faults(paths):  # what the checks before writing could not foresee
            status = _run(opts)
        if dist.is_initialized():
            # Every rank past its last collective before any tears the group down: a rank that
            # destroyed its group while a peer still waited on it left that peer's gloo thread
            # to abort the process at exit ("terminate called without an active exception").
            dist.barrier()
        return status
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(opts: argparse.Namespace) -> int:
    """One direction; rank 0 reports (under torchrun every rank does its share of the work)."""
    if opts.direction == "hf-to-dcp":
        name, flavor = hf_to_dcp(opts.hf_dir, opts.out_dir, dtype=torch_dtype(opts.dtype))
        _say(f"wrote DCP folder {opts.out_dir} ({opts.dtype})")
        if flavor is not None:
            _say(f"train from it with --model.name {name} --model.flavor {flavor} "
                 f"--checkpoint.initial_load_path {opts.out_dir}")
        else:
            _say(f"note: no built-in flavor has this architecture; add one to torchmoe/arch/{name}.py "
                  "FLAVORS to train from it")
    else:
        # The one warning here (a non-zero expert bias dropped, as --drop-expert-bias asked) is news
        # for the user, so it is printed as one line rather than with the source line Python's format adds.
        lora_run = _lora_run(Path(opts.ckpt_dir), opts.lora_export)
        if lora_run is not None:
            cfg, run = lora_run
            model, source = cfg.model, f" from {run}"
        else:
            model, source = _checkpoint_model(Path(opts.ckpt_dir), opts.model_name, opts.flavor, opts.tokenizer)
        name, flavor = model.name, model.flavor
        tokenizer = model.tokenizer_path if opts.tokenizer is None else opts.tokenizer
        tokenizer_fix = "pass the tokenizer.json the model trained with, or its folder"
        if tokenizer:  # before anything is written
            with path_faults("--tokenizer", tokenizer, tokenizer_fix):
                os.stat(tokenizer)
        with warnings.catch_warnings(record=True) as caught:
            if lora_run is not None:
                _lora_to_hf(cfg, Path(opts.ckpt_dir), Path(opts.out_dir), drop_expert_bias=opts.drop_expert_bias)
                form = f"the LoRA run's {'PEFT adapter' if cfg.lora.export == 'adapter' else 'merged model'}"
            else:
                dtype = dcp_to_hf(opts.ckpt_dir, opts.out_dir, flavor=flavor, name=name,
                                  drop_expert_bias=opts.drop_expert_bias,
                                  architecture=model.architecture if isinstance(model, FolderModel) else None)
                form = str(dtype).removeprefix("torch.")
        for w in caught:
            _say(f"warning: {w.message}", file=sys.stderr)
        kept, copied = [], []
        if not dist.is_initialized() or dist.get_rank() == 0:
            kept = keep_base_files(Path(opts.out_dir), base_config_folder(model))  # a Hugging Face start's fields
            with path_faults("--tokenizer", tokenizer, tokenizer_fix):
                copied = copy_tokenizer_files(tokenizer, opts.out_dir)
        _say(f"wrote Hugging Face folder {opts.out_dir} ({name} {flavor}{source}, {form}"
             + (f"; from the folder it started from: {', '.join(kept)}" if kept else "")
             + (f"; tokenizer: {', '.join(copied)})" if copied else ")"))
    return 0
