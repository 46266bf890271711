"""`[validation]` end to end, anchored outside the trainer: the logged validation_loss equals the
mean cross entropy of the step's saved weights over the same batches, recomputed here.

    python -m pytest -q tests/integration/test_validation.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import empty_tiny_model, train_tiny_here
from tests.launch import metrics_by_step

pytestmark = pytest.mark.integration

ROWS, SEQ_LEN = 4, 32


def _flags(corpus: Path, steps: int) -> list[str]:
    return ["--training.steps", "2", "--validation.enable", "true", "--validation.dataset", "local",
            "--validation.dataset_path", str(corpus), "--validation.freq", "2", "--validation.steps", str(steps),
            "--validation.local_batch_size", str(ROWS), "--validation.seq_len", str(SEQ_LEN)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("val") / "held_out.jsonl"
    path.write_text("".join(json.dumps({"text": f"held-out document {i}: " + "moe " * (i % 7)}) + "\n"
                            for i in range(24)))
    return path


def _reference(weights: Path, corpus: Path, steps: int) -> float:
    """Mean token loss of `weights` over the first `steps` validation batches (-1: all complete
    ones), packed by torchmoe's loader but scored here."""
    from torchmoe.checkpoints.checkpoint_state import load_model_only
    from torchmoe.config.job_config import Training, Validation
    from torchmoe.data import ByteTokenizer
    from torchmoe.data.dataloader import build_dataloader, validation_data
    from torchmoe.data.errors import CorpusEnd

    model = empty_tiny_model()
    load_model_only(str(weights), [model])
    val = Validation(dataset="local", dataset_path=str(corpus), local_batch_size=ROWS, seq_len=SEQ_LEN)
    loader = build_dataloader(validation_data(Training(), val), ByteTokenizer(), repeat=False)
    losses = []
    with torch.no_grad():
        while steps == -1 or len(losses) < steps:
            try:
                ((inputs, labels),) = loader.next_batch()
            except CorpusEnd:
                break
            losses.append(F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item())
    assert losses
    return sum(losses) / len(losses)  # batches of equal size: the mean of means is the token mean


def test_validation_loss_is_the_mean_loss_of_the_weights_on_the_held_out_batches(corpus: Path, tmp_path: Path) -> None:
    """One whole pass (steps = -1; a fixed number of batches is the parity tests' setting)."""
    folder = tmp_path / "run"
    train_tiny_here(folder, _flags(corpus, -1))
    metrics = metrics_by_step(folder)
    assert "validation_loss" not in metrics[1] and "validation_loss" in metrics[2]
    want = _reference(folder / "checkpoint" / "step-2", corpus, -1)
    assert metrics[2]["validation_loss"] == pytest.approx(want, rel=1e-5)
    # one pass holds more than 2 batches: a limit would see other data
    assert want != pytest.approx(_reference(folder / "checkpoint" / "step-2", corpus, 2), rel=1e-6)
    from torchmoe.commands import cli

    assert cli.main(["report", str(folder), "--out", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "<th>validation_loss</th>" in page and "data:image/png;base64," in page


def test_too_little_validation_data_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers import TINY_JOB
    from torchmoe.commands import cli

    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"text": "x"}) + "\n" for _ in range(ROWS)))
    assert cli.main(["train", *TINY_JOB, *_flags(tiny, -1), "--job.dump_folder", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert 'validation.dataset = "local": holds less than one batch (4 rows of 33 tokens)' in err
