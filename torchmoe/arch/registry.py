"""The model families torchmoe trains, by `model.name`, and the `ModelArgs` a `[model]` section means.

    python -c "from torchmoe.arch.registry import FLAVORS; print({k: list(v) for k, v in FLAVORS.items()})"

The one place a family's name is looked up: every other module reads `ModelArgs` (and its
`family`), never the name.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from torchmoe.arch import deepseek_v3, gpt_oss, llama4, qwen3
from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import Model

# model.name -> flavor name -> architecture. The names are torchtitan's, so its users find them.
FLAVORS: dict[str, dict[str, ModelArgs]] = {
    "llama4": llama4.FLAVORS,
    "qwen3": qwen3.FLAVORS,
    "deepseek_v3": deepseek_v3.FLAVORS,
    "gpt_oss": gpt_oss.FLAVORS,
}


# Names users give a family that torchmoe spells otherwise, by their letters and digits alone (lower
# case): Hugging Face's config.json model_type ("qwen3_moe", "llama4_text") and a release's name.
# Hugging Face's class names ("Qwen3MoeForCausalLM") end in one of _HF_CLASS_SUFFIXES.
_OTHER_NAMES = {"llama4text": "llama4", "qwen3moe": "qwen3", "kimik2": "deepseek_v3", "kimi": "deepseek_v3"}
_HF_CLASS_SUFFIXES = ("forcausallm", "forconditionalgeneration")


def _letters(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def family_meant(name: str) -> str | None:
    """The `model.name` that `name` most likely means: a family spelled with other separators or
    case ("deepseek-v3", "gpt_oss" as "gptoss", "Qwen3"), Hugging Face's model type or class name
    ("qwen3_moe", "Qwen3MoeForCausalLM"), a release ("kimi_k2"), or a typo that keeps the version
    ("lama4"; "llama3" and "deepseek_v2" are other families, never these); None otherwise."""
    key = _letters(name)
    for suffix in _HF_CLASS_SUFFIXES:
        key = key.removesuffix(suffix)
    families = {_letters(family): family for family in FLAVORS}
    if key in families or key in _OTHER_NAMES:
        return families.get(key) or _OTHER_NAMES[key]
    digits = lambda text: "".join(c for c in text if c.isdigit())  # noqa: E731
    close = difflib.get_close_matches(key, [k for k in families if digits(k) == digits(key)], n=1, cutoff=0.75)
    return families[close[0]] if close else None


def _setting(key: str, value: str) -> str:
    """How to set `key` to `value` in a fix: a flag (``--flavor tiny``) or a config key."""
    return f"pass {key} {value}" if key.startswith("-") else f"set {key} = {show_value(value)}"


def check_model(name: str, flavor: str, *, name_key: str = "model.name", flavor_key: str = "model.flavor") -> None:
    """`name` must be a family torchmoe trains and `flavor` one of its flavors; `name_key` and
    `flavor_key` are the settings that gave them (``--model-name`` and ``--flavor`` for convert).

    Raises:
        ConfigError: naming the setting that is wrong: the family when it is spelled otherwise
            (Hugging Face's "qwen3_moe": "did you mean qwen3"), or when it is a flavor's name; the
            flavor otherwise, naming the family it was looked up in, and the family it belongs to
            when it is another's (qwen3 with "scout").
    """
    families = ", ".join(show_value(family) for family in FLAVORS)
    if name not in FLAVORS:
        meant = family_meant(name)
        flavor_of = [family for family in FLAVORS if name in FLAVORS[family]]
        if meant is not None:
            fix = (f"did you mean {show_value(meant)}? {_setting(name_key, meant)} (torchmoe keeps torchtitan's "
                   "names of the families, not Hugging Face's)")
        elif flavor_of:
            fix = (f"{show_value(name)} is a flavor of {show_value(flavor_of[0])}: {_setting(name_key, flavor_of[0])} "
                   f"and {_setting(flavor_key, name).removeprefix('set ').removeprefix('pass ')}")
        else:  # e.g. a torchtitan file of a dense family: llama3
            fix = "use one of them, with one of its flavors (docs/models.md), or train this model family with torchtitan"
        raise ConfigError(name_key, name, f"torchmoe trains the mixture-of-experts families {families}", fix)
    own = list(FLAVORS[name])
    if flavor in own:
        return
    options = ", ".join(show_value(f) for f in own)
    # (family, its flavor of that name but for case) of the other families that have one
    others = [(family, next(f for f in FLAVORS[family] if f.lower() == flavor.lower())) for family in FLAVORS
              if family != name and flavor.lower() in map(str.lower, FLAVORS[family])]
    close = [f for f in own if f.lower() == flavor.lower()] or difflib.get_close_matches(flavor, own, n=1, cutoff=0.5)
    problem = f"not a flavor of {name_key} = {show_value(name)}"
    if others:
        problem += f" but of {' and '.join(show_value(family) for family, _ in others)}"
    fix = f"did you mean {show_value(close[0])}? " if close else ""
    fix += f"{name}'s flavors: {options}"
    if others:
        fix += f"; or {_setting(name_key, others[0][0])} to train its {show_value(others[0][1])}"
    raise ConfigError(flavor_key, flavor, problem, fix)


@dataclass
class FolderModel(Model):
    """A `[model]` section whose architecture is a Hugging Face folder's config.json, not a flavor
    (`weight_sources.folder_model.with_folder_model` makes it for a run that starts from one).

    Attributes:
        architecture: what config.json describes; the section's training settings
            (`attn_backend`, the balance losses, `mtp_layers`...) apply to it as to a flavor.
        source: the folder, for messages.
    """

    architecture: ModelArgs | None = None
    source: str = ""


def build_model_args(name: str, flavor: str, *, attn_backend: str = "", use_grouped_mm: bool = True,
                     load_balance_coeff: float = -1.0, aux_loss_coeff: float = -1.0,
                     z_loss_coeff: float = 0.0, moe_force_load_balance: bool = False, mtp_layers: int = 0,
                     mtp_loss_coeff: float = 0.1) -> ModelArgs:
    """Family `name`'s flavor `flavor` with overrides applied; sentinel values keep the flavor's
    own (`model_args_from_config` passes a `[model]` section's). Raises KeyError for an unknown
    family or flavor (the config checks name both before a model is built)."""
    return _with_overrides(FLAVORS[name][flavor], attn_backend=attn_backend, use_grouped_mm=use_grouped_mm,
                           load_balance_coeff=load_balance_coeff, aux_loss_coeff=aux_loss_coeff,
                           z_loss_coeff=z_loss_coeff, moe_force_load_balance=moe_force_load_balance,
                           mtp_layers=mtp_layers, mtp_loss_coeff=mtp_loss_coeff)


def _with_overrides(base: ModelArgs, *, attn_backend: str, use_grouped_mm: bool, load_balance_coeff: float,
                    aux_loss_coeff: float, z_loss_coeff: float, moe_force_load_balance: bool, mtp_layers: int,
                    mtp_loss_coeff: float) -> ModelArgs:
    """`base` (a flavor's or a folder's architecture) with a `[model]` section's training settings."""
    overrides: dict = {"use_grouped_mm": use_grouped_mm, "z_loss_coeff": z_loss_coeff,
                       "moe_force_load_balance": moe_force_load_balance, "mtp_layers": mtp_layers,
                       "mtp_loss_coeff": mtp_loss_coeff}
    if attn_backend:
        overrides["attn_backend"] = attn_backend
    if load_balance_coeff >= 0:
        overrides["load_balance_coeff"] = load_balance_coeff or None
    if aux_loss_coeff >= 0:
        overrides["aux_loss_coeff"] = aux_loss_coeff
    return base.replace(**overrides)


def model_args_from_config(model_cfg: Model, *, lora: bool = False) -> ModelArgs:
    """The `ModelArgs` a `[model]` config section describes: its flavor's, or for a `FolderModel`
    the folder's config.json's, with the section's training settings. With `lora` (the run trains
    adapters on a frozen base: `lora.enable`) the expert bias is part of that base: it stays the
    base's unless the section sets `load_balance_coeff` itself (its -1 means off, not the family's
    default).

    Raises:
        ConfigError: the family or the flavor is not one torchmoe has (`check_model`).
    """
    base = getattr(model_cfg, "architecture", None)
    if base is None:
        check_model(model_cfg.name, model_cfg.flavor)
        base = FLAVORS[model_cfg.name][model_cfg.flavor]
    balance = model_cfg.load_balance_coeff
    return _with_overrides(base, attn_backend=model_cfg.attn_backend, use_grouped_mm=model_cfg.use_grouped_mm,
                           load_balance_coeff=0.0 if lora and balance < 0 else balance,
                           aux_loss_coeff=model_cfg.aux_loss_coeff,
                           z_loss_coeff=model_cfg.z_loss_coeff, moe_force_load_balance=model_cfg.moe_force_load_balance,
                           mtp_layers=model_cfg.mtp_layers, mtp_loss_coeff=model_cfg.mtp_loss_coeff)
