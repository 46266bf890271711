"""Every parallel layout reproduces the single-process run (fp32, CPU, gloo): loss, gradient norm,
MoE imbalance and per-expert token counts of every step.

All runs start from one seed checkpoint and see the same global batch (8 sequences of 64
tokens) per step; only the split over ranks and micro-batches differs. The gradient norm is what
catches gradients wrong by a constant factor (AdamW with clipping barely moves the loss then).
Observed differences are ~1e-7 for the loss and up to ~3e-6 for the norm (summation order of
sharded norms); the bound is 1e-5 relative.

The multi-rank runs are trained in one torchrun world per rank count (`tests.helpers.TinyRuns`),
each job with its own `Trainer` and meshes, as `torchmoe train` would build them.
"""

from __future__ import annotations

import pytest

from tests.distributed import fake_slurm
from tests.helpers import (
    BALANCE,
    DEBUG_CONFIG,
    MUON,
    TINY_JOB,
    Job,
    TinyRuns,
    assert_same_curve,
    start_from,
    train_tiny,
)
from tests.launch import metrics_by_step

pytestmark = pytest.mark.distributed
RTOL = 1e-5


@pytest.fixture(scope="module")
def reference(runs):
    """Single process, gradient accumulation 2 x 4 sequences."""
    ref = metrics_by_step(runs.folder("single"))
    assert sorted(ref) == [1, 2, 3, 4, 5] and ref[5]["loss"] < ref[1]["loss"]
    return ref


LAYOUTS = {
    # name: (ranks, extra flags). fsdp4 saves at step 3 too, for the resharding test.
    "fsdp4": (4, ["--training.local_batch_size", "2", "--checkpoint.interval", "3"]),
    "hsdp2x2_selective_op_ac": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                                    "--training.local_batch_size", "2",
                                    "--activation_checkpoint.mode", "selective"]),
    "ddp2": (2, ["--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "4"]),
    "tp2_fsdp2_full_ac": (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
                              "--activation_checkpoint.mode", "full"]),
    "tp4_moe_tp_selective_layer_ac": (4, ["--parallelism.tensor_parallel_degree", "4",
                                          "--training.local_batch_size", "8",
                                          "--activation_checkpoint.mode", "selective",
                                          "--activation_checkpoint.selective_ac_option", "2"]),
    "tp2_no_loss_parallel": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8",
                                 "--parallelism.disable_loss_parallel", "true"]),
    "fsdp2_compile": (2, ["--training.local_batch_size", "4", "--compile.enable", "true"]),
    # aot_eager: dynamo and AOT autograd over DTensor and the SAC policy, without inductor's
    # codegen (fsdp2_compile and EP's ep2_compile run inductor; here it would cost 20 s more).
    "tp2_compile_selective_op_ac": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8",
                                        "--parallelism.data_parallel_shard_degree", "1", "--compile.enable", "true",
                                        "--compile.backend", "aot_eager", "--activation_checkpoint.mode", "selective"]),
    "fsdp2_never_reshard": (2, ["--training.local_batch_size", "4", "--parallelism.fsdp_reshard_after_forward",
                                "never"]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(layout, runs, reference):
    got = metrics_by_step(runs.folder(layout))
    assert_same_curve(got, reference, layout, rtol=RTOL)
    if "compile" in layout:  # every block one graph (fullgraph=True would have refused a break)
        assert got[1]["compile_graph_breaks"] == 0 and got[1]["compile_graphs"] >= 2
        assert [got[step]["compile_recompiles"] for step in range(2, 6)] == [0] * 4  # no guard failed later


BF16_LAYOUTS = {
    # name: (ranks, flags). FSDP and DDP cast parameters with their mixed-precision policy; one
    # process and TP alone run under autocast (the residual stream stays fp32 there).
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "ddp2": LAYOUTS["ddp2"],
    "single": (1, ["--training.local_batch_size", "8"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "8"]),
}


@pytest.fixture(scope="module")
def runs(seed, tmp_path_factory) -> TinyRuns:
    """Every run of this module but the last two of the dp 2 -> 1 -> 2 chain."""
    bf16 = ["--training.mixed_precision_param", "bfloat16"]
    return TinyRuns(seed, tmp_path_factory.mktemp("runs"), {
        "single": Job(1, ["--training.local_batch_size", "4"]),
        **{name: Job(nproc, flags) for name, (nproc, flags) in LAYOUTS.items()},
        **{f"bf16_{name}": Job(nproc, [*flags, *bf16]) for name, (nproc, flags) in BF16_LAYOUTS.items()},
        "fsdp4_to_tp2_fsdp2": Job(4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
                                  start=("fsdp4", 3)),
        "dp2": Job(2, ["--training.local_batch_size", "4", "--checkpoint.interval", "3"], saves=True),
        **{name: Job(nproc, flags, preflight=not name.endswith("offload")) for name, (nproc, flags) in CLIP.items()},
        **{name: Job(nproc, [*flags, *VALIDATION]) for name, (nproc, flags) in VALIDATION_LAYOUTS.items()},
        **{name: Job(nproc, [*flags, *BALANCE, *MUON]) for name, (nproc, flags) in MUON_LAYOUTS.items()},
        "muon_fsdp4_to_tp2_fsdp2": Job(4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size",
                                           "4", *BALANCE, *MUON], start=("muon_fsdp4", 10)),
    })


# Every step clipped (gradient norms 0.9-1.1 in the tiny job), with the sharded gradients in
# device memory or offloaded to the host.
CLIP = {
    "single_clip": (1, ["--training.local_batch_size", "4", "--training.max_norm", "0.5"]),
    "fsdp2_clip": (2, ["--training.local_batch_size", "4", "--training.max_norm", "0.5"]),
    "fsdp2_clip_cpu_offload": (2, ["--training.local_batch_size", "4", "--training.max_norm", "0.5",
                                   "--parallelism.fsdp_cpu_offload", "true"]),
}


@pytest.mark.parametrize("layout", ["fsdp2_clip", "fsdp2_clip_cpu_offload"])
def test_clipping_with_host_gradients_matches_single_process(layout, runs):
    """FSDP CPU offload, forced (the preflight refuses it without an accelerator; on a CPU mesh
    FSDP offloads into unpinned host memory): the sharded gradients live on the host, the norm's
    DTensor reductions run on host tensors, and every step clips exactly like the single process
    and the run without offload (loss and gradient norm before clipping, 1e-5)."""
    reference = metrics_by_step(runs.folder("single_clip"))
    assert all(record["grad_norm"] > 0.5 for record in reference.values())  # every step clipped
    assert_same_curve(metrics_by_step(runs.folder(layout)), reference, layout, rtol=RTOL)


# [validation] every 2nd step, 2 batches of 8 sequences of 64 tokens (python_docs, from its start).
VALIDATION = ["--validation.enable", "true", "--validation.dataset", "python_docs", "--validation.freq", "2",
              "--validation.steps", "2", "--validation.seq_len", "64"]
VALIDATION_LAYOUTS = {
    # name: (ranks, flags); validation.local_batch_size * dp = 8 rows everywhere. val_ep2 is FSDP 2
    # too (EP borrows the dp_shard ranks): its losses are reduced over dp as well.
    "val_single": (1, ["--training.local_batch_size", "4", "--validation.local_batch_size", "8"]),
    "val_tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                    "--training.local_batch_size", "8", "--validation.local_batch_size", "8"]),
    "val_ep2": (2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4",
                    "--validation.local_batch_size", "4"]),
    "val_cp2": (2, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                    "--training.local_batch_size", "8", "--validation.local_batch_size", "8"]),
}


def test_validation_leaves_the_training_curve_alone(runs, reference):
    """Validation forwards route tokens too: their counts must not reach the bias update."""
    assert_same_curve(metrics_by_step(runs.folder("val_single")), reference, "val_single", rtol=0)


@pytest.mark.parametrize("layout", sorted(set(VALIDATION_LAYOUTS) - {"val_single"}))
def test_validation_loss_matches_single_process(layout, runs):
    got, ref = metrics_by_step(runs.folder(layout)), metrics_by_step(runs.folder("val_single"))
    assert [s for s in sorted(ref) if "validation_loss" in ref[s]] == [2, 4]
    for step in (2, 4):
        assert got[step]["validation_loss"] == pytest.approx(ref[step]["validation_loss"], rel=RTOL), (layout, step)
    assert "validation_loss" not in got[3]


@pytest.mark.parametrize("layout", sorted(BF16_LAYOUTS))
def test_bf16_mixed_precision_tracks_fp32(layout, runs, reference):
    """bf16 compute with fp32 master weights, gradients and reduction. bf16 keeps an 8-bit
    mantissa (relative rounding 2^-9 = 2e-3 per op) but the loss is a mean over 512 tokens of an
    fp32 cross entropy, so rounding largely averages out: observed 5.2e-4 (FSDP, DDP) and 7e-5
    (autocast, whose residual stream stays fp32); bound 2e-3. The gradient norm moves more:
    observed 2.5e-3 (FSDP, DDP) and 8.5e-4 (autocast); bound 1e-2."""
    got = metrics_by_step(runs.folder(f"bf16_{layout}"))
    assert got[1]["loss"] != reference[1]["loss"]  # bf16 really was used
    for step, ref in reference.items():
        assert got[step]["loss"] == pytest.approx(ref["loss"], rel=2e-3), (layout, step)
        assert got[step]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2), (layout, step)


def test_checkpoint_reshards_from_fsdp4_to_tp2_fsdp2(runs, reference):
    """Save at step 3 under FSDP 4 (its parity run); resume under TP 2 x FSDP 2: steps 4-5
    continue the curve."""
    resumed = metrics_by_step(runs.folder("fsdp4_to_tp2_fsdp2"))
    assert sorted(resumed) == [4, 5]
    assert_same_curve(resumed, {s: reference[s] for s in (4, 5)}, "fsdp4 -> tp2 x fsdp2", rtol=RTOL)


def test_resume_across_dp_degrees_2_to_1_to_2(runs, reference, tmp_path):
    """FSDP 2 saves at step 3 (each rank its 4 data rows, a DTensor over the batch mesh); one
    process resumes it (all 8 rows) and saves at step 4; FSDP 2 resumes that: every step
    continues the single-process curve (loss, gradient norm, MoE counts)."""
    two = runs.folder("dp2")
    one = start_from(two / "checkpoint" / "step-3", tmp_path / "dp1")
    train_tiny(one, ["--training.local_batch_size", "4", "--checkpoint.interval", "4"])
    again = start_from(one / "checkpoint" / "step-4", tmp_path / "dp2_again")
    train_tiny(again, ["--training.local_batch_size", "2"], nproc=2)  # and 2 micro-batches
    assert_same_curve(metrics_by_step(two), reference, "dp2", rtol=RTOL)
    assert_same_curve(metrics_by_step(one), {s: reference[s] for s in (4, 5)}, "dp2 -> dp1", rtol=RTOL)
    assert_same_curve(metrics_by_step(again), {5: reference[5]}, "dp1 -> dp2", rtol=RTOL)


def test_two_torchrun_nodes_train_what_one_world_of_four_trains(runs, seed, tmp_path_factory):
    """Multi-node for real on one machine: `scripts/multinode.slurm` (`tests/distributed/fake_slurm.py`)
    starts two torchrun "nodes" (`--nnodes 2`, c10d rendezvous on localhost, 2 ranks each) with
    hsdp2x2's flags (HSDP: FSDP inside a node, replicas across, the usual multi-node shape). The
    two worlds hold the same global ranks doing the same work: equal bit for bit. The dump folder
    is the job id's (what a requeued job finds again: resuming from it is `test_train`'s)."""
    root = tmp_path_factory.mktemp("multinode")
    folder = start_from(seed, fake_slurm.dump_folder(root, 4242))
    args = [DEBUG_CONFIG, *TINY_JOB[2:], *LAYOUTS["hsdp2x2_selective_op_ac"][1]]
    proc = fake_slurm.sbatch(root, args, job_id=4242)
    assert "2 nodes x 2 ranks, rendezvous localhost:" in proc.stdout
    got, ref = metrics_by_step(folder), metrics_by_step(runs.folder("hsdp2x2_selective_op_ac"))
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    for step in ref:
        for key in ("loss", "grad_norm", "moe_imbalance", "tokens_per_expert"):
            assert got[step][key] == ref[step][key], (step, key)
    assert sorted(p.name for p in (folder / "checkpoint").glob("step-*")) == ["step-0", "step-5"]


# Muon (`tests.helpers.MUON`: 20 steps, Newton-Schulz in float32) in this module's worlds, against
# the single process's Muon run (`muon_reference`). Muon gathers every sharded matrix whole
# before its Newton-Schulz: FSDP's rows, HSDP's shards of replicas, TP's (and SP's) column- and
# row-wise splits under FSDP.
MUON_LAYOUTS = {
    # name: (ranks, flags). muon_fsdp4 saves at step 10 too, for the resume under TP 2 x FSDP 2.
    "muon_fsdp4": (4, ["--training.local_batch_size", "2", "--checkpoint.interval", "10"]),
    "muon_hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2"]),
    "muon_tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
}


@pytest.mark.parametrize("layout", sorted(MUON_LAYOUTS))
def test_muon_layout_matches_single_process(layout, runs, muon_reference):
    """20 Muon steps, loss and gradient norm within 1e-5 of one process (observed <= 1.9e-7).
    Newton-Schulz in float32 (`optimizer.ns_dtype`), not torch's bfloat16: the layouts' gradients
    differ by summation order (~1e-7), and a bf16 cast of the NS input turns such a difference
    into a whole bf16 rounding step (2^-9) now and then, which the NS spreads over the matrix
    (bf16 NS measured 5.3e-4 off in the loss under EP 2; `tests.helpers.MUON`)."""
    reference = metrics_by_step(muon_reference)
    assert sorted(reference) == list(range(1, 21)) and reference[20]["loss"] < reference[1]["loss"]
    assert_same_curve(metrics_by_step(runs.folder(layout)), reference, layout, rtol=RTOL)


def test_muon_state_reshards_from_fsdp4_to_tp2_fsdp2(runs, muon_reference):
    """Muon's momentum buffers (and AdamW's moments) saved at step 10 under FSDP 4, resumed
    under TP 2 x FSDP 2: steps 11-20 continue the single process's curve."""
    resumed = metrics_by_step(runs.folder("muon_fsdp4_to_tp2_fsdp2"))
    assert_same_curve(resumed, {s: r for s, r in metrics_by_step(muon_reference).items() if s > 10},
                      "muon fsdp4 -> tp2 x fsdp2", rtol=RTOL)


def test_muon_resume_is_exact(muon_reference, tmp_path):
    """One process resuming the Muon reference's step-10 checkpoint trains steps 11-20 bit for
    bit as the uninterrupted run did (the same launch, the same thread count)."""
    folder = start_from(muon_reference / "checkpoint" / "step-10", tmp_path / "resumed")
    train_tiny(folder, ["--training.local_batch_size", "8", *BALANCE, *MUON])
    reference = metrics_by_step(muon_reference)
    assert_same_curve(metrics_by_step(folder), {s: r for s, r in reference.items() if s > 10}, "muon resume", rtol=0)
