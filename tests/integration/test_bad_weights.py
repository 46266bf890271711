"""Every weights file torchmoe reads, broken in every way: one `ConfigError` naming the option, the
path and the fix (the CLI: exit 2, one message, no traceback); and resuming past a broken checkpoint
says one line about it.

    python -m pytest -q -m integration tests/integration/test_bad_weights.py

The fault classes (missing, a folder where a file should be, unreadable, truncated, garbage, not
UTF-8, wrong format, another model) meet the four readers: `checkpoint.initial_load_path` of a DCP
and of a Hugging Face folder (`load_initial_weights`, what `torchmoe train` runs on every rank
before step 1) and both directions of `torchmoe convert` (in-process `cli.main`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn

from tests.helpers import DEBUG_CONFIG, HF_EXPORT, assert_user_error, empty_tiny_model
from tests.launch import read_metrics, run_cli
from torchmoe.checkpoints.checkpoint import MARKER, CheckpointManager
from torchmoe.checkpoints.checkpoint_state import ModelWrapper
from torchmoe.commands import cli
from torchmoe.config import ConfigError
from torchmoe.config.job_config import Checkpoint as CheckpointConfig
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.models.llama4.hf import hf_config_from_args
from torchmoe.run_folders.run_lock import LOCK_NAME
from torchmoe.weight_sources.initial_load import load_initial_weights
from torchmoe.weights.weight_files import quiet_dcp_logs

# In-process DCP calls here run without a process group, which DCP warns about on every call.
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

# Deterministic bytes that are no file format: not a pickle, a zip, JSON or a safetensors header.
GARBAGE = bytes(range(256)) * 8
TRAIN = ["train", "--config", DEBUG_CONFIG, "--training.seq_len", "64", "--training.steps", "2"]


# ---- inputs ---------------------------------------------------------------------------------------


def _state(flavor: str) -> dict[str, torch.Tensor]:
    """The state dict of a model of `flavor`, zeros: these tests read files, not values (which must
    be finite: NaN and inf are refused)."""
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    return {name: torch.zeros_like(t, device="cpu") for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory) -> Path:
    """A DCP folder of a bare tiny-flavor state dict (what `convert hf-to-dcp` writes)."""
    folder = tmp_path_factory.mktemp("dcp")
    dcp.save(_state("tiny"), checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.fixture(scope="module")
def bench_dcp_dir(tmp_path_factory) -> Path:
    """A DCP folder of a bench256 model: weights of another flavor."""
    folder = tmp_path_factory.mktemp("bench_dcp")
    dcp.save(_state("bench256"), checkpoint_id=str(folder), no_dist=True)
    return folder


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _scramble(path: Path) -> None:
    """Garbage of the file's own length (a shorter file is reported as truncated)."""
    size = path.stat().st_size
    path.write_bytes((GARBAGE * (size // len(GARBAGE) + 1))[:size])


def _replace_by_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _deny(name: str) -> Callable[[pytest.MonkeyPatch], None]:
    """Make opening any file called `name` fail as an unreadable file does (the tests run as
    root, for whom no permission bit denies a read)."""
    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        real_open = io.open

        def open_(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and Path(file).name == name:
                raise PermissionError(13, "Permission denied", os.fspath(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(io, "open", open_)  # pathlib opens through io.open
    return patch


def _int32_dcp(folder: Path) -> None:
    shutil.rmtree(folder)
    dcp.save({k: v.to(torch.int32) for k, v in _state("tiny").items()}, checkpoint_id=str(folder), no_dist=True)


def _int32_safetensors(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v.to(torch.int32) for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})


def _nan_dcp(folder: Path) -> None:
    state = _state("tiny")
    state["tok_embeddings.weight"][7] = float("nan")  # one row: 128 values
    state["layers.1.moe.experts.w2"][0, 0, 0] = float("inf")
    shutil.rmtree(folder)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _nan_safetensors(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors["model.embed_tokens.weight"][7] = float("nan")
    tensors["model.layers.1.feed_forward.experts.gate_up_proj"][0, 0, -1] = float("-inf")  # w3's half
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _absurd_dcp(folder: Path) -> None:
    """Finite but beyond any trained model: a router bias of 1e9, a norm weight of -7e4."""
    state = _state("tiny")
    state["layers.1.moe.expert_bias"][2] = 1e9
    state["norm.weight"][0] = -7e4
    shutil.rmtree(folder)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _absurd_safetensors(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"][0, 0] = 3e38
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _fifo(path: Path) -> None:
    """A named pipe in the file's place: an open to read waits for a writer for ever."""
    path.unlink()
    os.mkfifo(path)


def _data_file_outside(folder: Path) -> None:
    """.metadata points at ../<the data file> (the file moved there, so it exists)."""
    from torchmoe.weights.dcp_unpickling import unpickle_metadata

    metadata = unpickle_metadata((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../" + info.relative_path
    (folder / "__0_0.distcp").rename(folder.parent / "__0_0.distcp")
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _index(text: str | bytes) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        path = folder / "model.safetensors.index.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return write


@dataclass(frozen=True)
class Fault:
    """One way a weights folder can be broken, and what the message must say about it."""

    kind: str  # "dcp" or "hf": the folder it breaks
    damage: Callable[[Path], None]
    expected: tuple[str, ...]
    patch: Callable[[pytest.MonkeyPatch], None] | None = None


_MISSING_SHARD = json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})

def _set_field(config: Path, field: str, literal: str) -> None:
    """`config` (a config.json) with `field` written as the JSON text `literal` (NaN, 1e400), its
    other fields (model_type first of all) as they were."""
    fields = json.loads(config.read_text())
    fields[field] = "@value@"
    config.write_text(json.dumps(fields).replace('"@value@"', literal))

FAULTS = {
    # missing
    "dcp-missing-metadata": Fault("dcp", lambda d: (d / ".metadata").unlink(),
                                  ("not a DCP checkpoint (no .metadata)",)),
    "dcp-missing-data": Fault("dcp", lambda d: (d / "__0_0.distcp").unlink(),
                              ("__0_0.distcp: No such file or directory",)),
    "hf-missing-config": Fault("hf", lambda d: (d / "config.json").unlink(), ("has no config.json",)),
    "hf-missing-weights": Fault("hf", lambda d: (d / "model.safetensors").unlink(), ("holds no *.safetensors files",)),
    "hf-missing-indexed-file": Fault("hf", _index(_MISSING_SHARD), (
        "model.safetensors.index.json lists 1 file that is not there", "model-00002-of-00002.safetensors")),
    # a folder where a file should be
    "dcp-folder-metadata": Fault("dcp", lambda d: _replace_by_folder(d / ".metadata"),
                                 (".metadata: Is a directory",)),
    "dcp-folder-data": Fault("dcp", lambda d: _replace_by_folder(d / "__0_0.distcp"),
                             ("__0_0.distcp: Is a directory",)),
    "hf-folder-config": Fault("hf", lambda d: _replace_by_folder(d / "config.json"),
                              ("config.json: Is a directory",)),
    "hf-folder-weights": Fault("hf", lambda d: _replace_by_folder(d / "model.safetensors"),
                               ("model.safetensors: Is a directory",)),
    # unreadable
    "dcp-unreadable-metadata": Fault("dcp", lambda d: None, (".metadata: Permission denied",),
                                     patch=_deny(".metadata")),
    "hf-unreadable-config": Fault("hf", lambda d: None, ("config.json: Permission denied",),
                                  patch=_deny("config.json")),
    # truncated
    "dcp-truncated-metadata": Fault("dcp", lambda d: _truncate(d / ".metadata"),
                                    (".metadata is damaged or truncated",)),
    "dcp-truncated-data": Fault("dcp", lambda d: _truncate(d / "__0_0.distcp"), ("__0_0.distcp is truncated (",)),
    "hf-truncated-config": Fault("hf", lambda d: _truncate(d / "config.json"), ("config.json is not JSON",)),
    "hf-deeply-nested-config": Fault("hf", lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
                                     ("config.json is not JSON (nested too deeply",)),
    # Python's digit limit: its ValueError traceback before; a NaN read as a value to check.
    "hf-long-number-config": Fault("hf", lambda d: (d / "config.json").write_text('{"vocab_size": ' + "9" * 5001 + "}"),
                                   ("config.json is not JSON (a number of more than 4,300 digits",)),
    "hf-nan-config": Fault("hf", lambda d: _set_field(d / "config.json", "rms_norm_eps", "NaN"),
                           ('its config.json sets "rms_norm_eps": NaN, not a finite number',)),
    "hf-overflowing-config": Fault("hf", lambda d: _set_field(d / "config.json", "rope_theta", "1e400"),
                                   ('its config.json sets "rope_theta": Infinity, not a finite number',)),
    "hf-truncated-weights": Fault("hf", lambda d: _truncate(d / "model.safetensors"),
                                  ("model.safetensors is damaged or truncated",)),
    "hf-empty-weights": Fault("hf", lambda d: (d / "model.safetensors").write_bytes(b""),
                              ("model.safetensors is damaged or truncated",)),
    # garbage
    "dcp-garbage-metadata": Fault("dcp", lambda d: (d / ".metadata").write_bytes(GARBAGE),
                                  (".metadata is damaged or truncated",)),
    "dcp-garbage-data": Fault("dcp", lambda d: _scramble(d / "__0_0.distcp"),
                              ("a *.distcp file is damaged or truncated",)),
    "hf-garbage-weights": Fault("hf", lambda d: (d / "model.safetensors").write_bytes(GARBAGE),
                                ("model.safetensors is damaged or truncated",)),
    # not UTF-8: another encoding, or a byte order mark, which JSON does not allow
    "hf-latin1-config": Fault("hf", lambda d: (d / "config.json").write_bytes(b'{"a": "caf\xe9"}'), (
        "config.json is not UTF-8 text (byte 10 is 0xE9: invalid continuation byte)",
        "fix: convert config.json to UTF-8, e.g. iconv -f latin1 -t UTF-8 config.json > config.json.utf8, then "
        "replace it")),
    "hf-bom-config": Fault("hf", lambda d: (d / "config.json").write_bytes(b"\xef\xbb\xbf" + (d / "config.json")
                                                                           .read_bytes()), (
        "config.json starts with the UTF-8 byte order mark (BOM, bytes EF BB BF)",
        "fix: save config.json as UTF-8 without a BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' config.json")),
    "hf-utf16-config": Fault("hf", lambda d: (d / "config.json").write_text((d / "config.json").read_text(),
                                                                            encoding="utf-16"), (
        "config.json is UTF-16LE text, not UTF-8: it starts with the UTF-16LE byte order mark (BOM, bytes FF FE)",
        "fix: convert config.json to UTF-8, e.g. iconv -f UTF-16 -t UTF-8 config.json > config.json.utf8, then "
        "replace it")),
    "hf-utf16-index": Fault("hf", _index("{}".encode("utf-16-be")), (
        "model.safetensors.index.json is not UTF-8 text: byte 0 is NUL (UTF-16BE text without a byte order mark?)",
        "iconv -f UTF-16BE -t UTF-8 model.safetensors.index.json")),
    # wrong format
    "dcp-list-metadata": Fault("dcp", lambda d: (d / ".metadata").write_bytes(pickle.dumps([1])),
                               (".metadata is not DCP metadata",)),
    "dcp-int32-weights": Fault("dcp", _int32_dcp, ("is stored as int32, not as floating-point weights",)),
    "hf-list-config": Fault("hf", lambda d: (d / "config.json").write_text("[1]"),
                            ("config.json holds an array, not a JSON object",)),
    "hf-list-index": Fault("hf", _index("[1]"), ("model.safetensors.index.json holds an array, not a JSON object",)),
    "hf-int32-weights": Fault("hf", _int32_safetensors,
                              ("model.embed_tokens.weight is stored as int32, not as floating-point weights",)),
    # NaN and inf: named as the folder names them (one HF tensor holds both w1 and w3), never lr's fault
    "dcp-nan-weights": Fault("dcp", _nan_dcp, ("the weights hold NaN or inf in tok_embeddings.weight, "
                                               "layers.1.moe.experts.w2: they came in with the weights",
                                               "fix: point it at weights without NaN or inf")),
    "hf-nan-weights": Fault("hf", _nan_safetensors, (
        "the weights hold NaN or inf in model.embed_tokens.weight, model.layers.1.feed_forward.experts.gate_up_proj:",
        "fix: point it at weights without NaN or inf")),
    # finite, but beyond ±2^16 (weights.finite.WEIGHT_BOUND): passed the finite check, and trained on
    "dcp-absurd-weights": Fault("dcp", _absurd_dcp, (
        "the weights hold values beyond ±65,536, which no trained model reaches (largest |value|: "
        "layers.1.moe.expert_bias (1e+09), norm.weight (7e+04)): the files are damaged or crafted",
        "fix: point it at weights within that bound")),
    "hf-absurd-weights": Fault("hf", _absurd_safetensors, (
        "beyond ±65,536, which no trained model reaches (largest |value|: model.layers.0.self_attn.o_proj.weight "
        "(3e+38))",)),
    # not a regular file of the folder (crafted): a named pipe hung the read, a path left the folder
    "dcp-fifo-metadata": Fault("dcp", lambda d: _fifo(d / ".metadata"), (".metadata is a named pipe, not a regular "
                                                                         "file",)),
    "dcp-fifo-data": Fault("dcp", lambda d: _fifo(d / "__0_0.distcp"), ("__0_0.distcp is a named pipe, not a "
                                                                        "regular file",)),
    "dcp-data-outside": Fault("dcp", _data_file_outside, (
        ".metadata points at the data file '../__0_0.distcp', which is not a file of this folder",)),
    "hf-fifo-config": Fault("hf", lambda d: _fifo(d / "config.json"), ("config.json is a named pipe, not a regular "
                                                                       "file",)),
    "hf-fifo-weights": Fault("hf", lambda d: _fifo(d / "model.safetensors"), ("model.safetensors is a named pipe, "
                                                                              "not a regular file",)),
    "hf-index-outside": Fault("hf", _index(json.dumps({"weight_map": {"model.norm.weight": "../model.safetensors"}})),
                              ("model.safetensors.index.json lists files outside the folder, e.g. "
                               "['../model.safetensors']",)),
    # another model (the other flavor's DCP case needs its own folder: `test_dcp_of_another_flavor`)
    "hf-llama3-config": Fault("hf", lambda d: (d / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64})),
        ("its config.json cannot be used: model_type 'llama' is not a family torchmoe trains (known: llama4, "
         "llama4_text, qwen3_moe, deepseek_v3, kimi_k2, gpt_oss)",)),
}

# Each reader of each kind of folder: the option that names the folder.
READERS = {"dcp": ("train-dcp", "dcp-to-hf"), "hf": ("train-hf", "hf-to-dcp")}
KEYS = {"train-dcp": "checkpoint.initial_load_path", "train-hf": "checkpoint.initial_load_path",
        "dcp-to-hf": "CKPT_DIR", "hf-to-dcp": "HF_DIR"}
CASES = [(reader, name) for name, fault in FAULTS.items() for reader in READERS[fault.kind]]


def _read(reader: str, folder: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `reader` on `folder`, which must fail with a user error; returns its message.

    The train readers call what `torchmoe train` calls before step 1 and get the `ConfigError`;
    the convert readers run the CLI in this process and get its exit status and stderr.
    """
    if reader.startswith("train"):
        ckpt = CheckpointConfig(initial_load_path=str(folder), initial_load_in_hf=reader == "train-hf")
        with pytest.raises(ConfigError) as err:
            load_initial_weights(ckpt, "tiny", FLAVORS["tiny"], empty_tiny_model())
        assert "Traceback" not in capsys.readouterr().err  # nothing DCP logged along the way
        return str(err.value)
    argv = ["convert", reader, str(folder), str(out)] + (["--flavor", "tiny"] if reader == "dcp-to-hf" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert not out.exists()  # refused before anything was written
    return err


def _assert_message(message: str, key: str, value: str, *expected: str) -> None:
    assert f'{key} = "{value}": ' in message, message
    assert "\n  fix: " in message, message
    for text in expected:
        assert text in message, message


# ---- every fault, every reader ----------------------------------------------------------------------


@pytest.mark.parametrize(("reader", "fault"), CASES, ids=[f"{r}:{f}" for r, f in CASES])
def test_broken_folder_is_one_user_error(reader: str, fault: str, hf_dir: Path, dcp_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    spec = FAULTS[fault]
    folder = tmp_path / "in"
    shutil.copytree(dcp_dir if spec.kind == "dcp" else hf_dir, folder)
    spec.damage(folder)
    if spec.patch is not None:
        spec.patch(monkeypatch)
    message = _read(reader, folder, tmp_path / "out", capsys)
    _assert_message(message, KEYS[reader], str(folder), *spec.expected)


@pytest.mark.parametrize("reader", ["train-dcp", "dcp-to-hf"])
def test_dcp_of_another_flavor_names_the_flavor_that_fits(reader: str, bench_dcp_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    message = _read(reader, bench_dcp_dir, tmp_path / "out", capsys)
    key, fix = ("model.flavor", "fix: pass --model.flavor bench256") if reader == "train-dcp" else \
        ("--flavor", "fix: pass --flavor bench256")
    # torchtitan's debug flavors have bench256's shapes: a DCP checkpoint cannot tell them apart.
    _assert_message(message, key, "tiny", "does not fit", str(bench_dcp_dir),
                    "tok_embeddings.weight has shape (2048, 256), the model's is (512, 128)", fix,
                    "(its tensors also fit debugmodel, debugmodel_irope, which differ only in attention or RoPE")


def test_hf_folder_of_another_flavor_names_the_flavor_that_fits(hf_dir: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "in"
    shutil.copytree(hf_dir, folder)
    (folder / "config.json").write_text(json.dumps(hf_config_from_args(FLAVORS["bench256"], torch.float32)))
    message = _read("train-hf", folder, tmp_path / "out", capsys)
    _assert_message(message, "checkpoint.initial_load_path", str(folder),
                    "its config differs from flavor 'tiny' in dim", "fix: pass --model.flavor bench256")


# A config.json value of the wrong type or range: (field, value, what is wrong, what the fix sets it to). The
# hf_dir fixture is the tiny flavor: 4 layers, 8 heads (4 key/value heads), 8 experts.
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
HF_VALUES = {
    "string-for-int": ("vocab_size", "512", "a string, not an integer from 1 to 16777216",
                       "an integer from 1 to 16777216, e.g. 512 (without quotes)"),
    "negative": ("num_hidden_layers", -4, "out of range: expected an integer from 1 to 1024",
                 "an integer from 1 to 1024"),
    "absurdly-large": ("num_hidden_layers", 10**12, "out of range: expected an integer from 1 to 1024",
                       "an integer from 1 to 1024"),
    "zero": ("num_attention_heads", 0, "out of range: expected an integer from 1 to 4096", "an integer from 1 to 4096"),
    "float-for-int": ("hidden_size", 128.0, "a number, not an integer from 1 to 1048576",
                      "an integer from 1 to 1048576"),
    "bool-for-int": ("intermediate_size", True, "a boolean, not an integer from 1 to 1048576",
                     "an integer from 1 to 1048576"),
    "null": ("vocab_size", None, "null is not allowed here", "an integer from 1 to 16777216"),
    "list-for-int": ("num_local_experts", [8], "a list, not an integer from 1 to 65536", "an integer from 1 to 65536"),
    "string-for-bool": ("use_qk_norm", "yes", "a string, not true or false", "true or false"),
    "not-finite": ("rms_norm_eps", float("inf"), "not a finite number", "a number > 0"),
    "zero-eps": ("rms_norm_eps", 0, "out of range: expected a number > 0", "a number > 0"),
    "object-for-number": ("attn_scale", {"x": 1}, "an object, not a finite number", "a finite number"),
    "heads-not-divisible": ("num_key_value_heads", 3, "the 8 query heads (num_attention_heads) are not a multiple of "
                            "it", "a divisor of 8: 1, 2, 4, 8"),
    "odd-head-dim": ("head_dim", 15, "gives heads of 15 dimensions: RoPE needs an even number", "an even integer"),
    "top-k-above-experts": ("num_experts_per_tok", 9, "more than the 8 experts (num_local_experts)",
                            "an integer from 1 to 8"),
    "moe-layer-outside": ("moe_layers", [1, 4], "holds 4, not a layer index from 0 to 3",
                          "a list of layer indices from 0 to 3"),
    "moe-layer-twice": ("moe_layers", [1, 1], "names a layer twice", "a list of distinct layer indices"),
    "list-of-strings": ("moe_layers", [1, "3"], "a list holding a string, not a list of integers, or null",
                        "a list of integers, or null"),
    "no-rope-not-0-1": ("no_rope_layers", [1, 1, 2, 0], "holds 2, not 0 (NoPE) or 1 (RoPE)",
                        "a list of 4 entries, 0 or 1"),
    "no-rope-short": ("no_rope_layers", [1, 0], "has 2 entries for 4 layers (num_hidden_layers)",
                      "a list of 4 entries, 0 or 1"),
    "chunk-negative": ("attention_chunk_size", -1, "out of range: expected an integer from 1 to 2147483647, or null",
                       "an integer from 1 to 2147483647, or null"),
    "rope-not-object": ("rope_parameters", 5, "an integer, not an object {...}, or null", "an object {...}, or null"),
    "rope-field-string": ("rope_parameters", {**_LLAMA3, "factor": "8"}, "a string, not a number > 0",
                          "a number > 0, e.g. 8.0 (without quotes)"),
    "llama3-incomplete": ("rope_parameters", {"rope_type": "llama3", "rope_theta": 10000.0},
                          "llama3 RoPE scaling needs factor, low_freq_factor, high_freq_factor, "
                          "original_max_position_embeddings",
                          "an object with factor, low_freq_factor, high_freq_factor, original_max_position_embeddings "
                          'for rope_type "llama3"'),
    "layer-types-ints": ("layer_types", [0, 1, 0, 1], "a list holding an integer, not a list of strings, or null",
                         "a list of strings, or null"),
    # architectures that contradict model_type ("llama4_text") were ignored: which to believe is the user's call.
    "architectures-of-another-family": ("architectures", ["Qwen3MoeForCausalLM"], "names Qwen3-MoE's "
                                        "Qwen3MoeForCausalLM, but model_type 'llama4_text' is Llama 4's: one of the "
                                        "two was edited", '["Llama4ForCausalLM"] for a Llama 4 checkpoint, or '
                                        '"model_type" to "qwen3_moe" for a Qwen3-MoE one'),
    "architectures-of-kimi": ("architectures", ["DeepseekV3ForCausalLM"], "names DeepSeek-V3's DeepseekV3ForCausalLM, "
                              "but model_type 'llama4_text' is Llama 4's: one of the two was edited",
                              '["Llama4ForCausalLM"] for a Llama 4 checkpoint, or "model_type" to "deepseek_v3" or '
                              '"kimi_k2" for a DeepSeek-V3 one'),
    "architectures-of-no-family": ("architectures", ["LlamaForCausalLM"], "names LlamaForCausalLM, no class of "
                                   "model_type 'llama4_text' (Llama 4: Llama4ForCausalLM, "
                                   "Llama4ForConditionalGeneration)", '["Llama4ForCausalLM"]'),
    "architectures-not-a-list": ("architectures", "Llama4ForCausalLM", "is not a list of class names",
                                 '["Llama4ForCausalLM"]'),
}


@pytest.mark.parametrize("reader", ["train-hf", "hf-to-dcp"])
@pytest.mark.parametrize("case", list(HF_VALUES))
def test_config_json_value_of_the_wrong_type_or_range(reader: str, case: str, hf_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    field, value, problem, expected = HF_VALUES[case]
    folder = tmp_path / "in"
    shutil.copytree(hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    nested = field if field != "rope_parameters" or not isinstance(value, dict) or case == "llama3-incomplete" else \
        "rope_parameters.factor"
    shown = json.dumps(value if nested == field else value["factor"])
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    message = _read(reader, folder, tmp_path / "out", capsys)
    assert f'{KEYS[reader]} = "{folder}": its config.json sets "{nested}": {shown}, {problem}\n' \
           f'  fix: set "{nested}" in {folder / "config.json"} to {expected}' in message, message


def test_multimodal_config_names_the_text_config_field(hf_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "in"
    shutil.copytree(hf_dir, folder)
    text = {**json.loads((folder / "config.json").read_text()), "vocab_size": 512.5}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": text}))
    message = _read("hf-to-dcp", folder, tmp_path / "out", capsys)
    assert f'its config.json sets "text_config.vocab_size": 512.5, a number, not an integer from 1 to 16777216\n' \
           f'  fix: set "text_config.vocab_size" in {folder / "config.json"} to an integer from 1 to 16777216' \
           in message, message


def test_released_configs_pass_the_value_checks() -> None:
    """What transformers' first Llama 4 release wrote (attn_temperature_tuning: 4) and what ours
    writes for every flavor are accepted."""
    from torchmoe.models.llama4.hf import args_from_hf_config

    for flavor, args in FLAVORS.items():
        config = hf_config_from_args(args, torch.bfloat16)
        assert args_from_hf_config(config).n_layers == args.n_layers, flavor
    legacy = {**hf_config_from_args(FLAVORS["scout"], torch.bfloat16), "attn_temperature_tuning": 4}
    assert args_from_hf_config(legacy).attn_temperature_tuning is True


@pytest.mark.parametrize("direction", ["hf-to-dcp", "dcp-to-hf"])
@pytest.mark.parametrize("out", ["file", "under-a-file", "read-only"])
def test_output_folder_that_cannot_be_written(direction: str, out: str, hf_dir: Path, dcp_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    target = {"file": tmp_path / "afile", "under-a-file": tmp_path / "afile" / "out",
              "read-only": tmp_path / "ro" / "out"}[out]
    if out == "read-only":
        (tmp_path / "ro").mkdir()
        real_open = os.open  # root may write anywhere: creating a file there is refused as it would be

        def open_(path, flags, *args):
            if Path(path).parent == tmp_path / "ro" and flags & os.O_CREAT:
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", open_)
    source = hf_dir if direction == "hf-to-dcp" else dcp_dir
    argv = ["convert", direction, str(source), str(target)] + (["--flavor", "tiny"]
                                                               if direction == "dcp-to-hf" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    expected = {"file": "Not a directory", "under-a-file": f"Not a directory ({tmp_path / 'afile'} is a file)",
                "read-only": f"{tmp_path / 'ro'}: cannot create files in it: Permission denied"}[out]
    assert "Traceback" not in err
    _assert_message(err, "OUT_DIR", str(target), expected)


def test_truncated_step_checkpoint_is_named_though_the_model_part_is_intact(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # DCP reads only the byte ranges of what it loads: the model's may well lie in the half that
    # is left, and then only the file's size shows the damage.
    folder = tmp_path / "step-2"
    shutil.copytree(run_dir / "checkpoint" / "step-2", folder)
    _truncate(folder / "__0_0.distcp")
    message = _read("train-dcp", folder, tmp_path / "out", capsys)
    _assert_message(message, "checkpoint.initial_load_path", str(folder), "__0_0.distcp is truncated (")


def _flip_model_bytes(folder: Path) -> None:
    """Invert 64 bytes of the stored token embeddings (its raw values: torch checks the zip records
    around them, not the values), as a disk or a copy can: the file keeps its size."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # this test's own file
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "model.tok_embeddings.weight")
    with open(folder / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        data = f.read(64)
        f.seek(info.offset + info.length // 2)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("reader", ["train-dcp", "dcp-to-hf"])
def test_changed_bytes_of_a_step_checkpoint_are_named(reader: str, run_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "step-2"
    shutil.copytree(run_dir / "checkpoint" / "step-2", folder)
    _flip_model_bytes(folder)
    message = _read(reader, folder, tmp_path / "out", capsys)
    _assert_message(message, KEYS[reader], str(folder),
                    "__0_0.distcp does not match the checksum recorded when it was saved (xxh3_64 ",
                    "): it changed on disk")


# ---- the CLI end to end ---------------------------------------------------------------------------


def test_train_from_int32_hf_weights_exits_2_instead_of_training(hf_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(hf_dir, folder)
    _int32_safetensors(folder)
    proc = run_cli([*TRAIN, "--checkpoint.initial_load_path", folder, "--checkpoint.initial_load_in_hf", "true",
                    "--job.dump_folder", tmp_path / "run"], timeout=120, expect=None)
    assert_user_error(proc, "model.embed_tokens.weight is stored as int32")
    assert "step 1" not in proc.stdout + proc.stderr


def test_nan_initial_weights_are_refused_before_training_and_never_exported(
        hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN row in the initial Hugging Face weights with checkpointing off and last_save_in_hf:
    refused at load naming the tensor (it used to train and export 128 NaNs with exit 0), and the
    message does not blame optimizer.lr."""
    folder = tmp_path / "hf"
    shutil.copytree(hf_dir, folder)
    _nan_safetensors(folder)
    run = tmp_path / "run"
    status = cli.main([*TRAIN, "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
                       "true", "--checkpoint.last_save_in_hf", "true", *HF_EXPORT, "--job.dump_folder", str(run)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    _assert_message(err, "checkpoint.initial_load_path", str(folder), "model.embed_tokens.weight")
    assert "optimizer.lr" not in err and "step 1" not in err
    # No config.toml, no export: only the locks of the folders the run would have written into.
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [LOCK_NAME, "checkpoint",
                                                                       f"checkpoint/{LOCK_NAME}"]


def test_a_seed_checkpoint_seeds_from_initial_load_path(hf_dir: Path, tmp_path: Path) -> None:
    """create_seed_checkpoint with initial_load_path: step-0 holds those weights (it used to hold
    random ones, the path silently ignored)."""
    assert cli.main(["train", "--config", DEBUG_CONFIG, "--checkpoint.enable", "true",
                     "--checkpoint.create_seed_checkpoint", "true", "--checkpoint.initial_load_path", str(hf_dir),
                     "--checkpoint.initial_load_in_hf", "true", "--job.dump_folder", str(tmp_path)]) == 0
    seeded = empty_tiny_model()
    CheckpointManager(tmp_path, CheckpointConfig(enable=True), total_steps=1).load_latest(
        {"model": ModelWrapper(seeded)})
    expected = load_file(hf_dir / "model.safetensors")
    assert torch.equal(seeded.tok_embeddings.weight, expected["model.embed_tokens.weight"])
    assert torch.equal(seeded.layers["1"].moe.experts.w2.transpose(1, 2),
                       expected["model.layers.1.feed_forward.experts.down_proj"])


def test_every_writer_of_weights_refuses_nan_before_writing(tmp_path: Path) -> None:
    """The Hugging Face writer (`save_model`, the export, `convert dcp-to-hf`), checkpoint saves
    (seed ones too) and a float16 export that would overflow: nothing written."""
    from torchmoe.hf import save_model
    from torchmoe.weights.finite import NonFiniteValues

    model = empty_tiny_model()
    model.init_weights(seed=0)
    model.layers["0"].attention.wq.weight.data[3, 5] = float("nan")
    with pytest.raises(NonFiniteValues, match=r"^NaN or inf in layers\.0\.attention\.wq\.weight$"):
        save_model(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    manager = CheckpointManager(tmp_path, CheckpointConfig(enable=True), total_steps=1)
    with pytest.raises(NonFiniteValues, match=r"^NaN or inf in model\.layers\.0\.attention\.wq\.weight$"):
        manager.save_seed_checkpoint({"model": ModelWrapper(model)})
    model.layers["0"].attention.wq.weight.data[3, 5] = 1e5  # finite, beyond float16's 65504
    export = CheckpointManager(tmp_path, CheckpointConfig(enable=True, last_save_model_only=True,
                                                          export_dtype="float16"), total_steps=1)
    with pytest.raises(ConfigError, match=r'checkpoint.export_dtype = "float16": layers\.0\.attention\.wq\.weight '
                                          r"exceed its range \(6\.55e\+04\): the export would hold inf\n  fix: "
                                          r"export in bfloat16 or float32"):
        export.save(1, {"model": ModelWrapper(model)})
    assert not list((tmp_path / "checkpoint").glob("step-*"))


# ---- resuming: probing broken checkpoints quietly -----------------------------------------------------


def test_resume_skips_a_corrupt_newest_checkpoint_with_one_warning(run_dir: Path, tmp_path: Path) -> None:
    dump = tmp_path / "run"
    shutil.copytree(run_dir, dump)
    broken = dump / "checkpoint" / "step-4"
    shutil.copytree(dump / "checkpoint" / "step-2", broken)
    (broken / MARKER).write_text(json.dumps({**json.loads((broken / MARKER).read_text()), "step": 4}))
    _truncate(broken / "__0_0.distcp")
    # training.steps 2: resuming at step 2 leaves nothing to train.
    proc = run_cli([*TRAIN, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", dump],
                   timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line and "checkpoint" in line]
    assert len(warnings) == 1 and "step-4" in warnings[0] and "truncated" in warnings[0], proc.stderr
    assert f"resumed from {dump / 'checkpoint' / 'step-2'}" in proc.stderr


def test_resume_skips_a_checkpoint_whose_bytes_changed_and_trains_on_exactly(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Step-4, a copy of step-2 with 64 bytes changed (they would load and train): one warning,
    and step 3 trains from step-2 exactly as from an intact folder."""
    train = [*TRAIN[:-1], "3", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    reference, dump = tmp_path / "reference", tmp_path / "run"
    shutil.copytree(run_dir, reference)
    assert cli.main([*train, "--job.dump_folder", str(reference)]) == 0
    shutil.copytree(run_dir, dump)
    broken = dump / "checkpoint" / "step-4"
    shutil.copytree(dump / "checkpoint" / "step-2", broken)
    (broken / MARKER).write_text(json.dumps({**json.loads((broken / MARKER).read_text()), "step": 4}))
    _flip_model_bytes(broken)
    capsys.readouterr()
    assert cli.main([*train, "--job.dump_folder", str(dump)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "WARNING" in line and "checkpoint" in line]
    assert len(warnings) == 1 and f"could not load checkpoint {broken} (__0_0.distcp does not match the checksum " \
        "recorded when it was saved (xxh3_64 " in warnings[0], err
    assert f"resumed from {dump / 'checkpoint' / 'step-2'}" in err
    got, want = read_metrics(dump)[-1], read_metrics(reference)[-1]
    assert got["step"] == want["step"] == 3
    assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])


def test_resume_skips_a_checkpoint_holding_nan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A step-N whose weights are NaN (no save writes that: damaged on disk, or another program's)
    is one warning, naming the tensor, and the previous checkpoint resumes."""
    model = nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path, CheckpointConfig(enable=True), total_steps=10)
    manager.save(1, {"model": ModelWrapper(model)})
    nan = tmp_path / "checkpoint" / "step-2"
    with torch.no_grad():
        model.bias[2] = float("nan")
    dcp.save({"model": ModelWrapper(model)}, checkpoint_id=str(nan), no_dist=True)  # past the manager's check
    shutil.copy(tmp_path / "checkpoint" / "step-1" / MARKER, nan / MARKER)
    with caplog.at_level(logging.WARNING):
        step = CheckpointManager(tmp_path, CheckpointConfig(enable=True), total_steps=10).load_latest(
            {"model": ModelWrapper(model)})
    assert step == 1 and torch.isfinite(model.bias).all()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"could not load checkpoint {nan} (the weights hold NaN or inf in model.bias); trying the previous one"]


def test_no_loadable_checkpoint_is_one_short_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path, CheckpointConfig(enable=True), total_steps=10)
    for step in (1, 2):
        manager.save(step, {"model": ModelWrapper(model)})
    (tmp_path / "checkpoint" / "step-1" / ".metadata").write_bytes(GARBAGE)
    _truncate(tmp_path / "checkpoint" / "step-2" / "__0_0.distcp")
    with pytest.raises(ConfigError) as err:
        CheckpointManager(tmp_path, CheckpointConfig(enable=True), total_steps=10).load_latest(
            {"model": ModelWrapper(nn.Linear(4, 4))})
    lines = str(err.value).splitlines()
    assert lines[0] == f'checkpoint.folder = "{tmp_path / "checkpoint"}": no checkpoint there could be loaded:'
    assert lines[1].startswith("  step-2: __0_0.distcp is truncated ("), lines
    # Garbage in place of a checksummed .metadata is a checksum mismatch, found before unpickling it.
    assert lines[2].startswith("  step-1: .metadata does not match the checksum recorded when it was saved ("), lines
    assert lines[3].startswith("  fix: ") and len(lines) == 4, lines
    assert "Traceback" not in capsys.readouterr().err


def test_dcp_tracebacks_are_dropped_while_reading(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DCP logs a metadata file it cannot read with its traceback (on the root logger), then raises."""
    (tmp_path / ".metadata").write_bytes(GARBAGE)

    def load() -> list[logging.LogRecord]:
        caplog.clear()
        with pytest.raises(BaseException):
            dcp.load({"x": torch.zeros(1)}, checkpoint_id=str(tmp_path), no_dist=True)
        return [r for r in caplog.records if r.exc_info]

    with caplog.at_level(logging.WARNING):
        assert load()  # what would be printed
        with quiet_dcp_logs():
            assert not load()
        assert load()  # only while reading
