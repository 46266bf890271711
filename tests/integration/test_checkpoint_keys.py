"""torchtitan's checkpoint keys, end to end: load_step, exclude_from_loading, last_save_model_only
with export_dtype, enable_first_step_checkpoint, load_only (their refusals: tests/unit/test_checkpoint.py).

    python -m pytest -q tests/integration/test_checkpoint_keys.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers import start_from, train_tiny_here
from tests.launch import metrics_by_step

pytestmark = pytest.mark.integration

# On top of TINY_JOB (5 steps; train_tiny adds it): saving at steps 2 and 4 and at the last.
JOB = ["--checkpoint.interval", "2"]


def _saved(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoint").glob("step-*"))  # not the run's lock


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """Five steps, with step-1 saved too; the last save an export in bfloat16."""
    folder = tmp_path_factory.mktemp("full")
    train_tiny_here(folder, [*JOB, "--checkpoint.enable_first_step_checkpoint", "true",
                        "--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype", "bfloat16"])
    assert _saved(folder) == ["step-1", "step-2", "step-4", "step-5"]
    return folder


def test_last_save_is_a_model_only_export_in_export_dtype(full_run: Path) -> None:
    export, full = full_run / "checkpoint" / "step-5", full_run / "checkpoint" / "step-4"
    assert json.loads((export / ".complete").read_text())["model_only"] is True
    saved = FileSystemReader(str(export)).read_metadata().state_dict_metadata
    assert saved and all(k.startswith("model.") for k in saved)
    assert {m.properties.dtype for m in saved.values()} == {torch.bfloat16}
    full_meta = FileSystemReader(str(full)).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer.") for k in full_meta)
    assert full_meta["model.output.weight"].properties.dtype == torch.float32


def test_a_run_does_not_resume_from_an_export(full_run: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Going on to 6 steps resumes from step-4 (full), not from the step-5 export."""
    folder = tmp_path / "more"
    shutil.copytree(full_run / "checkpoint", folder / "checkpoint")
    train_tiny_here(folder, [*JOB, "--training.steps", "6"])
    assert "holds only the weights (last_save_model_only)" in capsys.readouterr().err
    assert sorted(metrics_by_step(folder)) == [5, 6]


def test_load_step_resumes_from_the_step_named(full_run: Path, tmp_path: Path) -> None:
    folder = tmp_path / "from2"
    shutil.copytree(full_run / "checkpoint", folder / "checkpoint")
    train_tiny_here(folder, [*JOB, "--checkpoint.load_step", "2", "--checkpoint.interval", "1000"])
    got, ref = metrics_by_step(folder), metrics_by_step(full_run)
    assert sorted(got) == [3, 4, 5]
    for step in got:  # the same curve as the run that went on from step 2
        assert got[step]["loss"] == ref[step]["loss"] and got[step]["grad_norm"] == ref[step]["grad_norm"]


def test_exclude_from_loading_and_load_only(full_run: Path, tmp_path: Path) -> None:
    """Without the dataloader's position, step 3 trains on the run's first batch again: not the
    loss of the run that went on (which a plain resume reproduces, `test_load_step_...`); with
    load_only the run resumes and never saves."""
    folder = start_from(full_run / "checkpoint" / "step-2", tmp_path / "fresh_data")
    train_tiny_here(folder, [*JOB, "--checkpoint.exclude_from_loading", "dataloader", "--checkpoint.load_only", "true"])
    got = metrics_by_step(folder)
    assert sorted(got) == [3, 4, 5] and got[3]["loss"] != metrics_by_step(full_run)[3]["loss"]
    assert _saved(folder) == ["step-2"]
