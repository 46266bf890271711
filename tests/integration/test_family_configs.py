"""The shipped configs of the families beyond Llama 4: each plans its GPU job with the published
parameter counts, and trains on one CPU process with a flavor of its family as the only change.

    python -m pytest -q tests/integration/test_family_configs.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchmoe import cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# (file, ranks, the dry run's parameter line: Qwen/Qwen3-30B-A3B's published 30.5B / 3.3B;
# DeepSeek-V2-Lite's 15.7B, whose shapes torchtitan's DeepSeek-V3 16B has)
PLANS = [("qwen3_30b_a3b.toml", 64, "parameters: total 30.53 B, active 3.35 B"),
         ("deepseek_v3_16b.toml", 64, "parameters: total 15.71 B, active 2.66 B"),
         ("gpt_oss_20b.toml", 16, "parameters: total 20.91 B, active 3.61 B")]
# (file, a flavor of its family small enough for the suite: torchtitan's Qwen3 debugmodel_moe takes
# ~37 s here in CI, its 316 M parameters' initialisation and AdamW state; docs/models.md has its
# runs. DeepSeek-V3's debugmodel (33 M) and gpt-oss's (81 M) are the ones the files' comments
# name; document masking where the family runs it: gpt-oss refuses it.)
DEBUG_FLAVORS = [("qwen3_30b_a3b.toml", "tiny", True), ("deepseek_v3_16b.toml", "debugmodel", True),
                 ("gpt_oss_20b.toml", "debugmodel", False)]


@pytest.mark.parametrize(("name", "world_size", "expected"), PLANS)
def test_each_config_plans_its_gpu_job(name: str, world_size: int, expected: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--config", str(CONFIGS / name), "--dry-run", "--world-size", str(world_size),
                     "--job.dump_folder", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert expected in " ".join(out.split()), out
    assert "fits:" in out and "error:" not in err, err


@pytest.mark.parametrize(("name", "flavor", "masking"), DEBUG_FLAVORS)
def test_each_config_trains_on_one_cpu_process_with_a_small_flavor(name: str, flavor: str, masking: bool,
                                                                   tmp_path: Path) -> None:
    """The file as shipped (bf16 autocast, full AC, AdamW, its data and tokenizer) on one process
    with a flavor of its family as the one change: one step of 256 tokens, no compile and no
    checkpoint, for time; with document masking, whose varlen kernel is no autocast op (Qwen3's
    q/k norms handed it fp32 queries beside bf16 values under autocast: a crash)."""
    assert cli.main(["train", "--config", str(CONFIGS / name), "--model.flavor", flavor, "--training.steps", "1",
                     "--training.seq_len", "256", "--compile.enable", "false", "--checkpoint.enable", "false",
                     "--training.document_masking", str(masking).lower(), "--metrics.log_freq", "1",
                     "--job.dump_folder", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and 0 < record["loss"] < 20 and record["grad_norm"] > 0


def test_weights_of_another_family_name_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Qwen3-MoE Hugging Face folder given to a Llama 4 run: one error (exit 2, nothing
    written) that names the family the folder holds and the flags that train it."""
    from torchmoe.arch.qwen3 import FLAVORS
    from torchmoe.hf import save_model
    from torchmoe.models.decoder.model import Transformer

    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed=1)
    save_model(model, tmp_path / "qwen3")
    assert cli.main(["train", "--config", str(CONFIGS / "debug_model.toml"), "--training.steps", "1",
                     "--checkpoint.initial_load_path", str(tmp_path / "qwen3"), "--checkpoint.initial_load_in_hf",
                     "true", "--job.dump_folder", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "differs from flavor 'tiny' in family" in err and "(a Qwen3-MoE model, not Llama 4)" in err, err
    assert "fix: pass --model.name qwen3 --model.flavor tiny" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("change", "message", "fix"), [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "its config.json cannot be used: quantization_config is set: the weights are quantized", None),
    ({"n_group": 3}, 'its config.json sets "n_group": 3, does not divide the 8 experts (n_routed_experts) into '
     "groups of 2 or more", 'set "n_group" in'),
    # Valid, but routing the run's flavor does not (a field no tensor shape shows).
    ({"n_group": 2, "routed_scaling_factor": 1.0}, "its config differs from flavor 'tiny' in n_group, "
     "routed_scaling_factor", "add a flavor with its architecture to torchmoe/arch/deepseek_v3.py FLAVORS"),
])
def test_a_deepseek_folder_the_model_cannot_represent_is_one_error(change: dict, message: str, fix: str | None,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A DeepSeek-V3 Hugging Face folder with fp8-quantized weights (the release's form), a bad
    value, or another routing than the flavor's: exit 2, one message naming the field, nothing
    trained."""
    from torchmoe.arch.deepseek_v3 import FLAVORS
    from torchmoe.hf import save_model
    from torchmoe.models.decoder.model import Transformer

    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed=1)
    save_model(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    assert cli.main(["train", "--config", str(CONFIGS / "deepseek_v3_16b.toml"), "--model.flavor", "tiny",
                     "--training.steps", "1", "--training.seq_len", "256",
                     "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                     "--checkpoint.initial_load_in_hf", "true", "--job.dump_folder", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err and message in " ".join(err.split()), err
    assert fix is None or fix in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_flavor_without_a_hugging_face_form_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torchtitan's DeepSeek debugmodel scores experts with softmax, which DeepseekV3ForCausalLM
    cannot: a run that would write it as a Hugging Face folder at its end, and `convert
    dcp-to-hf` of it, are refused up front (exit 2, one message), not after the training."""
    assert cli.main(["train", "--config", str(CONFIGS / "deepseek_v3_16b.toml"), "--model.flavor", "debugmodel",
                     "--checkpoint.last_save_in_hf", "true", "--training.steps", "1",
                     "--job.dump_folder", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "checkpoint.last_save_in_hf = true: the debugmodel flavor has no Hugging Face form: score_func " \
           "'softmax'" in err and "fix: set checkpoint.last_save_in_hf = false" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert cli.main(["convert", "dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--model-name",
                     "deepseek_v3", "--flavor", "16B"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and '--flavor = "16B": the 16B flavor has no Hugging Face form' in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("flags", "message", "fix"), [
    (["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
     "parallelism.context_parallel_degree = 2: model.name = \"gpt_oss\" attends with sinks and sliding windows over "
     "whole rows; context parallelism's exchanges do not carry the sinks or the window",
     "fix: set parallelism.context_parallel_degree = 1"),
    (["--training.document_masking", "true"],
     "training.document_masking = true: model.name = \"gpt_oss\" attends with sinks and sliding windows over whole "
     "rows; document masking's per-document segments do not carry the sinks or the window",
     "fix: set training.document_masking = false"),
    (["--model.attn_backend", "flex", "--training.device", "cuda"],
     "model.attn_backend = \"flex\": model.name = \"gpt_oss\" attends with sinks and sliding windows",
     'fix: use model.attn_backend = "sdpa"'),
])
def test_gpt_oss_refuses_what_its_attention_cannot_run(flags: list[str], message: str, fix: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 and one message naming the key, the value and the fix; planned as for a GPU job
    (`--dry-run`), so the refusal comes before any process group or model."""
    assert cli.main(["train", "--config", str(CONFIGS / "gpt_oss_20b.toml"), *flags,
                     "--dry-run", "--world-size", "2", "--job.dump_folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert message in " ".join(err.split()) and fix in err, err


@pytest.mark.parametrize(("flags", "message", "fix"), [
    (["--model.mtp_layers", "1", "--parallelism.context_parallel_degree", "2",
      "--parallelism.data_parallel_shard_degree", "1"],
     "parallelism.context_parallel_degree = 2: model.mtp_layers = 1 reads the tokens up to 1 positions past each "
     "one, which context parallelism places on other ranks", "fix: set parallelism.context_parallel_degree = 1"),
    (["--model.mtp_layers", "2", "--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "2"],
     "parallelism.pipeline_parallel_degree = 2: model.mtp_layers = 2 runs the first stage's embedding after the "
     "last stage's blocks", "fix: set parallelism.pipeline_parallel_degree = 1"),
    (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.mtp_layers", "1"],
     "model.mtp_layers = 1: multi-token prediction is DeepSeek-V3's; the qwen3 family has no place for its layers",
     'fix: set model.mtp_layers = 0, or model.name = "deepseek_v3"'),
    (["--model.mtp_layers", "-1"], "model.mtp_layers = -1: must be >= 0",
     "fix: use 0 to disable multi-token prediction"),
    (["--model.mtp_loss_coeff", "nan"], "model.mtp_loss_coeff = nan: must be >= 0", "fix: use a non-negative weight"),
])
def test_multi_token_prediction_refuses_what_it_cannot_run(flags: list[str], message: str, fix: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 and one message naming the key, the value and the fix, before any process group."""
    assert cli.main(["train", "--config", str(CONFIGS / "deepseek_v3_16b.toml"), *flags,
                     "--dry-run", "--world-size", "2", "--job.dump_folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert message in " ".join(err.split()) and fix in err, err


def test_multi_token_prediction_plans_its_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The dry run of the shipped DeepSeek config with one MTP module sizes it: more parameters
    and memory per rank than without, the same active count."""
    import json

    sizes = {}
    for mtp in ("0", "1"):
        folder = tmp_path / mtp
        assert cli.main(["train", "--config", str(CONFIGS / "deepseek_v3_16b.toml"), "--model.mtp_layers", mtp,
                         "--dry-run", "--world-size", "64", "--job.dump_folder", str(folder)]) == 0
        sizes[mtp] = json.loads((folder / "dry_run.json").read_text())
    capsys.readouterr()
    plain, mtp = sizes["0"], sizes["1"]
    assert mtp["params_total"] == plain["params_total"] + mtp["params_mtp"] > plain["params_total"]
    assert mtp["params_active"] == plain["params_active"] and plain["params_mtp"] == 0
    assert mtp["flops_per_token"] > plain["flops_per_token"]
    assert mtp["memory_per_rank_gib"]["total"] > plain["memory_per_rank_gib"]["total"]
