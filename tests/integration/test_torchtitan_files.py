"""torchtitan v0.2.2 job files run unchanged: the three files of `tests/assets/torchtitan` (our own,
in its format, holding every key of its JobConfig) plan their jobs, and the debug one trains on CPU
from a folder laid out like a torchtitan checkout (its `tests/assets/tokenizer` and
`tests/assets/c4_test`, which this module writes).

The training run is anchored outside the trainer: its step-1 loss and gradient norm equal a plain
forward and backward of the same weights on a batch packed here from the corpus file with the
tokenizers library itself (BOS + document + EOS, torchtitan's packing, which `training.add_bos`
selects).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.launch import metrics_by_step
from torchmoe.commands import cli
from torchmoe.config.job_file import load_toml_config

pytestmark = pytest.mark.integration

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "torchtitan"
DEBUG = ASSETS / "debug_model.toml"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SEQ_LEN, ROWS = 64, 8  # the file's local_batch_size 8 on one rank: 8 rows


def _documents() -> list[str]:
    words = "the of expert router token layer gradient shard mesh rank batch loss model weight data".split()
    return [" ".join(words[(d * 7 + i * 3) % len(words)] for i in range(20 + d % 30)) + f" {d}." for d in range(64)]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A folder laid out like a torchtitan checkout: a BPE tokenizer with BOS/EOS named in its
    tokenizer_config.json, and a c4_test corpus (.json, one object per line as c4's files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("torchtitan")
    corpus = root / "tests" / "assets" / "c4_test"
    corpus.mkdir(parents=True)
    lines = [json.dumps({"text": text, "url": f"https://example.com/{i}"}) for i, text in enumerate(_documents())]
    (corpus / "c4_test.json").write_text("\n".join(lines) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_documents(), trainers.BpeTrainer(vocab_size=400, special_tokens=[BOS, EOS]))
    folder = root / "tests" / "assets" / "tokenizer"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return root


@pytest.mark.parametrize(("name", "world_size", "expected"), [
    ("debug_model.toml", 1, "parameters: total 15.02 M, active 6.76 M"),
    ("llama4_17bx16e.toml", 64, "parameters: total 107.77 B, active 17.17 B"),
    ("llama4_17bx128e.toml", 256, "parameters: total 400.71 B, active 17.18 B"),
])
def test_each_file_plans_its_job(name: str, world_size: int, expected: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--config", str(ASSETS / name), "--dry-run", "--world-size", str(world_size),
                     "--job.dump_folder", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert expected in " ".join(out.split()), out
    # No key needs a warning but the settings a file leaves off (one line each: `config.dependent_keys`,
    # tests/unit/test_torchtitan_config.py lists them); the others are the planner's about speed
    # (torchtitan's Maverick preset: 1F1B over 4 micro-batches idles 43% of each step; docs/planner.md).
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert all(" slower than the planner's best " in w or w.startswith("warning: pipeline bubble ") or
               " in the job file has no effect: it only matters with " in w for w in warnings), err
    assert "error:" not in err, err


def _reference_step1(checkout: Path, seed: int) -> tuple[float, float]:
    """Step 1 without the trainer: row j = the documents whose line starts in the j-th eighth of the
    file's non-blank lines' bytes, each as BOS ids EOS, the first SEQ_LEN + 1 tokens of each; the
    flavor's weights from `seed`; mean cross entropy; fp64 norm."""
    from tokenizers import Tokenizer

    from torchmoe.models.llama4 import FLAVORS, Transformer

    tok = Tokenizer.from_file(str(checkout / "tests" / "assets" / "tokenizer" / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    corpus = (checkout / "tests" / "assets" / "c4_test" / "c4_test.json").read_text()
    lines = [line for line in corpus.split("\n") if line.strip()]
    sizes = [len(line.encode("utf-8")) for line in lines]
    assert max(sizes) * ROWS <= sum(sizes)  # no document is cut into parts
    starts = [0, *itertools.accumulate(sizes)]
    rows = []
    for j in range(ROWS):
        docs = [json.loads(line)["text"] for line, s in zip(lines, starts) if s * ROWS // sum(sizes) == j]
        stream = [t for doc in docs for t in [bos, *tok.encode(doc, add_special_tokens=False).ids, eos]]
        rows.append(stream[: SEQ_LEN + 1])
    windows = torch.tensor(rows)
    inputs, labels = windows[:, :-1], windows[:, 1:]
    with torch.device("meta"):
        model = Transformer(FLAVORS["debugmodel"])
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad.double() for p in model.parameters()])
    return loss.item(), norm.item()


def test_the_debug_file_trains_on_cpu(checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file as it is, run from the checkout; the command line only shortens the job (3 steps of
    64 tokens, float32 for an exact reference) and selects torchtitan's packing and decay."""
    monkeypatch.chdir(checkout)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(DEBUG), "--training.seq_len", str(SEQ_LEN), "--training.steps", "3",
                     "--training.mixed_precision_param", "float32", "--training.add_bos", "true",
                     "--optimizer.decay_all_params", "true", "--lr_scheduler.warmup_reaches_peak", "true",
                     "--job.dump_folder", str(out)]) == 0
    metrics = metrics_by_step(out)
    assert sorted(metrics) == [1, 2, 3]
    resolved = load_toml_config(out / "config.toml")
    assert (resolved.model.flavor, resolved.training.seed, resolved.training.dataset) == ("debugmodel", 42, "c4_test")
    assert resolved.model.tokenizer_path == "./tests/assets/tokenizer"  # from hf_assets_path / tokenizer_path
    assert metrics[1]["lr"] == pytest.approx(4e-3 / 2)  # warmup 2, torchtitan's: step 1 at half the peak
    loss, norm = _reference_step1(checkout, seed=42)
    assert metrics[1]["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics[1]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics[3]["loss"] < metrics[1]["loss"]
