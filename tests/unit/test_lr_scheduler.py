"""Exact LR factors of the warmup-stable-decay schedule, and the LambdaLR built from it."""

from __future__ import annotations

import math

import pytest
import torch

from torchmoe.config.job_config import LRScheduler as LRSchedulerConfig
from torchmoe.optim.lr_scheduler import build_lr_scheduler, lr_factor


def _f(step: int, **kw) -> float:
    return lr_factor(step, **kw)


def test_warmup_never_starts_at_zero() -> None:
    kw = dict(warmup_steps=4, total_steps=20)
    assert [_f(s, **kw) for s in (1, 2, 4)] == [1 / 5, 2 / 5, 4 / 5]
    # The first post-warmup step trains at the peak.
    assert _f(5, **kw) == 1.0


@pytest.mark.parametrize(
    "decay_type, expected",
    [
        # warmup 2, total 10, decay over the 8 post-warmup steps: p = (s - 3) / 8.
        ("linear", {3: 1.0, 4: 1 - 1 / 8, 7: 1 - 4 / 8, 10: 1 - 7 / 8}),
        ("sqrt", {3: 1.0, 4: 1 - math.sqrt(1 / 8), 7: 1 - math.sqrt(4 / 8), 10: 1 - math.sqrt(7 / 8)}),
        (
            "cosine",
            {3: 1.0, 4: 0.5 * (1 + math.cos(math.pi / 8)), 7: 0.5, 10: 0.5 * (1 + math.cos(7 * math.pi / 8))},
        ),
    ],
)
def test_decay_over_all_post_warmup_steps(decay_type: str, expected: dict[int, float]) -> None:
    for step, value in expected.items():
        got = _f(step, warmup_steps=2, total_steps=10, decay_type=decay_type)
        assert got == pytest.approx(value, abs=1e-12), step


def test_wsd_with_min_lr() -> None:
    # 100 steps, 10 warmup, last 20% (20 steps) decay linearly to 0.1: stable on 11..80.
    kw = dict(warmup_steps=10, total_steps=100, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.1)
    assert _f(10, **kw) == pytest.approx(10 / 11)
    assert _f(11, **kw) == 1.0 and _f(80, **kw) == 1.0
    assert _f(81, **kw) == 1.0  # p = 0
    assert _f(91, **kw) == pytest.approx(0.1 + 0.9 * (1 - 10 / 20))
    assert _f(100, **kw) == pytest.approx(0.1 + 0.9 * (1 / 20))
    assert _f(101, **kw) == pytest.approx(0.1)  # the limit, one step after the end
    assert _f(500, **kw) == pytest.approx(0.1)


def test_decay_ratio_longer_than_post_warmup_is_capped() -> None:
    kw = dict(warmup_steps=8, total_steps=10, decay_ratio=0.5)
    assert [_f(s, **kw) for s in (9, 10)] == [1.0, 0.5]


def test_lambda_lr_follows_lr_factor_and_round_trips() -> None:
    cfg = LRSchedulerConfig(warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.2)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = build_lr_scheduler(opt, cfg, total_steps=12)
    kw = dict(warmup_steps=3, total_steps=12, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.2)
    seen = []
    for step in range(1, 8):
        seen.append(opt.param_groups[0]["lr"])  # the LR that trains this step
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * lr_factor(s, **kw) for s in range(1, 8)])

    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched2 = build_lr_scheduler(opt2, cfg, total_steps=12)
    sched2.load_state_dict(sched.state_dict())
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]  # restored by the optimizer's state
    for _ in range(3):
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("warmup, ratio", [(20, -1.0), (5, 0.0), (5, 0.01)])
def test_no_decay_phase_holds_the_peak_past_the_end(warmup, ratio):
    """warmup == steps, or a decay ratio rounding to 0 steps: the scheduler's step after the
    last one must not divide by zero (it used to, losing the final checkpoint)."""
    kwargs = dict(warmup_steps=warmup, total_steps=20, decay_ratio=ratio)
    assert lr_factor(20, **kwargs) == (20 / 21 if warmup == 20 else 1.0)
    assert lr_factor(21, **kwargs) == 1.0


@pytest.mark.parametrize(("settings", "factors"), [
    # torchtitan v0.2.2's factors for steps 1..10, computed with its own LambdaLR (written out here):
    # its debug_model.toml (warmup 2, decay_ratio 0.8, linear, min 0.1), then decay right after warmup.
    (dict(decay_ratio=0.8, min_lr_factor=0.1), [0.5, 1.0, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125]),
    (dict(), [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]),
])
def test_warmup_reaches_peak_reproduces_torchtitan(settings: dict, factors: list[float]) -> None:
    cfg = LRSchedulerConfig(warmup_steps=2, warmup_reaches_peak=True, **settings)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_lr_scheduler(opt, cfg, 10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * f for f in factors], rel=1e-12)


def test_total_steps_sets_the_schedules_length() -> None:
    """A schedule of 20 steps in a 10-step run: the decay is half done at the end; past its
    end the LR holds at the minimum."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(opt, LRSchedulerConfig(warmup_steps=0, total_steps=20), 10)
    for _ in range(9):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1 - 9 / 20)  # step 10 of 20
    assert lr_factor(25, warmup_steps=0, total_steps=20) == 0.0


def test_state_resumes_into_another_number_of_param_groups() -> None:
    """The optimizer has one param group per (weight decay, mesh): 2 under FSDP, 3 once expert
    parallelism puts the experts on a mesh of their own. The schedule saved under one layout
    resumes under the other at the same step and LR (and from LambdaLR's own older state)."""
    cfg = LRSchedulerConfig(warmup_steps=2)
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    two = torch.optim.SGD([{"params": weights[:2]}, {"params": weights[2:]}], lr=0.1)
    saved = build_lr_scheduler(two, cfg, 10)
    for _ in range(4):
        two.step()
        saved.step()
    state = saved.state_dict()
    assert state == {"last_epoch": 4, "_step_count": 5, "base_lr": 0.1}
    older = torch.optim.lr_scheduler.LambdaLR.state_dict(saved)  # what checkpoints held before
    for resumed_state in (state, older):
        three = torch.optim.SGD([{"params": [w]} for w in weights], lr=0.1)
        resumed = build_lr_scheduler(three, cfg, 10)
        resumed.load_state_dict(resumed_state)
        # Step 5 (the first after the resume) trains at step 5's LR, and reports it.
        step5 = 0.1 * lr_factor(5, warmup_steps=2, total_steps=10)
        assert [g["lr"] for g in three.param_groups] == resumed.get_last_lr() == [step5] * 3
        three.step()
        resumed.step()  # to training step 6's LR, as the saved run's next step would be
        assert resumed.last_epoch == 5 and resumed.base_lrs == [0.1] * 3
        assert [g["lr"] for g in three.param_groups] == [0.1 * lr_factor(6, warmup_steps=2, total_steps=10)] * 3


def test_resume_keeps_each_groups_peak_for_muon() -> None:
    """Muon's groups peak at optimizer.lr, its AdamW groups at adamw_lr: a resume keeps both
    exactly (0.02 * (1.3e-3 / 0.02) would not be 1.3e-3), and a checkpoint whose peak differs
    from the run's scales both alike."""
    cfg = LRSchedulerConfig(warmup_steps=2)
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]

    def optimizer() -> torch.optim.SGD:
        return torch.optim.SGD([{"params": weights[:1], "lr": 0.02}, {"params": weights[1:], "lr": 1.3e-3}], lr=0.1)

    saved = build_lr_scheduler(optimizer(), cfg, 10)
    for _ in range(3):
        saved.step()
    resumed = build_lr_scheduler(optimizer(), cfg, 10)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.base_lrs == [0.02, 1.3e-3] and resumed.get_last_lr() == saved.get_last_lr()
    doubled = build_lr_scheduler(optimizer(), cfg, 10)
    doubled.load_state_dict({**saved.state_dict(), "base_lr": 0.04})
    assert doubled.base_lrs == pytest.approx([0.04, 2.6e-3], rel=1e-15)
