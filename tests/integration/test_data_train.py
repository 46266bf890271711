"""Training from the data sources end to end, in this process: one text file at any batch size.

    pytest tests/integration/test_data_train.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG
from tests.launch import read_metrics
from torchmoe.commands import cli

pytestmark = pytest.mark.integration

TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.steps", "2",
        "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1"]


def _play(lines: int) -> str:
    return "".join(f"{i}: Now is the winter of our discontent made glorious summer\n" for i in range(lines))


@pytest.mark.parametrize("rows", [8, 64])
def test_one_text_file_trains_at_any_global_batch(capsys, tmp_path: Path, rows: int) -> None:
    """nanoGPT's first exercise: one .txt file (one document) at the debug job's 8 rows and at 64
    (it was refused: "holds 1 document(s), fewer than the 8 rows of a global batch")."""
    (tmp_path / "play.txt").write_text(_play(2_000))
    status = cli.main(["train", *TINY, "--training.local_batch_size", str(rows), "--training.dataset", "local",
                       "--training.dataset_path", str(tmp_path / "play.txt"), "--job.dump_folder",
                       str(tmp_path / "run")])
    assert status == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_a_mixture_trains_and_counts_tokens_per_source(capsys, tmp_path: Path) -> None:
    (tmp_path / "play.txt").write_text(_play(800))
    (tmp_path / "code.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(800)))
    status = cli.main(["train", *TINY, "--training.local_batch_size", "8", "--training.dataset_mix",
                       f"play=0.75:local:{tmp_path / 'play.txt'}", f"code=0.25:local:{tmp_path / 'code.txt'}",
                       "--job.dump_folder", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert status == 0, err
    records = read_metrics(tmp_path / "run")
    for r in records:  # every row of every step counted once: 8 rows of 32 tokens per step
        assert r["tokens/play"] + r["tokens/code"] == r["step"] * 8 * 32
        assert r["tokens/play"] > r["tokens/code"] > 0
    last = records[-1]  # the console's shares of the tokens so far
    share = round(100 * last["tokens/play"] / (last["step"] * 8 * 32))
    assert f"play {share}% code {100 - share}%" in out, out


def test_a_resume_with_the_mixture_reordered_is_refused(capsys, tmp_path: Path) -> None:
    """Each source's position is kept by its place in the list: the sources swapped (weights
    and all) used to resume each from the other's position, silently. Refused naming both
    places; the same mix resumes (2 -> 3 steps)."""
    (tmp_path / "play.txt").write_text(_play(800))
    (tmp_path / "code.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(800)))
    play, code = f"play=0.75:local:{tmp_path / 'play.txt'}", f"code=0.25:local:{tmp_path / 'code.txt'}"
    run = ["train", *TINY, "--training.local_batch_size", "8", "--checkpoint.enable", "true", "--job.dump_folder",
           str(tmp_path / "run")]
    assert cli.main([*run, "--training.dataset_mix", play, code]) == 0
    capsys.readouterr()
    assert cli.main([*run, "--training.dataset_mix", code, play, "--training.steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert ('training.dataset_mix = "code, play": the checkpoint was saved with other sources at position 0 (code), '
            "1 (play)") in " ".join(err.split()), err
    assert cli.main([*run, "--training.dataset_mix", play, code, "--training.steps", "3"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.parametrize("flags, message", [
    (["--training.dataset_mix", "web=0:local:x.txt"], 'training.dataset_mix = "web=0:local:x.txt": the weight 0 is '
     "not a positive number"),
    (["--training.dataset_mix", "1:local:{tmp}/missing.txt"], 'training.dataset_mix = "{tmp}/missing.txt": No such '
     "file or directory"),
    (["--training.dataset_mix", "1:nope:x"], 'training.dataset_mix = "1:nope:x": its DATASET "nope": not an allowed '
     "value"),
    (["--training.dataset_mix", "1:local:{tmp}/play.txt", "--training.dataset_path", "{tmp}/play.txt"],
     "training.dataset_path = \"{tmp}/play.txt\": is set together with training.dataset_mix"),
])
def test_a_bad_mixture_is_one_message(capsys, tmp_path: Path, flags: list[str], message: str) -> None:
    (tmp_path / "play.txt").write_text(_play(100))
    flags = [f.format(tmp=tmp_path) for f in flags]
    status = cli.main(["train", *TINY, *flags, "--job.dump_folder", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert message.format(tmp=tmp_path) in err, err


@pytest.mark.parametrize("flags, message", [
    (["--training.dataset_mix", "web=0:local:x.txt"], 'training.dataset_mix = "web=0:local:x.txt": the weight 0 is '
     "not a positive number"),
    (["--training.dataset_mix", "1:nope:x"], 'training.dataset_mix = "1:nope:x": its DATASET "nope": not an allowed '
     "value"),
    (["--training.dataset_mix", "1:local"], 'training.dataset_mix = "1:local": its dataset "local" needs a path\n'
     '  fix: write each entry as [NAME=]WEIGHT:DATASET[:PATH], e.g. "web=0.7:local:data/web/*.jsonl"; its PATH is '
     "files (a file, folder or glob)"),
    (["--training.dataset_mix", "a=1:local:x", "a=2:local:y"], "a second source named 'a'"),
    (["--training.dataset_mix", "1:local:x", "--training.dataset_path", "y"],
     'training.dataset_path = "y": is set together with training.dataset_mix'),
])
def test_the_dry_run_refuses_a_bad_mixture_as_the_run_does(capsys, tmp_path: Path, flags: list[str],
                                                           message: str) -> None:
    """What the entries say, checked without opening a source: a dry run passed them before, and
    only the run refused them."""
    errors = []
    for dry in (["--dry-run"], []):
        status = cli.main(["train", *TINY, *flags, *dry, "--job.dump_folder", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err and err.count("error:") == 1, err
        errors.append(err)
    assert errors[0] == errors[1] and message in errors[0], errors


def test_training_from_shards_equals_training_from_the_text(capsys, tmp_path: Path) -> None:
    """The loss curve from `torchmoe prepare-data`'s shards is the raw text's, step for step."""
    import json

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": f"{i}: {_play(3)}"}) + "\n" for i in range(80)))
    (corpus / "b.txt").write_text(_play(2))
    assert cli.main(["prepare-data", str(corpus), str(tmp_path / "shards"), "--workers", "1"]) == 0
    curves = []
    for name, flags in (("text", ["--training.dataset", "local", "--training.dataset_path", str(corpus)]),
                        ("tokens", ["--training.dataset", "tokens", "--training.dataset_path", str(tmp_path / "shards")])):
        status = cli.main(["train", *TINY, "--training.steps", "3", "--training.local_batch_size", "8",
                           "--training.mixed_precision_param", "float32", *flags,
                           "--job.dump_folder", str(tmp_path / name)])
        assert status == 0, capsys.readouterr().err
        curves.append([(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / name)])
    assert curves[0] == curves[1] and len(curves[0]) == 3
