"""`[fault_tolerance]` without a world: bad settings are one message each (exit 2), a group plans and
writes under its own folder, `torchmoe lighthouse` refuses bad flags, and `ReplicaGroups` on a
fake torchft Manager (another group's tensors added in its collectives): the small per-step
collective (loss averaged, counts summed, positions kept), row positions round-tripping through a
loader, layouts compared (the later group stops naming both, the earlier fails only the step),
and recovered state checked against this rank's before it is taken.

    python -m pytest -q tests/unit/test_fault_tolerance_config.py

(Groups training, failing and recovering: tests/distributed/test_fault_tolerance.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from torchmoe import cli
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
from torchmoe.distributed.semi_sync import SemiSync
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
    (["--fault_tolerance.semi_sync_method", "DiLoCo"], 'fault_tolerance.semi_sync_method = "DiLoCo"',
     "not an allowed value", 'did you mean "diloco"'),
    ([*FT, "--fault_tolerance.process_group_timeout_ms", "0"], "fault_tolerance.process_group_timeout_ms = 0",
     "milliseconds", "e.g. 10000"),
    ([*FT, "--fault_tolerance.lighthouse_timeout_ms", "-1"], "fault_tolerance.lighthouse_timeout_ms = -1",
     "milliseconds", "e.g. 10000"),
    ([*FT, "--fault_tolerance.outer_momentum", "1.0"], "fault_tolerance.outer_momentum = 1.0", "[0, 1)",
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
    from torchmoe.launch import free_port

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


class _Work:
    def wait(self) -> None:
        pass


class _FakeManager:
    """torchft's Manager as one rank of group `mine` sees it, with `other` the same rank of
    another group: each collective adds what `other` contributes (a callable of the tensor this
    rank sends); AVG divides by the participants."""

    def __init__(self, other, *, participants: int = 2, commits: bool = True) -> None:
        self.other, self.participants, self.commits = other, participants, commits
        self.errors: list[Exception] = []
        self.quorums = 0

    def register_state_dict_fn(self, key, load, state) -> None:
        self.load, self.state = load, state

    def start_quorum(self) -> None:
        self.quorums += 1

    def allreduce(self, tensor: torch.Tensor, reduce_op=torch.distributed.ReduceOp.AVG) -> _Work:
        if not self.errors:
            tensor += self.other(tensor)
            if reduce_op == torch.distributed.ReduceOp.AVG:
                tensor /= self.participants
        return _Work()

    def errored(self):
        return self.errors[0] if self.errors else None

    def report_error(self, err: Exception) -> None:
        self.errors.append(err)

    def num_participants(self) -> int:
        return self.participants

    def should_commit(self) -> bool:
        return self.commits and not self.errors


LAYOUT = GroupLayout(model="llama4/tiny, float32", degrees={"pp": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1},
                     ranks=2, seq_len=64, local_batch_size=2, global_batch_size=8)
OTHER = GroupLayout(model="llama4/debugmodel, float32", degrees={"pp": 1, "dp_shard": 1, "cp": 1, "tp": 2, "ep": 1},
                    ranks=2, seq_len=64, local_batch_size=2, global_batch_size=8)


def _groups(manager: _FakeManager, *, replica_id: int = 0, group_size: int = 2, width: int = 3,
            layout: GroupLayout = LAYOUT) -> ReplicaGroups:
    cfg = FaultTolerance(enable=True, group_size=group_size, replica_id=replica_id)
    return ReplicaGroups(manager, cfg, layout=layout, known_models=["llama4/tiny, float32", "llama4/debugmodel, float32"],
                         position_width=width, state=lambda: {"w": 1}, load=lambda state, position: None,
                         device=torch.device("cpu"), quorum_timeout_s=300.0)


def _peer(layout: GroupLayout, group: int, *, committed: int = 0, position=(5.0, 6.0, 7.0), loss: float = 3.0,
          counts=(1.0, 2.0), hook=(0.0, 0.0), groups: int = 2):
    """What group `group` of `layout` sends in each of a step's collectives, by the tensor's form
    (of `groups` groups; counts as many of `counts` as this rank sends)."""
    header = [1, committed, *layout.codes()]

    def contribution(tensor: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tensor)
        width = len(header) + 2 + len(position)
        if tensor.dtype == torch.int64:  # the layouts, at the first of FSDP's hooks
            out[group] = torch.tensor(header)
        elif tensor.numel() < groups * width:  # gradients: the other group's are zeros
            pass
        else:  # loss, counts, then one row per group: [*header, hook calls, hook elements, *position]
            n = tensor.numel() - groups * width
            out[:n] = torch.tensor([loss, *counts][:n], dtype=tensor.dtype)
            out[n:].view(groups, width)[group] = torch.tensor([*header, *hook, *position], dtype=tensor.dtype)
        return out
    return contribution


def test_a_step_averages_the_loss_sums_the_counts_and_commits_every_groups_rows() -> None:
    manager = _FakeManager(_peer(LAYOUT, 1))
    groups = _groups(manager)
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
    groups = _groups(_FakeManager(_peer(LAYOUT, 1), commits=False))
    groups.begin_step()
    groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    assert not groups.commit(1) and groups.positions.get(0) is None and groups.positions.get(1) is None


def test_groups_whose_gradient_reductions_differ_stop() -> None:
    groups = _groups(_FakeManager(_peer(LAYOUT, 1, hook=(3.0, 100.0))))
    groups.begin_step()
    with pytest.raises(RuntimeError, match="reduced 3 gradient buffers of 100 elements.*did not line up"):
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])


def test_a_group_of_another_layout_stops_if_it_joined_later_else_fails_the_step() -> None:
    # This group joined later (committed nothing here, the peer 5 steps): it stops, naming both.
    groups = _groups(_FakeManager(_peer(OTHER, 1, committed=5)))
    groups.begin_step()
    with pytest.raises(ConfigError) as err:
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    text = str(err.value)
    assert "replica group 0" in text and "runs llama4/tiny, float32 on 2 ranks (pp 1, dp_shard 2" in text
    assert "replica group 1 runs llama4/debugmodel, float32 on 2 ranks (pp 1, dp_shard 1, cp 1, tp 2" in text
    assert "only fault_tolerance.replica_id differs" in text
    # This group was here first: the step fails (tried again without the newcomer), nothing stops.
    manager = _FakeManager(_peer(OTHER, 1, committed=0))
    groups = _groups(manager)
    groups.committed_here = 3
    groups.begin_step()
    groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    assert len(manager.errors) == 1 and not groups.commit(4)


def test_two_launches_with_one_replica_id_stop() -> None:
    groups = _groups(_FakeManager(_peer(LAYOUT, 0)))  # the other launch is replica group 0 too
    groups.begin_step()
    with pytest.raises(ConfigError, match="2 launches joined the job as replica group 0"):
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])


class _QuorumNeverForms(_FakeManager):
    """torchft's Manager when too few groups are up: the quorum times out (its client's timeout)."""

    def start_quorum(self) -> None:
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')


def test_a_quorum_that_never_forms_is_one_message_naming_what_to_launch() -> None:
    """min_replica_size 2 and one group up for the whole quorum timeout: a TimeoutError traceback
    from torchft's thread before."""
    cfg = FaultTolerance(enable=True, group_size=2, min_replica_size=2)
    groups = ReplicaGroups(_QuorumNeverForms(_peer(LAYOUT, 1)), cfg, layout=LAYOUT, known_models=[],
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
    class _CommitTimesOut(_FakeManager):
        def should_commit(self) -> bool:
            raise TimeoutError("commit")

    groups = _groups(_CommitTimesOut(_peer(LAYOUT, 1)))
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
    manager = _FakeManager(_peer(LAYOUT, 1))
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


class _TwoGroups:
    """`ReplicaGroups` as this rank sees it when a second group holds `other`: averaging takes the
    mean with the other group's tensors (in the order given), when its wait is called; commit
    says `commits`."""

    def __init__(self, other: list[torch.Tensor], *, commits: bool = True) -> None:
        self.other, self.commits, self.quorums = other, commits, 0

    def begin_step(self) -> None:
        self.quorums += 1

    def start_average(self, tensors: list[torch.Tensor], *, quantize: bool = False):
        theirs = list(self.other)

        def wait() -> None:
            for mine, other in zip(tensors, theirs, strict=True):
                mine.copy_((mine + other) / 2)
        return wait

    def reduce(self, loss, counts, grads, position):
        return loss, counts

    def commit(self, step: int) -> bool:
        return self.commits


def _semi_sync(method: str, params: list[torch.Tensor], groups, bias: torch.Tensor, *, names=None, blocks=None,
               **keys):
    cfg = FaultTolerance(enable=True, group_size=2, semi_sync_method=method, **keys)
    names = names or [f"layers.{i}.w" for i in range(len(params))]
    return SemiSync(groups, cfg, lambda: list(zip(names, params)), [bias], layer_ids=range(blocks or len(params)))


def test_diloco_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient() -> None:
    """Two syncs of one rank against a hand computation and against torch's own SGD (lr 0.7,
    momentum 0.9, Nesterov) stepped on the averaged pseudo-gradient, to 1e-6."""
    gen = torch.Generator().manual_seed(0)
    theta0 = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    params = [t.clone() for t in theta0]
    groups = _TwoGroups([])
    sync = _semi_sync("diloco", params, groups, torch.zeros(2), outer_lr=0.7, outer_momentum=0.9)
    reference = [torch.nn.Parameter(t.clone()) for t in theta0]
    outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    anchor, momentum = [t.clone() for t in theta0], None
    for _ in range(2):
        mine = [torch.randn(p.shape, generator=gen) * 0.1 for p in params]  # this group's inner steps
        theirs = [torch.randn(p.shape, generator=gen) * 0.1 for p in params]
        for p, step in zip(params, mine):
            p.sub_(step)
        # The other group's pseudo-gradient (anchor - its θ), and its expert bias.
        groups.other = [*theirs, torch.ones(2)]
        assert sync.after_step(5, []) == {"ft_synced": True, "ft_fragment": 0}
        delta = [(m + t) / 2 for m, t in zip(mine, theirs)]  # mean of (anchor - θ_g)
        momentum = delta if momentum is None else [0.9 * m + d for m, d in zip(momentum, delta)]
        anchor = [a - 0.7 * (d + 0.9 * m) for a, d, m in zip(anchor, delta, momentum)]
        for ref, d in zip(reference, delta):
            ref.grad = d.clone()
        outer.step()
        for got, hand, torch_sgd in zip(params, anchor, reference):
            assert torch.allclose(got, hand, rtol=0, atol=1e-6)
            assert torch.allclose(got, torch_sgd.detach(), rtol=0, atol=1e-6)
        assert all(torch.equal(a, p) for a, p in zip(sync.anchor, params))  # the next sync's anchor
    assert torch.equal(sync.buffers[0], torch.full((2,), 0.75)) and groups.quorums == 2  # 0 -> 0.5 -> 0.75


def test_local_sgd_averages_parameters_and_biases_and_a_failed_sync_changes_nothing() -> None:
    params, bias = [torch.zeros(3), torch.ones(2)], torch.zeros(4)
    groups = _TwoGroups([torch.full((3,), 2.0), torch.full((2,), 3.0), torch.ones(4)], commits=False)
    sync = _semi_sync("local_sgd", params, groups, bias, sync_steps=5)
    assert [sync.fragment_at(s) for s in (4, 5, 10)] == [None, 0, 0]
    assert sync.after_step(4, []) is None
    assert sync.after_step(5, []) == {"ft_synced": False, "ft_fragment": 0}
    assert torch.equal(params[0], torch.zeros(3)) and torch.equal(bias, torch.zeros(4))
    groups.commits = True
    assert sync.after_step(10, [])["ft_synced"]
    assert torch.equal(params[0], torch.ones(3)) and torch.equal(params[1], torch.full((2,), 2.0))
    assert torch.equal(bias, torch.full((4,), 0.5))
    assert sync.state_dict() == {"anchor": [], "momentum": []}


def test_streaming_diloco_syncs_fragments_in_turn_with_delay_and_mixing_against_a_hand_computation() -> None:
    """2 fragments (the embedding with block 0, block 1 with the head), sync_steps 4: fragment 0
    syncs at steps 2 and 6, fragment 1 at 4 and 8; each pseudo-gradient is taken a step before
    (delay 1), and a synced fragment's parameters become 0.75 x the outer step's + 0.25 x this
    group's own (alpha 0.25). Outer SGD: lr 0.7, Nesterov momentum 0.9, per fragment."""
    names = ["tok_embeddings.weight", "layers.0.w", "layers.1.w", "output.weight"]
    gen = torch.Generator().manual_seed(1)
    theta0 = [torch.randn(3, generator=gen) for _ in names]
    params = [t.clone() for t in theta0]
    groups = _TwoGroups([])
    sync = _semi_sync("diloco", params, groups, torch.zeros(2), names=names, blocks=2, sync_steps=4, num_fragments=2,
                      fragment_sync_delay=1, fragment_update_alpha=0.25, outer_lr=0.7, outer_momentum=0.9)
    assert sync.fragments == [[0, 1], [2, 3]]
    anchor, momentum = [t.clone() for t in theta0], [torch.zeros(3) for _ in names]
    synced = []
    for step in range(1, 9):
        for p in params:  # this group's inner step
            p.sub_(torch.randn(3, generator=gen) * 0.1)
        if step % 2:  # a fragment's pseudo-gradient is taken: the other group's is `theirs`
            fragment = [0, 1] if step % 4 == 1 else [2, 3]
            theirs = [torch.randn(3, generator=gen) * 0.1 for _ in fragment]
            groups.other = [*theirs, torch.ones(2)]
            deltas = [((anchor[i] - params[i]) + t) / 2 for i, t in zip(fragment, theirs)]
            assert sync.after_step(step, []) is None
            continue
        local = [p.clone() for p in params]
        report = sync.after_step(step, [])
        assert report == {"ft_synced": True, "ft_fragment": fragment[0] // 2}, step
        synced.append((step, report["ft_fragment"]))
        for i, delta in zip(fragment, deltas):
            momentum[i] = 0.9 * momentum[i] + delta
            anchor[i] = anchor[i] - 0.7 * (delta + 0.9 * momentum[i])
            assert torch.allclose(sync.anchor[i], anchor[i], rtol=0, atol=1e-6), (step, i)
            assert torch.allclose(params[i], 0.75 * anchor[i] + 0.25 * local[i], rtol=0, atol=1e-6), (step, i)
        for i in {0, 1, 2, 3} - set(fragment):  # the other fragment is untouched
            assert torch.equal(params[i], local[i]), (step, i)
    assert synced == [(2, 0), (4, 1), (6, 0), (8, 1)]


def test_fragments_split_the_blocks_in_contiguous_runs() -> None:
    from torchmoe.distributed.semi_sync import fragments_of

    names = ["tok_embeddings.weight", *(f"layers.{i}.attention._checkpoint_wrapped_module.wq.weight" for i in range(5)),
             "mtp.5.enorm.weight", "layers.5.moe.router.weight", "norm.weight", "output.weight"]
    assert fragments_of(names, range(6), 3) == [[0, 1, 2], [3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ConfigError, match="must be at most the model's 6 blocks"):
        fragments_of(names, range(6), 7)


def test_in_fsdps_backward_the_first_hook_compares_layouts_before_any_gradient_crosses() -> None:
    manager = _FakeManager(_peer(LAYOUT, 1, hook=(2.0, 6.0)))
    groups = _groups(manager)
    groups.attached = True  # as `attach` leaves it: FSDP's hooks call `_average_in_backward`
    groups.begin_step()
    shard = torch.full((4,), 2.0)
    groups._average_in_backward(shard)  # the peer's shard is zeros here: the mean is half
    groups._average_in_backward(torch.ones(2))
    assert shard.tolist() == [1.0] * 4
    loss, _ = groups.reduce(torch.tensor(1.0), None, lambda: pytest.fail("averaged twice"), [1.0, 2.0, 3.0])
    assert loss.item() == 2.0 and groups.commit(1)
    groups = _groups(_FakeManager(_peer(LAYOUT, 1, hook=(1.0, 4.0))))
    groups.attached = True
    groups.begin_step()
    groups._average_in_backward(torch.ones(4))
    groups._average_in_backward(torch.ones(2))
    with pytest.raises(RuntimeError, match="replica group 1 reduced 1 gradient buffers of 4 elements.*this group 2 of 6"):
        groups.reduce(torch.tensor(1.0), None, lambda: [], [1.0, 2.0, 3.0])
    other = _groups(_FakeManager(_peer(OTHER, 1, committed=5)))
    other.attached = True
    other.begin_step()
    with pytest.raises(ConfigError, match="replica group 1 runs llama4/debugmodel"):
        other._average_in_backward(torch.ones(3))


def test_a_group_recovering_at_the_commit_is_left_out_of_the_mean() -> None:
    """Asynchronous quorum: a group that recovers at this step's commit is a participant whose
    collectives sent zeros (torchft zeroes them), so its row is absent. The mean of the loss and
    the gradients is over the one group that sent them, not torchft's two participants."""
    manager = _FakeManager(lambda tensor: torch.zeros_like(tensor), participants=2)
    groups = _groups(manager)
    groups.begin_step()
    grads = [torch.full((3,), 4.0)]
    loss, counts = groups.reduce(torch.tensor(1.5), torch.tensor([3.0]), lambda: grads, [1.0, 2.0, 3.0])
    assert loss.item() == 1.5 and counts.tolist() == [3.0] and grads[0].tolist() == [4.0, 4.0, 4.0]
    assert groups.commit(1) and groups.positions.get(1) is None
