"""Nothing is unpickled from a checkpoint but DCP's metadata classes and plain values.

    pytest tests/unit/test_dcp_unpickling.py

The allowlist is exactly what torch 2.13 writes into `.metadata` for the checkpoints torchmoe
saves in one process (sync, async, a model-only bf16 export); the sharded layouts' checkpoints
(FSDP, TP, EP, PP, CP) load through it in `tests/distributed`. A pickle that names anything else
is refused in every form pickle has for naming a global. A scan of the package keeps every load
on this path.
"""

from __future__ import annotations

import collections
import copyreg
import io
import os
import pickle
import re
import sys
import tokenize
from pathlib import Path

import pytest
import torch
from torch import nn

from torchmoe.checkpoints.checkpoint import CheckpointManager
from torchmoe.checkpoints.checkpoint_state import ModelWrapper, OptimizerWrapper, RankLocal, RNGState
from torchmoe.config.job_config import Checkpoint as CheckpointConfig
from torchmoe.config.job_config import LRScheduler as LRSchedulerConfig
from torchmoe.optim.lr_scheduler import build_lr_scheduler
from torchmoe.weights.dcp_unpickling import _METADATA_GLOBALS, RefusedPickle, unpickle_metadata, value_fault

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PACKAGE = Path(__file__).resolve().parents[2] / "torchmoe"


class _Recording(pickle.Unpickler):
    """A plain unpickler (of files this test wrote) that records the globals it resolves."""

    def __init__(self, data: bytes, seen: collections.Counter) -> None:
        super().__init__(io.BytesIO(data))
        self.seen = seen

    def find_class(self, module: str, name: str):
        self.seen[(module, name)] += 1
        return super().find_class(module, name)


def test_the_allowlist_is_what_our_checkpoints_hold(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": ModelWrapper(model), "optimizer": OptimizerWrapper(model, opt),
             "lr_scheduler": build_lr_scheduler(opt, LRSchedulerConfig(warmup_steps=2), total_steps=3),
             "rng": RankLocal(RNGState(), rank=0)}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    for mode in ("disabled", "async"):
        manager = CheckpointManager(tmp_path / mode, CheckpointConfig(
            enable=True, interval=1, async_mode=mode, last_save_model_only=True, export_dtype="bfloat16"),
            total_steps=3)
        manager.save(1, state)
        manager.save(3, state)  # the last step: the bf16 model-only export
        manager.close()
    seen: collections.Counter = collections.Counter()
    files = sorted(tmp_path.glob("*/checkpoint/step-*/.metadata"))
    assert len(files) == 4
    for file in files:
        assert type(unpickle_metadata(file.read_bytes())).__name__ == "Metadata"
        _Recording(file.read_bytes(), seen).load()
    dtypes = {name for module, name in seen if module == "torch" and isinstance(getattr(torch, name), torch.dtype)}
    assert dtypes == {"float32", "bfloat16", "uint8"}  # weights and optimizer state, the export, RNG state
    other_python = ("pathlib._local" if sys.version_info < (3, 13) else "pathlib", "PosixPath")
    assert {g for g in seen if g[0] != "torch" or g[1] not in dtypes} == _METADATA_GLOBALS - {other_python}


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _forms(marker: Path) -> dict[str, bytes]:
    """The payload in every way a pickle can name a global: GLOBAL (protocols 0-2), STACK_GLOBAL
    (4, 5), INST, OBJ, and an extension code (copyreg's registry, resolved by the unpickler)."""
    command = f"touch {marker}".encode()
    forms = {f"protocol-{p}": pickle.dumps(_Payload(marker), protocol=p) for p in range(6)}
    forms["inst"] = b"(S'" + command + b"'\nios\nsystem\n."
    forms["obj"] = b"(cos\nsystem\nS'" + command + b"'\no."
    forms["ext1"] = b"\x80\x02\x82\x7fX" + len(command).to_bytes(4, "little") + command + b"\x85R."
    return forms


@pytest.mark.parametrize("form", ["protocol-0", "protocol-1", "protocol-2", "protocol-3", "protocol-4",
                                  "protocol-5", "inst", "obj", "ext1"])
def test_every_way_of_naming_a_global_is_refused(form: str, tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    copyreg.add_extension("os", "system", 127)
    try:
        with pytest.raises(RefusedPickle) as err:
            unpickle_metadata(_forms(marker)[form])
        assert not marker.exists()
        pickle.loads(_forms(marker)[form])  # the control: plain pickle runs it
        assert marker.exists()
    finally:
        copyreg.remove_extension("os", "system", 127)
    module = "posix" if form.startswith("protocol") else "os"
    assert str(err.value) == (f".metadata asks to load {module}.system, which a checkpoint never holds: refused, "
                              "nothing of it was run")


def test_a_persistent_id_is_damage_not_a_call() -> None:
    with pytest.raises(pickle.UnpicklingError):
        unpickle_metadata(b"P0\n.")


# ---- the package: every load goes through the safe path ---------------------------------------------

# pattern -> the modules allowed to use it (relative to torchmoe/), and why.
_GUARDED = {
    r"\bpickle\.loads?\(|\bUnpickler\(": set(),  # only dcp_unpickling subclasses pickle.Unpickler
    r"weights_only\s*=\s*False": set(),
    r"\btorch\.load\(": {"weights/dcp_unpickling.py"},  # with weights_only=True
    r"\bdcp\.load\(": {"weights/weight_files.py", "hf_files/hf_storage.py"},  # SafeReader; safetensors
    r"FileSystemReader\b": {"weights/dcp_unpickling.py"},
    r"DefaultLoadPlanner\b": {"weights/dcp_unpickling.py"},
    r"trust_remote_code|AutoTokenizer|from_pretrained|auto_map": set(),
    r"(?<![.\w])(eval|exec)\(|__import__\(|import_module\(": set(),
}


def _code(path: Path) -> str:
    """The source of `path` with its comments and strings (docstrings too) blanked out."""
    lines = path.read_text().splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            (row, col), (end_row, end_col) = tok.start, tok.end
            for r in range(row, end_row + 1):
                line = lines[r - 1]
                start, stop = (col if r == row else 0), (end_col if r == end_row else len(line.rstrip("\n")))
                lines[r - 1] = line[:start] + " " * (stop - start) + line[stop:]
    return "".join(lines)


def test_no_module_loads_files_any_other_way() -> None:
    found = collections.defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        text = _code(path)
        for pattern in _GUARDED:
            if re.search(pattern, text):
                found[pattern].add(str(path.relative_to(PACKAGE)))
    assert {p: found[p] for p in _GUARDED} == _GUARDED


@pytest.mark.parametrize(("template", "stored", "fault"), [
    ((0.9, 0.95), "oops", "a string ('oops'), where a tuple of 2 belongs"),
    ((0.9, 0.95), (0.9,), "a tuple ((0.9,)), where a tuple of 2 belongs"),
    ((0.9, 0.95), (0.9, float("inf")), "[1] inf, not a finite number"),
    (3e-4, float("nan"), "nan, not a finite number"),
    (3e-4, "3e-4", "a string ('3e-4'), where a number belongs"),
    (7, 2**70, "1.18e+21, beyond 64 bits"),
    (7, -2**63 - 1, "-9.22e+18, beyond 64 bits"),
    (7, 10**5000, "an integer beyond 64 bits"),
    (False, 0, "a number, where a boolean belongs"),
    (7, True, "a boolean, where a number belongs"),
    ("adamw", 3, "a number, where a string belongs"),
    ([1, 2], [1, "x", 3], "[1] a string ('x'), where a number belongs"),
    ({"a": 1}, {"a": None}, "['a'] None (None), where a number belongs"),
], ids=lambda _: "")  # 10**5000 has no str() for an id
def test_a_stored_value_unlike_its_place_is_named(template, stored, fault) -> None:
    assert value_fault(template, stored) == fault


@pytest.mark.parametrize(("template", "stored"), [
    (0, 0.1),  # weight_decay = 0 in this run's TOML, 0.1 in the run that saved
    (0.5, 3),
    (None, "anything"),
    (0.25, None),  # Python's RNG state: its cached gaussian, or None
    ([1, 2], [5, 6, 7, 8]),  # rows per rank: another layout's count
    ({"a": 1}, {"a": 2, "b": "x"}),
    ((3, (1, 2, 3), None), (3, (4, 5, 6), 0.5)),  # random.getstate()
])
def test_a_stored_value_of_its_places_kind_is_taken(template, stored) -> None:
    assert value_fault(template, stored) is None
