"""`[fault_tolerance]` without a world: bad settings are one message each (exit 2), a group plans and
writes under its own folder, `torchmoe lighthouse` refuses bad flags, and `ReplicaGroups` on a
fake torchft Manager (another group's tensors added in its collectives): the small per-step
collective (loss averaged, counts summed, positions kept), row positions round-tripping through a
loader, layouts compared (the later group stops naming both, the earlier fails only the step),
and recovered state checked against this rank's before it is taken.

    python -m pytest -q tests/unit/test_fault_tolerance_config.py

(FSDP's hooks and gradient accumulation: tests/unit/test_fault_tolerance_overlap.py; the
semi-synchronous syncs: tests/unit/test_semi_sync.py; groups training, failing and recovering:
tests/distributed/test_fault_tolerance.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from tests.replica_fakes import LAYOUT, OTHER, FakeManager, peer, replica_groups
from torchmoe.commands import cli
from torchmoe.config import load_job_config
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import FaultTolerance
from torchmoe.data.dataloader import build_dataloader
from torchmoe.data.tokenizer import build_tokenizer
from torchmoe.distributed.fault_tolerance import LIGHTHOUSE_ENV, ReplicaGroups
from torchmoe.distributed.replica_state import (
    GroupLayout,
    RowPositions,
    decode_position,
    encode_position,
    like,
    local_tensors,
)
from torchmoe.models.llama4 import FLAVORS, Transformer

FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]


@pytest.mark.parametrize(("flags", "key", "problem", "fix"), [
    (["--fault_tolerance.enable", "true"], "fault_tolerance.group_size = 0", "must be >= 1",
     "set the number of replica groups"),
    ([*FT, "--fault_tolerance.replica_id", "2"], "fault_tolerance.replica_id = 2", "0 .. group_size - 1 = 1",
     "--fault_tolerance.replica_id 1"),
    ([*FT, "--fault_tolerance.min_replica_size", "3"], "fault_tolerance.min_replica_size = 3",
     "1 .. group_size = 2", "how many groups must join"),
    ([*FT, "--fault_tolerance.process_group", "mpi"], 'fault_tolerance.process_group = "mpi"',
     "not an allowed value", '"gloo", "nccl"'),
    ([*FT, "--fault_tolerance.semi_sync_method", "DiLoCo"], 'fault_tolerance.semi_sync_method = "DiLoCo"',
     "not an allowed value", 'did you mean "diloco"'),
    ([*FT, "--fault_tolerance.process_group_timeout_ms", "0"], "fault_tolerance.process_group_timeout_ms = 0",
     "milliseconds", "e.g. 10000"),
    ([*FT, "--fault_tolerance.lighthouse_timeout_ms", "-1"], "fault_tolerance.lighthouse_timeout_ms = -1",
     "milliseconds", "e.g. 10000"),
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.outer_momentum", "1.0"],
     "fault_tolerance.outer_momentum = 1.0", "[0, 1)",
     "such as 0.9"),
    ([*FT, "--parallelism.data_parallel_replicate_degree", "2", "--world-size", "4"],
     "parallelism.data_parallel_replicate_degree = 2", "the replica groups are the replicate dimension",
     "launch fault_tolerance.group_size (2) groups"),
    ([*FT, "--training.global_batch_size", "12", "--training.local_batch_size", "2", "--world-size", "2"],
     "training.global_batch_size = 12", "* fault_tolerance.group_size(2) = 8", "use a multiple of 8"),
    ([*FT, "--fault_tolerance.process_group", "nccl"], 'fault_tolerance.process_group = "nccl"',
     "trains on the CPU", 'use "gloo"'),
    ([*FT, "--checkpoint.enable", "true", "--checkpoint.create_seed_checkpoint", "true"],
     "checkpoint.create_seed_checkpoint = true",
     "joins no replica group", "fault_tolerance.enable = false"),
    ([*FT, "--fault_tolerance.async_quorum", "true", "--fault_tolerance.semi_sync_method", "diloco"],
     "fault_tolerance.async_quorum = true", "meets at syncs", "set async_quorum = false"),
    # Only a real run's SemiSync refused these before: the dry run passed them (the tiny flavor has 4 blocks).
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments", "8",
      "--fault_tolerance.sync_steps", "16"], "fault_tolerance.num_fragments = 8", "must be at most the model's 4 "
     "blocks", "use 1 .. 4"),
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments", "6",
      "--fault_tolerance.sync_steps", "12", "--model.name", "deepseek_v3", "--model.flavor", "tiny",
      "--model.mtp_layers", "1"], "fault_tolerance.num_fragments = 6",
     "must be at most the model's 5 blocks", "use 1 .. 5"),  # a multi-token prediction module is a block too
])
def test_bad_settings_are_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], key: str,
                                      problem: str, fix: str) -> None:
    status = cli.main(["train", "--config", DEBUG_CONFIG, "--dry-run", "--job.dump_folder", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert status == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert f"{key}:" in err and problem in err and fix in err, err


def test_the_dry_run_refuses_more_fragments_than_blocks_as_the_run_does(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Streaming DiLoCo's fragments over the tiny flavor's 4 blocks: only a real run's SemiSync
    refused 5 before, the dry run planned it. Now both say the same, before anything starts."""
    flags = [*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments", "5",
             "--fault_tolerance.sync_steps", "10"]
    errors = []
    for dry in (["--dry-run"], []):
        status = cli.main(["train", "--config", DEBUG_CONFIG, *dry, "--job.dump_folder", str(tmp_path), *flags])
        err = capsys.readouterr().err
        assert status == 2 and err.count("error:") == 1 and "Traceback" not in err, err
        errors.append(err)
    assert errors[0] == errors[1] and "fault_tolerance.num_fragments = 5: must be at most the model's 4 blocks" \
        in errors[0], errors
    assert not (tmp_path / "dry_run.json").exists()


def test_a_group_plans_its_own_layout_in_its_own_folder(tmp_path: Path) -> None:
    assert cli.main(["train", "--config", DEBUG_CONFIG, "--dry-run", "--world-size", "2", "--job.dump_folder",
                     str(tmp_path), *FT, "--fault_tolerance.replica_id", "1"]) == 0
    report = json.loads((tmp_path / "replica_1" / "dry_run.json").read_text())
    assert report["world_size"] == 2 and not (tmp_path / "dry_run.json").exists()


@pytest.mark.parametrize(("lighthouse", "expected"), [
    (None, f'{LIGHTHOUSE_ENV} = "": is not set: fault_tolerance.enable needs a torchft lighthouse'),
    ("http://127.0.0.1:1", f'{LIGHTHOUSE_ENV} = "http://127.0.0.1:1": cannot be reached: Connection refused'),
    ("localhost:29510", f'{LIGHTHOUSE_ENV} = "localhost:29510": is not an http://HOST:PORT address'),
    ("http://localhost:port", f'{LIGHTHOUSE_ENV} = "http://localhost:port": is not an address'),
])
def test_training_without_a_lighthouse_is_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch, lighthouse, expected) -> None:
    """Unset, unreachable (a traceback after torchft's connect timeout before) or no address:
    one message, within seconds, naming how to start one. (A group of one rank under torchrun:
    its variables set here.)"""
    from tests.launch import free_port

    if lighthouse is None:
        monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    else:
        monkeypatch.setenv(LIGHTHOUSE_ENV, lighthouse)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert cli.main(["train", "--config", DEBUG_CONFIG, "--training.steps", "1", "--job.dump_folder", str(tmp_path),
                     *FT]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and expected in err and "torchmoe lighthouse" in err, err
    assert "Traceback" not in err, err


def test_a_replica_group_without_torchrun_is_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft's manager reads MASTER_ADDR: a KeyError traceback before."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert cli.main(["train", "--config", DEBUG_CONFIG, "--training.steps", "1", "--job.dump_folder", str(tmp_path),
                     *FT]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "fault_tolerance.enable = true: runs each replica group as a torchrun launch" in err, err
    assert "fix: launch each group with torchrun" in err, err


@pytest.mark.parametrize(("flags", "expected"), [
    (["--min-replicas", "0"], '--min-replicas = "0": must be an integer from 1 to 100000\n  fix: pass 1 .. 100,000 '
                              "replica groups; the default is 1"),
    (["--heartbeat-timeout-ms", "-5"], '--heartbeat-timeout-ms = "-5": must be an integer from 1 to 86400000'),
    (["--bind", "no-such-host.invalid:1"], "--bind = \"no-such-host.invalid:1\": the lighthouse cannot listen there"),
    (["--min-replicas", "two"], '--min-replicas = "two": expected an integer'),
    (["--min-replicas", "9" * 5001], '--min-replicas = "99999999999999999999... (5,001 characters)": must be an '
                                     "integer from 1 to 100000"),
    (["--port", "1"], "unrecognized arguments: --port 1"),
    # Beyond what torchft's core takes (2**64): an OverflowError reported as a bind failure before.
    (["--min-replicas", str(2**70)], f'--min-replicas = "{2**70}": must be an integer from 1 to 100000'),
    (["--join-timeout-ms", str(2**64)], f'--join-timeout-ms = "{2**64}": must be an integer from 1 to 86400000\n  '
                                        "fix: pass 1 .. 86,400,000 ms (a day); the default is 60000"),
    (["--quorum-tick-ms", "3600000"], '--quorum-tick-ms = "3600000": must be an integer from 1 to 60000'),
    (["--bind", "[::]"], '--bind = "[::]": has no port a socket can have'),
    (["--bind", "0.0.0.0:99999"], '--bind = "0.0.0.0:99999": has no port a socket can have'),
    (["--bind", "29510"], '--bind = "29510": is not HOST:PORT'),
    (["--bind", ":29510"], '--bind = ":29510": is not HOST:PORT'),
])
def test_lighthouse_bad_flags_are_one_message(capsys: pytest.CaptureFixture[str], flags: list[str],
                                             expected: str) -> None:
    assert cli.main(["lighthouse", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and expected in err and "Traceback" not in err, err


def _loader(dp_rank: int = 1):
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2"])
    return build_dataloader(cfg.training, build_tokenizer(""), dp_rank=dp_rank, dp_degree=4)


def test_a_row_position_round_trips_through_the_table_and_resumes_the_rows_after_it() -> None:
    """A loader's position after 2 batches, encoded, committed into the table, saved and loaded
    into a fresh table (a resumed process), then decoded into a fresh loader: its next batch is
    the 3rd."""
    loader = _loader()
    for _ in range(2):
        loader.next_batch()
    position = encode_position(loader.state_dict())
    table = RowPositions(group_size=3, width=len(position))
    assert table.get(1) is None  # nothing committed: the start position is used
    table.commit({1: position})
    again = RowPositions(group_size=3, width=len(position))
    again.load_state_dict({"table": table.state_dict()["table"].clone()})
    assert again.get(1) == position and again.get(0) is None
    fresh = _loader()
    fresh.load_state_dict(decode_position(again.get(1), fresh.state_dict()))
    reference = _loader()
    expected = [reference.next_batch() for _ in range(3)][-1]
    got = fresh.next_batch()
    assert all(torch.equal(a, b) for pair in zip(got, expected) for a, b in zip(*pair))
    with pytest.raises(ValueError, match=r"shape \(2, 5\), this rank's is \(3, "):
        again.load_state_dict({"table": torch.zeros(2, 5)})


def test_a_step_averages_the_loss_sums_the_counts_and_commits_every_groups_rows() -> None:
    manager = FakeManager(peer(LAYOUT, 1))
    groups = replica_groups(manager)
    groups.begin_step()
    grads = [torch.full((3,), 4.0)]
    loss, counts = groups.reduce(torch.tensor(1.0), torch.tensor([3.0, 4.0]), lambda: grads, [1.0, 2.0, 3.0])
    assert loss.item() == 2.0 and counts.tolist() == [4.0, 6.0]
    assert grads[0].tolist() == [2.0, 2.0, 2.0]  # no FSDP attached: averaged after the backward
    assert groups.positions.get(1) is None  # not before the commit
    assert groups.commit(1)
    assert groups.positions.get(0) == [1.0, 2.0, 3.0] and groups.positions.get(1) == [5.0, 6.0, 7.0]
    assert manager.quorums == 1 and groups.committed_here == 1


def test_a_step_that_does_not_commit_keeps_the_positions() -> None:
    groups = replica_groups(FakeManager(peer(LAYOUT, 1), commits=False))
    groups.begin_step()
    groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    assert not groups.commit(1) and groups.positions.get(0) is None and groups.positions.get(1) is None


def test_groups_whose_gradient_reductions_differ_stop() -> None:
    groups = replica_groups(FakeManager(peer(LAYOUT, 1, hook=(3.0, 100.0))))
    groups.begin_step()
    with pytest.raises(RuntimeError, match="reduced 3 gradient buffers of 100 elements.*did not line up"):
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])


@pytest.mark.parametrize("async_quorum", [False, True])
def test_a_group_of_another_layout_stops_if_it_joined_later_else_fails_the_step(async_quorum: bool) -> None:
    """Compared in the step's first collective (here `reduce`'s, without FSDP's hooks), in a
    collective of its own."""
    # This group joined later (committed nothing here, the peer 5 steps): it stops, naming both.
    groups = replica_groups(FakeManager(peer(OTHER, 1, committed=5)), async_quorum=async_quorum)
    with pytest.raises(ConfigError) as err:
        groups.begin_step()
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    assert groups.take_report()["ft_collectives"] == 1
    text = str(err.value)
    assert "replica group 0" in text and "runs llama4/tiny, float32 on 2 ranks (pp 1, dp_shard 2" in text
    assert "replica group 1 runs llama4/debugmodel, float32 on 2 ranks (pp 1, dp_shard 1, cp 1, tp 2" in text
    assert "only fault_tolerance.replica_id differs" in text
    # This group was here first: the step fails (tried again without the newcomer), nothing stops.
    manager = FakeManager(peer(OTHER, 1, committed=0))
    groups = replica_groups(manager, async_quorum=async_quorum)
    groups.committed_here = 3
    groups.begin_step()
    groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    assert len(manager.errors) == 1 and not groups.commit(4)


def test_two_launches_with_one_replica_id_stop() -> None:
    groups = replica_groups(FakeManager(peer(LAYOUT, 0)))  # the other launch is replica group 0 too
    groups.begin_step()
    with pytest.raises(ConfigError, match="2 launches joined the job as replica group 0"):
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])


class _QuorumNeverForms(FakeManager):
    """torchft's Manager when too few groups are up: the quorum times out (its client's timeout)."""

    def start_quorum(self) -> None:
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')


def test_a_quorum_that_never_forms_is_one_message_naming_what_to_launch() -> None:
    """min_replica_size 2 and one group up for the whole quorum timeout: a TimeoutError traceback
    from torchft's thread before."""
    cfg = FaultTolerance(enable=True, group_size=2, min_replica_size=2)
    groups = ReplicaGroups(_QuorumNeverForms(peer(LAYOUT, 1)), cfg, layout=LAYOUT, known_models=[],
                           position_width=3, state=lambda: {}, load=lambda state, position: None,
                           device=torch.device("cpu"), quorum_timeout_s=300.0)
    with pytest.raises(ConfigError) as err:
        groups.begin_step()
    assert str(err.value) == (
        'fault_tolerance.min_replica_size = 2: no quorum of that many replica groups formed within 300 s '
        '(comm.init_timeout_seconds): fewer were up, or the lighthouse did not answer (status: Cancelled, message: '
        '"Timeout expired")\n  fix: launch the missing groups (each resumes from its newest checkpoint, or takes a '
        "peer's live state), or wait longer for them with a larger comm.init_timeout_seconds")


def test_a_commit_that_times_out_is_not_taken_for_a_quorum() -> None:
    class _CommitTimesOut(FakeManager):
        def should_commit(self) -> bool:
            raise TimeoutError("commit")

    groups = replica_groups(_CommitTimesOut(peer(LAYOUT, 1)))
    groups.begin_step()
    groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    with pytest.raises(TimeoutError, match="commit"):
        groups.commit(1)


@pytest.mark.parametrize(("timeout_s", "retries"), [(300, 299), (10, 9), (1, 0), (0.5, 0)])
def test_the_lighthouse_is_tried_again_every_second_within_the_quorum_timeout(
        monkeypatch: pytest.MonkeyPatch, timeout_s: float, retries: int) -> None:
    """torchft sleeps timeout / (retries + 1) between tries: 1 s (a restarted lighthouse is
    reached within a second; with none, a failed request hung the group for the timeout)."""
    import sys
    import types

    made = {}
    fake = types.SimpleNamespace(ProcessGroupGloo=lambda timeout: "pg", Manager=lambda **kw: made.update(kw))
    monkeypatch.setitem(sys.modules, "torchft", fake)
    monkeypatch.setattr("torchmoe.distributed.fault_tolerance.check_lighthouse", lambda url, fix: None)
    monkeypatch.setattr("torchmoe.distributed.fault_tolerance._tensors_only_transport", lambda timeout: None)
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://127.0.0.1:1")
    from torchmoe.distributed.fault_tolerance import connect

    connect(FaultTolerance(enable=True, group_size=2), quorum_timeout_s=timeout_s)
    assert made["quorum_retries"] == retries and made["quorum_timeout"].total_seconds() == timeout_s


def test_a_recovering_group_refuses_a_peer_of_another_layout_and_takes_its_own_rows() -> None:
    taken = []
    manager = FakeManager(peer(LAYOUT, 1))
    cfg = FaultTolerance(enable=True, group_size=2, replica_id=1)
    ReplicaGroups(manager, cfg, layout=LAYOUT, known_models=[], position_width=3, state=lambda: {},
                  load=lambda state, position: taken.append((state, position)), device=torch.device("cpu"),
                  quorum_timeout_s=300.0)
    table = RowPositions(2, 3)
    table.commit({1: [4.0, 5.0, 6.0]})
    manager.load({"trainer": {"w": 2}, "layout": LAYOUT.codes(), "positions": table.state_dict()})
    assert taken == [({"w": 2}, [4.0, 5.0, 6.0])]
    with pytest.raises(ConfigError, match=r"but the groups it joins run a model of code 0x[0-9a-f]+ on 2 ranks"):
        manager.load({"trainer": {}, "layout": OTHER.codes(), "positions": table.state_dict()})


def test_a_layout_round_trips_through_its_codes() -> None:
    assert GroupLayout.from_codes(OTHER.codes(), ["llama4/debugmodel, float32"]) == OTHER
    assert GroupLayout.from_codes(OTHER.codes()).model.startswith("a model of code 0x")


def test_a_peers_state_must_have_this_ranks_keys_and_shapes() -> None:
    mine = {"model": {"w": torch.zeros(2, 3)}, "step": 4}
    sent = local_tensors({"model": {"w": torch.ones(2, 3)}, "step": 9})
    assert torch.equal(like(mine, sent)["model"]["w"], torch.ones(2, 3)) and like(mine, sent)["step"] == 9
    with pytest.raises(ValueError, match=r"missing \['w'\], extra \['v'\]"):
        like(mine, {"model": {"v": torch.ones(2, 3)}, "step": 9})
    with pytest.raises(ValueError, match=r"model.w is \(3, 2\), this rank's \(2, 3\)"):
        like(mine, {"model": {"w": torch.ones(3, 2)}, "step": 9})


def test_a_forward_and_backward_leave_the_live_state_as_it_was() -> None:
    """torchft serves a group's live state to a recovering peer while the group runs the retried
    step's forward and backward: nothing in the model's state dict may change then (the routed-
    token counts did, and a peer summed a step's counts twice)."""
    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed=0)
    served = local_tensors(model.state_dict())
    before = {name: tensor.clone() for name, tensor in served.items()}
    tokens = torch.randint(0, FLAVORS["tiny"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens).sum().backward()
    assert sum(moe.tokens_per_expert.sum().item() for moe in model.moe_layers()) > 0  # the forward counted
    changed = [name for name, tensor in served.items() if not torch.equal(tensor, before[name])]
    assert changed == []
    assert any(name.endswith("expert_bias") for name in served)  # the router state still travels


def test_a_group_recovering_at_the_commit_is_left_out_of_the_mean() -> None:
    """Asynchronous quorum: a group that recovers at this step's commit is a participant whose
    collectives sent zeros (torchft zeroes them), so its row is absent. The mean of the loss and
    the gradients is over the one group that sent them, not torchft's two participants."""
    manager = FakeManager(lambda tensor: torch.zeros_like(tensor), participants=2)
    groups = replica_groups(manager)
    groups.begin_step()
    grads = [torch.full((3,), 4.0)]
    loss, counts = groups.reduce(torch.tensor(1.5), torch.tensor([3.0]), lambda: grads, [1.0, 2.0, 3.0])
    assert loss.item() == 1.5 and counts.tolist() == [3.0] and grads[0].tolist() == [4.0, 4.0, 4.0]
    assert groups.commit(1) and groups.positions.get(1) is None


def test_a_lost_peers_error_logged_by_torchft_is_one_warning_line() -> None:
    """torchft's manager and process group log a failed collective with `logger.exception`: a lost
    peer's (gloo's "Connection closed by peer", what a survivor of a killed group sees) becomes one
    warning naming the peer; another error keeps its traceback."""
    import io
    import logging

    from torchft.manager import _ManagerLogger

    from torchmoe.distributed.fault_tolerance import import_torchft

    import_torchft()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    manager = _ManagerLogger(manager=type("M", (), {"current_step": lambda self: 4})(), replica_id="g0", group_rank=1)
    process_group = logging.getLogger("torchft.process_group")
    gone = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:36000. This is typically caused by a remote worker crashing. GLHF!")
    # A group killed while the survivors configure the new quorum's process group: its key never
    # comes (seen in CI: the kill fell inside a quorum change); a store timeout on another key is not it.
    never = torch.distributed.DistStoreError("wait timeout after 30000ms, keys: /torchft/4/0/1")
    other_store = torch.distributed.DistStoreError("wait timeout after 30000ms, keys: /my_job/ready")
    for log in (manager._logger, process_group):
        log.addHandler(handler)
    try:
        for error in (gone, ValueError("a bug")):
            try:
                raise error
            except Exception as e:  # noqa: BLE001 - what torchft catches
                manager.exception(f"got exception waiting for work {e}")
                process_group.exception(f"got exception in future -- skipping remaining: {e}")
        for error in (never, other_store):
            try:
                raise error
            except Exception as e:  # noqa: BLE001 - what torchft catches
                manager.exception(f"got exception in pg configure: {e}")
    finally:
        for log in (manager._logger, process_group):
            log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[:2] == [
        "WARNING torchft.manager: [g0/1 - step 4] got exception waiting for work: the peer at 127.0.0.1:36000 "
        "(Connection closed by peer) is gone (its replica group failed); this step is not committed",
        "WARNING torchft.process_group: got exception in future -- skipping remaining: the peer at 127.0.0.1:36000 "
        "(Connection closed by peer) is gone (its replica group failed); this step is not committed"]
    assert lines[2] == "ERROR torchft.manager: [g0/1 - step 4] got exception waiting for work a bug"
    assert lines[3] == "Traceback (most recent call last):" and "ValueError: a bug" in lines
    configure = lines.index("WARNING torchft.manager: [g0/1 - step 4] got exception in pg configure: a peer of the "
                            "new quorum never joined it (no /torchft/4/0/1 in the store after 30000 ms: its replica "
                            "group failed); this step is not committed")
    assert lines[configure + 1] == ("ERROR torchft.manager: [g0/1 - step 4] got exception in pg configure: wait timeout "
                                    "after 30000ms, keys: /my_job/ready")
    assert lines[configure + 2] == "Traceback (most recent call last):"
    # Without NCCL in the torch build, its flight recorder's note at every quorum is INFO (log files only).
    records = []
    catch = logging.Handler()
    catch.emit = records.append
    manager._logger.addHandler(catch)
    try:
        manager._logger.warning("[g0/1 - step 4] Unable to reset NCCL flight recorder recording so traces will be "
                                "incorrect.")  # what manager.warn logs (Logger.warn is deprecated)
    finally:
        manager._logger.removeHandler(catch)
    nccl = torch.distributed.is_nccl_available()
    assert [r.levelname for r in records] == ["WARNING" if nccl else "INFO"]
