"""Which built-in flavor a checkpoint's weights belong to.

    matching_flavor(args_from_hf_config(config))      # the flavor of a Hugging Face config, or None
    require_fit("model.flavor", "tiny", args, model_tensors(metadata), "checkpoint.initial_load_path /x")

A Hugging Face config spells out the whole architecture, so at most one flavor matches it (Scout's
is `scout`, not torchtitan's `17bx16e`, which has its shapes but computes differently). A DCP
checkpoint records only its tensors' names and shapes, so a checkpoint of another flavor shows as
tensors that do not fit; the error then names the flavors that fit, several where flavors share
shapes (`scout`, `17bx16e`, `17bx16e_irope`), and suggests the first in `FLAVORS` order. torchmoe's
flavors come first there, so for a release's shapes that is the release's architecture (`scout`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import FLAVORS
from torchmoe.config.errors import ConfigError
from torchmoe.models.decoder.model import Transformer
from torchmoe.models.hf_config_spec import HFConversionError
from torchmoe.models.registry import hf_mapping
from torchmoe.weights.weight_files import misfit

__all__ = ["flavor_fix", "flavors_fitting", "matching_flavor", "meta_state", "require_fit", "stored_mtp_layers"]

# Hugging Face config fields that do not change what the model computes: the dtype, the length
# limit (the released configs advertise 10M positions; torchmoe caps its RoPE table anyway), and
# fields the explicit ones restate (interleave step -> moe_layers, NoPE interval -> no_rope_layers,
# rope_theta / rope_scaling -> rope_parameters).
# The multi-token prediction layers are the training objective's, not the flavor's.
_NOT_ARCHITECTURE = ("dtype", "max_position_embeddings", "interleave_moe_layer_step", "no_rope_layer_interval",
                     "rope_theta", "rope_scaling", "num_nextn_predict_layers")
_MTP_PROJECTION = re.compile(r"^mtp\.\d+\.eh_proj\.weight$")


def _architecture(args: ModelArgs) -> dict | None:
    """A canonical description of what `args` computes: its Hugging Face config, which spells out
    derived settings (RoPE/NoPE and MoE layers) that `ModelArgs` may leave implicit; None when the
    family's Hugging Face model cannot express it (DeepSeek-V3's softmax-scored flavors)."""
    try:
        config = hf_mapping(args).hf_config_from_args(args, torch.float32)
    except HFConversionError:
        return None
    return {k: v for k, v in config.items() if k not in _NOT_ARCHITECTURE}


def matching_flavor(args: ModelArgs) -> str | None:
    """The built-in flavor of the family of `args` with exactly its architecture, or None."""
    want = _architecture(args)
    if want is None:
        return None
    return next((name for name, flavor in FLAVORS[args.family].items() if _architecture(flavor) == want), None)


def meta_state(args: ModelArgs) -> dict[str, torch.Tensor]:
    """The state dict (parameters and persistent buffers) of a model of `args`, on the meta device."""
    with torch.device("meta"):
        return Transformer(args).state_dict()


@functools.cache
def _flavor_shapes(family: str, flavor: str, mtp_layers: int = 0) -> dict[str, tuple[int, ...]]:
    args = FLAVORS[family][flavor].replace(mtp_layers=mtp_layers)
    return {name: tuple(t.shape) for name, t in meta_state(args).items()}


def stored_mtp_layers(names: Iterable[str]) -> int:
    """The multi-token prediction modules a checkpoint's model tensors hold (torchmoe's names)."""
    return sum(1 for name in names if _MTP_PROJECTION.match(name))


def flavors_fitting(shapes: Mapping[str, Sequence[int]], family: str) -> list[str]:
    """The built-in flavors of `family` whose model (with the checkpoint's multi-token prediction
    modules) holds exactly tensors of these names and `shapes` (a checkpoint's model tensors), in
    `FLAVORS` order."""
    have = {name: tuple(shape) for name, shape in shapes.items()}
    mtp = stored_mtp_layers(have)
    return [flavor for flavor in FLAVORS[family] if _flavor_shapes(family, flavor, mtp) == have]


def flavor_fix(flag: str, fits: list[str]) -> str | None:
    """The fix that passes the first flavor of `fits` to `flag` (``--model.flavor``), naming the
    others, which a checkpoint cannot tell apart; None when no flavor fits."""
    if not fits:
        return None
    fix = f"pass {flag} {fits[0]}"
    if len(fits) > 1:
        fix += (f" (its tensors also fit {', '.join(fits[1:])}, which differ only in attention or RoPE: "
                "if it was trained with one of those, pass that one)")
    return fix


def require_fit(key: str, flavor: str, args: ModelArgs, stored: Mapping[str, TensorStorageMetadata],
                source: str, *, family_key: str = "model.name") -> None:
    """Raise a `ConfigError` naming `key` (a flavor option: ``model.flavor``, ``--flavor``) when the
    `stored` model tensors of `source` are not those of a model of `args` (built from `flavor`);
    the fix names the built-in flavors they fit, if any (`flavor_fix`). Tensors that fit no flavor
    of the family but another family's are the family's fault: `family_key` (``model.name``,
    ``--model-name``) is named, with the family and flavor they fit. Multi-token prediction
    modules the checkpoint holds beyond the model's are skipped; fewer are refused naming
    ``model.mtp_layers``."""
    held = stored_mtp_layers(stored)
    if args.mtp_layers > held:
        raise ConfigError("model.mtp_layers", args.mtp_layers, f"{source} holds {held} multi-token prediction "
                          "modules", f"set model.mtp_layers to {held} or less")
    problem = misfit(meta_state(args.replace(mtp_layers=held)), stored, extra_ok=False)
    if problem is None:
        return
    shapes = {name: md.size for name, md in stored.items()}
    fits = flavors_fitting(shapes, args.family)
    flag = lambda name: name if name.startswith("-") else f"--{name}"  # noqa: E731
    if not fits:
        other = next(((family, found) for family in FLAVORS if family != args.family
                      for found in [flavors_fitting(shapes, family)] if found), None)
        if other is not None:
            family, found = other
            raise ConfigError(family_key, args.family, f"{source} holds a {family} model (its tensors fit {family}'s "
                              f"{', '.join(found)}), not a {args.family} one",
                              f"pass {flag(family_key)} {family} {flag(key)} {found[0]}")
    fix = flavor_fix(flag(key), fits)
    raise ConfigError(key, flavor, f"does not fit {source}: {problem}",
                      fix or "pass the flavor the checkpoint was trained with")
