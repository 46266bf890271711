"""Weights & Biases tracking and `torchmoe report`, on one tiny real run.

    python -m pytest -q -m integration tests/integration/test_tracking.py

The run logs to W&B offline (WANDB_MODE=offline: no account, no network); what W&B recorded is
read back from its run file. The report runs in this process (`torchmoe.commands.cli.main`).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from tests.launch import read_metrics, run_train
from torchmoe.commands import cli
from torchmoe.metrics.metrics import moe_imbalance

pytestmark = pytest.mark.integration

# tiny, 2 x 32 tokens a step, every step logged, checkpoints on (the last step saves one).
TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "2", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1",
        "--checkpoint.enable", "true", "--metrics.enable_wandb", "true", "--metrics.wandb_tags", "ci", "tiny"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def offline_wandb(tmp_path_factory):
    """W&B offline, quiet, without system metrics, its user files in a temporary home, and none
    of the caller's W&B settings (run_train's child inherits this environment)."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_NAME", "WANDB_TAGS", "WANDB_DIR", "WANDB_RUN_ID",
                    "WANDB_RESUME", "WANDB_ENTITY", "WANDB_BASE_URL"):
            mp.delenv(var, raising=False)
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_ERROR_REPORTING", "false")
        mp.setenv("WANDB_X_DISABLE_STATS", "true")
        for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
            mp.setenv(var, str(home / sub))
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory, offline_wandb) -> Path:
    """Two steps with W&B on; step-2 saved."""
    folder = tmp_path_factory.mktemp("run")
    run_train([*TINY, "--training.steps", "2"], dump_folder=folder, timeout=180)
    assert [r["step"] for r in read_metrics(folder)] == [1, 2]
    return folder


# ---- what W&B recorded -------------------------------------------------------------------------


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of a W&B run file (`run-<id>.wandb`). Its format is LevelDB's log: a
    7-byte file header (":W&B", 0xBEE1, version 0), then 32 KiB blocks of chunks, each a 7-byte
    header (CRC-32, little-endian length, type 1 whole / 2 first / 3 middle / 4 last) and its
    bytes; a block's tail too short for a header is padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_runs(folder: Path) -> list[dict]:
    """Each W&B run folder under `<folder>/wandb`, oldest first: its id, name, project, tags,
    config and history (step -> logged values), as recorded."""
    def items(entries) -> dict:  # an entry is keyed by `key` or by a path, `nested_key`
        return {e.key or ".".join(e.nested_key): json.loads(e.value_json) for e in entries}

    runs = []
    for run_file in sorted((folder / "wandb").glob("offline-run-*/run-*.wandb")):
        found = {"history": {}}
        for record in _wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                found.update(id=r.run_id, name=r.display_name, project=r.project, tags=list(r.tags),
                             config=items(r.config.update))
            elif kind == "history":
                found["history"][record.history.step.num] = items(record.history.item)
        runs.append(found)
    return runs


def test_wandb_records_the_config_and_every_logged_step(run: Path) -> None:
    (recorded,) = _wandb_runs(run)
    assert recorded["id"] == (run / "wandb_run_id").read_text().strip()
    assert recorded["name"] == run.name  # wandb_run_name empty: the dump folder's name
    assert recorded["project"] == "torchmoe" and recorded["tags"] == ["ci", "tiny"]
    config = recorded["config"]
    assert config["training"]["steps"] == 2 and config["training"]["seq_len"] == 32
    assert config["metrics"]["enable_wandb"] is True and config["model"]["flavor"] == "tiny"
    assert sorted(recorded["history"]) == [1, 2]
    for row in read_metrics(run):
        logged = recorded["history"][row["step"]]
        for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "moe_imbalance"):
            assert logged[f"train/{key}"] == row[key], (row["step"], key)
        assert "train/mfu" not in logged  # null on CPU: left out
        per_layer = [logged[f"moe/imbalance/layer{i}"] for i in range(len(row["tokens_per_expert"]))]
        assert per_layer == [moe_imbalance(torch.tensor(c)) for c in row["tokens_per_expert"]]


def test_a_resumed_run_continues_the_same_wandb_run(run: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    run_train([*TINY, "--training.steps", "3"], dump_folder=folder, timeout=180)
    first, resumed = _wandb_runs(folder)
    assert resumed["id"] == first["id"] == (folder / "wandb_run_id").read_text().strip()
    assert sorted(resumed["history"]) == [3]  # resumed at step 2
    assert resumed["history"][3]["train/loss"] == read_metrics(folder)[-1]["loss"]
    assert resumed["config"]["training"]["steps"] == 3


# ---- torchmoe report ---------------------------------------------------------------------------


def _report(capsys, *args: str) -> tuple[int, str]:
    status = cli.main(["report", *args])
    return status, capsys.readouterr().err


def _assert_one_error(status: int, err: str, *expected: str) -> None:
    assert status == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    for text in expected:
        assert text in err, err


def test_report_png(run: Path, capsys) -> None:
    import matplotlib.image

    status, err = _report(capsys, str(run))
    assert status == 0, err
    png = run / "report.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    pixels = matplotlib.image.imread(png)  # (height, width, channels), floats in [0, 1]
    assert pixels.shape[1] >= 1000 and pixels.shape[0] >= 800
    assert pixels[..., :3].std() > 0.05  # curves, heatmaps and text, not a blank canvas


def test_report_html_embeds_the_figure_and_the_final_metrics(run: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report.html"
    status, err = _report(capsys, str(run), "--out", str(out))
    assert status == 0, err
    page = out.read_text()
    image = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert image and base64.b64decode(image.group(1))[:8] == PNG_MAGIC
    final = read_metrics(run)[-1]
    assert f"<th>loss</th><td>{final['loss']:.6g}</td>" in page
    assert "Final metrics (step 2)" in page and "tiny: 2.40 M parameters" in page


def test_report_of_a_resumed_run_counts_each_step_once_and_marks_the_resume(run: Path, tmp_path: Path,
                                                                          capsys) -> None:
    """A step logged again by a resumed run is drawn with its later record; the resume is a
    dotted line on each curve at the checkpoint's step, and a note in the header."""
    from torchmoe.commands.report import load_run, render

    folder = _copy(run, tmp_path)
    rows = read_metrics(run)
    assert all("resumed_from" not in r for r in rows)  # a run that resumed nothing
    # step 2 again, as a run resuming step-1 logs it, then a torn line
    lines = [*rows, {**rows[1], "loss": 99.0, "resumed_from": 1}, '{"step": 3, "lo']
    (folder / "metrics.jsonl").write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n"
                                                  for r in lines))
    loaded = load_run(folder, world_size=None)
    assert [r["step"] for r in loaded.records] == [1, 2] and loaded.records[-1]["loss"] == 99.0
    assert loaded.skipped == f"{folder / 'metrics.jsonl'}: 1 line is not a record (line 4; torn by a kill, or edited)"
    assert loaded.moe_layers == [1, 3]
    assert loaded.facts[1].startswith("1 rank: pp 1 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 1, ep 1")
    assert loaded.facts[2].startswith("steps 1-2 of 2 logged, resumed at step 1; seq_len 32")
    fig = render(loaded)
    for ax in fig.axes[:4]:  # loss, gradient norm, LR, tokens/s
        curve, mark = ax.lines
        assert list(curve.get_xdata()) == [1, 2] and list(mark.get_xdata()) == [1, 1]
        assert ax.get_legend_handles_labels()[1] == ["resumed at step 1"]


def test_report_says_how_many_lines_it_leaves_out_and_which(run: Path, tmp_path: Path, capsys) -> None:
    """Lines that are not records (an edit, a record without its step) are left out with one
    warning naming their count and line numbers; the report is drawn from the others."""
    folder = _copy(run, tmp_path)
    rows = [json.dumps(r) for r in read_metrics(run)]
    (folder / "metrics.jsonl").write_text("\n".join([rows[0], "not json", '{"loss": 1.0}', rows[1], "[]"]) + "\n")
    status, err = _report(capsys, str(folder))
    assert status == 0 and (folder / "report.png").read_bytes()[:8] == PNG_MAGIC, err
    assert err == f"warning: {folder / 'metrics.jsonl'}: 3 lines are not records (lines 2, 3, 5; torn by a kill, or " \
        "edited): left out of the report\n"


def _copy(run: Path, tmp_path: Path, names: tuple[str, ...] = ("metrics.jsonl", "config.toml", "run_info.json"),
          ) -> Path:
    """A dump folder holding only `names` of the run's files."""
    folder = tmp_path / "copy"
    folder.mkdir()
    for name in names:
        shutil.copy(run / name, folder / name)
    return folder


def test_report_without_run_info_needs_the_world_size(run: Path, tmp_path: Path, capsys) -> None:
    folder = _copy(run, tmp_path, ("metrics.jsonl", "config.toml"))
    _assert_one_error(*_report(capsys, str(folder)), "DUMP_FOLDER = ", "holds no run_info.json",
                      "pass --world-size N")
    status, err = _report(capsys, str(folder), "--world-size", "1")
    assert status == 0, err
    assert (folder / "report.png").read_bytes()[:8] == PNG_MAGIC


REPORT_ERRORS = {
    "folder_missing": ((), "No such file or directory"),
    "no_metrics": (("config.toml",), "holds no metrics.jsonl"),
    "no_config": (("metrics.jsonl",), "holds no config.toml"),
    "empty_metrics": (("config.toml", "metrics.jsonl"), "metrics.jsonl holds no records"),
    # What a refused run used to leave: another flavor's config.toml over the run's metrics.
}


@pytest.mark.parametrize("kind", list(REPORT_ERRORS))
def test_report_of_a_bad_dump_folder_is_one_message(run: Path, tmp_path: Path, capsys, kind: str) -> None:
    names, problem = REPORT_ERRORS[kind]
    folder = _copy(run, tmp_path, names) if names else tmp_path / "nope"
    if kind == "empty_metrics":
        (folder / "metrics.jsonl").write_text("")
    _assert_one_error(*_report(capsys, str(folder)), f'DUMP_FOLDER = "{folder}"', problem)
    assert not (folder / "report.png").exists()


def test_report_needs_matplotlib(run: Path, capsys, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    _assert_one_error(*_report(capsys, str(run), "--out", "x.png"), "torchmoe report = ",
                      "matplotlib package, which is not installed", "pip install 'torchmoe[report]'")


def test_report_out_must_be_png_or_html(run: Path, capsys) -> None:
    _assert_one_error(*_report(capsys, str(run), "--out", "x.pdf"), '--out = "x.pdf"', "neither a .png nor an .html")


def test_report_usage(capsys) -> None:
    _assert_one_error(*_report(capsys), 'torchmoe report = ""', "the following arguments are required: DUMP_FOLDER",
                      "fix: run `torchmoe report --help` for the usage")
    assert cli.main(["report", "--help"]) == 0 and "--world-size" in capsys.readouterr().out


def _edit_records(edit) -> callable:
    """A damage that applies `edit` to the list of metrics.jsonl records and writes them back."""
    def damage(folder: Path) -> None:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        edit(rows)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return damage


def _edit_config(old: str, new: str) -> callable:
    def damage(folder: Path) -> None:
        text = (folder / "config.toml").read_text()
        assert old in text
        (folder / "config.toml").write_text(text.replace(old, new))
    return damage


_MEND = ("fix: fix or delete line {line} of {folder}/metrics.jsonl (torchmoe writes numbers, null for a non-finite "
         "one, and tokens_per_expert as one list of per-expert token counts per MoE layer)")
_SIZE_FIX = "fix: pass --world-size N, the number of ranks the run was launched with"
_IN = 'DUMP_FOLDER = "{folder}": '
# Each field the report reads, malformed: (damage, the message; {folder} is the dump folder).
REPORT_INPUTS = {
    "ragged_counts": (_edit_records(lambda r: r[1]["tokens_per_expert"][0].pop()),
                      _IN + "metrics.jsonl line 2: tokens_per_expert is ragged: its rows hold 7 and 8 experts\n  "
                      + _MEND.replace("{line}", "2")),
    "counts_not_a_list": (_edit_records(lambda r: r[0].update(tokens_per_expert={"layer": 1})),
                          _IN + "metrics.jsonl line 1: tokens_per_expert is {{layer = 1}}, not a list of per-expert "
                          "token counts per MoE layer\n  " + _MEND.replace("{line}", "1")),
    "negative_count": (_edit_records(lambda r: r[1]["tokens_per_expert"][1].__setitem__(3, -5)),
                       _IN + "metrics.jsonl line 2: tokens_per_expert holds -5, not a token count\n  "
                       + _MEND.replace("{line}", "2")),
    "loss_a_string": (_edit_records(lambda r: r[0].update(loss="nan")),
                      _IN + 'metrics.jsonl line 1: loss is "nan", not a number (or null)\n  '
                      + _MEND.replace("{line}", "1")),
    "lr_a_boolean": (_edit_records(lambda r: r[1].update(lr=True)),
                     _IN + "metrics.jsonl line 2: lr is true, not a number (or null)\n  " + _MEND.replace("{line}", "2")),
    "table_field_a_list": (_edit_records(lambda r: r[1].update(memory_gib=[1])),
                           _IN + "metrics.jsonl line 2: memory_gib is [1], not a number (or null)\n  "
                           + _MEND.replace("{line}", "2")),
    "resumed_after_its_step": (_edit_records(lambda r: r[0].update(resumed_from=1)),
                               _IN + "metrics.jsonl line 1: resumed_from is 1, not a checkpoint step before the "
                               "record's\n  " + _MEND.replace("{line}", "1")),
    "step_zero": (_edit_records(lambda r: r[0].update(step=0)),
                  _IN + "metrics.jsonl line 1: step is 0, not a positive integer\n  " + _MEND.replace("{line}", "1")),
    "counts_of_another_flavor": (
        _edit_records(lambda r: r[1]["tokens_per_expert"].append([1.0] * 8)),
        _IN + "metrics.jsonl line 2: tokens_per_expert holds 3 MoE layers of 8 experts, but config.toml's flavor "
        "'tiny' has 2 of 8: the metrics are another run's\n  fix: report a dump folder whose metrics.jsonl and "
        "config.toml are one run's (these counts fit flavor bench256, debugmodel, debugmodel_irope)"),
    "config_of_another_flavor": (
        _edit_config('flavor = "tiny"', 'flavor = "bench256"'),
        _IN + "metrics.jsonl line 1: tokens_per_expert holds 2 MoE layers of 8 experts, but config.toml's flavor "
        "'bench256' has 3 of 8: the metrics are another run's\n  fix: report a dump folder whose metrics.jsonl and "
        "config.toml are one run's (these counts fit flavor tiny)"),
    "config_unknown_flavor": (
        _edit_config('flavor = "tiny"', 'flavor = "llama3_8b"'),
        _IN + 'its config.toml sets model.flavor = "llama3_8b": not a flavor of model.name = "llama4"\n  fix: '
        'llama4\'s flavors: "tiny", "bench256", "scout", "maverick", "debugmodel", "debugmodel_irope", "17bx16e", '
        '"17bx16e_irope", "17bx128e", "17bx128e_irope" (in {folder}/config.toml)'),
    "config_bad_value": (_edit_config("seq_len = 32", "seq_len = 0"),
                         _IN + "its config.toml sets training.seq_len = 0: must be >= 1\n  fix: set it to 1 or more "
                         "(in {folder}/config.toml)"),
    "config_with_bom": (lambda f: (f / "config.toml").write_bytes(b"\xef\xbb\xbf" + (f / "config.toml").read_bytes()),
                        'DUMP_FOLDER = "{folder}/config.toml": starts with the UTF-8 byte order mark (BOM, bytes EF BB '
                        "BF)\n  fix: save config.toml as UTF-8 without a BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' "
                        "config.toml"),
    "run_info_not_json": (lambda f: (f / "run_info.json").write_text('{"world_size": '),
                          _IN + "run_info.json is not JSON (Expecting value at line 1 column 16)\n  " + _SIZE_FIX),
    "run_info_string_size": (lambda f: (f / "run_info.json").write_text('{"world_size": "2"}'),
                             _IN + 'run_info.json holds {{"world_size": "2"}}, not an object with a world_size from 1 '
                             "to 1048576\n  " + _SIZE_FIX),
    "run_info_zero_size": (lambda f: (f / "run_info.json").write_text('{"world_size": 0}'),
                           _IN + 'run_info.json holds {{"world_size": 0}}, not an object with a world_size from 1 to '
                           "1048576\n  " + _SIZE_FIX),
    # A planner asked for 2**64 ranks searched for ever.
    "run_info_huge_size": (lambda f: (f / "run_info.json").write_text('{"world_size": 18446744073709551616}'),
                           _IN + 'run_info.json holds {{"world_size": 18446744073709551616}}, not an object with a '
                           "world_size from 1 to 1048576\n  " + _SIZE_FIX),
    "run_info_a_list": (lambda f: (f / "run_info.json").write_text("[1]"),
                        _IN + "run_info.json holds [1], not an object with a world_size from 1 to 1048576\n  "
                        + _SIZE_FIX),
    "run_info_utf16": (lambda f: (f / "run_info.json").write_text('{"world_size": 1}', encoding="utf-16"),
                       _IN + "run_info.json is UTF-16LE text, not UTF-8: it starts with the UTF-16LE byte order mark "
                       "(BOM, bytes FF FE)\n  " + _SIZE_FIX),
    "world_size_that_does_not_fit": (
        lambda f: (_edit_config("tensor_parallel_degree = 1", "tensor_parallel_degree = 2")(f),
                   (f / "run_info.json").write_text('{"world_size": 3}')),
        _IN + "world size 3 does not fit the run's config.toml: -1 fills the rest, but WORLD_SIZE(3) / "
        "(dp_replicate(1) * cp(1) * tp(2) * pp(1)) = 3/2 is not an integer\n  " + _SIZE_FIX),
}


@pytest.mark.parametrize("kind", list(REPORT_INPUTS))
def test_report_of_a_malformed_run_file_is_one_message(run: Path, tmp_path: Path, capsys, kind: str) -> None:
    """Whatever the report reads of metrics.jsonl, config.toml and run_info.json, malformed or of
    another run: exit 2 and one message naming the file, the line or key, and the fix."""
    damage, message = REPORT_INPUTS[kind]
    folder = _copy(run, tmp_path)
    damage(folder)
    _assert_one_error(*_report(capsys, str(folder)), "error: " + message.format(folder=folder) + "\n")
    assert not (folder / "report.png").exists()


def test_report_world_size_flag_out_of_range(run: Path, capsys) -> None:
    _assert_one_error(*_report(capsys, str(run), "--world-size", "0"), '--world-size = "0": must be an integer from '
                      "1 to 1048576\n  " + _SIZE_FIX)
    # 2**64 ranks planned for ever; 5,001 digits were Python's digit-limit traceback.
    _assert_one_error(*_report(capsys, str(run), "--world-size", str(2**64)), f'--world-size = "{2**64}": must be '
                      "an integer from 1 to 1048576\n  " + _SIZE_FIX)
    _assert_one_error(*_report(capsys, str(run), "--world-size", "3" * 5001), '--world-size = "33333333333333333333... '
                      '(5,001 characters)": must be an integer from 1 to 1048576\n  ' + _SIZE_FIX)
