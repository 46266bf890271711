"""Divergence: state that became NaN/inf stops the run (exit 1, naming the step) before it is
saved, so no checkpoint ever holds it.

The per-step checks ride on the step's one host sync (`Trainer.train_step`): the loss, the
gradient norm, and whether an MoE expert bias is finite. Parameters and optimizer state are
checked in full only before a save (`nonfinite_state`): a pass over every tensor each step
would cost what a save does, and a non-finite update shows up in the next step's loss anyway.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class TrainingDiverged(RuntimeError):
    """Training state became NaN/inf; the run stops without saving that state."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def nonfinite_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of this rank's parameters, buffers and optimizer states (``<param>.exp_avg``)
    holding NaN/inf, in model order. One host sync for all of them."""
    names_of = {p: name for name, p in model.named_parameters()}
    named: list[tuple[str, torch.Tensor]] = [*model.named_parameters(), *model.named_buffers()]
    for p, state in optimizer.state.items():
        named += [(f"{names_of.get(p, '?')}.{k}", v) for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]
    named = [(n, t) for n, t in named if t.is_floating_point() and _local(t).numel()]
    if not named:
        return []
    bad = torch.stack([~torch.isfinite(_local(t)).all() for _, t in named]).tolist()
    return [name for (name, _), b in zip(named, bad) if b]
