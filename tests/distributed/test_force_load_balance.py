"""`model.moe_force_load_balance` (torchtitan's `debug.moe_force_load_balance`): round-robin routing
is exactly balanced and the same in every layout.

    python -m pytest -q tests/distributed/test_force_load_balance.py

Every run starts from the seed checkpoint with the expert-bias rate at 0.05 and the balance loss
and z-loss on (`tests.helpers.BALANCE`), 5 steps of 8 x 64 tokens. Each rank numbers the tokens
of its own MoE call (its sequences, its context-parallel pieces, its sequence shard under EP with
TP) and routes them round-robin; with 64-token sequences, 16-token CP pieces and 32-token EP x TP
shards all multiples of the 8 experts, every layout routes every token to the expert the single
process does. So the curves agree at the parity tests' 1e-5 (observed: loss within 1e-7,
gradient norms equal as logged), and every step's per-expert counts are equal: `moe_imbalance`
exactly 1.0.
"""

from __future__ import annotations

import pytest

from tests.helpers import BALANCE, Job, TinyRuns, assert_same_curve
from tests.launch import metrics_by_step

pytestmark = pytest.mark.distributed
RTOL = 1e-5
FORCED = ["--model.moe_force_load_balance", "true", *BALANCE]
ONE_SHARD = ["--parallelism.data_parallel_shard_degree", "1"]
LAYOUTS = {
    # name: (ranks, flags)
    "accumulation_2x4": (1, ["--training.local_batch_size", "4"]),
    "fsdp2_ep2": (2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "tp2_ep2_spanning_tp": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                                "2", "--training.local_batch_size", "8"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2", *ONE_SHARD, "--training.local_batch_size", "8"]),
}


@pytest.fixture(scope="module")
def runs(seed, tmp_path_factory) -> TinyRuns:
    return TinyRuns(seed, tmp_path_factory.mktemp("runs"), {
        "single": Job(1, [*FORCED, "--training.local_batch_size", "8"]),
        **{name: Job(nproc, [*flags, *FORCED]) for name, (nproc, flags) in LAYOUTS.items()},
    })


def test_every_expert_gets_the_same_tokens(runs, balance_reference):
    """8 x 64 tokens, top 1, 8 experts: 64 per expert in both MoE layers at every step, where the
    router's own routing (the same job unforced) is imbalanced."""
    got = metrics_by_step(runs.folder("single"))
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, record in got.items():
        assert record["moe_imbalance"] == 1.0, step
        assert record["tokens_per_expert"] == [[64.0] * 8] * 2, step
    assert balance_reference[1]["moe_imbalance"] > 1.1
    assert got[2]["loss"] != balance_reference[2]["loss"]  # a different routing trains a different model


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forced_routing_is_the_same_in_every_layout(runs, layout):
    assert_same_curve(metrics_by_step(runs.folder(layout)), metrics_by_step(runs.folder("single")), layout,
                      rtol=RTOL)
