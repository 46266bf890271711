"""The pipeline planner: stage placement, the cost-model split, the bubble, activations in flight.

    python -m pytest -q tests/unit/test_pipeline_plan.py

Each is checked against something independent of `plan/pipeline.py`: torch's own stage-to-rank
mapping, a brute-force search over every split, the closed-form bubble of GPipe / 1F1B /
interleaved 1F1B, and micro-batch counts written out by hand.
"""

from __future__ import annotations

import io
import itertools
import math

import pytest
from rich.console import Console
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Parallelism
from torchmoe.config.loader import load_job_config
from torchmoe.config.validate import PIPELINE_SCHEDULES
from torchmoe.models.llama4 import FLAVORS
from torchmoe.plan.dry_run import run_dry_run
from torchmoe.plan.parallel_dims import MESH_DIMS, ParallelDims
from torchmoe.plan.pipeline import (
    SCHEDULE_STYLES,
    bubble_fraction,
    layer_costs,
    peak_activations_in_flight,
    pipeline_layout,
    split_by_cost,
    split_by_count,
    stage_costs,
    stage_ranks,
)
from torchmoe.preflight import validate_job_config


def _dims(**degrees: int) -> ParallelDims:
    full = dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1) | degrees
    return ParallelDims(**full, world_size=math.prod(full[d] for d in MESH_DIMS))


def test_every_validated_schedule_has_a_placement():
    assert tuple(SCHEDULE_STYLES) == PIPELINE_SCHEDULES


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                      "DualPipeV"])
def test_stage_placement_is_torchs(schedule, pp):
    style = "v" if SCHEDULE_STYLES[schedule] == "v" else "loop"
    torch_map = generate_stage_to_rank_mapping(pp, 2 * pp, style=style)
    ours = stage_ranks(pp, 2 * pp, schedule)
    assert {s: r for r, stages in enumerate(ours) for s in stages} == torch_map
    if style == "v":
        assert ours[0] == [0, 2 * pp - 1]  # rank 0 holds the first and the last stage


def test_cost_split_is_the_exact_minimax():
    """Against a brute force over every contiguous split of random costs."""
    import random

    rng = random.Random(0)
    for _ in range(40):
        n, stages = rng.randint(3, 9), rng.randint(2, 3)
        flops = [rng.randint(1, 20) for _ in range(n)]
        state = [rng.randint(1, 20) for _ in range(n)]
        ends = {"first_bytes": rng.randint(0, 30), "last_bytes": rng.randint(0, 30), "last_flops": rng.randint(0, 30)}
        mean_f = (sum(flops) + ends["last_flops"]) / stages
        mean_m = (sum(state) + ends["first_bytes"] + ends["last_bytes"]) / stages

        def worst(split):
            c = stage_costs(split, flops, state, ends)
            return max(max(f / mean_f, m / mean_m) for f, m in zip(c.flops, c.state_bytes))

        best = min(worst([list(range(a, b)) for a, b in zip((0, *cuts), (*cuts, n))])
                   for cuts in itertools.combinations(range(1, n), stages - 1))
        got = split_by_cost(flops, state, stages, ends)
        assert [i for s in got for i in s] == list(range(n)) and all(got)
        assert worst(got) == pytest.approx(best)


@pytest.mark.parametrize(("pp", "expected"), [(4, (1.075, 1.154)), (8, (1.201, 1.359))])
def test_cost_split_beats_layer_count_on_maverick(pp, expected):
    """Maverick (48 blocks, MoE every other one), 512 ranks of TP 8 x EP 8: the head's FLOPs
    (a 202k vocabulary) weigh several blocks, which a layer-count split leaves on the last stage."""
    args = FLAVORS["maverick"]
    dims = _dims(pp=pp, dp_shard=512 // (8 * pp), tp=8, ep=8)
    flops, state, ends = layer_costs(args, dims, 8192)
    par = Parallelism(pipeline_parallel_schedule="1F1B")
    ours = stage_costs(pipeline_layout(args, dims, par, 8192).layers, flops, state, ends)
    by_count = stage_costs(split_by_count(args.n_layers, pp), flops, state, ends)
    worst = lambda c: max(c.flops_imbalance, c.memory_imbalance)
    assert round(worst(ours), 3) == expected[0]
    assert round(worst(by_count), 3) == expected[1]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [1, 4, 8, 12])
def test_bubble_replay_matches_closed_forms(pp, m):
    """GPipe / 1F1B: (p - 1) / (m + p - 1); interleaved with v stages per rank: (p - 1) / (v m + p - 1)."""
    if m >= pp:
        assert bubble_fraction("1F1B", pp, pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble_fraction("GPipe", pp, pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
    if m >= pp and m % (m // pp) == 0:
        for schedule in ("Interleaved1F1B", "LoopedBFS"):
            assert bubble_fraction(schedule, pp, 2 * pp, m) == pytest.approx((pp - 1) / (2 * m + pp - 1))


def test_zero_bubble_schedules_fill_the_bubble():
    interleaved = bubble_fraction("Interleaved1F1B", 4, 8, 8)
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert bubble_fraction(schedule, 4, 8, 8) < interleaved / 2
    assert bubble_fraction("1F1B", 1, 1, 8) == 0.0


def test_activations_in_flight_by_hand():
    ones = lambda stages: dict.fromkeys(stages, 1.0)
    # GPipe: all m forwards before any backward; 1F1B: pp - r warm-up forwards on rank r.
    assert peak_activations_in_flight("GPipe", 4, 4, 8, 0, ones([0])) == 8
    assert [peak_activations_in_flight("1F1B", 4, 4, 8, r, ones([r])) for r in range(4)] == [4, 3, 2, 1]
    # Weighted by stage: rank 0 of a 2-rank V runs F0,0 F0,1 F0,2 F3,0 I3,0 W3,0 F3,1 I3,1 W3,1
    # F0,3 ...: at most three of stage 0 and one of stage 3 (freed at W), then four of stage 0.
    assert peak_activations_in_flight("ZBVZeroBubble", 2, 4, 4, 0, {0: 1.0, 3: 10.0}) == 13
    assert peak_activations_in_flight("ZBVZeroBubble", 2, 4, 4, 0, {0: 10.0, 3: 1.0}) == 40
    assert peak_activations_in_flight("1F1B", 1, 1, 8, 0, {0: 3.0}) == 3.0


def test_explicit_and_fixed_size_stages():
    args, dims = FLAVORS["tiny"], _dims(pp=2)
    fixed = pipeline_layout(args, dims, Parallelism(pipeline_parallel_layers_per_stage=1,
                                                    pipeline_parallel_schedule="Interleaved1F1B"), 64)
    assert fixed.layers == [[0], [1], [2], [3]] and fixed.ranks == [[0, 2], [1, 3]]
    assert fixed.rank_layers(1) == [1, 3] and fixed.stage_fqns(3) == ["layers.3", "norm", "output"]
    explicit = pipeline_layout(args, dims, Parallelism(module_fqns_per_model_part=[
        ["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]), 64)
    assert explicit.layers == [[0], [1, 2, 3]]
    assert explicit.has_first_stage(0) and explicit.has_last_stage(1) and not explicit.has_last_stage(0)
    assert pipeline_layout(args, _dims(), Parallelism(pipeline_parallel_schedule="ZBVZeroBubble"), 64).ranks == [[0]]


def test_tied_embeddings_are_refused_under_pp(monkeypatch):
    monkeypatch.setitem(FLAVORS, "tiny", FLAVORS["tiny"].replace(tie_word_embeddings=True))
    cfg = load_job_config(["--config", "configs/debug_model.toml", "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ConfigError) as err:
        validate_job_config(cfg, 2, check_device=False)
    assert err.value.key == "parallelism.pipeline_parallel_degree" and "ties the output head" in str(err.value)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_split_backward_with_tensor_parallelism_is_refused(schedule):
    """torch 2.13's input backward detaches the stage outputs in place; under TP they are views
    ("Can't detach views in-place", seen on 4 gloo ranks, pp 2 x tp 2): refused before the run."""
    cfg = load_job_config(["--config", "configs/debug_model.toml", "--parallelism.pipeline_parallel_degree", "2",
                           "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                           schedule, "--parallelism.data_parallel_shard_degree", "1"])
    with pytest.raises(ConfigError) as err:
        validate_job_config(cfg, 4, check_device=False)
    assert err.value.key == "parallelism.pipeline_parallel_schedule" and "views tensor parallelism" in str(err.value)
    one_f_one_b = load_job_config(["--config", "configs/debug_model.toml", "--parallelism.pipeline_parallel_degree",
                                   "2", "--parallelism.tensor_parallel_degree", "2",
                                   "--parallelism.data_parallel_shard_degree", "1",
                                   "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"])
    validate_job_config(one_f_one_b, 4, check_device=False)


def test_dry_run_prints_the_stages(tmp_path):
    cfg = load_job_config(["--config", "configs/llama4_128e.toml", "--job.dump_folder", str(tmp_path),
                           "--parallelism.pipeline_parallel_degree", "4", "--training.local_batch_size", "8",
                           "--training.global_batch_size", "512", "--parallelism.pipeline_parallel_schedule",
                           "ZBVZeroBubble"])
    out = io.StringIO()
    report = run_dry_run(cfg, 512, console=Console(file=out, width=200))
    pipeline = report["pipeline"]
    assert [s["pp_rank"] for s in pipeline["stages"]] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [i for s in pipeline["stages"] for i in s["layers"]] == list(range(48))
    assert pipeline["bubble_fraction"] == bubble_fraction("ZBVZeroBubble", 4, 8, 8)
    assert pipeline["microbatches"] == 8
    text = out.getvalue()
    assert "pipeline stages (ZBVZeroBubble, 8 micro-batches" in text and "stage imbalance (max / mean)" in text
