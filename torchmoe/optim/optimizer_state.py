"""Whether a checkpoint's optimizer state is what this run's optimizer keeps, per parameter.

    refuse_other_state(optimizer_wrapper.state_dict(), saved_shapes)   # before a resume loads

AdamW keeps ``exp_avg``, ``exp_avg_sq`` and ``step`` for a parameter, Muon a ``momentum_buffer``
for its matrices (and AdamW's for the rest): a checkpoint of the one cannot continue the other.
"""

from __future__ import annotations

from typing import Any

from torchmoe.config.errors import ConfigError

__all__ = ["refuse_other_state"]

_FRESH = 'or keep these weights with fresh optimizer state: checkpoint.exclude_from_loading = ["optimizer"]'


def _state_names(flat: dict[str, Any]) -> dict[str, set[str]]:
    """Parameter FQN -> the names of its optimizer state, from the keys of a flattened optimizer
    state dict (``state.<fqn>.<name>``; DCP's ``flatten_optimizer_state_dict``)."""
    names: dict[str, set[str]] = {}
    for key in flat:
        if key.startswith("state."):
            fqn, _, name = key[len("state."):].rpartition(".")
            names.setdefault(fqn, set()).add(name)
    return names


def _kind(names: dict[str, set[str]]) -> str:
    """The optimizer that keeps state `names` (FQN -> state names; Adam's are AdamW's)."""
    return "Muon" if any("momentum_buffer" in n for n in names.values()) else "AdamW"


def refuse_other_state(current: dict[str, Any], saved: dict[str, Any]) -> None:
    """Raise when a parameter's saved optimizer state has other names than `current`'s.

    Args:
        current: this run's flattened optimizer state dict.
        saved: the checkpoint's optimizer entries (flattened keys; values unused).
    Raises:
        ConfigError: on optimizer.name, for a switch between AdamW and Muon, or another split of
            the parameters between them, with the fixes.
    """
    held_by, kept_by = _state_names(saved), _state_names(current)
    ours, theirs = _kind(kept_by), _kind(held_by)
    for fqn, names in kept_by.items():
        held = held_by.get(fqn)
        if held is None or held == names:
            continue
        keeps, holds = ", ".join(sorted(names)), ", ".join(sorted(held))
        if ours != theirs:
            raise ConfigError("optimizer.name", ours, f"does not match the run's checkpoints: they hold {theirs}'s "
                              f"state for {fqn} ({holds}), {ours} keeps {keeps}",
                              f'resume with optimizer.name = "{theirs}"; {_FRESH}; or give this run its own '
                              "job.dump_folder")
        raise ConfigError("optimizer.name", ours, f"splits the parameters otherwise than the run's checkpoints: "
                          f"they hold {holds} for {fqn}, this run keeps {keeps}",
                          "resume with the optimizer.muon_router, muon_params and adamw_params the checkpoints "
                          f"were saved with; {_FRESH}")
