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
    gpt_oss               LoRA (merged export), without base/

    python -m pytest -q tests/integration/test_reading_a_run.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file

peft = pytest.importorskip("peft")
import transformers  # noqa: E402

from tests.chat_jobs import CHAT_ROWS, chat_checkpoint, write_chat_file  # noqa: E402
from tests.helpers import start_from  # noqa: E402
from torchmoe.commands import cli  # noqa: E402
from torchmoe.data.chat_template import ChatTemplate  # noqa: E402
from torchmoe.data.tokenizer import build_tokenizer  # noqa: E402

pytestmark = pytest.mark.integration

FAMILIES = ["llama4", "deepseek_v3", "qwen3", "gpt_oss"]
LORA = ["--lora.enable", "true", "--lora.targets", '["attention", "experts", "router"]', "--lora.rank", "4",
        "--lora.alpha", "8"]
KINDS = {"llama4": ["--model.load_balance_coeff", "0"], "deepseek_v3": [], "qwen3": [*LORA, "--lora.checkpoint_base", "true"],
         "gpt_oss": [*LORA, "--lora.export", "merged", "--training.loss_on", "last"]}  # harmony: not prefix-stable
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
