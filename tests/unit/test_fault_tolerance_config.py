"""`[fault_tolerance]` without a world: bad settings are one message each (exit 2), a group plans and
writes under its own folder, `torchmoe lighthouse` refuses bad flags, a group's data position
round-trips, and recovered state is checked against this rank's before it is taken.

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
from torchmoe.components.data_position import DataPosition
from torchmoe.config import load_job_config
from torchmoe.data.dataloader import build_dataloader
from torchmoe.data.tokenizer import build_tokenizer
from torchmoe.distributed.fault_tolerance import LIGHTHOUSE_ENV, like, local_tensors
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
])
def test_bad_settings_are_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], key: str,
                                      problem: str, fix: str) -> None:
    status = cli.main(["train", "--config", DEBUG_CONFIG, "--dry-run", "--job.dump_folder", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert status == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert f"{key}:" in err and problem in err and fix in err, err


def test_a_group_plans_its_own_layout_in_its_own_folder(tmp_path: Path) -> None:
    assert cli.main(["train", "--config", DEBUG_CONFIG, "--dry-run", "--world-size", "2", "--job.dump_folder",
                     str(tmp_path), *FT, "--fault_tolerance.replica_id", "1"]) == 0
    report = json.loads((tmp_path / "replica_1" / "dry_run.json").read_text())
    assert report["world_size"] == 2 and not (tmp_path / "dry_run.json").exists()


def test_training_without_a_lighthouse_is_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    assert cli.main(["train", "--config", DEBUG_CONFIG, "--training.steps", "1", "--job.dump_folder", str(tmp_path),
                     *FT]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{LIGHTHOUSE_ENV} = " in err and "torchmoe lighthouse" in err, err


@pytest.mark.parametrize(("flags", "expected"), [
    (["--min-replicas", "0"], "--min-replicas = 0: must be >= 1"),
    (["--heartbeat-timeout-ms", "-5"], "--heartbeat-timeout-ms = -5: must be >= 1"),
    (["--bind", "no-such-host.invalid:1"], "--bind = \"no-such-host.invalid:1\": the lighthouse cannot listen there"),
    (["--min-replicas", "two"], "torchmoe lighthouse"),
    (["--port", "1"], "unrecognized arguments: --port 1"),
])
def test_lighthouse_bad_flags_are_one_message(capsys: pytest.CaptureFixture[str], flags: list[str],
                                             expected: str) -> None:
    assert cli.main(["lighthouse", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and expected in err and "Traceback" not in err, err


def _loader(dp_rank: int = 1):
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2"])
    return build_dataloader(cfg.training, build_tokenizer(""), dp_rank=dp_rank, dp_degree=4)


def test_a_data_position_resumes_the_rows_after_the_last_step_that_counted(tmp_path: Path) -> None:
    """Committed after 2 batches, then a 3rd drawn and marked pending: recovery resumes after the
    2nd unless a peer's record says the 3rd step averaged this group's gradients."""
    position = DataPosition(tmp_path, rank=3)
    loader = _loader()
    assert position.restore(loader, lambda step: True) is None  # never committed: the loader stays
    for _ in range(2):
        loader.next_batch()
    position.save(loader, committed_step=7)
    loader.next_batch()
    position.save_pending(loader, step=8)
    loader.next_batch()  # drawn, never averaged
    fresh = _loader()
    batches = [fresh.next_batch() for _ in range(4)]
    for counted, step, expected in ((set(), 7, batches[2]), ({8}, 8, batches[3])):
        again = _loader()
        assert position.restore(again, counted.__contains__) == step
        got = again.next_batch()
        assert all(torch.equal(a, b) for pair in zip(got, expected) for a, b in zip(*pair)), step


def test_an_unreadable_data_position_is_one_message(tmp_path: Path) -> None:
    position = DataPosition(tmp_path, rank=0)
    position.path.parent.mkdir(parents=True)
    position.path.write_text("{not json")
    with pytest.raises(Exception) as err:
        position.restore(_loader(), lambda step: True)
    assert "rank0.json is unreadable" in str(err.value) and "delete it" in str(err.value)


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
    mean with the other group's tensors (in the order given), commit says `commits`."""

    def __init__(self, other: list[torch.Tensor], *, commits: bool = True) -> None:
        self.other, self.commits, self.quorums = other, commits, 0

    def start_step(self) -> None:
        self.quorums += 1

    def average_(self, tensors: list[torch.Tensor]) -> None:
        for mine, theirs in zip(tensors, self.other, strict=True):
            mine.copy_((mine + theirs) / 2)

    def commit(self, step: int) -> bool:
        return self.commits


def _semi_sync(method: str, params: list[torch.Tensor], groups, bias: torch.Tensor, **keys):
    from torchmoe.config.job_config import FaultTolerance
    from torchmoe.distributed.fault_tolerance import SemiSync

    cfg = FaultTolerance(enable=True, group_size=2, semi_sync_method=method, **keys)
    return SemiSync(groups, cfg, lambda: params, [bias])


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
        assert sync.sync(5)
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
    assert [sync.due(s) for s in (4, 5, 10)] == [False, True, True]
    assert not sync.sync(5)
    assert torch.equal(params[0], torch.zeros(3)) and torch.equal(bias, torch.zeros(4))
    groups.commits = True
    assert sync.sync(10)
    assert torch.equal(params[0], torch.ones(3)) and torch.equal(params[1], torch.full((2,), 2.0))
    assert torch.equal(bias, torch.full((4,), 0.5))
    assert sync.state_dict() == {"anchor": [], "momentum": []}
