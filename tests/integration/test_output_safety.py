"""Every command writes only where it may: never over what is not a regular file of the user's
(a device, a named pipe, a socket, a symbolic link), never at or below a folder a live run holds,
and a bad flag is refused before any work or output (docs/cli.md, "Bad input": files written;
docs/checkpoints.md, "A run owns its folders").

    python -m pytest -q -m integration tests/integration/test_output_safety.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, REPO
from torchmoe.commands import cli
from torchmoe.config.files import file_writes

pytestmark = pytest.mark.integration

CORPUS = str(REPO / "tests" / "assets" / "short_documents.jsonl")
PLAN = ["plan", "--config", DEBUG_CONFIG, "--gpus", "2"]

# A live run: a Trainer built for dump folder argv[1] with checkpoints (it holds the dump and
# checkpoint folders), until killed.
_RUN = """
import sys, time
from torchmoe.config import load_job_config
from torchmoe.training.loop import Trainer
trainer = Trainer(load_job_config(["--config", sys.argv[2], "--checkpoint.enable", "true",
                                   "--job.dump_folder", sys.argv[1]]))
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> tuple[Path, int]:
    """(the live run's dump folder, its pid): one run for every case of the module."""
    folder = tmp_path_factory.mktemp("live") / "run"
    proc = subprocess.Popen([sys.executable, "-c", _RUN, str(folder), DEBUG_CONFIG], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield folder.resolve(), proc.pid
    finally:
        proc.kill()
        proc.wait()


def _main(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """`torchmoe ARGV` in this process: (exit status, stderr)."""
    status = cli.main([str(a) for a in argv])
    return status, capsys.readouterr().err


def _one_error(status: int, err: str, *expected: str) -> None:
    text = " ".join(err.split())
    assert status == 2 and "Traceback" not in err and err.count("error:") == 1, err
    for part in expected:
        assert " ".join(part.split()) in text, err


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder): what a refused command must leave."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


# name: (argv; {a} is the live run's dump folder, {hf} a Hugging Face folder), the refused key = value,
# and the folder the message names as held ({a} or its checkpoint folder).
INTO_A_LIVE_RUN = {
    "plan_out_over_its_config": ([*PLAN, "--out", "{a}/config.toml"], '--out = "{a}/config.toml"', "{a}"),
    "plan_json_into_its_checkpoints": ([*PLAN, "--json", "{a}/checkpoint/all.json"],
                                       '--json = "{a}/checkpoint/all.json"', "{a}/checkpoint"),
    "plan_out_in_a_new_folder_below_it": ([*PLAN, "--out", "{a}/new/deeper/best.toml"],
                                          '--out = "{a}/new/deeper/best.toml"', "{a}"),
    "calibrate_into_it": (["plan", "--calibrate", "{a}/cpu.json", "--config", DEBUG_CONFIG],
                          '--calibrate = "{a}/cpu.json"', "{a}"),
    "dry_run_in_it": (["train", "--config", DEBUG_CONFIG, "--dry-run", "--world-size", "2", "--job.dump_folder", "{a}"],
                      'job.dump_folder = "{a}": is {a},', "{a}"),
    "dry_run_below_it": (["train", "--config", DEBUG_CONFIG, "--dry-run", "--world-size", "2", "--job.dump_folder",
                          "{a}/dry"],
                         'job.dump_folder = "{a}/dry": is inside {a},', "{a}"),
    "prepare_data_into_its_checkpoint_folder": (["prepare-data", CORPUS, "{a}/checkpoint"],
                                                'OUT_DIR = "{a}/checkpoint": is {a}/checkpoint,', "{a}/checkpoint"),
    "prepare_data_below_it": (["prepare-data", CORPUS, "{a}/tokens"], 'OUT_DIR = "{a}/tokens": is inside {a},',
                              "{a}"),
    "report_of_it_into_its_folder": (["report", "{a}"], 'DUMP_FOLDER = "{a}": is inside {a},', "{a}"),
    "eval_out_into_it": (["eval", "--config", DEBUG_CONFIG, "--out", "{a}/eval.json"], '--out = "{a}/eval.json"',
                         "{a}"),
    "a_run_below_it": (["train", "--config", DEBUG_CONFIG, "--job.dump_folder", "{a}/nested"],
                       'job.dump_folder = "{a}/nested": is inside {a}, which another run holds', "{a}"),
    "convert_below_its_checkpoints": (["convert", "hf-to-dcp", "{hf}", "{a}/checkpoint/converted"],
                                      'OUT_DIR = "{a}/checkpoint/converted": is inside {a}/checkpoint,',
                                      "{a}/checkpoint"),
}


@pytest.mark.parametrize("case", list(INTO_A_LIVE_RUN))
def test_no_command_writes_at_or_below_a_live_runs_folders(capsys, live, hf_dir, case) -> None:
    """One line naming the key, the held folder and its holder (the live run's pid); the live
    run's folders are byte for byte as they were (nothing created in them, nothing replaced)."""
    folder, pid = live
    argv, refused, held = INTO_A_LIVE_RUN[case]
    names = {"a": str(folder), "hf": str(hf_dir)}
    before = _tree(folder)
    status, err = _main(capsys, [a.format(**names) for a in argv])
    _one_error(status, err, refused.format(**names), f"{held.format(**names)}, which ", f"pid {pid} on ")
    assert _tree(folder) == before


def _socket(path: Path) -> Path:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()  # the socket file stays
    return path


# name: (make the thing at the output path, argv with {p} for it, what the message says of it).
NOT_A_REGULAR_FILE = {
    "plan_json_a_named_pipe": (lambda p: os.mkfifo(p), [*PLAN, "--json", "{p}"], "is a named pipe, not a regular file"),
    "plan_out_a_socket": (_socket, [*PLAN, "--out", "{p}"], "is a socket, not a regular file"),
    "plan_json_a_link_to_a_file": (lambda p: p.symlink_to(p.with_name("target")), [*PLAN, "--json", "{p}"],
                                   "is a symbolic link (to "),
    "report_out_a_named_pipe": (lambda p: os.mkfifo(p.with_suffix(".png")), ["report", "{d}", "--out", "{p}.png"],
                                "is a named pipe, not a regular file"),
    "eval_out_a_link_to_nothing": (lambda p: p.symlink_to(p.with_name("nothing")), ["eval", "--config", DEBUG_CONFIG,
                                   "--out", "{p}"], "is a symbolic link (to "),
    "calibrate_a_named_pipe": (lambda p: os.mkfifo(p), ["plan", "--calibrate", "{p}", "--config", DEBUG_CONFIG],
                               "is a named pipe, not a regular file"),
}


@pytest.mark.parametrize("case", list(NOT_A_REGULAR_FILE))
def test_an_output_that_is_not_a_regular_file_is_refused_not_replaced(capsys, tmp_path, case) -> None:
    """A rename over it would put a regular file in its place: refused before any work, and it
    is still what it was (a link still a link, its target untouched)."""
    make, argv, says = NOT_A_REGULAR_FILE[case]
    target = tmp_path / "target"
    target.write_text("theirs")
    path = tmp_path / "out"
    make(path)
    shown = path.with_suffix(".png") if case.startswith("report") else path
    kind_before = os.lstat(shown).st_mode
    status, err = _main(capsys, [a.format(p=path, d=tmp_path) for a in argv])
    _one_error(status, err, f'"{shown}": {says}')
    assert os.lstat(shown).st_mode == kind_before and target.read_text() == "theirs"


def test_a_device_is_never_replaced(capsys, tmp_path, monkeypatch) -> None:
    """--json /dev/null: refused as a character device. (A rename over it is trapped here, so
    that a regression fails this test instead of replacing the machine's /dev/null.)"""
    def trapped(src, dst):
        raise AssertionError(f"would replace {dst}")

    monkeypatch.setattr(file_writes.os, "replace", trapped)
    status, err = _main(capsys, [*PLAN, "--json", "/dev/null"])
    _one_error(status, err, '--json = "/dev/null": is a character device, not a regular file')


def test_plan_out_and_json_naming_one_file_is_refused(capsys, tmp_path) -> None:
    """Under two spellings of one file, too: one output would overwrite the other."""
    (tmp_path / "sub").mkdir()
    status, err = _main(capsys, [*PLAN, "--out", f"{tmp_path}/x", "--json", f"{tmp_path}/sub/../x"])
    _one_error(status, err, f'--json = "{tmp_path}/sub/../x": is the file --out names too')
    assert list(tmp_path.iterdir()) == [tmp_path / "sub"]


@pytest.mark.parametrize(("flags", "refused"), [
    (["--calibrate", "{t}/p.json", "--gpus", "4"], '--gpus = "4": has no effect with --calibrate'),
    (["--calibrate", "{t}/p.json", "--hardware", "h100"], '--hardware = "h100": has no effect with --calibrate'),
    (["--calibrate", "{t}/p.json", "--free", "all"], '--free = "all": has no effect with --calibrate'),
    (["--gpus", "4", "--budget", "5"], '--budget = "5": only times --calibrate'),
])
def test_calibration_flags_that_would_be_ignored_are_refused(capsys, tmp_path, flags, refused) -> None:
    status, err = _main(capsys, ["plan", "--config", DEBUG_CONFIG, *(f.format(t=tmp_path) for f in flags)])
    _one_error(status, err, refused)
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_checks_its_hardware_before_writing(capsys, tmp_path) -> None:
    status, err = _main(capsys, ["train", "--config", DEBUG_CONFIG, "--dry-run", "--hardware", "h900",
                                 "--job.dump_folder", tmp_path / "dry"])
    _one_error(status, err, '--hardware = "h900": unknown hardware profile')
    assert not (tmp_path / "dry").exists()


def test_a_name_of_255_bytes_is_written(capsys, tmp_path) -> None:
    """The longest legal name: its temporary name (a suffix added) is cut to fit, not refused."""
    out = tmp_path / ("é" * 124 + "xy.json")  # 2 bytes each: 248 + 7
    assert len(os.fsencode(out.name)) == 255
    assert _main(capsys, [*PLAN, "--json", out])[0] == 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name] and out.read_text().startswith("{")
