"""Muon's state through the checkpoint path (DCP, `OptimizerWrapper`, the LR schedule): exact
resume, and a resume across AdamW and Muon refused with the fix.

    python -m pytest -q tests/unit/test_muon_checkpoint.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchmoe.checkpoints.checkpoint import CheckpointManager
from torchmoe.checkpoints.checkpoint_state import ModelWrapper, OptimizerWrapper
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Checkpoint as CheckpointConfig
from torchmoe.config.job_config import LRScheduler as LRSchedulerConfig
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.nn.experts import GroupedExperts
from torchmoe.optim.lr_scheduler import build_lr_scheduler
from torchmoe.optim.optimizer import build_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MUON = OptimizerConfig(name="Muon", lr=0.02, adamw_lr=1e-3, adamw_weight_decay=0.01)
ADAMW = OptimizerConfig(name="AdamW", lr=1e-3)


class _Net(nn.Module):
    """An embedding, a projection, routed experts (3-D), a norm and the head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 12)
        self.experts = GroupedExperts(8, 6, 3, use_grouped_mm=False)
        for w in (self.experts.w1, self.experts.w2, self.experts.w3):
            nn.init.normal_(w)
        self.norm = nn.RMSNorm(8)
        self.output = nn.Linear(8, 16, bias=False)


class _Run:
    def __init__(self, cfg: OptimizerConfig) -> None:
        self.model = _Net()
        self.opt = build_optimizer(self.model, cfg)
        self.sched = build_lr_scheduler(self.opt, LRSchedulerConfig(warmup_steps=2), 10)
        self.state = {"model": ModelWrapper(self.model), "optimizer": OptimizerWrapper(self.model, self.opt),
                      "lr_scheduler": self.sched}

    def step(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        for p in self.model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        self.opt.step()
        self.sched.step()


def _manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(tmp_path, CheckpointConfig(enable=True, interval=1, **kw), total_steps=10)


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Saved after step 2, resumed into a new run: steps 3 and 4 equal the unbroken run's, bit for
    bit (Muon's momentum buffers, AdamW's moments, each group's LR: Muon's and adamw_lr)."""
    run = _Run(MUON)
    for step in (1, 2):
        run.step(step)
    _manager(tmp_path).save(2, run.state)
    keys = set(dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-2")).read_metadata().state_dict_metadata)
    assert {"optimizer.state.proj.weight.momentum_buffer", "optimizer.state.experts.w1.momentum_buffer",
            "optimizer.state.proj.bias.exp_avg", "optimizer.state.output.weight.exp_avg_sq"} <= keys
    assert not any(k.startswith("optimizer.state.proj.weight.exp_avg") for k in keys)
    resumed = _Run(MUON)
    assert _manager(tmp_path).load_latest(resumed.state) == 2
    assert [g["lr"] for g in resumed.opt.param_groups] == [g["lr"] for g in run.opt.param_groups]
    for step in (3, 4):
        run.step(step)
        resumed.step(step)
    for (name, a), b in zip(run.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("saved, resumed", [(ADAMW, MUON), (MUON, ADAMW)])
def test_switching_optimizer_on_resume_is_refused(tmp_path: Path, saved: OptimizerConfig,
                                                  resumed: OptimizerConfig) -> None:
    run = _Run(saved)
    run.step(1)
    _manager(tmp_path).save(1, run.state)
    with pytest.raises(ConfigError) as err:
        _manager(tmp_path).load_latest(_Run(resumed).state)
    ours, theirs = resumed.name, saved.name
    states = {"Muon": "momentum_buffer", "AdamW": "exp_avg, exp_avg_sq, step"}
    assert str(err.value) == (
        f'optimizer.name = "{ours}": does not match the run\'s checkpoints: they hold {theirs}\'s state for '
        f"proj.weight ({states[theirs]}), {ours} keeps {states[ours]}\n"
        f'  fix: resume with optimizer.name = "{theirs}"; or keep these weights with fresh optimizer state: '
        'checkpoint.exclude_from_loading = ["optimizer"]; or give this run its own job.dump_folder')
    fresh = _Run(resumed)
    assert _manager(tmp_path, exclude_from_loading=["optimizer"]).load_latest(fresh.state) == 1
    assert torch.equal(fresh.model.proj.weight, run.model.proj.weight)


def test_another_split_is_refused(tmp_path: Path) -> None:
    run = _Run(MUON)
    run.step(1)
    _manager(tmp_path).save(1, run.state)
    with pytest.raises(ConfigError, match=r"^optimizer.name = \"Muon\": splits the parameters otherwise than the "
                       r"run's checkpoints: they hold momentum_buffer for proj.weight, this run keeps exp_avg, "
                       r"exp_avg_sq, step\n  fix: resume with the optimizer.muon_router, muon_params and "
                       r"adamw_params the checkpoints were saved with"):
        _manager(tmp_path).load_latest(_Run(OptimizerConfig(**{**vars(MUON), "adamw_params": ["proj.*"]})).state)


def test_a_crafted_ns_steps_is_refused() -> None:
    """Newton-Schulz runs ns_steps iterations per matrix: a checkpoint's count outside
    torch.optim.Muon's range (a run that would never finish its step) is refused on load."""
    run = _Run(MUON)
    run.step(1)
    state = run.state["optimizer"].state_dict()
    state["param_groups.proj.weight.ns_steps"] = 10**9
    with pytest.raises(ValueError, match=r"^the optimizer's param_groups.proj.weight.ns_steps is 1000000000, "
                                         r"not a whole number in 1 \.\. 99$"):
        run.state["optimizer"].load_state_dict(state)
