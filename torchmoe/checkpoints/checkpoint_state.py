"""What a checkpoint holds, and reading it: the `Stateful` wrappers of the model, the optimizers,
the RNG and per-rank state (`ModelWrapper`, `OptimizerWrapper`, `RNGState`, `RankLocal`), DCP's
load of a state into them (its saved shapes checked first, nothing unpickled but plain values),
and `load_model_only`, the model's weights alone from a DCP folder.

    state = {"model": ModelWrapper(model_parts), "optimizer": OptimizerWrapper(model_parts, optimizers),
             "rng": RankLocal(RNGState(), rank=rank)}
    dcp_load(state, Path("outputs/run/checkpoint/step-40"), group=None)

Model and optimizer state go through `get_model_state_dict` / `get_optimizer_state_dict`, which
return (sharded) DTensors keyed by the model's FQNs, so a checkpoint saved under one layout (FSDP
degree, TP, EP, PP split) loads under another. Persistent buffers, such as the MoE expert biases
of aux-loss-free balancing, are part of the model state dict.

Per-rank state that has no global view (RNG) must be wrapped in `RankLocal`: DCP deduplicates
same-named values across ranks, so without a rank in the key only one rank's value would
survive. When resuming with a different world size a rank finds no value of its own; it then
keeps its current state and logs a warning.

A Stateful may define `check_saved_shapes(shapes)`: before loading, it gets the saved shapes of
its tensors (keys relative to its own state dict) and raises `ConfigError` for a checkpoint that
the job's configuration cannot continue (the dataloader, for another global_batch_size).
Saving, resuming and the folders' layout are `checkpoint.py`'s (`CheckpointManager`).
"""

from __future__ import annotations

import logging
import math
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchmoe.config.errors import ConfigError
from torchmoe.optim.optimizer_state import refuse_other_state
from torchmoe.weights.dcp_unpickling import SafeLoadPlanner
from torchmoe.weights.finite import refuse_bad_values
from torchmoe.weights.flavor_fit import flavor_fix, flavors_fitting, stored_mtp_layers
from torchmoe.weights.weight_files import load_dcp, misfit, model_prefix, model_tensors, non_float, read_dcp_metadata

logger = logging.getLogger(__name__)


def as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


# Without a process group DCP saves and loads in one process (a supported mode here: CPU and
# single-GPU runs) but warns on every call, async saves included, from their background thread;
# so the filter is process-wide, and matches only that message.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# ---------------------------------------------------------------------------------------------
# Stateful wrappers
# ---------------------------------------------------------------------------------------------


class ModelWrapper(Stateful):
    """The model state (parameters and persistent buffers) of one or more model parts.

    Pipeline stages are pruned copies of the full model that keep its FQNs, so the parts'
    state dicts merge into one dict keyed like the unsplit model's.
    """

    def __init__(self, model_parts: nn.Module | list[nn.Module], *, flavor: str = "", family: str = "llama4",
                 keep: Callable[[str], bool] | None = None,
                 check: Callable[[dict[str, torch.Size]], None] | None = None) -> None:
        self.model_parts = as_list(model_parts)
        # Named in the error for a checkpoint of another model, with the family's flavors it fits.
        self.flavor, self.family = flavor, family
        # The tensors this state holds, by name (LoRA: the adapters and the biases it trains); None: every one.
        self.keep = keep
        # Refuses saved tensors by the setting that decides them (LoRA's: `adapter_settings`), before the flavor's check.
        self.check = check

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part in self.model_parts:
            sd.update(get_model_state_dict(part))
        return sd if self.keep is None else {name: t for name, t in sd.items() if self.keep(name)}

    def check_saved_shapes(self, shapes: dict[str, torch.Size]) -> None:
        """Refuse a checkpoint of another model (another flavor): its checkpoints are valid, so
        the fix is the flavor they fit (`fit.flavors_fitting`: the whole model's saved tensors,
        whatever stages this rank holds), not deleting them (see `_check_saved_shapes`); first
        `check`'s refusal, if given."""
        if self.check is not None:
            self.check(shapes)
        state = self.state_dict()
        have, held = stored_mtp_layers(state), stored_mtp_layers(shapes)
        if have > held:  # multi-token prediction modules the checkpoints lack (more are skipped)
            raise ConfigError("model.mtp_layers", have, f"does not match the run's checkpoints: they hold {held} "
                              "multi-token prediction modules", f"set model.mtp_layers to {held} or less; or give "
                              "this run its own job.dump_folder")
        for name, tensor in state.items():
            saved = shapes.get(name)
            if saved is None or tuple(saved) != tuple(tensor.shape):
                found = "has no such tensor" if saved is None else f"holds it as {tuple(saved)}"
                fix = (flavor_fix("--model.flavor", flavors_fitting(shapes, self.family))
                       or "use the flavor the run was trained with")
                raise ConfigError("model.flavor", self.flavor, f"does not match the run's checkpoints: this model's "
                                  f"{name} is {tuple(tensor.shape)}, the checkpoint {found}",
                                  f"{fix}; or give this run its own job.dump_folder")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # strict=False: each part takes only its own keys from the merged dict. Missing keys are
        # still errors: DCP loads exactly the keys that state_dict() returned.
        options = StateDictOptions(strict=False)
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=options)


class OptimizerWrapper(Stateful):
    """Optimizer state of one optimizer per model part, keyed by parameter FQN.

    The flattened form (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`) does not depend on how
    parameters are grouped, so it loads into an optimizer built for another layout.
    """

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(
        self,
        model_parts: nn.Module | list[nn.Module],
        optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer],
    ) -> None:
        self.model_parts = as_list(model_parts)
        self.optimizers = as_list(optimizers)
        if len(self.model_parts) != len(self.optimizers):
            raise ValueError(
                f"OptimizerWrapper: {len(self.model_parts)} model parts but "
                f"{len(self.optimizers)} optimizers; pass one optimizer per model part"
            )

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.optimizers):
            sd.update(get_optimizer_state_dict(part, opt, options=self._OPTIONS))
        return sd

    def check_saved_shapes(self, shapes: dict[str, torch.Size]) -> None:
        """Refuse a checkpoint of another optimizer (`optimizer_state.refuse_other_state`)."""
        refuse_other_state(self.state_dict(), shapes)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises:
            ValueError: a hyperparameter no optimizer takes (a negative or non-finite LR, a beta
                outside [0, 1), ...: a checkpoint altered or crafted), naming it.
        """
        for key, value in state_dict.items():
            name = key.rsplit(".", 1)[-1]
            if key.startswith("param_groups.") and name in _GROUP_RANGES:
                values = (value,) if name != "betas" else value if isinstance(value, (tuple, list)) else ()
                ok, what = _GROUP_RANGES[name]
                if not values or not all(type(v) in (int, float) and math.isfinite(v) and ok(v) for v in values) \
                        or (name == "betas" and len(values) != 2):
                    raise ValueError(f"the optimizer's {key} is {value!r:.40}, not {what}")
        for part, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state_dict, options=self._OPTIONS)


# The ranges torch's AdamW, SGD and Muon accept (they raise a ValueError in their constructor,
# but a param group loaded later is never checked): name -> (test, what it must be).
_GROUP_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda v: v >= 0, "a finite number >= 0"),
    "betas": (lambda v: 0 <= v < 1, "two finite numbers in [0, 1)"),
    "eps": (lambda v: v >= 0, "a finite number >= 0"),
    "weight_decay": (lambda v: v >= 0, "a finite number >= 0"),
    "momentum": (lambda v: v >= 0, "a finite number >= 0"),
    "ns_steps": (lambda v: type(v) is int and 1 <= v < 100, "a whole number in 1 .. 99"),
}


class RNGState(Stateful):
    """The random generators of this process: torch CPU, the current CUDA device, Python."""

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])
        random.setstate(state_dict["python"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


class RankLocal(Stateful):
    """Keys the state of `obj` by this process's rank (`rank<r>`), so every rank's value is kept.

    `obj` is a Stateful or a plain dict (updated in place on load).
    """

    def __init__(self, obj: Stateful | dict[str, Any], *, rank: int) -> None:
        self.obj = obj
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        inner = dict(self.obj) if isinstance(self.obj, dict) else self.obj.state_dict()
        return {self.key: inner}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = state_dict[self.key]
        if isinstance(self.obj, dict):
            self.obj.update(inner)
        else:
            self.obj.load_state_dict(inner)


class _LoadPlanner(SafeLoadPlanner):
    """DCP's default load planner (strict; `SafeLoadPlanner`: plain values only), except that keys
    under `optional` prefixes which the checkpoint lacks are skipped and recorded in `skipped`
    (rank-local state of a rank that did not exist when the checkpoint was written)."""

    def __init__(self, optional: tuple[str, ...]) -> None:
        super().__init__()
        self.optional = optional
        self.skipped: list[str] = []

    def create_local_plan(self) -> LoadPlan:
        present = self.metadata.state_dict_metadata
        for fqn in list(self.state_dict):
            if fqn not in present and fqn.startswith(self.optional):
                del self.state_dict[fqn]
                self.skipped.append(fqn)
        return super().create_local_plan()


def _check_saved_shapes(state: dict[str, Any], metadata: Metadata) -> None:
    """Call `check_saved_shapes` of every object in `state` that has one (module docstring)."""
    for name, obj in state.items():
        check = getattr(obj, "check_saved_shapes", None)
        if check is None:
            continue
        prefix = f"{name}."
        check({
            fqn[len(prefix):]: md.size
            for fqn, md in metadata.state_dict_metadata.items()
            if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)
        })  # fmt: skip


def dcp_load(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    """dcp.load of `state` from `path` over `group` (`load_dcp`: checksums first, nothing unpickled
    but plain values), tolerating missing rank-local keys (with a warning).

    Raises:
        UnreadableWeights: a file of the checkpoint is missing or damaged.
        UnsafeWeights: a file would run code.
        ConfigError: an object's `check_saved_shapes` refuses the checkpoint.
    """
    key, fix = "checkpoint.folder", "delete or move the broken step-N folder"  # the manager reports its own
    metadata = read_dcp_metadata(key, path, fix, group)
    _check_saved_shapes(state, metadata)
    optional = tuple(f"{k}." for k, v in state.items() if isinstance(v, RankLocal))
    planner = _LoadPlanner(optional)
    load_dcp(state, path, metadata, key=key, fix=fix, planner=planner, group=group)
    if planner.skipped:
        logger.warning(
            "%s has no rank-local state for this rank (%s); keeping the current state",
            path, ", ".join(sorted({k.split(".")[0] for k in planner.skipped})),
        )


_DCP_FOLDER = "a DCP checkpoint folder: a step-N folder of a run, or the output of `torchmoe convert hf-to-dcp`"


def load_model_only(path: str | os.PathLike, model_parts: nn.Module | list[nn.Module], *,
                    key: str = "checkpoint.initial_load_path", metadata: Metadata | None = None,
                    keep: Callable[[str], bool] | None = None) -> None:
    """Load only model weights (no optimizer, no step) from a DCP folder.

    Accepts a torchmoe `step-N/` folder (keys `model.<fqn>`) or a DCP folder of a bare model
    state dict (keys `<fqn>`), e.g. `checkpoint.initial_load_path`. Every parameter and
    persistent buffer of the model must be in it, of its shape and (for floating-point ones) in
    floating point; extra keys are ignored (a pipeline stage loads only its own). Collective
    under a process group. `metadata`: the folder's, when the caller read it already
    (`read_dcp_metadata`); `keep`: the tensors to load, by name (`ModelWrapper`; LoRA's base
    loads without its adapters).

    Raises:
        ConfigError: (naming `key`, the option that named `path`) a file of the folder is
            missing, unreadable or damaged, its tensors are not the model's, or they hold NaN, inf
            or values beyond `finite.WEIGHT_BOUND`.
    """
    path = Path(path)
    fix = f"point it at {_DCP_FOLDER}"
    metadata = metadata if metadata is not None else read_dcp_metadata(key, path, fix)
    wrapper = ModelWrapper(model_parts, keep=keep)
    sd = wrapper.state_dict()
    stored = model_tensors(metadata)
    problem = misfit(sd, stored, extra_ok=True) or non_float(sd, stored)
    if problem is not None:
        raise ConfigError(key, str(path), problem, f"point it at a checkpoint of this model flavor ({_DCP_FOLDER})")
    prefixed = bool(model_prefix(metadata))
    load_dcp({"model": wrapper} if prefixed else sd, path, metadata, key=key, fix=fix)
    if not prefixed:  # DCP filled the tensors of `sd`; the wrapper puts them into the model
        wrapper.load_state_dict(sd)
    refuse_bad_values(wrapper, key=key, path=path)
    logger.info("loaded model weights from %s", path)
