"""CheckpointManager in one process without a process group (DCP's no-dist mode)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchmoe.checkpoints.base_fingerprint import BaseFingerprint
from torchmoe.checkpoints.checkpoint import MARKER, CheckpointManager, SaveFailed
from torchmoe.checkpoints.checkpoint_state import ModelWrapper, OptimizerWrapper, RankLocal, RNGState, load_model_only
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Checkpoint as CheckpointConfig
from torchmoe.config.job_config import LRScheduler as LRSchedulerConfig
from torchmoe.data import ByteTokenizer, DataLoader, InMemoryDocuments
from torchmoe.optim.lr_scheduler import build_lr_scheduler

# pytest resets warning filters per test; the module's filter for DCP's no-process-group notice
# (which async saves emit from their thread) is restated here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(6, 8)
        self.w2 = nn.Linear(8, 6)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("expert_bias", torch.zeros(4))  # persistent: checkpointed
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.w2(torch.relu(self.w1(x)))) + self.expert_bias.sum()


class _Run:
    """A tiny training setup: model, AdamW, LR schedule, loader position, RNG."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = _Net()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = build_lr_scheduler(self.opt, LRSchedulerConfig(warmup_steps=2), total_steps=20)
        self.loader = {"epoch": 0, "offset": 0}
        self.state = {
            "model": ModelWrapper(self.model),
            "optimizer": OptimizerWrapper(self.model, self.opt),
            "lr_scheduler": self.sched,
            "dataloader": RankLocal(self.loader, rank=0),
            "rng": RankLocal(RNGState(), rank=0),
        }

    def step(self) -> float:
        x = torch.randn(4, 6)  # draws from the RNG: resumes must restore it
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        self.model.expert_bias += 0.5  # stands in for the MoE bias update
        self.loader["offset"] += 4
        return loss.item()


def _manager(tmp_path: Path, **kw) -> CheckpointManager:
    cfg = CheckpointConfig(enable=True, **{"interval": 1, **kw})
    return CheckpointManager(tmp_path, cfg, total_steps=20)


def _steps(tmp_path: Path) -> list[int]:
    return [s for s, _ in _manager(tmp_path).complete_checkpoints()]


def test_round_trip_continues_the_exact_loss_curve(tmp_path: Path) -> None:
    run = _Run()
    ckpt = _manager(tmp_path, interval=3)
    for step in range(1, 4):
        run.step()
        ckpt.maybe_save(step, run.state)
    assert (tmp_path / "checkpoint" / "step-3" / MARKER).is_file()
    expected = [run.step() for _ in range(3)]

    resumed = _Run(seed=123)
    assert _manager(tmp_path).load_latest(resumed.state) == 3
    assert resumed.loader == {"epoch": 0, "offset": 12}
    assert resumed.sched.last_epoch == 3
    torch.testing.assert_close(resumed.model.expert_bias, torch.full((4,), 1.5))
    assert [resumed.step() for _ in range(3)] == expected
    for a, b in zip(resumed.model.state_dict().values(), run.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_entry_added_after_a_checkpoint_was_written_is_optional_to_load(tmp_path: Path, caplog) -> None:
    """A LoRA checkpoint of the version before base fingerprints (`state["base"]`) resumes: the
    entry it lacks keeps its fresh value, with a warning; one it holds is loaded; a required
    entry it lacks still fails the load."""
    run = _Run()
    run.step()
    _manager(tmp_path).save(1, run.state)
    newer = _Run(seed=5)
    fingerprint = BaseFingerprint()
    assert _manager(tmp_path).load_latest({**newer.state, "base": fingerprint}) == 1
    assert fingerprint.recorded is None and "holds no base (written by an older version)" in caplog.text
    assert newer.loader == run.loader
    fingerprint.check({"w": "float32:7"}, key="k", path="p", fix="f")
    _manager(tmp_path).save(2, {**newer.state, "base": fingerprint})
    again = BaseFingerprint()
    assert _manager(tmp_path).load_latest({**_Run().state, "base": again}) == 2
    assert again.recorded == {"w": "float32:7"}
    _manager(tmp_path / "old").save(1, run.state)
    with pytest.raises(ConfigError, match="the checkpoint has no such tensor"):
        _manager(tmp_path / "old").load_latest({**_Run().state, "extra": ModelWrapper(_Net())})


def test_a_base_fingerprint_covers_the_expert_biases_where_the_checkpoint_recorded_them() -> None:
    """A fingerprint recorded with the base's expert biases refuses a base whose bias changed; one
    recorded before they were covered (parameters alone) compares the parameters, still all of them."""
    found = {"w": "float32:7", "layers.1.moe.expert_bias": "float32:3"}
    covered = BaseFingerprint()
    covered.recorded = {"w": "float32:7", "layers.1.moe.expert_bias": "float32:4"}
    with pytest.raises(ConfigError, match=r"\(1 of 2 tensors differ, e.g. layers.1.moe.expert_bias\)"):
        covered.check(found, key="k", path="p", fix="f")
    older = BaseFingerprint()
    older.recorded = {"w": "float32:7"}
    older.check(found, key="k", path="p", fix="f")
    assert older.current == found  # what the next checkpoint records: the biases too
    older.recorded = {"w": "float32:8"}
    with pytest.raises(ConfigError, match=r"\(1 of 1 tensors differ, e.g. w\)"):
        older.check(found, key="k", path="p", fix="f")


def test_persistent_buffers_only(tmp_path: Path) -> None:
    run = _Run()
    _manager(tmp_path).save(1, run.state)
    meta = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-1")).read_metadata()
    assert "model.expert_bias" in meta.state_dict_metadata
    assert "model.scratch" not in meta.state_dict_metadata


def test_interval_and_final_step(tmp_path: Path) -> None:
    ckpt = CheckpointManager(tmp_path, CheckpointConfig(enable=True, interval=5), total_steps=12)
    assert [s for s in range(1, 13) if ckpt.should_save(s)] == [5, 10, 12]
    off = CheckpointManager(tmp_path, CheckpointConfig(enable=False), total_steps=12)
    assert not any(off.should_save(s) for s in range(1, 13))
    assert off.load_latest(_Run().state) is None


def test_first_step_and_load_only(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path, CheckpointConfig(enable=True, interval=5, enable_first_step_checkpoint=True),
                              total_steps=12)
    assert [s for s in range(1, 13) if first.should_save(s)] == [1, 5, 10, 12]
    load_only = CheckpointManager(tmp_path, CheckpointConfig(enable=True, load_only=True), total_steps=12)
    assert not load_only.writes and not any(load_only.should_save(s) for s in range(1, 13))


def test_load_step_picks_a_resumable_checkpoint(tmp_path: Path) -> None:
    """load_step names a full checkpoint; one that is missing or a model-only export (the last
    save of last_save_model_only) is refused before anything loads."""
    run = _Run()
    ckpt = _manager(tmp_path, interval=2, last_save_model_only=True)
    ckpt.total_steps = 5
    for step in range(1, 6):
        ckpt.maybe_save(step, run.state)
    assert _steps(tmp_path) == [2, 4, 5]
    assert _manager(tmp_path).load_latest(_Run().state) == 4  # the step-5 export is not resumed from
    assert _manager(tmp_path, load_step=2).load_latest(_Run().state) == 2
    with pytest.raises(ConfigError, match=r"checkpoint.load_step = 3: no complete checkpoint step-3 in .*"
                                          r"\(found: step-2, step-4\)\n  fix: name one of those steps"):
        _manager(tmp_path, load_step=3).load_latest(_Run().state)
    with pytest.raises(ConfigError, match=r"checkpoint.load_step = 5: .*step-5 holds only the weights"):
        _manager(tmp_path, load_step=5).load_latest(_Run().state)


def test_keep_latest_k(tmp_path: Path) -> None:
    run = _Run()
    ckpt = _manager(tmp_path, keep_latest_k=2)
    for step in range(1, 5):
        ckpt.maybe_save(step, run.state)
    assert _steps(tmp_path) == [3, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-3", "step-4"]


def test_a_linked_step_folder_is_never_loaded_pruned_or_replaced(tmp_path: Path) -> None:
    """A step-N that is a symbolic link (refused at start; here one appearing mid-run) is not the
    run's: resuming skips it, pruning leaves it and its target's marker, and a save of its step
    fails rather than deleting through it."""
    run = _Run()
    shared = tmp_path / "shared"
    _manager(shared).save(9, run.state)  # another run's complete checkpoint
    ckpt = _manager(tmp_path, keep_latest_k=1)
    ckpt.save(1, run.state)
    (tmp_path / "checkpoint" / "step-5").symlink_to(shared / "checkpoint" / "step-9")
    (tmp_path / "checkpoint" / "step-3").symlink_to(shared / "checkpoint" / "step-9")
    assert [step for step, _ in ckpt.complete_checkpoints()] == [1]
    assert _manager(tmp_path).load_latest(_Run().state) == 1
    ckpt.save(2, run.state)  # prunes step-1, not the links
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-3", "step-5"]
    with pytest.raises(SaveFailed, match=r"checkpoint step-3 could not be saved \(Not a directory: "):
        ckpt.save(3, run.state)
    assert (shared / "checkpoint" / "step-9" / MARKER).is_file()
    assert sorted(p.name for p in (shared / "checkpoint" / "step-9").iterdir()) == sorted(
        p.name for p in (tmp_path / "checkpoint" / "step-2").iterdir())


def test_incomplete_folders_are_never_loaded(tmp_path: Path) -> None:
    run = _Run()
    run.step()
    _manager(tmp_path).save(1, run.state)
    root = tmp_path / "checkpoint"
    # A kill mid-write leaves a temp folder; a folder renamed without its marker is not complete.
    shutil.copytree(root / "step-1", root / "step-7.tmp-deadbeef")
    shutil.copytree(root / "step-1", root / "step-5")
    (root / "step-5" / MARKER).unlink()
    assert _steps(tmp_path) == [1]
    assert _manager(tmp_path).load_latest(_Run(seed=1).state) == 1

    # The next save removes the dead temp folder of the earlier run (and leaves step-5 alone).
    _manager(tmp_path).save(2, run.state)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2", "step-5"]


def _truncate_distcp(folder: Path) -> None:
    for f in folder.glob("*.distcp"):
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)


def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, caplog) -> None:
    run = _Run()
    ckpt = _manager(tmp_path)
    run.step()
    ckpt.save(1, run.state)
    after_1 = [t.clone() for t in run.model.state_dict().values()]
    run.step()
    ckpt.save(2, run.state)
    _truncate_distcp(tmp_path / "checkpoint" / "step-2")

    resumed = _Run(seed=5)
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path).load_latest(resumed.state) == 1
    assert "could not load checkpoint" in caplog.text and "step-2" in caplog.text
    for a, b in zip(resumed.model.state_dict().values(), after_1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    _truncate_distcp(tmp_path / "checkpoint" / "step-1")
    with pytest.raises(ConfigError, match="no checkpoint there could be loaded"):
        _manager(tmp_path).load_latest(_Run().state)


def test_async_save_is_complete_after_wait(tmp_path: Path) -> None:
    run = _Run()
    ckpt = _manager(tmp_path, async_mode="async", interval=2)
    for step in range(1, 5):
        run.step()
        ckpt.maybe_save(step, run.state)
    ckpt.close()
    assert _steps(tmp_path) == [2, 4]
    assert not list((tmp_path / "checkpoint").glob("*.tmp-*"))
    resumed = _Run(seed=9)
    assert _manager(tmp_path).load_latest(resumed.state) == 4
    for a, b in zip(resumed.model.state_dict().values(), run.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_async_save_snapshots_state_at_save_time(tmp_path: Path) -> None:
    run = _Run()
    ckpt = _manager(tmp_path, async_mode="async")
    ckpt.save(1, run.state)
    saved = [t.clone() for t in run.model.state_dict().values()]
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)  # training goes on while the save is in flight
    ckpt.wait()
    resumed = _Run(seed=3)
    _manager(tmp_path).load_latest(resumed.state)
    for a, b in zip(resumed.model.state_dict().values(), saved):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_seed_checkpoint_loads_model_only(tmp_path: Path) -> None:
    seed = _Run(seed=42)
    path = _manager(tmp_path).save_seed_checkpoint(seed.state)
    assert path.name == "step-0" and (path / MARKER).is_file()
    fresh = _Run(seed=7)
    assert _manager(tmp_path).load_latest(fresh.state) == 0
    for a, b in zip(fresh.model.state_dict().values(), seed.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fresh.step()  # the optimizer is fresh and usable


def test_seed_checkpoint_never_prunes(tmp_path: Path) -> None:
    """keep_latest_k = 1 must not delete the seed just written, nor the checkpoints already there."""
    run = _Run()
    for step in (3, 4):
        _manager(tmp_path, keep_latest_k=1).save(step, run.state)
    assert _steps(tmp_path) == [4]  # an ordinary save prunes
    _manager(tmp_path, keep_latest_k=1).save_seed_checkpoint(run.state)
    assert _steps(tmp_path) == [0, 4]


def _data_loader(global_batch_size: int) -> DataLoader:
    docs = InMemoryDocuments([f"document {i} " + "z" * (i * 5 % 23) for i in range(30)])
    return DataLoader(docs, ByteTokenizer(), seq_len=7, global_batch_size=global_batch_size, local_batch_size=2)


def test_dataloader_rows_resume_exactly_and_another_global_batch_is_refused(tmp_path: Path, caplog) -> None:
    run = _data_loader(8)
    for _ in range(3):
        run.next_batch()
    _manager(tmp_path).save(2, {"dataloader": run})
    _manager(tmp_path).save(3, {"dataloader": run})
    meta = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-3")).read_metadata()
    assert meta.state_dict_metadata["dataloader.rows"].size == (8, 3)  # (G, 3) int64 rows
    resumed = _data_loader(8)
    assert _manager(tmp_path).load_latest({"dataloader": resumed}) == 3
    for (x0, _), (x1, _) in zip(run.next_batch(), resumed.next_batch(), strict=True):
        assert torch.equal(x0, x1)
    # Another G is refused with one message naming the key, at the newest checkpoint (the older
    # one shares the problem, so no fallback).
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as err:
        _manager(tmp_path).load_latest({"dataloader": _data_loader(4)})
    assert err.value.key == "training.global_batch_size" and err.value.value == 4
    assert "saved with global_batch_size 8" in str(err.value)
    assert "trying the previous one" not in caplog.text


def test_changed_dataset_stops_at_the_newest_checkpoint_with_its_whole_message(tmp_path: Path, caplog) -> None:
    """A position past the end of the (changed) data is the loader's own message, whole (it was cut
    at 160 characters as a damaged file's), raised at the newest checkpoint, never advising to
    delete the run's checkpoints."""
    run = _data_loader(8)
    for _ in range(3):
        run.next_batch()
    _manager(tmp_path).save(2, {"dataloader": run})
    _manager(tmp_path).save(3, {"dataloader": run})
    shorter = DataLoader(InMemoryDocuments(["x"] * 30), ByteTokenizer(), seq_len=7, global_batch_size=8,
                         local_batch_size=2)
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as err:
        _manager(tmp_path).load_latest({"dataloader": shorter})
    row0 = run.state_dict()["rows"][0].tolist()
    assert str(err.value) == (
        f'training.dataset = "row 0 of 8 of InMemoryDocuments(30 texts)": the checkpoint\'s data position '
        f"(pass 0, document {row0[1]}, token {row0[2]}) is past the end of that document: the dataset or the "
        "tokenizer has changed since the checkpoint was saved\n"
        "  fix: resume with the dataset and tokenizer it was saved with; or, to go on training from it with these, "
        'set checkpoint.exclude_from_loading = ["dataloader"] (every batch row starts again at its first document); '
        "or start a new run in another job.dump_folder")
    assert "trying the previous one" not in caplog.text
    assert [step for step, _ in _manager(tmp_path).complete_checkpoints()] == [2, 3]


def test_data_positions_of_the_old_row_split_are_refused(tmp_path: Path) -> None:
    """A checkpoint saved before rows were ranges of the corpus (its dataloader state has no
    `split`) holds positions that mean other documents now: refused with the fix, not continued."""

    class OldLoader:
        def __init__(self, loader: DataLoader) -> None:
            self.loader = loader

        def state_dict(self) -> dict:
            return {k: v for k, v in self.loader.state_dict().items() if k != "split"}

        def load_state_dict(self, state: dict) -> None:
            self.loader.load_state_dict(state)

    run = _data_loader(8)
    run.next_batch()
    _manager(tmp_path).save(1, {"dataloader": OldLoader(run)})
    with pytest.raises(ConfigError) as err:
        _manager(tmp_path).load_latest({"dataloader": _data_loader(8)})
    assert "row split of torchmoe before 2026-12-02" in str(err.value)
    assert 'exclude_from_loading = ["dataloader"]' in str(err.value)
    _manager(tmp_path).save(2, {"dataloader": run})  # today's state resumes
    again = _data_loader(8)
    assert _manager(tmp_path).load_latest({"dataloader": again}) == 2
    assert torch.equal(again.next_batch()[0][0], run.next_batch()[0][0])


def test_model_of_no_flavor_is_refused_without_naming_one(tmp_path: Path) -> None:
    _manager(tmp_path).save(1, {"model": ModelWrapper(_Net())})
    other = nn.Sequential(nn.Linear(6, 6))
    with pytest.raises(ConfigError) as err:
        _manager(tmp_path).load_latest({"model": ModelWrapper(other, flavor="tiny")})
    assert str(err.value).endswith("\n  fix: use the flavor the run was trained with; or give this run its own "
                                   "job.dump_folder"), err.value


def test_rank_local_state_of_another_world_size_is_kept(tmp_path: Path, caplog) -> None:
    run = _Run()
    run.state["dataloader"] = RankLocal(run.loader, rank=1)  # as if written by rank 1 only
    run.loader["offset"] = 99
    _manager(tmp_path).save(1, run.state)
    resumed = _Run()
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path).load_latest(resumed.state) == 1
    assert resumed.loader == {"epoch": 0, "offset": 0}
    assert "no rank-local state for this rank (dataloader)" in caplog.text


def test_load_model_only_from_step_folder_and_bare_dcp(tmp_path: Path) -> None:
    src = _Run(seed=11)
    _manager(tmp_path).save(3, src.state)
    target = _Net()
    load_model_only(tmp_path / "checkpoint" / "step-3", target)
    for a, b in zip(target.state_dict().values(), src.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    bare = tmp_path / "bare"
    dcp.save(src.model.state_dict(), checkpoint_id=str(bare), no_dist=True)
    target = _Net()
    load_model_only(bare, [target])
    torch.testing.assert_close(target.w1.weight, src.model.w1.weight, rtol=0, atol=0)

    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_path = .*: it lacks 2 of the model's tensors"):
        load_model_only(bare, nn.Linear(6, 6))
    with pytest.raises(ConfigError, match=r"not a DCP checkpoint \(no \.metadata\)"):
        load_model_only(tmp_path, target)


def _stages(seed: int) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """Two pipeline stages: pruned copies of one model that keep its FQNs."""
    torch.manual_seed(seed)
    first, second = _Net(), _Net()
    first.w2 = None
    second.w1 = None
    parts = [first, second]
    return parts, [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]


def test_model_parts_with_one_optimizer_each(tmp_path: Path) -> None:
    parts, opts = _stages(0)
    for part, opt in zip(parts, opts):
        for p in part.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    state = {"model": ModelWrapper(parts), "optimizer": OptimizerWrapper(parts, opts)}
    _manager(tmp_path).save(1, state)
    meta = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-1")).read_metadata()
    assert {"model.w1.weight", "model.w2.weight", "optimizer.state.w2.bias.exp_avg"} <= set(
        meta.state_dict_metadata
    )

    new_parts, new_opts = _stages(1)
    new_state = {"model": ModelWrapper(new_parts), "optimizer": OptimizerWrapper(new_parts, new_opts)}
    assert _manager(tmp_path).load_latest(new_state) == 1
    for old, new in zip(parts, new_parts):
        for a, b in zip(old.state_dict().values(), new.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for old, new in zip(opts, new_opts):
        for p_old, p_new in zip(old.param_groups[0]["params"], new.param_groups[0]["params"]):
            torch.testing.assert_close(old.state[p_old]["exp_avg"], new.state[p_new]["exp_avg"])


def test_failed_save_and_stale_temporaries_leave_nothing(tmp_path: Path, monkeypatch) -> None:
    """A save that fails (a full disk) deletes its temporary folder at once, so retries do not
    pile them up; a new run deletes temporaries that no live run owns (it owns its folder)."""
    run = _Run()
    stale = tmp_path / "checkpoint" / "step-7.tmp-0dead0"
    stale.mkdir(parents=True)
    manager = _manager(tmp_path)
    assert not stale.exists()

    def full_disk(state, storage_writer, **kw):
        Path(storage_writer.path).mkdir(parents=True)
        (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    for _ in range(2):
        with pytest.raises(SaveFailed, match="step-1 could not be saved .*No space left"):
            manager.save(1, run.state)
    assert list((tmp_path / "checkpoint").iterdir()) == []
