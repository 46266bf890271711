"""An export is the model that was trained. Every family, trained briefly with its defaults (its
tiny flavor, one CPU process, fp32), writes a Hugging Face folder (`checkpoint.last_save_in_hf`)
that `torchmoe eval` scores exactly as it scores the run's own checkpoint, and that transformers
runs with the checkpoint's logits; or the run is refused by name before it trains. What a
family's Hugging Face model cannot hold (Llama 4's, Qwen3-MoE's and gpt-oss's have no place for
the aux-loss-free expert bias) is refused on every path that writes a folder (the training run,
a run that loads a checkpoint holding a bias, `torchmoe convert`, `torchmoe.hf.save_model`)
unless the lossy export is asked for by name, and then it evaluates to another loss.

    python -m pytest -q -m integration tests/integration/test_export_is_the_trained_model.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers import DEBUG_CONFIG, SHORT_DOCUMENTS  # noqa: E402
from tests.hf_parity import max_rel_err, random_tokens  # noqa: E402
from torchmoe.arch.registry import FLAVORS  # noqa: E402
from torchmoe.checkpoints.checkpoint_state import load_model_only  # noqa: E402
from torchmoe.commands import cli  # noqa: E402
from torchmoe.models.decoder.model import Transformer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

# Three steps of 8 x 64 tokens, warmup 2 (the LR moves), a checkpoint at the end and its export.
RUN = ["--config", DEBUG_CONFIG, "--model.flavor", "tiny", "--training.seq_len", "64", *SHORT_DOCUMENTS]
TRAIN = [*RUN, "--training.steps", "3", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
         "--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true"]
# Each family's transformers class.
HF_CLASSES = {"qwen3": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
              "llama4": "Llama4ForCausalLM"}


def _eval(family: str, weights: Path, out: Path) -> float:
    """`torchmoe eval`'s loss of `weights` on the training corpus's first two batches."""
    assert cli.main(["eval", *RUN, "--model.name", family, "--checkpoint", str(weights), "--split", "train",
                     "--batches", "2", "--out", str(out)]) == 0
    return json.loads(out.read_text())["loss"]


def _checkpoint_model(family: str, step_dir: Path) -> Transformer:
    """The tiny flavor of `family` holding a step-N checkpoint's weights (CPU, fp32)."""
    with torch.device("meta"):
        model = Transformer(FLAVORS[family]["tiny"])
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    load_model_only(step_dir, [model])
    return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Each family that exports by default, trained with its defaults: its run folder."""
    runs = {}
    for family in ("qwen3", "deepseek_v3", "gpt_oss"):
        runs[family] = tmp_path_factory.mktemp(family)
        assert cli.main(["train", *TRAIN, "--model.name", family, "--job.dump_folder", str(runs[family])]) == 0
    return runs


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "gpt_oss"])
def test_the_export_of_a_default_run_evaluates_to_its_checkpoint_s_loss(family, trained, tmp_path):
    """The same fp32 weights through the same code: `torchmoe eval` of the export equals that of
    the checkpoint to the last bit, and transformers' model of the export gives the checkpoint's
    logits (1e-5). DeepSeek-V3 trains its expert bias (e_score_correction_bias in the folder);
    Qwen3-MoE and gpt-oss train none (their released recipe: the balance loss instead)."""
    run = trained[family] / "checkpoint"
    assert _eval(family, run / "step-3-hf", tmp_path / "hf.json") == _eval(family, run / "step-3",
                                                                            tmp_path / "dcp.json")
    ours = _checkpoint_model(family, run / "step-3")
    bias = torch.stack([moe.expert_bias for moe in ours.moe_layers()])
    assert (bias.abs().max() > 0) == (family == "deepseek_v3")
    theirs = getattr(transformers, HF_CLASSES[family]).from_pretrained(run / "step-3-hf").eval()
    tokens = random_tokens(ours.args.vocab_size, 96)
    with torch.no_grad():
        assert max_rel_err(theirs(tokens).logits, ours(tokens)) <= 1e-5


@pytest.mark.parametrize(("family", "flags", "title"), [
    ("llama4", [], "Llama 4"),  # Llama 4's default: the bias at 0.001, as torchtitan trains it
    ("qwen3", ["--model.load_balance_coeff", "0.001"], "Qwen3-MoE"),
    ("gpt_oss", ["--model.load_balance_coeff", "0.01"], "gpt-oss"),
])
def test_a_run_training_a_bias_its_export_cannot_hold_is_refused_before_it_trains(
        family, flags, title, tmp_path, capsys):
    status = cli.main(["train", *TRAIN, "--model.name", family, *flags, "--job.dump_folder", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    value = "0.01" if family == "gpt_oss" else "0.001"
    assert (f"model.load_balance_coeff = {value}: trains the aux-loss-free expert bias, which Hugging Face {title} "
            "has no place for: checkpoint.last_save_in_hf = true would write a model that selects other experts "
            "than the one trained (another loss)") in " ".join(err.split()), err
    assert ("fix: set model.load_balance_coeff = 0 (balance with model.aux_loss_coeff instead), or "
            "checkpoint.hf_drop_expert_bias = true to export without the bias") in " ".join(err.split()), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_lossy_export_asked_for_by_name_routes_otherwise(tmp_path, capsys):
    """Llama 4 with a bias (0.05: routing moves within a few steps; after 4 the bias is non-zero,
    where at this seed the sign updates of steps 1-3 cancel) and `hf_drop_expert_bias`: the
    run exports, warning; its folder evaluates to another loss than its checkpoint. Every other
    path that writes that model refuses it by name: a run loading the checkpoint (before it
    trains), `torchmoe convert dcp-to-hf` (unless --drop-expert-bias), `torchmoe.hf.save_model`
    (unless drop_expert_bias=True)."""
    from torchmoe.config import ConfigError
    from torchmoe.hf import save_model

    run = tmp_path / "lossy"
    with pytest.warns(UserWarning, match=r"is not representable in Hugging Face Llama 4 and is dropped "
                                         r"\(checkpoint.hf_drop_expert_bias\)"):
        assert cli.main(["train", *TRAIN, "--model.name", "llama4", "--model.load_balance_coeff", "0.05",
                         "--training.steps", "4", "--checkpoint.hf_drop_expert_bias", "true",
                         "--job.dump_folder", str(run)]) == 0
    capsys.readouterr()
    step = run / "checkpoint" / "step-4"
    exported, kept = _eval("llama4", step.with_name("step-4-hf"), tmp_path / "a.json"), _eval(
        "llama4", step, tmp_path / "b.json")
    assert abs(exported - kept) > 1e-4, (exported, kept)

    # A run that starts from it and would export it: refused before its first step.
    status = cli.main(["train", *TRAIN, "--model.name", "llama4", "--model.load_balance_coeff", "0",
                       "--checkpoint.initial_load_path", str(step), "--job.dump_folder", str(tmp_path / "next")])
    err = " ".join(capsys.readouterr().err.split())
    assert status == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert f'checkpoint.initial_load_path = "{step}": its model\'s expert_bias (max |bias| ' in err, err
    assert ("has no place in Hugging Face Llama 4, and checkpoint.last_save_in_hf = true would write the trained "
            "model without it (selecting other experts) fix: set checkpoint.hf_drop_expert_bias = true") in err, err
    assert not (tmp_path / "next" / "metrics.jsonl").exists()

    convert = ["convert", "dcp-to-hf", str(step), str(tmp_path / "hf"), "--model-name", "llama4", "--flavor", "tiny"]
    assert cli.main(convert) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("error:") == 1 and "--drop-expert-bias = false: the model's expert_bias (max |bias| " in err, err
    assert "fix: pass --drop-expert-bias to write the model without its expert bias" in err, err
    assert not (tmp_path / "hf").exists()
    assert cli.main([*convert, "--drop-expert-bias"]) == 0
    assert "warning: expert_bias (max |bias|" in capsys.readouterr().err
    assert _eval("llama4", tmp_path / "hf", tmp_path / "c.json") == exported

    model = _checkpoint_model("llama4", step)
    with pytest.raises(ConfigError, match="drop_expert_bias = false: the model's expert_bias"):
        save_model(model, tmp_path / "api")
    assert not (tmp_path / "api").exists()
    with pytest.warns(UserWarning, match="dropped"):
        save_model(model, tmp_path / "api", drop_expert_bias=True)
