"""Checksums of checkpoint files: recorded as they are written (sync and async saves), checked
before a load; a file that changed is a damaged checkpoint, which a resume steps past.

    pytest tests/unit/test_checksums.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from torchmoe.checkpoints.checkpoint import CheckpointManager
from torchmoe.checkpoints.checkpoint_state import ModelWrapper, OptimizerWrapper
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Checkpoint as CheckpointConfig
from torchmoe.weights.checksums import SIDECAR, digest_file, metadata_fault, verify
from torchmoe.weights.dcp_unpickling import unpickle_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Run:
    """A linear model and its AdamW state, one step further at each `step()`."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(64, 64)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.state = {"model": ModelWrapper(self.model), "optimizer": OptimizerWrapper(self.model, self.opt)}

    def step(self) -> None:
        self.model(torch.randn(4, 64)).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()


def _manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(tmp_path, CheckpointConfig(enable=True, interval=1, **kw), total_steps=10)


def _flip(folder: Path, n: int = 64) -> None:
    """Invert `n` bytes of the model's weight values in `folder`'s data file (the middle of its
    stored tensor: raw values, not the zip records around them, which torch does check)."""
    metadata = unpickle_metadata((folder / ".metadata").read_bytes())
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "model.weight")
    path = folder / info.relative_path
    data = bytearray(path.read_bytes())
    at = info.offset + info.length // 2
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_every_file_is_recorded_as_written(tmp_path: Path, async_mode: str) -> None:
    """Hashed while written (no second read): the digests are those of the files on disk."""
    manager = _manager(tmp_path, async_mode=async_mode)
    manager.save(1, _Run().state)
    manager.close()
    folder = tmp_path / "checkpoint" / "step-1"
    record = json.loads((folder / SIDECAR).read_text())
    assert record["algorithm"] == "xxh3_64"
    assert record["files"] == {name: digest_file(folder / name) for name in (".metadata", "__0_0.distcp")}
    assert verify(folder, ["__0_0.distcp"]) is None


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A step-1 folder of `_Run`."""
    _manager(tmp_path).save(1, _Run().state)
    return tmp_path / "checkpoint" / "step-1"


def test_a_changed_file_is_named_with_both_digests(saved: Path) -> None:
    recorded = json.loads((saved / SIDECAR).read_text())["files"]
    _flip(saved)
    now = digest_file(saved / "__0_0.distcp")
    assert now != recorded["__0_0.distcp"]
    assert verify(saved, ["__0_0.distcp"]) == (
        f"__0_0.distcp does not match the checksum recorded when it was saved (xxh3_64 {now}, recorded "
        f"{recorded['__0_0.distcp']}): it changed on disk")
    data = bytearray((saved / ".metadata").read_bytes())
    data[-10] ^= 1
    assert metadata_fault(saved, bytes(data)).startswith(".metadata does not match the checksum recorded")
    assert metadata_fault(saved, (saved / ".metadata").read_bytes()) is None


@pytest.mark.parametrize(("record", "problem"), [
    (b"\x00garbage", ".checksums.json is damaged (not JSON)"),
    (b"[" * 100_000 + b"]" * 100_000, ".checksums.json is damaged (not JSON)"),
    (b'{"algorithm": "md5", "files": {}}', ".checksums.json is damaged (no xxh3_64 digests)"),
    (b'{"algorithm": "xxh3_64", "files": {".metadata": "0"}}',
     "__0_0.distcp has no checksum in .checksums.json: the folder's files are not the ones it was saved with"),
])
def test_a_damaged_or_foreign_record_is_damage(saved: Path, record: bytes, problem: str) -> None:
    (saved / SIDECAR).write_bytes(record)
    assert verify(saved, ["__0_0.distcp"]) == problem


def test_without_a_record_the_folder_loads_unverified_and_says_so(saved: Path, caplog) -> None:
    (saved / SIDECAR).unlink()
    with caplog.at_level(logging.INFO, logger="torchmoe.weights.checksums"):
        assert verify(saved, ["__0_0.distcp"]) is None
    assert caplog.messages == [f"{saved} has no .checksums.json (saved before torchmoe recorded checksums, or by "
                               "another tool): loading it unverified"]


def test_resume_steps_past_flipped_bytes_which_load_silently_without_checksums(tmp_path: Path, caplog) -> None:
    """64 flipped bytes of a .distcp load without any error unless checked (the weights are then
    not the saved ones); checked, the checkpoint is skipped like a truncated one."""
    run = _Run()
    manager = _manager(tmp_path)
    run.step()
    manager.save(1, run.state)
    after_1 = run.model.weight.detach().clone()
    run.step()
    manager.save(2, run.state)
    after_2 = run.model.weight.detach().clone()
    step2 = tmp_path / "checkpoint" / "step-2"
    _flip(step2)

    resumed = _Run()
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path).load_latest(resumed.state) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"could not load checkpoint {step2} (__0_0.distcp does not match the checksum recorded when it was saved ("
    ), warnings
    assert torch.equal(resumed.model.weight, after_1)

    (step2 / SIDECAR).unlink()  # as a checkpoint saved before checksums
    unchecked = _Run()
    assert _manager(tmp_path).load_latest(unchecked.state) == 2
    # What loaded is not what was saved (16 float32 values inverted), and nothing said so.
    assert (unchecked.model.weight != after_2).sum().item() == 16

    _flip(tmp_path / "checkpoint" / "step-1")
    (tmp_path / "checkpoint" / "step-2" / "__0_0.distcp").unlink()
    with pytest.raises(ConfigError) as err:
        _manager(tmp_path).load_latest(_Run().state)
    lines = str(err.value).splitlines()
    assert lines[0] == f'checkpoint.folder = "{tmp_path / "checkpoint"}": no checkpoint there could be loaded:'
    assert lines[1] == f"  step-2: {step2 / '__0_0.distcp'}: No such file or directory", lines
    assert lines[2].startswith("  step-1: __0_0.distcp does not match the checksum recorded when it was saved ("), lines
