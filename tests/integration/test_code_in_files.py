"""Loading a file never runs code from it: pickles crafted into a checkpoint, a tokenizer's
`auto_map`, a dataset's loading script. Each payload would create a marker file if anything ran
it; each is refused with exit 2 and one message naming the file (or, for the tokenizer, ignored),
and the marker never appears.

    python -m pytest -q -m integration tests/integration/test_code_in_files.py

The checkpoint payloads go through the three readers of DCP folders: resuming (a crafted step-N
in the run's checkpoint folder), `checkpoint.initial_load_path` and `torchmoe convert dcp-to-hf`,
all in-process (`cli.main`, what the commands run). Each crafted folder also gets checksums that
match it (an attacker writes them too), so what stops it is the loading, not the checksums.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from tests.helpers import DEBUG_CONFIG, small_bpe
from tests.launch import read_metrics
from torchmoe.commands import cli
from torchmoe.weights.checksums import ALGORITHM, SIDECAR, digest_file
from torchmoe.weights.dcp_unpickling import unpickle_metadata

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

TRAIN = ["train", "--config", DEBUG_CONFIG, "--training.seq_len", "64", "--training.steps", "2"]


class _Payload:
    """Unpickles as `os.system("touch MARKER")` (pickled as posix.system), which returns 0."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ---- crafting a checkpoint --------------------------------------------------------------------------


def _metadata(folder: Path) -> Metadata:
    return unpickle_metadata((folder / ".metadata").read_bytes())


def _forge_checksums(folder: Path) -> None:
    """Record checksums that match the folder's files as they are now."""
    names = [".metadata"] + sorted(p.name for p in folder.glob("*.distcp"))
    (folder / SIDECAR).write_text(json.dumps({"algorithm": ALGORITHM,
                                              "files": {n: digest_file(folder / n) for n in names}}))


def _metadata_fails(folder: Path, marker: Path) -> None:
    """.metadata is the payload alone: unpickled plainly it runs, and is no metadata (0)."""
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))


def _metadata_works(folder: Path, marker: Path) -> None:
    """.metadata is the real one with the payload inside (its storage_meta.modules): unpickled
    plainly it runs, and the metadata is valid; the run would train on as if nothing happened."""
    metadata = _metadata(folder)
    metadata.storage_meta.modules = [_Payload(marker)]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _store(folder: Path, fqn: str, obj: object) -> None:
    """Point the entry `fqn` of the checkpoint at `torch.save(obj)` bytes appended to its file."""
    metadata = _metadata(folder)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(folder / info.relative_path, "ab") as f:
        info.offset = f.tell()
        info.length = f.write(buffer.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _stored_value(folder: Path, marker: Path) -> None:
    """A value stored as bytes (the data loader's step, an int) is the payload: torch.load of it
    without weights_only runs it and gets 0, a valid step."""
    _store(folder, "dataloader.step", _Payload(marker))


def _stored_tensor(folder: Path, marker: Path) -> None:
    """A model tensor's bytes are the payload (what initial loads and conversions read)."""
    _store(folder, "model.norm.weight", _Payload(marker))


CRAFTS = {
    "metadata-fails": (_metadata_fails, ".metadata asks to load posix.system"),
    "metadata-works": (_metadata_works, ".metadata asks to load posix.system"),
    "stored-value": (_stored_value, "__0_0.distcp (its value dataloader.step) asks to load posix.system"),
    "stored-tensor": (_stored_tensor, "__0_0.distcp asks to load posix.system"),
}
READERS = ("resume", "initial_load", "convert")
# The stored value is read only by a resume: the other two read the model's tensors alone.
CASES = [(craft, reader) for craft in CRAFTS for reader in READERS
         if craft != "stored-value" or reader == "resume"]


def _crafted(run_dir: Path, tmp_path: Path, craft: str) -> tuple[Path, Path]:
    """A copy of `run_dir` whose step-2 is crafted as `craft`; returns (dump folder, marker)."""
    dump, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(run_dir, dump)
    step = dump / "checkpoint" / "step-2"
    CRAFTS[craft][0](step, marker)
    _forge_checksums(step)
    return dump, marker


# ---- the crafted checkpoints run code when loaded plainly ---------------------------------------------


@pytest.mark.parametrize("craft", list(CRAFTS))
def test_each_craft_runs_its_code_when_loaded_the_unsafe_way(craft: str, run_dir: Path, tmp_path: Path) -> None:
    """The control: what DCP's own reader and planner would do (pickle.load, torch.load without
    weights_only) creates the marker, and the "works" forms still give valid values."""
    dump, marker = _crafted(run_dir, tmp_path, craft)
    step = dump / "checkpoint" / "step-2"
    metadata = pickle.loads((step / ".metadata").read_bytes())
    if craft.startswith("stored"):
        fqn = "dataloader.step" if craft == "stored-value" else "model.norm.weight"
        info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
        with open(step / info.relative_path, "rb") as f:
            f.seek(info.offset)
            value = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
        assert value == 0
    else:
        assert isinstance(metadata, Metadata) == (craft == "metadata-works")
    assert marker.exists()


# ---- every craft, every reader: refused, nothing ran ---------------------------------------------------


def _read(reader: str, dump: Path, out: Path) -> int:
    step = dump / "checkpoint" / "step-2"
    if reader == "resume":
        return cli.main([*TRAIN, "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                         "--job.dump_folder", str(dump)])
    if reader == "initial_load":
        return cli.main([*TRAIN, "--checkpoint.initial_load_path", str(step), "--job.dump_folder", str(out)])
    return cli.main(["convert", "dcp-to-hf", str(step), str(out), "--flavor", "tiny"])


@pytest.mark.parametrize(("craft", "reader"), CASES, ids=[f"{c}:{r}" for c, r in CASES])
def test_crafted_checkpoint_is_refused_and_runs_nothing(craft: str, reader: str, run_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    dump, marker = _crafted(run_dir, tmp_path, craft)
    status = _read(reader, dump, tmp_path / "out")
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    key = {"resume": "checkpoint.folder", "initial_load": "checkpoint.initial_load_path", "convert": "CKPT_DIR"}[reader]
    assert f'{key} = "{dump / "checkpoint" / "step-2"}": {CRAFTS[craft][1]}, which a checkpoint never holds: ' \
           "refused, nothing of it was run" in err, err
    assert "fix: do not load it: DCP and torchmoe never write code into a checkpoint" in err, err
    assert not marker.exists()
    # Nothing trained or written: a resume is refused outright (no fallback to training from scratch).
    assert [r["step"] for r in read_metrics(dump)] == [1, 2]
    assert not (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "out" / "config.json").exists()


# ---- tokenizers and datasets: files that name code ------------------------------------------------------


def _tokenizer(folder: Path, marker: Path) -> None:
    """A tokenizer.json with a tokenizer_config.json whose auto_map names a module of the folder
    that creates the marker on import (what transformers would import with trust_remote_code)."""
    folder.mkdir()
    small_bpe(folder / "tokenizer.json")
    (folder / "evil_tokenizer.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                              "class EvilTokenizer: pass\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]},
        "eos_token": "<|end_of_text|>"}))


def test_tokenizer_auto_map_is_ignored_and_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, marker = tmp_path / "tok", tmp_path / "MARKER"
    _tokenizer(folder, marker)
    status = cli.main([*TRAIN, "--model.tokenizer_path", str(folder), "--job.dump_folder", str(tmp_path / "run")])
    assert status == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    assert not marker.exists()


def test_dataset_loading_script_is_refused_and_runs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A local `datasets` folder with a loading script (and data beside it): datasets >= 4 never
    runs scripts, local or on the hub, whatever HF_DATASETS_TRUST_REMOTE_CODE says."""
    pytest.importorskip("datasets")
    folder, marker = tmp_path / "evil", tmp_path / "MARKER"
    folder.mkdir()
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(8)))
    monkeypatch.setenv("HF_DATASETS_TRUST_REMOTE_CODE", "1")  # what would have run it under datasets 3
    status = cli.main([*TRAIN, "--training.dataset", "hf", "--training.dataset_path", str(folder),
                       "--job.dump_folder", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert (f'training.dataset_path = "{folder}": the hub dataset cannot be read (RuntimeError: Dataset scripts '
            "are no longer supported, but found evil.py)") in err, err
    assert not marker.exists()


# ---- crafted plain values: refused where they are read -------------------------------------------------


def _first(folder: Path, suffix: str) -> str:
    return next(i.fqn for i in _metadata(folder).storage_data if i.fqn.endswith(suffix))


# name: (the stored entry's name ends with, the value crafted into it, what the message says of it).
VALUES = {
    "betas_a_string": (".betas", "oops", "is a string ('oops'), where a tuple of 2 belongs"),
    "lr_nan": ("param_groups.tok_embeddings.weight.lr", float("nan"), "is nan, not a finite number"),
    "last_epoch_past_64_bits": ("lr_scheduler.last_epoch", 2**70, "is 1.18e+21, beyond 64 bits"),
    "data_step_a_string": ("dataloader.step", "2", "is a string ('2'), where a number belongs"),
    # In kind, out of range: refused by the state's owner.
    "betas_past_one": (".betas", (0.9, 1.5), "is (0.9, 1.5), not two finite numbers in [0, 1)"),
    "negative_peak_lr": ("lr_scheduler.base_lr", -0.1,
                         "the LR schedule's base_lr (its peak LR) is -0.1, not a finite number >= 0"),
    "negative_step_count": ("lr_scheduler._step_count", -3, "the LR schedule's _step_count is -3, not a step count"),
}


@pytest.mark.parametrize("case", list(VALUES))
def test_a_crafted_value_is_refused_naming_it(case: str, run_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A plain value of the right pickle but the wrong kind or range (its checksums forged):
    before, `betas = "oops"` and a NaN LR trained on (a NaN loss from step 3), 2**70 overflowed
    inside the schedule. Now the resume is exit 2 naming the step folder and the value, and
    nothing trained (the step before would be tried: there is none)."""
    suffix, value, says = VALUES[case]
    dump = tmp_path / "run"
    shutil.copytree(run_dir, dump)
    step = dump / "checkpoint" / "step-2"
    fqn = _first(step, suffix)
    _store(step, fqn, value)
    _forge_checksums(step)
    status = _read("resume", dump, tmp_path / "out")
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and err.count("error:") == 1, err
    text = " ".join(err.split())
    assert f'checkpoint.folder = "{step.parent}": no checkpoint there could be loaded: step-2: ' in text, err
    assert says in text and fqn.split(".", 1)[1] in text, err
    assert [r["step"] for r in read_metrics(dump)] == [1, 2]
