"""`torchmoe eval` and `torchmoe generate` end to end on a run's checkpoints.

    python -m pytest -q -m integration tests/integration/test_generate_eval.py

The anchor: eval of a run's initial weights (here a Hugging Face folder of them) on the first
training batch is the loss the run logged at step 1, which training computed from the same
weights and rows.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG
from tests.launch import read_metrics, run_cli
from torchmoe.commands import cli
from torchmoe.data.file_index import INDEX_FOLDER

pytestmark = pytest.mark.integration

# The job of the `run_dir` fixture: the tiny flavor, one batch of 8 x 64 tokens per step (no
# accumulation), 2 steps, step-2 saved.
TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "64"]


def _tree(folder: Path) -> dict[str, int]:
    """Every file under `folder` with its modification time (ns), but the data indexes: `eval`
    keeps its files' indexes in the run's shared cache (`data_index`)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))
            if p.relative_to(folder).parts[0] != INDEX_FOLDER}


def test_eval_of_the_initial_weights_on_the_first_batch_is_the_first_steps_loss(run_dir: Path, hf_dir: Path,
                                                                              tmp_path: Path) -> None:
    # hf_dir holds the tiny model initialised from seed 0: the weights run_dir's step 1 trained.
    before = _tree(run_dir)
    logged = read_metrics(run_dir)[0]
    assert logged["step"] == 1
    out = tmp_path / "eval.json"
    proc = run_cli(["eval", *TINY, "--job.dump_folder", run_dir, "--checkpoint", hf_dir, "--split", "train",
                    "--batches", "1", "--out", out], timeout=180)
    result = json.loads(out.read_text())
    assert result["loss"] == pytest.approx(logged["loss"], rel=1e-6, abs=0)
    assert result["checkpoint"] == str(hf_dir) and result["batches"] == 1
    assert result["perplexity"] == pytest.approx(math.exp(logged["loss"]), rel=1e-9)
    assert proc.stdout.startswith(f"train loss {result['loss']:.6f} ")
    assert _tree(run_dir) == before  # the run's folder is only read


def test_eval_keeps_its_data_indexes_in_the_runs_cache_and_a_second_eval_indexes_nothing(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The indexes of the evaluated files go to the run's `data_index` (on the file system its
    nodes share, as the dump folder is), not to the scratch folder (`TMPDIR`, node-local), which
    is left empty; a second eval of the same files saves no index (every index file written is
    recorded: `file_syncs/sitecustomize.py`) and gives the same loss."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(2):
        lines = [json.dumps({"text": f"def f{f}_{i}(x):\n    return x * {i}\n"}) for i in range(400)]
        (corpus / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    scratch, calls = tmp_path / "scratch", tmp_path / "calls"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parents[1] / "distributed" / "file_syncs"),
                                                      *filter(None, [os.environ.get("PYTHONPATH")])]))
    cache = run_dir / "data_index"
    results = []
    for when in ("first", "again"):
        (calls / when).mkdir(parents=True)
        monkeypatch.setenv("TORCHMOE_FILE_SYNCS", str(calls / when))
        out = tmp_path / f"{when}.json"
        run_cli(["eval", *TINY, "--job.dump_folder", run_dir, "--split", "train", "--batches", "1", "--out", out,
                 "--training.dataset", "local", "--training.dataset_path", corpus], timeout=180)
        results.append(json.loads(out.read_text())["loss"])
        saves = [c for f in (calls / when).glob("*.json") for c in json.loads(f.read_text())["calls"]
                 if c["call"] == "replace" and "file_index.py:_save" in c["stack"]]
        assert len(saves) == (2 if when == "first" else 0), (when, saves)
        assert len(list(cache.glob("*.npy"))) == 2 and list(scratch.iterdir()) == [], when
    assert results[0] == results[1]


def test_eval_indexes_into_its_scratch_folder_where_the_runs_cache_cannot_be_written(tmp_path: Path, caplog) -> None:
    from torchmoe.commands.eval import _index_cache

    run, work = tmp_path / "run", tmp_path / "work"
    run.mkdir()
    assert _index_cache(run, work) == run / "data_index" and list(run.iterdir()) == []  # the probe is gone
    (run / "data_index").write_text("in the way")
    assert _index_cache(run, work) == work / "data_index"
    assert f"the run's data index cache {run / 'data_index'} cannot be written (cannot create files in it: Not a " \
        "directory): the data is indexed into this evaluation's scratch folder, again at every eval" in caplog.text


def test_eval_reads_the_runs_newest_checkpoint_by_default(capsys, run_dir: Path) -> None:
    # step-2: two steps of training lowered the loss on the first batch.
    assert cli.main(["eval", *TINY, "--job.dump_folder", str(run_dir), "--split", "train", "--batches", "1"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1] == str(run_dir / "checkpoint" / "step-2")
    assert float(printed[2]) < read_metrics(run_dir)[0]["loss"] - 0.01


def test_generate_continues_the_prompt_reproducibly(capsys, run_dir: Path) -> None:
    flags = ["generate", *TINY, "--job.dump_folder", str(run_dir), "--prompt", "def parse(", "--max-new-tokens", "24",
             "--temperature", "0.9", "--top-p", "0.95", "--seed", "5"]
    assert cli.main(flags) == 0
    first = capsys.readouterr().out
    assert first.startswith("def parse(") and len(first) > len("def parse(\n")
    assert cli.main(flags) == 0
    assert capsys.readouterr().out == first


# The weights named without a job file: the model (and the rest of the job) is the run's own
# config.toml, or the Hugging Face folder's config.json; each as the job file's run gives it.
SOURCES = {"run_folder": ["--job.dump_folder", "{run}"], "step_folder": ["--checkpoint", "{run}/checkpoint/step-2"]}


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_runs_weights_need_no_job_file(capsys, run_dir: Path, source: str) -> None:
    weights = [f.format(run=run_dir) for f in SOURCES[source]]
    sample = ["--prompt", "def parse(", "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "5"]
    assert cli.main(["generate", *TINY, "--job.dump_folder", str(run_dir), *sample]) == 0
    expected = capsys.readouterr().out
    assert cli.main(["generate", *weights, *sample]) == 0
    out, err = capsys.readouterr()
    assert out == expected and "note:" not in err, err
    assert cli.main(["eval", *TINY, "--job.dump_folder", str(run_dir), "--split", "train", "--batches", "1"]) == 0
    expected = capsys.readouterr().out
    assert cli.main(["eval", *weights, "--split", "train", "--batches", "1"]) == 0
    assert capsys.readouterr().out == expected


def test_a_job_file_of_another_model_takes_the_weights_model(capsys, run_dir: Path, hf_dir: Path,
                                                             tmp_path: Path) -> None:
    """A job file of another flavor (bench256) or family (qwen3) beside tiny Llama 4 weights: the
    model is the weights' (their run's config.toml, the folder's config.json), said in one note,
    and the loss is the one the right job file gives; a --model.* flag is asked for by name and
    kept (then it does not fit the weights: one error naming it)."""
    text = Path(DEBUG_CONFIG).read_text()
    jobs = {"bench256": text.replace('flavor = "tiny"', 'flavor = "bench256"'),
            "qwen3": text.replace('name = "llama4"', 'name = "qwen3"')}
    for name, job in jobs.items():
        (tmp_path / f"{name}.toml").write_text(job)
    batch = ["--training.seq_len", "64", "--split", "train", "--batches", "1"]
    for weights, job, note in ((["--job.dump_folder", str(run_dir)], "bench256",
                                f'from {run_dir / "config.toml"}: model.flavor = "tiny"'),
                               (["--checkpoint", str(hf_dir), "--job.dump_folder", str(tmp_path / "none")], "qwen3",
                                f'from {hf_dir / "config.json"}: model.name = "llama4"')):
        assert cli.main(["eval", *TINY, *weights, *batch]) == 0
        expected = capsys.readouterr().out
        assert cli.main(["eval", "--config", str(tmp_path / f"{job}.toml"), *weights, *batch]) == 0
        out, err = capsys.readouterr()
        assert out == expected and out.startswith("train loss "), (out, err)
        assert err.count("note:") == 1 and f"the model is the weights' own, {note}" in err, err
    status = cli.main(["eval", "--config", str(tmp_path / "bench256.toml"), "--model.flavor", "bench256",
                       "--job.dump_folder", str(run_dir), *batch])
    err = capsys.readouterr().err
    assert status == 2 and err.count("error:") == 1 and 'model.flavor = "bench256": does not fit' in err, err


@pytest.mark.parametrize("flags, expected", [
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["generate", "--prompt", "x", "--top-p", "0"], "--top-p"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "--prompt", "x", "--max-new-tokens", "5000"], "model.max_seq_len"),
    (["generate", "--prompt", "x", "--seed", "two"], "--seed"),
    # torch's seeds are 64 bits, unsigned: 2**64 overflowed with a traceback, -1 passed silently.
    (["generate", "--prompt", "x", "--seed", str(2**64)], f'--seed = "{2**64}": must be an integer from 0 to '
                                                          f"{2**64 - 1}\n  fix: pass e.g. --seed 0"),
    (["generate", "--prompt", "x", "--seed", "-1"], '--seed = "-1": must be an integer from 0 to'),
    # 1e-320 is 0 in float32: the division made every probability NaN (a multinomial traceback).
    (["generate", "--prompt", "x", "--temperature", "1e-320"], "--temperature = 1e-320: is below 1.18e-38, float32's "
                                                               "smallest normal number"),
    (["generate", "--prompt", "x", "--temperature", "1e39"], '--temperature = "1e39": must lie in [0, 3.40282e+38]'),
    (["generate", "--prompt", "x", "--top-p", "inf"], '--top-p = "inf": must be a finite number'),
    (["generate", "--prompt", "x", "--max-new-tokens", "9" * 5001], '--max-new-tokens = "99999999999999999999... '
                                                                    '(5,001 characters)": must be an integer from 1'),
    # Longer than the context: no --max-new-tokens fits ("pass at most 0" before); the prompt is to blame.
    (["generate", "--prompt", "y" * 3000], "--prompt = \"yyyyyyyyyyyyyyyyyyyy... (3,000 characters)\": encodes to "),
    (["generate", "--prompt", "x", "--step", "9"], "no complete checkpoint step-9 in"),
    (["generate", "--prompt", "x", "--step", "-1"], '--step = "-1": must be an integer from 0 to 9223372036854775807\n'
                                                   "  fix: name a saved step (a step-N folder), or leave --step out"),
    (["eval", "--step", "-2"], '--step = "-2": must be an integer from 0 to'),
    (["eval", "--batches", str(2**63)], f'--batches = "{2**63}": must be an integer from -1 to {2**63 - 1}'),
    (["eval", "--step", "1"], "found: step-2"),
    (["generate", "--prompt"], "--prompt"),
    (["eval", "--split", "test"], "--split"),
    (["eval", "--batches", "0"], "--batches"),
    (["eval", "--checkpoint", "{run}/metrics.jsonl"], "neither a DCP checkpoint folder"),
    (["eval", "--checkpoint", "{run}/metrics.jsonl/x"], "neither a DCP checkpoint folder"),
    (["eval", "--checkpoint", "{run}/checkpoint/step-1", "--step", "1"], "not both"),
    (["eval", "--out", "{run}"], "--out"),
    (["eval", "--split", "train", "--training.dataset_mix", '["1:python_docs"]'], "dataset_mix"),
])
def test_bad_flags_are_one_message(capsys, run_dir: Path, flags: list[str], expected: str) -> None:
    command, *rest = flags
    argv = [command, *TINY, "--job.dump_folder", str(run_dir), *(f.format(run=run_dir) for f in rest)]
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and err.count("error:") == 1 and expected in err, err


def test_logits_that_overflow_are_one_message_not_nul_bytes(capsys, monkeypatch, run_dir: Path) -> None:
    """Weights whose computation overflows (logits of NaN and inf): greedy decoding printed token 0
    (NUL bytes) with exit 0. Now exit 2, naming the weights, the compute dtype and the fix."""
    from torchmoe.commands import generate

    load = generate.load_trained_model

    def overflowing(*args, **kwargs):
        model = load(*args, **kwargs)
        forward = model.forward
        model.forward = lambda tokens, cache=None: forward(tokens, cache=cache) * float("inf")
        return model

    monkeypatch.setattr(generate, "load_trained_model", overflowing)
    status = cli.main(["generate", *TINY, "--job.dump_folder", str(run_dir), "--prompt", "ab", "--training.dtype",
                       "bfloat16", "--training.mixed_precision_param", "bfloat16"])
    out, err = capsys.readouterr()
    assert status == 2 and "\x00" not in out and out == "ab\n", (out, err)
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert ('--checkpoint = "(the run\'s newest checkpoint)": the logits of generated token 1 hold NaN or inf, '
            "computing in bfloat16: the weights overflow it") in err, err
    assert "fix: generate in float32 (--training.mixed_precision_param float32)" in err, err


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_loss_that_is_not_finite_is_one_message_and_writes_nothing(capsys, monkeypatch, run_dir: Path,
                                                                     tmp_path: Path, loss: float) -> None:
    """eval's result holds no NaN: the loss of weights whose computation overflows is refused,
    and --out is not written (json.dumps would have written NaN into it)."""
    from torchmoe.training import session as trainer
    from torchmoe.training.validation import ValidationLoss

    monkeypatch.setattr(trainer, "evaluate", lambda cfg, **kw: ValidationLoss(loss, 1, 64, None))
    out = tmp_path / "eval.json"
    status = cli.main(["eval", *TINY, "--job.dump_folder", str(run_dir), "--split", "train", "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert f'--checkpoint = "{run_dir / "checkpoint" / "step-2"}": the loss is {loss}, computing in ' in err, err
    assert "fix: evaluate in float32 (--training.mixed_precision_param float32)" in err, err
    assert not out.exists()


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_without_a_job_file_nothing_runs(capsys, command: str) -> None:
    assert cli.main([command, "--prompt", "x"] if command == "generate" else [command]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--config" in err and "Traceback" not in err, err
