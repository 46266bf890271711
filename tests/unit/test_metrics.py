"""MetricsLogger (metrics.jsonl contract, console, TensorBoard) and the metric helpers."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from torchmoe.config.errors import ConfigError
from torchmoe.config.files import file_writes
from torchmoe.config.job_config import Metrics as MetricsConfig
from torchmoe.metrics import metrics as metrics_mod
from torchmoe.metrics.metrics import (
    MetricsLogger,
    device_peak_flops,
    layer_imbalance,
    moe_imbalance,
    peak_memory_gib,
)
from torchmoe.metrics.wandb_logger import run_id

CONTRACT_FIELDS = {
    "step", "loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu", "memory_gib",
    "elapsed_s", "moe_imbalance",
}


def _values(loss: float) -> dict:
    return {
        "loss": torch.tensor(loss),
        "grad_norm": 1.5,
        "lr": 8e-4,
        "tokens_per_sec": 12345.6,
        "tflops": 98.9,
        "memory_gib": 3.25,
    }


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=200, force_terminal=False), out


def test_jsonl_has_the_contract_fields(tmp_path: Path) -> None:
    console, out = _console()
    counts = torch.tensor([[1, 1, 1, 1], [4, 0, 0, 0]])  # imbalance 1 and 4
    with MetricsLogger(
        tmp_path, MetricsConfig(log_freq=5), rank=0, total_steps=10, peak_flops=989e12, console=console
    ) as m:
        m.log(1, _values(7.5), tokens_per_expert=counts)
        m.log(5, {**_values(6.25), "loss": float("nan")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert CONTRACT_FIELDS <= first.keys()
    assert first["step"] == 1 and first["loss"] == 7.5
    assert first["mfu"] == pytest.approx(10.0)  # 98.9 TFLOP/s of 989
    assert first["moe_imbalance"] == pytest.approx(2.5)
    assert first["tokens_per_expert"] == counts.tolist()
    assert first["elapsed_s"] >= 0
    assert second["step"] == 5 and second["loss"] is None  # non-finite -> null, strict JSON
    assert "moe_imbalance" not in second and "tokens_per_expert" not in second

    text = out.getvalue()
    assert "step  1/10" in text and "loss 7.5000" in text and "MFU 10.0%" in text
    assert "12,346 tok/s" in text and "98.9 TFLOP/s" in text and "expert max/mean 2.50" in text and "eta" in text


@pytest.mark.parametrize(("tflops", "shown"), [(98.9, "98.9 TFLOP/s"), (1.0, "1.0 TFLOP/s"), (0.0853, "85.3 GFLOP/s"),
                                               (0.00042, "0.42 GFLOP/s")])
def test_the_console_shows_a_cpus_rate_in_gflops(tmp_path: Path, tflops: float, shown: str) -> None:
    """A CPU's rate is tens of GFLOP/s: "0.0 TFLOP/s" on every line said nothing. The record keeps
    TFLOP/s."""
    console, out = _console()
    with MetricsLogger(tmp_path, MetricsConfig(), rank=0, total_steps=3, console=console) as m:
        record = m.log(1, {**_values(1.0), "tflops": tflops})
    assert record["tflops"] == tflops
    assert f"  {shown}  " in out.getvalue() and "0.0 TFLOP/s" not in out.getvalue(), out.getvalue()


def test_mfu_is_null_without_a_known_peak(tmp_path: Path) -> None:
    console, _ = _console()
    with MetricsLogger(tmp_path, MetricsConfig(), rank=0, total_steps=3, console=console) as m:
        record = m.log(1, _values(1.0))
    assert record["mfu"] is None


@pytest.mark.parametrize("name, bf16, fp32", [("NVIDIA H100 80GB HBM3", 989e12, 67e12),
                                               ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12)])
def test_mfu_is_against_the_peak_of_the_compute_dtype(tmp_path: Path, monkeypatch, name, bf16, fp32) -> None:
    """bf16 runs against the bf16 tensor-core peak, fp32 runs against the fp32 one (TF32's, half
    the bf16 rate, when torch lets fp32 matmuls use TF32)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_flops("cuda", torch.bfloat16) == bf16
    assert device_peak_flops("cuda", torch.float32) == fp32
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert device_peak_flops("cuda", torch.float32) == bf16 / 2
    finally:
        torch.set_float32_matmul_precision(precision)
    # The same 98.9 TFLOP/s per rank: a small fraction of the bf16 peak, more of the fp32 one.
    for dtype, peak in ((torch.bfloat16, bf16), (torch.float32, fp32)):
        with MetricsLogger(tmp_path / str(dtype), MetricsConfig(), rank=0, total_steps=3, console=_console()[0],
                           peak_flops=device_peak_flops("cuda", dtype)) as m:
            assert m.log(1, _values(1.0))["mfu"] == pytest.approx(100 * 98.9e12 / peak)


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    console, out = _console()
    with MetricsLogger(tmp_path, MetricsConfig(), rank=1, total_steps=3, console=console) as m:
        assert m.log(1, _values(1.0)) is None
    assert not (tmp_path / "metrics.jsonl").exists() and out.getvalue() == ""


def test_should_log() -> None:
    m = MetricsLogger("unused", MetricsConfig(log_freq=4), rank=1, total_steps=10)
    assert [s for s in range(1, 11) if m.should_log(s)] == [1, 4, 8, 10]


def test_moe_imbalance_math() -> None:
    assert moe_imbalance(torch.tensor([5, 5, 5, 5])) == 1.0
    assert moe_imbalance(torch.tensor([[8, 0, 0, 0]])) == 4.0
    # Per layer: max/mean = 3/2 and 6/3; averaged: 1.75. Empty layers are skipped.
    counts = torch.tensor([[1, 3, 2, 2], [6, 3, 0, 3], [0, 0, 0, 0]])
    assert moe_imbalance(counts) == pytest.approx(1.75)
    assert moe_imbalance(torch.zeros(2, 4)) == 1.0
    per_layer = layer_imbalance(counts)  # what TensorBoard, W&B and `torchmoe report` show per layer
    assert per_layer[:2].tolist() == [1.5, 2.0] and per_layer[2].isnan()


def test_device_helpers_on_cpu() -> None:
    assert device_peak_flops("cpu", torch.bfloat16) is None
    assert 0 < peak_memory_gib("cpu") < 1024


class _FakeWriter:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.calls: list[tuple] = []

    def add_scalar(self, tag, value, step) -> None:
        self.calls.append(("scalar", tag, value, step))

    def add_histogram(self, tag, values, step) -> None:
        self.calls.append(("histogram", tag, values.tolist(), step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_tensorboard_scalars_and_expert_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_mod, "_summary_writer_cls", lambda: _FakeWriter)
    console, _ = _console()
    m = MetricsLogger(
        tmp_path, MetricsConfig(enable_tensorboard=True), rank=0, total_steps=3, console=console
    )
    writer = m._tb
    m.log(2, _values(3.0), tokens_per_expert=torch.tensor([[2, 2], [3, 1]]))
    m.close()
    assert writer.log_dir == str(tmp_path / "tb")
    assert ("scalar", "train/loss", 3.0, 2) in writer.calls
    assert ("histogram", "moe/tokens_per_expert/layer1", [3.0, 1.0], 2) in writer.calls
    assert ("scalar", "moe/imbalance/layer1", 1.5, 2) in writer.calls


class _FakeWandb:
    """The `wandb` module as MetricsLogger uses it: init() records its arguments; the run records
    what is logged to it."""

    def __init__(self) -> None:
        self.init_kwargs: dict = {}
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, data: dict, step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


def test_wandb_run_config_names_and_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_NAME", raising=False)
    dump = tmp_path / "my-run"
    cfg = MetricsConfig(enable_wandb=True, wandb_project="", wandb_tags=["a"])
    with MetricsLogger(dump, cfg, rank=0, total_steps=3, console=_console()[0],
                       run_config={"training": {"steps": 3}}) as m:
        m.log(2, {**_values(3.0), "grad_norm": float("inf"), "validation_loss": 3.5},
              tokens_per_expert=torch.tensor([[2, 2], [3, 1]]))
    kwargs = fake.init_kwargs
    assert kwargs["config"] == {"training": {"steps": 3}} and kwargs["dir"] == str(dump)
    assert kwargs["project"] is None  # empty: W&B reads WANDB_PROJECT itself
    assert kwargs["name"] == "my-run" and kwargs["tags"] == ["a"]
    assert kwargs["id"] == (dump / "wandb_run_id").read_text().strip() and kwargs["resume"] == "allow"
    ((data, step),) = fake.logged
    assert step == 2 and data["train/loss"] == 3.0 and data["train/moe_imbalance"] == pytest.approx(1.25)
    assert "train/grad_norm" not in data and "train/mfu" not in data  # nulls are left out
    assert data["validation/loss"] == 3.5 and "train/validation_loss" not in data
    assert data["moe/imbalance/layer0"] == 1.0 and data["moe/imbalance/layer1"] == 1.5
    assert fake.finished

    monkeypatch.setenv("WANDB_NAME", "from-env")  # fills an empty wandb_run_name; the key wins
    MetricsLogger(dump, cfg, rank=0, total_steps=3, console=_console()[0]).close()
    assert fake.init_kwargs["name"] == "from-env"
    MetricsLogger(dump, MetricsConfig(enable_wandb=True, wandb_run_name="key"), rank=0, total_steps=3,
                  console=_console()[0]).close()
    assert fake.init_kwargs["name"] == "key" and fake.init_kwargs["project"] == "torchmoe"


def test_wandb_not_logged_in_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online without an API key: W&B refuses at once (no network), and the message says how to
    log in or log offline."""
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(ConfigError) as caught:
        MetricsLogger(tmp_path / "run", MetricsConfig(enable_wandb=True), rank=0, total_steps=3,
                      console=_console()[0])
    message = str(caught.value)
    assert message.startswith("metrics.enable_wandb = true: W&B did not start: ") and "API key" in message
    assert "wandb login" in message and "WANDB_MODE=offline" in message


def test_wandb_run_id_is_kept_only_when_resuming(tmp_path: Path) -> None:
    first = run_id(tmp_path, resuming=True)  # no id kept yet: a new one, written
    assert (tmp_path / "wandb_run_id").read_text() == first + "\n"
    assert run_id(tmp_path, resuming=True) == first  # a resumed run continues the W&B run
    fresh = run_id(tmp_path, resuming=False)  # starting at step 0: a new run, as metrics.jsonl starts over
    assert fresh != first and run_id(tmp_path, resuming=True) == fresh
    assert [p.name for p in tmp_path.iterdir()] == ["wandb_run_id"]  # no temporary file left


def test_tensorboard_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match="pip install 'torchmoe\\[tensorboard\\]'"):
        MetricsLogger(tmp_path, MetricsConfig(enable_tensorboard=True), rank=0, total_steps=3)


def test_eta_format() -> None:
    assert metrics_mod._duration(3725) == "1h02m" and metrics_mod._duration(65) == "1m05s"


def test_live_bar_on_a_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True)
    with MetricsLogger(tmp_path, MetricsConfig(), rank=0, total_steps=4, console=console) as m:
        m.log(2, _values(2.0))
        assert m._progress.tasks[0].completed == 2
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # strip ANSI codes
    assert "loss 2.0000" in text and "2/4" in text


def test_throughput_window_leaves_out_the_first_step():
    from torchmoe.metrics.metrics import ThroughputWindow

    window = ThroughputWindow()
    window.add(100, 10.0)  # compile + warm-up: 10 tokens/s
    window.add(100, 1.0)
    assert window.take() == 100.0  # the second step only, not (200 tokens / 11 s)
    window.add(100, 1.0)
    window.add(100, 3.0)
    assert window.take() == 50.0  # the window since the last log: 200 tokens / 4 s
    resumed = ThroughputWindow()  # a resumed (or recovered) run's first step, whatever its number
    resumed.add(100, 4.0)
    assert resumed.take() == 25.0  # a window holding only the first step reports it


def test_records_a_full_disk_refuses_are_held_and_written_in_order(tmp_path: Path, monkeypatch, caplog) -> None:
    """Steps 2 and 3 meet a full disk (step 2's write is cut short after 10 bytes): the file keeps
    whole records only, step 4 writes 2, 3 and 4 in order, one warning and one note say so; held
    to the end, `require_written` names the steps and the OS's reason."""
    real_write = file_writes.os.write
    full = {"on": False, "cut": True}

    def write(fd, data):
        if not full["on"]:
            return real_write(fd, data)
        if full["cut"]:  # a first write cut short, as a disk that fills during it
            full["cut"] = False
            return real_write(fd, bytes(data[:10]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_writes.os, "write", write)
    m = MetricsLogger(tmp_path, MetricsConfig(), rank=0, total_steps=9, console=_console()[0])
    with caplog.at_level(logging.INFO, logger="torchmoe"):
        m.log(1, {"loss": 1.0})
        full["on"] = True
        m.log(2, {"loss": 2.0})
        m.log(3, {"loss": 3.0})
        assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
        full["on"] = False
        m.log(4, {"loss": 4.0})
        full["on"] = True
        m.log(5, {"loss": 5.0})
        m.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    messages = [r.getMessage() for r in caplog.records if "metrics.jsonl" in r.getMessage()]
    assert messages == [
        f"{tmp_path / 'metrics.jsonl'}: No space left on device: the record of step 2 and those after it are held "
        "in memory and written once the file takes them; training goes on",
        f"{tmp_path / 'metrics.jsonl'} takes records again: the ones held back are written",
        f"{tmp_path / 'metrics.jsonl'}: No space left on device: the record of step 5 and those after it are held "
        "in memory and written once the file takes them; training goes on"]
    with pytest.raises(ConfigError) as err:
        m.require_written()
    assert str(err.value) == (f'job.dump_folder = "{tmp_path}": {tmp_path / "metrics.jsonl"}: No space left on '
                              "device: the record of step 5 could not be written (training and its checkpoints "
                              "went on)\n  fix: free space on that filesystem (or use a folder on another one), then "
                              "run again")


def test_records_held_past_the_bound_drop_the_oldest_and_the_file_says_how_many(tmp_path: Path, monkeypatch,
                                                                                caplog) -> None:
    """A disk full for steps 2-11 with room for 3 held records: the memory held stays within the
    bound, steps 2-8 are dropped (oldest first), and once the disk takes records the file holds 1,
    then 9 (marked: 7 records of steps 2-8 dropped), 10, 11, 12, the console saying so; full again
    to the end, `require_written` names the dropped and the held."""
    from torchmoe.metrics.metrics import _RecordFile

    full = {"on": False}
    real_write = file_writes.os.write
    monkeypatch.setattr(file_writes.os, "write", lambda fd, data: real_write(fd, data) if not full["on"] else
                        (_ for _ in ()).throw(OSError(28, "No space left on device")))
    line = len(json.dumps({"step": 10, "loss": 1.0, "elapsed_s": 1.0}) + "\n")
    monkeypatch.setattr(_RecordFile, "HELD_BYTES", 3 * line + 2)  # steps 2-9 are a byte shorter than 10 and 11
    m = MetricsLogger(tmp_path, MetricsConfig(), rank=0, total_steps=99, console=_console()[0])
    with caplog.at_level(logging.INFO, logger="torchmoe"):
        m.record_step(1, {"loss": 1.0, "elapsed_s": 1.0})
        full["on"] = True
        for step in range(2, 12):
            m.record_step(step, {"loss": 1.0, "elapsed_s": 1.0})
            assert m._file.held_bytes == sum(len(d) for _, d in m._file.held) <= _RecordFile.HELD_BYTES
        assert [s for s, _ in m._file.held] == [9, 10, 11] and m._file.dropped == (7, 2, 8)
        full["on"] = False
        m.record_step(12, {"loss": 1.0, "elapsed_s": 1.0})
        full["on"] = True
        for step in range(13, 20):
            m.record_step(step, {"loss": 1.0, "elapsed_s": 1.0})
    records = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 9, 10, 11, 12]
    assert records[1]["dropped_records"] == {"count": 7, "first_step": 2, "last_step": 8}
    assert all("dropped_records" not in r for r in records[2:])
    messages = [r.getMessage() for r in caplog.records if "metrics.jsonl" in r.getMessage()]
    path = tmp_path / "metrics.jsonl"
    assert messages[1:4] == [
        f"{path}: the records held back pass 0 MiB: the oldest are dropped from the record of step 2 on (the file will "
        "say how many once it takes records again)",
        f"{path} takes records again: 7 records held back while it could not (steps 2-8) were dropped; the record of "
        "step 9 says so",
        f"{path} takes records again: the ones held back are written"]
    with pytest.raises(ConfigError) as err:
        m.require_written()
    assert "the 4 records of steps 13-16 (dropped, past 0 MiB held) and the records of steps 17-19 could not be " \
        "written" in str(err.value), str(err.value)


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize(("first", "kept"), [
    (1, []),  # a restart before the first checkpoint: the whole earlier life is logged again
    (4, [1, 2, 3]),  # a resume of the step-3 checkpoint: steps 4 and 5 again, torn line gone
    (9, [1, 2, 3, 4, 5]),  # a relaunched replica group that took a peer's state of step 8
])
def test_an_earlier_lifes_records_are_cut_from_the_first_step_logged(tmp_path: Path, first: int,
                                                                     kept: list[int], caplog) -> None:
    """The cut waits for the first record: a replica group relaunched at step 0 takes a peer's
    live state of step N, and its records before N are its history (cut at the start before).
    The lines that are not records go too, with a warning naming them."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    m = MetricsLogger(tmp_path, MetricsConfig(), rank=0, total_steps=20, console=_console()[0])
    assert len(path.read_text().splitlines()) == 6  # nothing cut before a record
    with caplog.at_level(logging.WARNING, logger="torchmoe"):
        m.record_step(first, {"loss": 100.0})
    m.log(first + 1, {"loss": 101.0})
    m.close()
    assert _losses(path) == [*map(float, kept), 100.0, 101.0]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 1 line is not a record (line 6; torn by a kill, or edited): removed from the file"]


def test_an_earlier_lifes_records_are_cut_once_the_disk_takes_them(tmp_path: Path, monkeypatch) -> None:
    """A full disk at the cut (its rewrite refused) holds the record like a refused append; the
    next record the disk takes cuts, then writes both, in order."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 6)))
    real_write_file, full = metrics_mod.write_file, {"on": True}

    def write_file(*args, **kwargs):
        if full["on"]:
            raise OSError(28, "No space left on device")
        return real_write_file(*args, **kwargs)

    monkeypatch.setattr(metrics_mod, "write_file", write_file)
    m = MetricsLogger(tmp_path, MetricsConfig(), rank=0, total_steps=20, console=_console()[0])
    m.log(3, {"loss": 30.0})
    assert _losses(path) == [1.0, 2.0, 3.0, 4.0, 5.0] and m._file.fault is not None
    full["on"] = False
    m.log(4, {"loss": 40.0})
    m.close()
    assert _losses(path) == [1.0, 2.0, 30.0, 40.0] and m._file.fault is None
