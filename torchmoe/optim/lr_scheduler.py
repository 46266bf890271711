"""Warmup-stable-decay learning-rate schedule.

    scheduler = build_lr_scheduler(optimizer, job_config.lr_scheduler, job_config.training.steps)
    for step in range(1, steps + 1):
        ...; optimizer.step(); scheduler.step()

Step numbering: training step s (1-based) trains with lr * lr_factor(s). The LambdaLR starts at
last_epoch=0, so its lambda maps epoch i to lr_factor(i + 1).

    factor
    1 |        _____________
      |      /              \\       warmup:  s / (warmup + 1)             s = 1 .. warmup
      |    /                  \\     stable:  1
      |  /                      \\   decay:   min + (1 - min) * shape(p),  p = (s - start - 1) / decay
      |/                           shape:   linear 1 - p, sqrt 1 - sqrt(p), cosine (1 + cos(pi p)) / 2
      +---------------------------- s
        warmup     stable     decay      (start = steps - decay, the last step before decaying)

Neither end reaches its limit inside training: step 1 trains at lr / (warmup + 1), never 0 (a
step at lr 0 is wasted compute), and the last step at p = (decay - 1) / decay, just above
lr * min_lr_factor, which the curve reaches one step after the end. The first decay step trains
at the peak, so even with decay over all post-warmup steps (decay_ratio = -1) the peak is used.
The decay is torchtitan v0.2.2's; its warmup is s / warmup (the last warmup step at the peak),
which `warmup_reaches_peak = true` selects. `total_steps` (default: training.steps) is where
the decay ends; steps past it hold lr * min_lr_factor.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchmoe.config.job_config import LRScheduler as LRSchedulerConfig

logger = logging.getLogger(__name__)

# Decay progress in [0, 1] -> the share of (peak - min) LR still applied.
_DECAY_SHAPES = {
    "linear": lambda progress: 1.0 - progress,
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def decay_steps_for(total_steps: int, warmup_steps: int, decay_ratio: float) -> int:
    """Number of decay steps at the end: all post-warmup steps when decay_ratio < 0 (default -1),
    else round(decay_ratio * total_steps), capped at the post-warmup steps."""
    post_warmup = max(total_steps - warmup_steps, 0)
    if decay_ratio < 0:
        return post_warmup
    return min(round(decay_ratio * total_steps), post_warmup)


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_ratio: float = -1.0,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
    warmup_reaches_peak: bool = False,
) -> float:
    """The multiplier of the peak LR used by training step `step` (1-based); see module docstring."""
    return _factor(
        step,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps_for(total_steps, warmup_steps, decay_ratio),
        total_steps=total_steps,
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
        warmup_reaches_peak=warmup_reaches_peak,
    )


def _factor(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    decay_type: str,
    min_lr_factor: float,
    warmup_reaches_peak: bool,
) -> float:
    if step <= warmup_steps:
        return step / (warmup_steps if warmup_reaches_peak else warmup_steps + 1)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        # Without a decay phase only the scheduler's step past the last one lands here: hold.
        return 1.0
    progress = min((step - decay_start - 1) / decay_steps, 1.0)
    return min_lr_factor + (1.0 - min_lr_factor) * _DECAY_SHAPES[decay_type](progress)


class LayoutFreeLambdaLR(LambdaLR):
    """A LambdaLR whose checkpointed state does not depend on the layout.

    The optimizer has one param group per (weight decay, mesh) (`optimizer.build_optimizer`), so
    their number differs between layouts (FSDP alone: 2; with expert parallelism the experts'
    mesh adds one), and LambdaLR's own state holds one base LR per group. Every group has the
    job's peak LR (with Muon: Muon's groups optimizer.lr, AdamW's adamw_lr, in a fixed ratio), so
    the state is the schedule's position and the first group's LR, and a run resumes under any
    layout.
    """

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count, "base_lr": self.base_lrs[0]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Raises:
            ValueError: a position that is no step count, or a peak LR that is no finite number >= 0
                (a checkpoint altered or crafted: one sentence, which the loader names the folder of).
        """
        # Checkpoints written before this class hold LambdaLR's own state (a list of base LRs).
        base_lr = state_dict["base_lr"] if "base_lr" in state_dict else state_dict["base_lrs"][0]
        for name in ("last_epoch", "_step_count"):
            value = state_dict[name]
            if type(value) is not int or not 0 <= value < 2**63:
                raise ValueError(f"the LR schedule's {name} is {value!r:.40}, not a step count (an integer >= 0)")
        if type(base_lr) not in (int, float) or not (math.isfinite(base_lr) and base_lr >= 0):
            raise ValueError(f"the LR schedule's base_lr (its peak LR) is {base_lr!r:.40}, not a finite number >= 0")
        # The saved peak is the first group's; the others keep their ratio to it (Muon's AdamW
        # groups: adamw_lr / lr), untouched when the peak is this run's, so that they are exact.
        if base_lr != self.base_lrs[0]:
            self.base_lrs = [base_lr * (lr / self.base_lrs[0]) for lr in self.base_lrs]
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        # The next step trains at the resumed position's LR, whatever the optimizer's groups held.
        for group, lr_lambda, lr in zip(self.optimizer.param_groups, self.lr_lambdas, self.base_lrs):
            group["lr"] = lr * lr_lambda(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> LambdaLR:
    """A `LayoutFreeLambdaLR` following `lr_factor`; its state_dict (last_epoch, the peak LR)
    checkpoints it.

    Args:
        optimizer: the optimizer whose param groups' lr is the peak LR.
        cfg: the `[lr_scheduler]` section.
        total_steps: training.steps (the schedule's length unless `cfg.total_steps` sets another).
    """
    if cfg.total_steps > 0:
        total_steps = cfg.total_steps
    decay_steps = decay_steps_for(total_steps, cfg.warmup_steps, cfg.decay_ratio)
    if cfg.decay_ratio >= 0 and decay_steps < round(cfg.decay_ratio * total_steps):
        logger.warning(
            "lr_scheduler: warmup_steps(%d) + decay_ratio(%g) * steps(%d) > steps; "
            "decaying over the %d post-warmup steps instead",
            cfg.warmup_steps, cfg.decay_ratio, total_steps, decay_steps,
        )
    return LayoutFreeLambdaLR(
        optimizer,
        lambda i: _factor(
            i + 1,
            warmup_steps=cfg.warmup_steps,
            decay_steps=decay_steps,
            total_steps=total_steps,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
            warmup_reaches_peak=cfg.warmup_reaches_peak,
        ),
    )
