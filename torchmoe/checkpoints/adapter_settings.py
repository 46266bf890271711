"""What a LoRA checkpoint's tensors mean, and a resume held to it: the settings they were trained
under, recorded in every checkpoint (`AdapterSettings`), and the refusal of saved tensors that
other settings would read into other places (`check_saved_adapters`), each naming the setting,
the checkpoint's value and the run's.

    state["lora"] = AdapterSettings(cfg.lora, balance)                    # saved with each checkpoint
    ModelWrapper(model, keep=..., check=lambda shapes: check_saved_adapters(shapes, expected, cfg.lora, balance))

    python -m pytest -q tests/integration/test_lora_training.py -k settings

A checkpoint's adapters are what was trained only under the settings that shaped and scaled them:

    lora.enable               a LoRA checkpoint holds the adapters, a full fine-tuning one the model
    lora.targets              which modules hold adapters (fewer would drop trained ones)
    lora.rank                 their shapes
    lora.alpha                their scale, alpha / rank: another alpha is another model
    lora.dropout              how they train: the resumed run would not be the one trained
    model.load_balance_coeff  on or off: whether the checkpoint holds the expert biases the run
                              trains (their rate may change, as it may in full fine-tuning)

A resume with another is refused. The shapes give the first four and the biases away before
anything loads (`check_saved_adapters`, the `ModelWrapper`'s check); alpha and dropout are in
the record alone, compared as it loads (`AdapterSettings.load_state_dict`). Harmless, and not
compared: ``lora.export`` (what the export writes), ``lora.checkpoint_base`` (where the base is
read from: its fingerprint is checked, `checkpoints.base_fingerprint`) and ``lora.adapter`` (a new
run's start: a resume continues its checkpoint's adapters).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import LoRA
from torchmoe.models.decoder.lora import target_of
from torchmoe.nn.lora import is_adapter_name

__all__ = ["AdapterSettings", "check_saved_adapters"]

_BALANCE = "model.load_balance_coeff"
_NEW_RUN = "or start a new run in another job.dump_folder"
# Why each setting's change is refused, after "the run's checkpoints were trained with KEY = VALUE: ".
_WHY = {
    "lora.targets": "they hold adapters on those modules alone",
    "lora.rank": "their adapters have that rank",
    "lora.alpha": "their adapters are scaled by alpha / rank, so another alpha makes another model of the same "
                  "tensors (and the adapter export would claim it)",
    "lora.dropout": "the resumed run would not be the one trained (and the adapter export would claim its dropout)",
    _BALANCE: "whether they hold the expert biases the run trains",
}


def _trains(balance: float) -> bool:
    """Whether a LoRA run's `model.load_balance_coeff` trains the expert biases (-1: unset, which
    LoRA leaves off; 0: off)."""
    return balance > 0


def _balance_fix(trained: bool) -> str:
    """The fix for a resume that would change whether the expert biases train (`trained`: the
    checkpoint's run trained them)."""
    wanted = "a value > 0, as the run had it (its config.toml)" if trained else "-1 (unset) or 0, as the run had it"
    return f"set {_BALANCE} to {wanted}, {_NEW_RUN}"


def _refuse(key: str, value: Any, saved: Any, found: str = "") -> ConfigError:
    """The error for a resume whose `key` = `value` differs from the checkpoint's `saved`
    (`found`: where its tensors show it)."""
    if key == _BALANCE:
        fix = _balance_fix(_trains(saved))
    elif key == "lora.dropout":
        fix = (f"set {key} = {show_value(saved)} as the run trained, {_NEW_RUN} whose lora.adapter is an adapter "
               "export of this run (its adapters, trained on with the new dropout)")
    else:
        fix = f"set {key} = {show_value(saved)} as the run trained, {_NEW_RUN}"
    return ConfigError(key, value, f"the run's checkpoints were trained with {key} = {show_value(saved)}{found}: "
                       f"{_WHY[key]}", fix)


class AdapterSettings(Stateful):
    """The settings a LoRA run's adapters were trained under (`state["lora"]`): saved with each
    checkpoint, compared as a resume loads it.

    Args:
        lora: the run's `[lora]`.
        balance: the run's `model.load_balance_coeff` as set (-1: unset).
    """

    # Checkpoints of LoRA runs from before the record (torchmoe of 2026-12-07) hold none: they
    # resume with what the shapes show checked (`check_saved_adapters`), alpha and dropout not.
    optional_in_checkpoints = True

    def __init__(self, lora: LoRA, balance: float) -> None:
        self.settings = {"lora.targets": list(lora.targets), "lora.rank": lora.rank, "lora.alpha": lora.alpha,
                         "lora.dropout": lora.dropout, _BALANCE: balance}

    def state_dict(self) -> dict[str, Any]:
        return {"settings": json.dumps(self.settings, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises:
            ConfigError: a setting differs from the checkpoint's (naming it, both values and the fix).
        """
        saved = json.loads(state_dict["settings"])
        for key, value in self.settings.items():
            before = saved.get(key, value)
            differs = _trains(before) != _trains(value) if key == _BALANCE else \
                sorted(before) != sorted(value) if key == "lora.targets" else before != value
            if differs:
                raise _refuse(key, value, before)


def _in_order(targets: set[str], order: Sequence[str]) -> list[str]:
    """`targets` in `lora.targets`' order where it names them, the others after."""
    return sorted(targets, key=lambda t: (order.index(t) if t in order else len(order), t))


def _rank_of(name: str, shape: Sequence[int]) -> int:
    """The rank of an adapter tensor `name` of `shape`: A is (..., r, in), B (..., out, r)."""
    return shape[-2] if name.endswith("_a") else shape[-1]


def check_saved_adapters(saved: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]] | None,
                         lora: LoRA, balance: float) -> None:
    """Refuse, before anything loads, a checkpoint whose model tensors `saved` (name -> shape) are
    not the LoRA run's `expected` (the whole model's tensors it checkpoints: the adapters and the
    expert biases it trains, name -> shape; None: a full fine-tuning run) by a setting that
    decides them.

    Args:
        lora: the run's `[lora]`; balance: its `model.load_balance_coeff` as set.

    Raises:
        ConfigError: naming `lora.enable`, `lora.targets`, `lora.rank` or `model.load_balance_coeff`,
            the checkpoint's value (as its tensors show it) and the run's.
    """
    adapters = sorted(name for name in saved if is_adapter_name(name))
    if expected is None:
        if adapters:
            raise ConfigError("lora.enable", False, f"the run's checkpoints are a LoRA run's (they hold adapters, e.g. "
                              f"{adapters[0]}, not the base): a full fine-tuning run cannot continue them",
                              "set lora.enable = true with the run's [lora] settings (its config.toml); "
                              "to fine-tune the whole trained model, write it merged (torchmoe convert dcp-to-hf STEP "
                              "OUT --lora-export merged) and start a new run from that folder in another "
                              "job.dump_folder")
        return
    if saved and not adapters:
        raise ConfigError("lora.enable", True, "the run's checkpoints are a full fine-tuning run's (the whole model, "
                          "no adapters): a LoRA run cannot continue them", "set lora.enable = false, "
                          f"{_NEW_RUN} (checkpoint.initial_load_path = a step-N of this run adapts what it trained)")
    held = {target_of(name) for name in adapters}
    if held != {target_of(name) for name in expected if is_adapter_name(name)}:
        found = f" (they hold adapters such as {adapters[0]})"
        raise _refuse("lora.targets", list(lora.targets), _in_order(held, lora.targets), found)
    for name, shape in expected.items():
        if name in saved and is_adapter_name(name) and _rank_of(name, saved[name]) != _rank_of(name, shape):
            raise _refuse("lora.rank", lora.rank, _rank_of(name, saved[name]), f" ({name} is {tuple(saved[name])})")
    biases = sorted(name for name in saved if not is_adapter_name(name))
    if bool(biases) != any(not is_adapter_name(name) for name in expected):
        held_biases = (f"hold the expert biases the run trained (e.g. {biases[0]}), which this run would leave at the "
                       "base's" if biases else "hold no expert bias (the run left them at the base's), which this run "
                       "would train from the base's in mid-run")
        raise ConfigError(_BALANCE, balance, f"the run's checkpoints {held_biases}", _balance_fix(bool(biases)))
    extra = sorted(set(adapters) - set(expected))
    if extra:  # the flavor's check (`ModelWrapper`) sees the run's own tensors only
        raise ConfigError("lora.targets", list(lora.targets), f"the run's checkpoints hold {len(extra)} adapter "
                          f"tensors this run's model has no place for (e.g. {extra[0]}): resuming would drop what "
                          "they trained", f"resume with the model and [lora] settings of the run (its config.toml), "
                          f"{_NEW_RUN}")
