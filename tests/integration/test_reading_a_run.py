"""The commands that read a run (`eval`, `generate --chat`, `convert dcp-to-hf`) and the run's
own Hugging Face export, on runs that started from a Hugging Face folder whose sizes match no
flavor (`tests.chat_jobs.chat_checkpoint`: weights, a chat tokenizer, a release's generation
settings): each from the dump folder alone, with numbers only the trained weights give.

One run per family, two steps of chat SFT (fp32, one process, in this process), each step saved
and validated, the export at the end:

    llama4, deepseek_v3   full fine-tuning
    qwen3                 LoRA (adapter export, lora.checkpoint_base), started from
                          model.hf_assets_path as the shipped SFT configs do; its folder is
                          moved away after training: every reader works from the run's base/
    gpt_oss               LoRA (merged export, dropout 0.25 on the adapters), without base/

    python -m pytest -q tests/integration/test_reading_a_run.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
import transformers  # noqa: E402

from tests.chat_jobs import CHAT_ROWS, chat_checkpoint, write_chat_file  # noqa: E402
from tests.helpers import start_from  # noqa: E402
from torchmoe.commands import cli  # noqa: E402
from torchmoe.data.chat.chat_template import ChatTemplate  # noqa: E402
from torchmoe.data.tokenizer import build_tokenizer  # noqa: E402

pytestmark = pytest.mark.integration

FAMILIES = ["llama4", "deepseek_v3", "qwen3", "gpt_oss"]
LORA = ["--lora.enable", "true", "--lora.targets", '["attention", "experts", "router"]', "--lora.rank", "4",
        "--lora.alpha", "8"]
KINDS = {"llama4": ["--model.load_balance_coeff", "0"],  # its export has no place for the bias (docs/checkpoints.md)
         "deepseek_v3": [], "qwen3": [*LORA, "--lora.checkpoint_base", "true"],
         "gpt_oss": [*LORA, "--lora.export", "merged", "--lora.dropout", "0.25",
                     "--training.loss_on", "last"]}  # harmony: not prefix-stable
PROMPT = "the sum?"


class Run(NamedTuple):
    dump: Path
    start: Path
    """Where the folder it started from is now (qwen3's was moved after training)."""
    records: dict[int, dict]
    """metrics.jsonl by step."""

    @property
    def export(self) -> Path:
        return self.dump / "checkpoint" / "step-2-hf"


def _train(family: str, start: Path, data: Path, dump: Path, *extra: str) -> int:
    """Two steps of chat SFT from `start` into `dump`: lr 0.01 from the first step, each step
    saved and validated on the first batch of the chat file, the export written at the end."""
    job = dump.parent / f"{dump.name}.toml"
    job.write_text("[compile]\nenable = false\n[metrics]\nenable_tensorboard = false\n")
    source = (["--model.hf_assets_path", str(start)] if family == "qwen3" else
              ["--checkpoint.initial_load_path", str(start), "--model.tokenizer_path", str(start)])
    return cli.main([
        "train", "--config", str(job), *source, "--checkpoint.initial_load_in_hf", "true",
        "--training.dataset", "chat", "--training.dataset_path", str(data), "--training.seq_len", "96",
        "--training.local_batch_size", "2", "--training.steps", "2", "--training.mixed_precision_param", "float32",
        "--optimizer.lr", "0.01", "--lr_scheduler.warmup_steps", "0", "--validation.enable", "true",
        "--validation.freq", "1", "--validation.steps", "1", "--validation.dataset", "chat",
        "--validation.dataset_path", str(data), "--validation.local_batch_size", "2", "--validation.seq_len", "96",
        "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.last_save_in_hf", "true",
        "--metrics.log_freq", "1", "--job.dump_folder", str(dump), *KINDS[family], *extra])


def _records(dump: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("runs")
    data = write_chat_file(root / "chat.jsonl")
    found = {}
    for family in FAMILIES:
        start = chat_checkpoint(family, root / f"{family}-start")
        assert _train(family, start, data, root / family) == 0
        if family == "qwen3":  # every reader must do without it: the run kept base/
            start = start.rename(root / "qwen3-moved")
        found[family] = Run(root / family, start, _records(root / family))
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_of_the_run_is_its_own_validation_loss(family: str, runs: dict[str, Run], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`torchmoe eval --job.dump_folder RUN` (no job file: the run's config.toml) evaluates the
    run's step-2 as it trained (a full fine-tuning's weights; a LoRA run's adapters over its
    base) on the validation batch: the run's own validation loss after step 2, bit for bit,
    which step 2 moved away from step 1's."""
    run = runs[family]
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--job.dump_folder", str(run.dump), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["checkpoint"] == str(run.dump / "checkpoint" / "step-2")
    assert result["loss"] == run.records[2]["validation_loss"], (result, run.records)
    assert abs(run.records[2]["validation_loss"] - run.records[1]["validation_loss"]) > 1e-4
    printed = capsys.readouterr().out
    assert printed.startswith(f"validation loss {result['loss']:.6f} ") and \
        f"over 1 batch, {result['targets']} targets in {result['documents']} conversations of chat" in printed, printed


def test_a_lora_run_is_read_without_its_dropout(runs: dict[str, Run], tmp_path: Path) -> None:
    """The gpt_oss run trained its adapters with dropout; its validation (and so `eval` of its
    checkpoint) reads the model as it is, without dropout: the loss of its merged export, a whole
    model without adapters, evaluated on the same batch (within 1e-5: W + s B A summed first)."""
    run = runs["gpt_oss"]
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--config", str(run.dump / "config.toml"), "--checkpoint", str(run.export),
                     "--out", str(out)]) == 0
    assert json.loads(out.read_text())["loss"] == pytest.approx(run.records[2]["validation_loss"], rel=1e-5, abs=0)


def _reference(run: Run, family: str) -> transformers.PreTrainedModel:
    """The run's export in transformers, fp32: the model itself, or (qwen3's adapter) PEFT's
    adapter over the folder the run started from."""
    if family == "qwen3":
        base = transformers.AutoModelForCausalLM.from_pretrained(run.start, dtype=torch.float32)
        return peft.PeftModel.from_pretrained(base, run.export).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(run.export, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_chat_continues_as_the_export_does_in_transformers(family: str, runs: dict[str, Run],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`torchmoe generate --job.dump_folder RUN --chat` (greedy) prints the prompt rendered by the
    run's chat template and the tokens transformers' own greedy `generate` picks from the run's
    export (with PEFT for an adapter), stopping at the same end of turn."""
    run = runs[family]
    assert cli.main(["generate", "--job.dump_folder", str(run.dump), "--chat", "--prompt", PROMPT,
                     "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    template = ChatTemplate.load(run.export)
    turn = [{"role": "user", "content": PROMPT}]
    prompt = template.tokens(turn, add_generation_prompt=True)
    tokenizer = build_tokenizer(str(run.export))
    with torch.no_grad():
        ids = _reference(run, family).generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                               eos_token_id=tokenizer.eos_id)[0, len(prompt):].tolist()
    assert ids and printed == template.text(turn, add_generation_prompt=True) + tokenizer.decode(ids) + "\n", \
        (printed, ids)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_of_the_run_s_step_writes_its_export(family: str, runs: dict[str, Run], tmp_path: Path) -> None:
    """`torchmoe convert dcp-to-hf RUN/checkpoint/step-2 OUT` writes the run's own step-2-hf:
    the same tensors bit for bit, the same config.json (the folder's fields kept) and files."""
    run = runs[family]
    out = tmp_path / "out"
    assert cli.main(["convert", "dcp-to-hf", str(run.dump / "checkpoint" / "step-2"), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in run.export.iterdir())
    ours, theirs = _tensors(out), _tensors(run.export)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("config.json", "generation_config.json", "adapter_config.json"):
        if (out / name).exists():
            assert json.loads((out / name).read_text()) == json.loads((run.export / name).read_text()), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_keeps_the_folder_s_settings_and_stops_at_its_end_of_turn(family: str, runs: dict[str, Run],
                                                                            tmp_path: Path) -> None:
    """The export (qwen3's adapter run: its merged model by convert, its folder gone, the run's
    base/ standing for it) holds every field of the folder's config.json with its value (the
    special tokens' ids, `router_aux_loss_coef`, Moonlight's own fields; the dtype in transformers
    4's spelling too, as written: float32, not the folder's bfloat16) and its
    generation_config.json byte for byte; transformers' `generate` on it stops at the folder's
    end of turn: with that token made likely (the output row of the third greedy token, doubled),
    it ends there, before its token limit."""
    run = runs[family]
    export = run.export
    if family == "qwen3":
        export = tmp_path / "merged"
        assert cli.main(["convert", "dcp-to-hf", str(run.dump / "checkpoint" / "step-2"), str(export),
                         "--lora-export", "merged"]) == 0
    base = json.loads((run.start / "config.json").read_text())
    written = json.loads((export / "config.json").read_text())
    assert {k: written.get(k) for k in base if k != "torch_dtype"} == {k: v for k, v in base.items()
                                                                       if k != "torch_dtype"}
    assert base["torch_dtype"] == "bfloat16" and written["torch_dtype"] == written["dtype"] == "float32"
    assert (export / "generation_config.json").read_bytes() == (run.start / "generation_config.json").read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    stops = model.generation_config.eos_token_id
    assert stops == json.loads((run.start / "generation_config.json").read_text())["eos_token_id"]
    assert model.config.eos_token_id == base["eos_token_id"] == stops[0]
    prompt = torch.tensor([ChatTemplate.load(export).tokens([{"role": "user", "content": PROMPT}],
                                                            add_generation_prompt=True)])
    with torch.no_grad():
        free = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, prompt.shape[1]:]
        assert len(free) == 12 and not set(free[:3].tolist()) & set(stops)  # the three tokens the change decides
        head = model.get_output_embeddings().weight
        head[stops[0]] = 2 * head[free[2]]
        ids = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert len(ids) <= 3 and ids[-1] == stops[0] and stops[0] not in ids[:-1], ids


@pytest.mark.parametrize(("family", "problem"), [
    ("deepseek_v3", "holds no config.json here, and {ckpt} keeps no copy of it: the model the run trained (its "
                    "config.json's) cannot be built fix: restore the folder the run started from there, or use the "
                    "run's Hugging Face export {ckpt}/step-2-hf, which describes the model itself; "),
    ("gpt_oss", "is gone, and {ckpt} holds no copy of the frozen base (lora.checkpoint_base was false): the run's "
                "adapters cannot be put back on their base fix: restore the folder the run started from there; "),
])
def test_every_reader_of_a_run_whose_folder_is_gone_says_so(family: str, problem: str, runs: dict[str, Run],
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A copy of the run whose config.toml names a folder that is gone (no base/: full
    fine-tuning has none, the gpt_oss LoRA run kept none): eval, generate, convert, report and a
    resume are each exit 2 naming checkpoint.initial_load_path, its path and the fix (the run's
    own export, which holds the model whole, where there is one); nothing is written."""
    run = runs[family]
    copy, gone = tmp_path / "run", tmp_path / "gone"
    shutil.copytree(run.dump, copy)
    (copy / "config.toml").write_text((copy / "config.toml").read_text().replace(str(run.start), str(gone)))
    ckpt = copy / "checkpoint"
    before = sorted(p for p in copy.rglob("*"))
    step = str(ckpt / "step-2")
    for argv in (["eval", "--job.dump_folder", str(copy)], ["generate", "--checkpoint", step, "--prompt", "x"],
                 ["convert", "dcp-to-hf", step, str(tmp_path / "out")], ["report", str(copy)],
                 ["train", "--config", str(copy / "config.toml"), "--job.dump_folder", str(copy),
                  "--training.steps", "3"]):
        assert cli.main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert err.count("error:") == 1 and f'checkpoint.initial_load_path = "{gone}": ' in err, (argv, err)
        assert problem.format(ckpt=ckpt) in err, (argv, err)
    assert sorted(p for p in copy.rglob("*")) == before and not (tmp_path / "out").exists()


def test_a_lora_checkpoint_on_another_base_is_refused(runs: dict[str, Run], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The gpt_oss run's config.toml pointed at a copy of its folder with one weight changed by one
    ulp: eval and generate of its step-2 are exit 2 naming checkpoint.initial_load_path, the folder
    and the tensor that differs (the fingerprint the step recorded), as a resume is."""
    run = runs["gpt_oss"]
    changed, copy = tmp_path / "changed", tmp_path / "run"
    shutil.copytree(run.start, changed)
    weights = load_file(changed / "model.safetensors")
    name = "model.layers.2.self_attn.o_proj.weight"
    weights[name][3, 4] = torch.nextafter(weights[name][3, 4], torch.tensor(float("inf")))
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(run.dump, copy)
    (copy / "config.toml").write_text((copy / "config.toml").read_text().replace(str(run.start), str(changed)))
    for argv in (["eval", "--job.dump_folder", str(copy)],
                 ["generate", "--job.dump_folder", str(copy), "--prompt", "x"]):
        assert cli.main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert err.count("error:") == 1 and (
            f'checkpoint.initial_load_path = "{changed}": holds other base weights than the run\'s checkpoints were '
            "trained on (1 of ") in err and "e.g. layers.2.attention.wo.weight)" in err, (argv, err)


def test_an_adapter_folder_goes_on_its_base(runs: dict[str, Run], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The qwen3 run's adapter export as `--checkpoint`: on the folder `--base` names, or its
    adapter_config.json's base_model_name_or_path, generate writes what the run's own checkpoint
    does and eval (the run's job for the data) gives the run's validation loss, bit for bit. A base
    that is a hub id, none, no Hugging Face folder, or given for a whole model is one message
    naming --base; an adapter of part of a target (PEFT's on some projections) one naming it."""
    run = runs["qwen3"]
    sample = ["--chat", "--prompt", PROMPT, "--max-new-tokens", "6"]
    assert cli.main(["generate", "--job.dump_folder", str(run.dump), *sample]) == 0
    expected = capsys.readouterr().out
    adapter = tmp_path / "adapter"
    shutil.copytree(run.export, adapter)
    assert cli.main(["generate", "--checkpoint", str(adapter), "--base", str(run.start), *sample]) == 0
    assert capsys.readouterr().out == expected
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--config", str(run.dump / "config.toml"), "--checkpoint", str(adapter), "--base",
                     str(run.start), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["loss"] == run.records[2]["validation_loss"]
    capsys.readouterr()
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    for named in (str(run.start), f"../{run.start.name}"):  # absolute, or relative to the adapter folder
        shutil.copytree(run.start, tmp_path / run.start.name, dirs_exist_ok=True)
        config_file.write_text(json.dumps({**config, "base_model_name_or_path": named}))
        assert cli.main(["generate", "--checkpoint", str(adapter), *sample]) == 0
        assert capsys.readouterr().out == expected
    refused = {
        "Qwen/Qwen3-30B-A3B": ('--base = "(not given)": --checkpoint {adapter} is a PEFT adapter whose '
                               'adapter_config.json names base_model_name_or_path = "Qwen/Qwen3-30B-A3B", which is no '
                               "Hugging Face folder here (torchmoe fetches nothing from the hub) fix: pass --base "
                               "FOLDER"),
        None: ('--base = "(not given)": --checkpoint {adapter} is a PEFT adapter, and its adapter_config.json names no '
               "base (base_model_name_or_path is null) fix: pass --base FOLDER"),
    }
    for named, message in refused.items():
        config_file.write_text(json.dumps({**config, "base_model_name_or_path": named}))
        assert cli.main(["generate", "--checkpoint", str(adapter), *sample]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert err.count("error:") == 1 and message.format(adapter=adapter) in err, err
    config_file.write_text(json.dumps(config))
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".layers.1.self_attn.k_proj." not in k},
              adapter / "adapter_model.safetensors")
    for argv, message in (
            (["--checkpoint", str(adapter), "--base", str(run.start)],
             f'--checkpoint = "{adapter}": adapts part of what lora.targets "attention" adapts (22 of its 24 tensors; '
             "it lacks e.g. base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight), and torchmoe adapts "
             "whole targets fix: merge it into its base with PEFT"),
            (["--checkpoint", str(adapter), "--base", str(tmp_path)],
             f'--base = "{tmp_path}": holds no config.json: it is not a Hugging Face model folder'),
            (["--checkpoint", str(runs["llama4"].export), "--base", str(run.start)],
             f'--base = "{run.start}": names the base of a PEFT adapter folder, and --checkpoint '
             f"{runs['llama4'].export} is none (no adapter_config.json): it holds a whole model "
             "fix: leave --base out")):
        assert cli.main(["generate", *argv, *sample]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert err.count("error:") == 1 and message in err, err


def test_eval_of_a_hugging_face_folder_reads_chat_data_with_its_tokenizer(runs: dict[str, Run], tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`eval --checkpoint` of the llama4 run's export (a folder of no flavor, its tokenizer in
    it) with a job naming another tokenizer (DeepSeek's template and specials): the chat data is
    rendered by the folder's tokenizer, so the loss is the run's validation loss, bit for bit;
    the note says the tokenizer was the folder's."""
    run = runs["llama4"]
    other = runs["deepseek_v3"].start
    job = tmp_path / "job.toml"
    job.write_text((run.dump / "config.toml").read_text().replace(f'tokenizer_path = "{run.start}"',
                                                                  f'tokenizer_path = "{other}"'))
    assert f'tokenizer_path = "{other}"' in job.read_text()
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--config", str(job), "--checkpoint", str(run.export), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["loss"] == run.records[2]["validation_loss"]
    err = " ".join(capsys.readouterr().err.split())
    assert f'model.tokenizer_path = "{run.export}"' in err and err.count("note:") == 1, err


def test_eval_of_one_pass_says_what_its_mean_covers(runs: dict[str, Run], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`--batches -1` reads one pass and says how many batches, targets and conversations its
    mean is over (and --out holds them); `--batches N` of that many batches is the same mean."""
    run = runs["deepseek_v3"]
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--job.dump_folder", str(run.dump), "--split", "train", "--batches", "-1",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert (f"over {result['batches_read']} batches (one pass), {result['targets']} targets in "
            f"{result['documents']} conversations of chat") in printed, printed
    assert result["batches_read"] >= 2 and 0 < result["documents"] <= len(CHAT_ROWS) < result["targets"]
    assert cli.main(["eval", "--job.dump_folder", str(run.dump), "--split", "train", "--batches",
                     str(result["batches_read"]), "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert (again["loss"], again["targets"], again["documents"]) == (result["loss"], result["targets"],
                                                                     result["documents"])


def test_the_lora_run_resumes_without_its_folder(runs: dict[str, Run], tmp_path: Path) -> None:
    """The qwen3 run's step-1 resumed from its config.toml (model.hf_assets_path now gone: the
    base, its config.json and the tokenizer come from base/): step 2's loss and gradient norm
    are the uninterrupted run's, bit for bit."""
    run = runs["qwen3"]
    resumed = start_from(run.dump / "checkpoint" / "step-1", tmp_path / "resumed")
    shutil.copytree(run.dump / "checkpoint" / "base", resumed / "checkpoint" / "base")
    assert cli.main(["train", "--config", str(run.dump / "config.toml"), "--job.dump_folder", str(resumed)]) == 0
    again = _records(resumed)[2]
    assert (again["loss"], again["grad_norm"]) == (run.records[2]["loss"], run.records[2]["grad_norm"])
