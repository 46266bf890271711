"""The optimizer and its learning-rate schedule: the one place that says which parameters train
and how each group of them is updated.

A trainable subset (LoRA: the adapters, not the frozen base) is a predicate over the named
parameters: the others get no gradient and no optimizer state. The parameter groups are
`optim.optimizer.build_optimizer`'s, each named by what sets it apart (weight decay or not,
mesh); an optimizer that updates some groups its own way (Muon: the hidden matrices, AdamW the
rest) is built here from those named groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LRScheduler

from torchmoe.config.job_config import LRScheduler as LRSchedulerConfig
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.optim.lr_scheduler import build_lr_scheduler
from torchmoe.optim.muon_groups import describe_split
from torchmoe.optim.optimizer import build_optimizer
from torchmoe.optim.qk_clip import QKClip

TrainableSubset = Callable[[str, nn.Parameter], bool]  # (full parameter name, parameter) -> trains?


def every_parameter(name: str, param: nn.Parameter) -> bool:
    """Full training: every parameter trains (pretraining's subset)."""
    return True


@dataclass
class Optimization:
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler  # stepped after each optimizer step
    # The run's opening lines on which parameters which algorithm updates (Muon's split into
    # Muon and AdamW tensors); none for an optimizer that updates every parameter alike.
    description: list[str]
    # QK-Clip (`optimizer.qk_clip_threshold`): the attention weights rescaled after each step; None: off.
    qk_clip: QKClip | None = None


def build_optimization(model: nn.Module, optimizer_cfg: OptimizerConfig, lr_cfg: LRSchedulerConfig, steps: int,
                       *, trainable: TrainableSubset = every_parameter, watched: list[str] | None = None,
                       n_heads: int = 0, device: torch.device | None = None) -> Optimization:
    """The optimizer over the parameters of `model` that `trainable` keeps (the others are frozen:
    ``requires_grad`` false), its schedule over `steps` steps, its opening lines (Muon: the
    split's tensor and element counts per algorithm and role, `muon_groups.describe_split`), and
    QK-Clip over the `watched` attention layers (`BuiltModel.watched`, of `n_heads` heads) when
    ``optimizer.qk_clip_threshold`` is set."""
    for name, param in model.named_parameters():
        param.requires_grad_(trainable(name, param))
    optimizer = build_optimizer(model, optimizer_cfg)
    description = describe_split(model, optimizer_cfg) if optimizer_cfg.name.lower() == "muon" else []
    qk_clip = QKClip(model, watched, optimizer_cfg.qk_clip_threshold, n_heads, device) if watched else None
    return Optimization(optimizer, build_lr_scheduler(optimizer, lr_cfg, steps), description, qk_clip)
