"""`torchmoe plan` end to end: the commands docs/planner.md shows, the TOML it writes trains, a
calibrated profile plans, and bad input is one message with exit status 2.

    python -m pytest -q -m integration tests/integration/test_plan_cli.py
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, assert_user_error
from tests.launch import read_metrics, run_cli
from torchmoe.commands import cli

pytestmark = pytest.mark.integration


def _torchmoe(*args: str, nproc: int = 1) -> subprocess.CompletedProcess[str]:
    return run_cli(args, nproc=nproc, timeout=300, expect=None)


def test_plan_writes_a_toml_that_trains(tmp_path: Path) -> None:
    """torchmoe plan --config configs/debug_model.toml --gpus 4 --free all --out best.toml --json all.json,
    then torchmoe train --config best.toml --dry-run --world-size 4, and one real step of it."""
    best, every = tmp_path / "best.toml", tmp_path / "all.json"
    plan = _torchmoe("plan", "--config", DEBUG_CONFIG, "--gpus", "4", "--free", "all", "--out", str(best),
                     "--json", str(every), "--job.dump_folder", str(tmp_path / "run"))
    assert plan.returncode == 0, plan.stderr
    assert "fastest layouts" in plan.stdout and "families that lost" in plan.stdout
    report = json.loads(every.read_text())
    assert report["gpus"] == 4 and report["layouts"][0]["flags"]
    dry = _torchmoe("train", "--config", str(best), "--dry-run", "--world-size", "4")
    assert dry.returncode == 0 and "warning" not in dry.stderr, dry.stderr
    run = _torchmoe("train", "--config", str(best), "--training.steps", "1", nproc=4)
    assert run.returncode == 0, run.stderr[-3000:]
    assert read_metrics(tmp_path / "run")[-1]["step"] == 1


def test_the_toml_written_trains_beside_a_finished_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The job planned writes to a dump folder that holds a finished run (the README's order: the
    Quick start's run, then `plan`): the TOML written gets a free folder beside it, named after
    it, so that the command the plan prints trains (it was refused: that run's history)."""
    run = tmp_path / "run"
    job = ["--config", DEBUG_CONFIG, "--training.steps", "1", "--training.seq_len", "32", "--job.dump_folder", str(run)]
    assert cli.main(["train", *job]) == 0
    (tmp_path / "run-best").mkdir()  # taken too (another plan's run, say): the next name
    best = tmp_path / "best.toml"
    assert cli.main(["plan", *job, "--gpus", "1", "--hardware", "h100", "--out", str(best)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {best}: torchmoe train --config {best}, writing to "
                                            f"{run}-best-2\n")
    assert cli.main(["train", "--config", str(best)]) == 0
    assert [r["step"] for r in read_metrics(f"{run}-best-2")] == [1] and len(read_metrics(run)) == 1


def test_calibrated_profile_plans(tmp_path: Path) -> None:
    """docs/planner.md's two commands: torchrun --nproc_per_node=2 -m torchmoe plan --calibrate cpu.json
    --config configs/debug_model.toml, then torchmoe plan --config configs/debug_model.toml --gpus 2
    --hardware cpu.json --free all. With --budget 5 rather than the page's 20: the budget only
    sets how long each size is timed, and what this test checks is the profile and its use."""
    profile = tmp_path / "cpu.json"
    calibrated = _torchmoe("plan", "--calibrate", str(profile), "--config", DEBUG_CONFIG, "--budget", "5", nproc=2)
    assert calibrated.returncode == 0, calibrated.stderr[-3000:]
    doc = json.loads(profile.read_text())
    assert doc["gpus_per_node"] == 2 and set(doc["collectives"]) == {
        "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"}
    plan = _torchmoe("plan", "--config", DEBUG_CONFIG, "--gpus", "2", "--hardware", str(profile), "--free", "all")
    assert plan.returncode == 0, plan.stderr
    assert f"plan: tiny on 2 x {doc['name']}" in plan.stdout


@pytest.mark.parametrize(("flags", "expected"), [
    ([], ("--gpus", "missing")),
    (["--gpus", "0"], ("--gpus = \"0\"", "must be an integer from 1 to 1048576")),
    # 10^20 GPUs searched for ever; 1e20 is no integer; 5,001 digits were Python's digit-limit traceback.
    (["--gpus", "100000000000000000000"], ("--gpus = \"100000000000000000000\"", "from 1 to 1048576")),
    (["--gpus", "1e20"], ("--gpus = \"1e20\"", "expected an integer", "fix: pass e.g. --gpus 8")),
    (["--gpus", "7" * 5001], ("--gpus = \"77777777777777777777... (5,001 characters)\"", "from 1 to 1048576")),
    (["--gpus", "4", "--gpus-per-node", "-8"], ("--gpus-per-node = \"-8\"", "from 1 to 1048576")),
    (["--gpus", "4", "--margin", "nan"], ("--margin = \"nan\"", "must be a finite number")),
    (["--gpus", "4", "--hardware", "h900"], ("--hardware = \"h900\"", "unknown hardware profile", "h100, h200")),
    (["--gpus", "4", "--free", "optimizer"], ("--free = \"optimizer\"", "names no key")),
    (["--gpus", "4", "--top", "x"], ("--top = \"x\"",)),
    (["--gpus", "4", "--margin", "1.5"], ("--margin = \"1.5\"", "[0, 0.99]")),
    (["--gpus", "4", "--out", "{folder}"], ("--out", "Is a directory")),
    (["--gpus", "4", "--json", "{through}"], ("--json", "Not a directory")),
    (["--gpus", "4", "--gpus", "8"], ("--gpus = \"8\"", "given more than once")),
    (["--calibrate", "{through}"], ("--calibrate", "Not a directory")),
    (["--calibrate", "{tmp}/p.json", "--budget", "-3"], ("--budget = \"-3\"", "must lie in (0, 86400]")),
    (["--calibrate", "{tmp}/p.json", "--budget", "1e400"], ("--budget = \"1e400\"", "must be a finite number")),
])
def test_bad_plan_input_is_one_message(tmp_path: Path, flags: list[str], expected: tuple[str, ...],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """In process (`cli.main` returns the status rather than raising: no traceback); the
    subprocess path of the same errors is `test_nothing_fits_is_one_message`'s."""
    (tmp_path / "file").write_text("x")
    names = {"folder": str(tmp_path), "through": str(tmp_path / "file" / "out.json"), "tmp": str(tmp_path)}
    argv = [f.format(**names) for f in flags]
    assert cli.main(["plan", "--config", DEBUG_CONFIG, *argv]) == 2
    out, err = capsys.readouterr()
    text = " ".join(err.split())
    assert err.startswith("error: ") and err.count("error:") == 1 and "Traceback" not in err, err
    assert all(" ".join(e.split()) in text for e in expected), err


def test_nothing_fits_is_one_message() -> None:
    result = _torchmoe("plan", "--config", str(Path(DEBUG_CONFIG).parent / "llama4_128e.toml"), "--gpus", "8")
    assert_user_error(result, "--gpus = 8", "no layout of maverick fits 8 x h100", "does not fit")


@pytest.mark.parametrize("flags", [
    [],
    ["--compile.enable", "true", "--compile.backend", "aot_eager"],
    ["--compile.enable", "true", "--compile.components", "loss"],
])
def test_flex_attention_without_inductor_is_refused_alike_by_the_dry_run_and_the_planner(
        flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """FlexAttention's eager path holds the whole score matrix: the dry run refuses the job, and the
    planner, which no layout can help, with the same one message (not its "no layout fits")."""
    job = ["--config", DEBUG_CONFIG, "--model.attn_backend", "flex", "--training.device", "cuda", *flags,
           "--job.dump_folder", str(tmp_path)]
    errors = []
    for argv in (["train", *job, "--dry-run", "--world-size", "4"], ["plan", *job, "--gpus", "4"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "Traceback" not in err, err
        errors.append(err[err.index("error:"):])
    key, value, fix = {(): ("compile.enable", "false", "true"), ("aot_eager",): ("compile.backend", '"aot_eager"',
                       '"inductor"'), ("loss",): ("compile.components", '["loss"]', '["model"]')}[tuple(flags[3:4])]
    assert errors[0] == errors[1] == (
        f'error: {key} = {value}: model.attn_backend = "flex" needs inductor to compile the blocks (compile.enable = '
        'true, "model" in compile.components, compile.backend = "inductor"): FlexAttention\'s eager path holds every '
        f'query-key score of a row in memory\n  fix: set {key} = {fix}, or use model.attn_backend = "sdpa"\n')
    assert cli.main(["train", *job, "--compile.enable", "true", "--compile.backend", "inductor",
                     "--compile.components", "model", "--dry-run", "--world-size", "4"]) == 0


def test_dry_run_flags_only_with_dry_run() -> None:
    assert_user_error(_torchmoe("train", "--config", DEBUG_CONFIG, "--hardware", "h100"),
                      "--hardware = \"h100\"", "only plans", "--dry-run")
