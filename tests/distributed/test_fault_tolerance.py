"""Replica groups on torchft (`[fault_tolerance]`), on CPU: a lighthouse started here, and 2 groups
of 2 gloo ranks each (FSDP 2 inside a group), each its own torchrun launch.

    python -m pytest -q tests/distributed/test_fault_tolerance.py

  - no failure: the loss and gradient norm of every step equal a plain HSDP 2 x 2 run's (one
    torchrun world of 4), and every step has both groups;
  - a group dies: `kill -9` of group 1's launcher and ranks once it logged step 5; group 0 goes on alone
    without a restart, group 1 is launched again once group 0 has stepped alone, takes the live
    state from group 0, and both finish: their weights and optimizer states are equal bit for
    bit, and group 1 trained each of its rows once;
  - the quorum lost (min_replica_size 2): group 0 waits while group 1 is down, stepping nothing
    alone, and both finish once it is back.

The failure tests train the debugmodel flavor (about 1 s a step here) so that the survivor is
still training when the restarted group, whose start takes seconds, rejoins.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from torchmoe.launch import Lighthouse, ReplicaGroup, metrics_by_step, run_replica_groups, run_train

pytestmark = pytest.mark.distributed

STEPS = 20
JOB = ["--config", DEBUG_CONFIG, "--training.steps", str(STEPS), "--training.seq_len", "64",
       "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]
# The failure tests' job: the debugmodel flavor, whose steps are long enough (about 1 s for a
# group alone here) that the survivor is still training when the restarted group, whose start
# takes seconds (imports, the model, the recovery), rejoins.
SLOW = ["--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.local_batch_size", "4"]
FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
      "--fault_tolerance.process_group_timeout_ms", "5000"]


def _states(folder: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a step-N folder, whole (read in this process)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchmoe.components.weight_files import load_dcp, read_dcp_metadata

    metadata = read_dcp_metadata("test", folder, "")
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata) and k.startswith(("model.", "optimizer."))}
    load_dcp(state, folder, metadata, key="test", fix="")
    return state


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The reference: the same job as HSDP 2 x 2 in one torchrun world of 4 ranks."""
    folder = tmp_path_factory.mktemp("hsdp")
    run_train([*JOB, "--parallelism.data_parallel_replicate_degree", "2"], dump_folder=folder, nproc=4)
    reference = metrics_by_step(folder)
    assert sorted(reference) == list(range(1, STEPS + 1))
    return reference


def _assert_hsdp_curve(records: list[dict], reference: dict[int, dict], label: str) -> None:
    """Every step of `records` has HSDP's loss and gradient norm (1e-5) and token counts."""
    for record in records:
        ref = reference[record["step"]]
        for key in ("loss", "grad_norm"):
            assert record[key] == pytest.approx(ref[key], rel=1e-5), (label, record["step"], key)
        assert record["tokens_per_expert"] == ref["tokens_per_expert"], (label, record["step"])


def test_two_groups_train_what_hsdp_2x2_trains(tmp_path: Path, hsdp: dict[int, dict]) -> None:
    # --min-replicas 2: both groups are in the first quorum (a group up first would train alone).
    groups = run_replica_groups([*JOB, *FT], tmp_path / "ft", "--min-replicas", "2")
    for group in groups:
        records = group.records()
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert all(r["ft_participants"] == 2 for r in records)
        _assert_hsdp_curve(records, hsdp, str(group.metrics))


def test_a_killed_group_drops_out_and_recovers_the_live_state(tmp_path: Path) -> None:
    out = tmp_path / "ft"
    args = [*JOB, *SLOW, *FT, "--checkpoint.enable", "true", "--checkpoint.interval", "1000"]
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", "--min-replicas", "1")
    try:
        first = [ReplicaGroup(g, args, out, lighthouse) for g in (0, 1)]
        first[1].wait_for(lambda r: r and r[-1]["step"] >= 5, "group 1 reaches step 5")
        first[1].kill()
        killed = time.monotonic()
        died = first[1].last_step() + 1  # the step it died in (under load it may be past step 6)
        survivor = first[0]
        survivor.wait_for(lambda r: any(x["step"] >= died and x["ft_participants"] == 1 for x in r),
                          "group 0 steps alone")
        alone_s = time.monotonic() - killed
        restarted_at = time.monotonic()
        back = ReplicaGroup(1, args, out, lighthouse, tag="-restarted")
        back.wait_for(lambda r: r and r[-1]["step"] > died, "group 1 steps again")
        rejoin_s = time.monotonic() - restarted_at
        survivor.finish()
        back.finish()
    finally:
        lighthouse.close()
    print(f"group 0's first step alone {alone_s:.1f} s after the kill; group 1 stepped {rejoin_s:.1f} s after its "
          "restart")
    steps0 = survivor.records()
    assert [r["step"] for r in steps0] == list(range(steps0[0]["step"], STEPS + 1))  # never stopped, none twice
    alone = [r["step"] for r in steps0 if r["step"] >= died and r["ft_participants"] == 1]
    # From the step it died in (or the next, when group 0 committed that one with both groups).
    assert len(alone) >= 2 and alone[0] in (died, died + 1) and alone == list(range(alone[0], alone[-1] + 1))
    assert all(r["ft_participants"] == 2 for r in steps0 if r["step"] > alone[-1])
    log = (out / "group1-restarted.log").read_text()
    recovered = [int(s) for s in re.findall(r"recovered the live state of step (\d+)", log)]
    assert recovered and recovered[0] == alone[-1], log[-3000:]
    steps1 = [r["step"] for r in back.records()]
    assert steps1 == sorted(set(steps1)) and steps1[-1] == STEPS
    # Both hold the same weights and AdamW state, bit for bit.
    a, b = (_states(out / f"replica_{g}" / "checkpoint" / f"step-{STEPS}") for g in (0, 1))
    assert sorted(a) == sorted(b) and len(a) > 50
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Group 1's rows: one batch per step whose average held its gradients (those it logged, and
    # the step it died in if group 0 committed that one with both groups), none drawn twice nor
    # left out; `DataPosition` records where they stand.
    died_in = {r["step"]: r["ft_participants"] for r in steps0}[died]
    committed = len(steps1) + (died_in == 2 and died not in steps1)
    for rank in (0, 1):
        position = json.loads((out / "replica_1" / "data_position" / f"rank{rank}.json").read_text())
        assert position["pending"] is None
        assert position["committed"]["step"] == STEPS and position["committed"]["loader_step"] == committed


def test_with_the_quorum_lost_the_survivor_waits(tmp_path: Path, hsdp: dict[int, dict]) -> None:
    """min_replica_size 2: nothing is stepped alone, no row is repeated or left out, so the whole
    run, around the outage, is HSDP's, step for step, in both groups."""
    out = tmp_path / "ft"
    args = [*JOB, *FT, "--fault_tolerance.min_replica_size", "2"]
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", "--min-replicas", "2")
    try:
        first = [ReplicaGroup(g, args, out, lighthouse) for g in (0, 1)]
        first[1].wait_for(lambda r: bool(r) and r[-1]["step"] >= 5, "group 1 reaches step 5")
        first[1].kill()
        died = first[1].last_step() + 1  # the step it died in
        survivor = first[0]
        down = 4.0
        time.sleep(down)
        waited_at = survivor.last_step()
        back = ReplicaGroup(1, args, out, lighthouse, tag="-restarted")
        back.wait_for(lambda r: bool(r) and r[-1]["step"] > waited_at, "group 1 steps again")
        survivor.finish()
        back.finish()
    finally:
        lighthouse.close()
    steps0 = survivor.records()
    assert waited_at <= died  # the step group 1 died in, at most (it may have committed it first)
    assert [r["step"] for r in steps0] == list(range(1, STEPS + 1))
    assert all(r["ft_participants"] == 2 for r in steps0)  # never a step alone
    # The step after the kill waited for the restarted group: longer than it was down.
    elapsed = {r["step"]: r["elapsed_s"] for r in steps0}
    waited = elapsed[waited_at + 1] - elapsed[waited_at]
    print(f"group 0 waited {waited:.1f} s for the quorum (group 1 down {down:.0f} s, then starting again)")
    assert waited > down
    _assert_hsdp_curve(steps0, hsdp, "group 0")
    _assert_hsdp_curve(back.records(), hsdp, "group 1")
    # torchft's INFO, out of the console, is in every rank's log file: the restarted group's
    # rank 1 (whose console shows only warnings) says how it recovered, the killed run's start
    # stays above the restart's.
    log = (out / "replica_1" / "logs" / "rank1.log").read_text()
    assert log.count("rank 1 (pid") == 2 and "INFO torchft.manager:" in log and "reconfiguring for quorum_id" in log
    assert "applying pending state dict" in log and "recovered the live state of step" in log


def _semi_sync_run(tmp_path: Path, name: str, method: list[str], every: int) -> list[dict[int, dict]]:
    """2 groups of the tiny job, 10 steps, syncing every 5 by `method`; each group's model state
    every `every` steps (its checkpoints)."""
    out = tmp_path / name
    args = [*JOB, *FT, "--training.steps", "10", "--fault_tolerance.sync_steps", "5", *method,
            "--checkpoint.enable", "true", "--checkpoint.interval", str(every)]
    groups = run_replica_groups(args, out, "--min-replicas", "2")
    synced = [r["step"] for r in groups[0].records() if r.get("ft_synced")]
    assert synced == [5, 10] and all(r["ft_participants"] == 2 for r in groups[0].records() if r.get("ft_synced"))
    return [{step: {k: v for k, v in _states(out / f"replica_{g}" / "checkpoint" / f"step-{step}").items()
                    if k.startswith("model.")} for step in range(every, 11, every)} for g in (0, 1)]


def test_local_sgd_and_diloco_groups_agree_exactly_at_sync_steps(tmp_path: Path) -> None:
    """Local SGD: the groups' weights are equal at steps 5 and 10 and differ between. DiLoCo with
    outer lr 1 and no momentum applies the averaged pseudo-gradient to the anchor, which is
    the average of the groups' weights: local SGD's, to rounding (the outer step with momentum
    is checked against torch's SGD in tests/unit/test_fault_tolerance_config.py)."""
    local = _semi_sync_run(tmp_path, "local_sgd", ["--fault_tolerance.semi_sync_method", "local_sgd"], 1)
    for step in range(1, 11):
        equal = all(torch.equal(local[0][step][k], local[1][step][k]) for k in local[0][step])
        assert equal == (step % 5 == 0), step
    diloco = _semi_sync_run(tmp_path, "diloco", ["--fault_tolerance.semi_sync_method", "diloco",
                                                 "--fault_tolerance.outer_lr", "1.0",
                                                 "--fault_tolerance.outer_momentum", "0.0"], 5)
    for step in (5, 10):
        assert all(torch.equal(diloco[0][step][k], diloco[1][step][k]) for k in diloco[0][step]), step
    for key, value in diloco[0][5].items():
        assert torch.allclose(value.float(), local[0][5][key].float(), rtol=1e-5, atol=1e-6), key


def test_a_full_restart_resumes_every_group_exactly(tmp_path: Path, hsdp: dict[int, dict]) -> None:
    """Both groups killed after their step-5 checkpoints, then launched again: each resumes from
    its own checkpoint, and the whole run is HSDP's curve, step for step."""
    out = tmp_path / "ft"
    args = [*JOB, *FT, "--checkpoint.enable", "true", "--checkpoint.interval", "5"]
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", "--min-replicas", "2")
    try:
        first = [ReplicaGroup(g, args, out, lighthouse) for g in (0, 1)]
        first[0].wait_for(lambda r: bool(r) and r[-1]["step"] >= 7, "group 0 is past its step-5 checkpoint")
        for group in first:
            group.kill()
        again = [ReplicaGroup(g, args, out, lighthouse, tag="-again") for g in (0, 1)]
        for group in again:
            group.finish()
    finally:
        lighthouse.close()
    for group in again:
        resumed = re.findall(r"resuming at step (\d+)", group.log.read_text())
        assert resumed and int(resumed[0]) % 5 == 1, resumed  # from a checkpoint (step 5 here, or later under load)
        records = group.records()  # the first launch's records after step 5 were dropped
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        _assert_hsdp_curve(records, hsdp, str(group.metrics))
