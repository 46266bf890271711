"""What the planner says of a pipeline is what runs: the stage split, and activations in flight.

    python -m pytest -q tests/distributed/test_pipeline_memory.py

One torchrun world of 2 CPU/gloo ranks (pp 2). For each schedule every rank builds the real
`Trainer` from configs/debug_model.toml (4 micro-batches of 1 sequence), records which blocks
each of its stage modules holds, and runs one `forward_backward` under a saved-tensors hook
that tracks the bytes autograd holds for backward: per stage and micro-batch (all of a stage's
forwards pack the same shapes) and the peak held at once.

Checked against the planner:
  - the dry run's stage split (`dry_run.json`'s ``pipeline.stages``) equals the blocks each of
    torch's PipelineStage objects ran in the step (recorded by the stage index the schedule gave
    it, not read from the trainer's layout), stage by stage, with the same pp rank;
  - the peak bytes held equal `plan.pipeline.peak_activations_in_flight` — the schedule's action
    list replayed with the measured per-stage bytes. This is the factor the memory estimate
    multiplies its per-block activation model (checked against saved tensors in
    tests/unit/test_plan.py) by. Bound 1e-3 relative: a few hundred bytes per micro-batch are
    saved and released again inside a forward (counted in the per-stage totals, never all alive
    at once); observed 5e-5.
  - split-backward schedules (ZBVZeroBubble, DualPipeV): torch 2.13 frees a micro-batch's saved
    tensors at its weight-gradient step except for the input-path part of the graph (the nodes
    the input-gradient step walked with retain_graph and the weight step does not revisit),
    which stays until the step ends: measured 4-12% of a stage's bytes per micro-batch here.
    The estimate releases everything at the weight step, so the measured peak may exceed it by
    that remainder: bound +15%, and never below the estimate by more than the transients.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

WORLD = 2
REPO = Path(__file__).resolve().parents[2]
BASE = ["--config", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", "32",
        "--training.local_batch_size", "4", "--training.steps", "1", "--parallelism.pipeline_parallel_degree", "2"]
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble", "DualPipeV"]


def _flags(schedule: str) -> list[str]:
    return [*BASE, "--parallelism.pipeline_parallel_schedule", schedule]


class _SavedBytes:
    """Tracks the bytes autograd saves for backward while active: per stage (the stage whose
    forward is running) and the peak held at once (a saved tensor is released with its graph
    node, which here is when the micro-batch's backward has used it)."""

    def __init__(self, stages: dict[int, object]) -> None:
        self.current = None
        self.per_stage = dict.fromkeys(stages, 0)
        self.live = self.peak = 0
        for sid, module in stages.items():
            module.register_forward_pre_hook(lambda mod, args, sid=sid: setattr(self, "current", sid))

    def pack(self, t):
        holder = _Held(t)
        size = t.numel() * t.element_size()
        self.per_stage[self.current] += size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._release, size)
        return holder

    def _release(self, size: int) -> None:
        self.live -= size

    @staticmethod
    def unpack(holder):
        return holder.tensor


class _Held:
    def __init__(self, tensor) -> None:
        self.tensor = tensor


def _measure(schedule: str, out_dir: Path) -> dict:
    from collections import defaultdict
    from unittest import mock

    import torch
    from torch.distributed.pipelining import PipelineStage

    from torchmoe.config.loader import load_job_config
    from torchmoe.training.loop import Trainer

    cfg = load_job_config([*_flags(schedule), "--job.dump_folder", str(out_dir / schedule)])
    trainer = Trainer(cfg)
    stages = dict(zip(trainer.pipe.ranks[trainer.pp_rank], trainer.model_parts))
    tracker = _SavedBytes(stages)
    # Which blocks each of torch's PipelineStage objects really ran, by the stage index the
    # schedule gave it (not the trainer's layout, which the dry run shares).
    ran: dict[int, set[int]] = defaultdict(set)
    running = {}
    forward_one_chunk = PipelineStage.forward_one_chunk

    def recording_forward(stage, *args, **kwargs):
        running["stage"] = stage.stage_index
        return forward_one_chunk(stage, *args, **kwargs)

    for part in trainer.model_parts:
        for name, block in part.layers.items():
            block.register_forward_pre_hook(lambda mod, args, i=int(name): ran[running["stage"]].add(i))
    batch = trainer.dataloader.next_batch()
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack), \
            mock.patch.object(PipelineStage, "forward_one_chunk", recording_forward):
        trainer.forward_backward(batch)
    record = {
        "pp_rank": trainer.pp_rank,
        "stage_layers": {str(sid): sorted(layers) for sid, layers in ran.items()},
        "per_microbatch": {str(sid): b / trainer.pp_microbatches for sid, b in tracker.per_stage.items()},
        "peak": tracker.peak, "microbatches": trainer.pp_microbatches, "num_stages": trainer.pipe.num_stages,
    }
    del trainer
    torch.distributed.barrier()
    return record


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    write_rank_record(out_dir, {schedule: _measure(schedule, out_dir) for schedule in SCHEDULES})


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("pp_memory"), world=WORLD, timeout=300)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dry_run_split_is_the_trainers(measured, schedule, tmp_path):
    import io

    from rich.console import Console

    from torchmoe.config.loader import load_job_config
    from torchmoe.plan.dry_run import run_dry_run

    cfg = load_job_config([*_flags(schedule), "--job.dump_folder", str(tmp_path)])
    planned = run_dry_run(cfg, WORLD, console=Console(file=io.StringIO()))["pipeline"]["stages"]
    built = {int(sid): (rank, layers) for rank in range(WORLD)
             for sid, layers in measured[rank][schedule]["stage_layers"].items()}
    assert sorted(built) == [s["stage"] for s in planned]
    for stage in planned:
        assert built[stage["stage"]] == (stage["pp_rank"], stage["layers"]), (schedule, stage)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_activations_in_flight_match_the_schedule(measured, schedule):
    from torchmoe.plan.pipeline import SPLIT_BACKWARD_SCHEDULES, peak_activations_in_flight

    for rank in range(WORLD):
        got = measured[rank][schedule]
        per_stage = {int(sid): b for sid, b in got["per_microbatch"].items()}
        assert all(b > 0 for b in per_stage.values()), (schedule, rank)
        want = peak_activations_in_flight(schedule, WORLD, got["num_stages"], got["microbatches"], rank, per_stage)
        if schedule in SPLIT_BACKWARD_SCHEDULES:
            assert want * (1 - 1e-3) <= got["peak"] <= want * 1.15, (schedule, rank, got["peak"], want)
        else:
            assert got["peak"] == pytest.approx(want, rel=1e-3), (schedule, rank, got["peak"], want)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
