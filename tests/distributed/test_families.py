"""Every family on its single-process curve under every layout (fp32, CPU, gloo): loss, gradient
norm, MoE imbalance and per-expert token counts of every step, as `test_layout_parity.py` and
`test_expert_parallel.py` check Llama 4.

    python -m pytest -q tests/distributed/test_families.py

Qwen3-MoE (`qwen3` tiny: per-head QK RMSNorm before half-split RoPE, softmax top-2 renormalised,
gates on the experts' outputs, no shared expert, a dense first layer) with the `BALANCE` MoE
settings (a visible expert-bias update, the balance loss and z-loss on), from one seed
checkpoint. The layouts cover what this family changes: the per-head norms under TP (replicated
weights fed head shards, gradients summed over tp), MoE TP with gates on partial expert outputs
(their gradients summed over tp), EP, EP spanning TP, CP, PP, AC and compile; and a checkpoint
saved under one layout and resumed under another. Bound: 1e-5 relative, as for Llama 4.

The multi-rank runs are trained in one torchrun world per rank count (`tests.helpers.TinyRuns`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import BALANCE, Job, TinyRuns, assert_same_curve, seed_checkpoint
from torchmoe.launch import metrics_by_step

pytestmark = pytest.mark.distributed
RTOL = 1e-5
QWEN3 = ["--model.name", "qwen3", *BALANCE]

LAYOUTS = {
    # name: (ranks, flags); global batch 8 everywhere. tp2_moe_tp saves at step 3, for the resume.
    "tp2_moe_tp_fsdp2_full_ac": (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
                                     "--activation_checkpoint.mode", "full", "--checkpoint.interval", "3"]),
    "hsdp2x2_ep2_selective_ac": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                                     "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2",
                                     "--activation_checkpoint.mode", "selective"]),
    "fsdp2_tp2_ep4": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4",
                          "--training.local_batch_size", "4"]),
    "tp2_ep2_spanning_tp": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                                "2", "--training.local_batch_size", "8"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "8"]),
    "pp2_interleaved1f1b": (2, ["--parallelism.pipeline_parallel_degree", "2",
                                "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    # aot_eager: dynamo and AOT autograd over the family's blocks (graph breaks are dynamo's) without
    # inductor's codegen, 30 s more here; inductor's runs are Llama 4's (same ops but the norms).
    "fsdp2_compile": (2, ["--training.local_batch_size", "4", "--compile.enable", "true",
                          "--compile.backend", "aot_eager"]),
}


@pytest.fixture(scope="module")
def qwen3_seed(tmp_path_factory) -> Path:
    return seed_checkpoint(tmp_path_factory.mktemp("qwen3_seed"), QWEN3)


@pytest.fixture(scope="module")
def runs(qwen3_seed, tmp_path_factory) -> TinyRuns:
    return TinyRuns(qwen3_seed, tmp_path_factory.mktemp("runs"), {
        "single": Job(1, [*QWEN3, "--training.local_batch_size", "8"]),
        **{name: Job(nproc, [*flags, *QWEN3]) for name, (nproc, flags) in LAYOUTS.items()},
        "tp2_moe_tp_to_ep2": Job(2, [*QWEN3, "--parallelism.expert_parallel_degree", "2",
                                     "--training.local_batch_size", "4"], start=("tp2_moe_tp_fsdp2_full_ac", 3)),
    })


@pytest.fixture(scope="module")
def reference(runs) -> dict[int, dict]:
    ref = metrics_by_step(runs.folder("single"))
    assert sorted(ref) == [1, 2, 3, 4, 5] and ref[5]["loss"] < ref[1]["loss"]
    return ref


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_qwen3_layout_matches_single_process(layout, runs, reference):
    got = metrics_by_step(runs.folder(layout))
    assert_same_curve(got, reference, f"qwen3 {layout}", rtol=RTOL)
    if "ep" in layout:
        assert got[1]["ep_all_to_all_gib"] > 0
    if "compile" in layout:  # every block one graph (fullgraph=True would have refused a break)
        assert got[1]["compile_graph_breaks"] == 0 and got[1]["compile_graphs"] >= 2


def test_qwen3_resumes_across_layouts(runs, reference):
    """Saved at step 3 under TP 2 (MoE TP) x FSDP 2, resumed under EP 2 x FSDP 2: steps 4-5
    continue the single process's curve."""
    resumed = metrics_by_step(runs.folder("tp2_moe_tp_to_ep2"))
    assert_same_curve(resumed, {s: reference[s] for s in (4, 5)}, "qwen3 tp2 -> ep2", rtol=RTOL)
