"""The shipped configs of the families beyond Llama 4: each plans its GPU job with the published
parameter counts, and trains on one CPU process with a flavor of its family as the only change.

    python -m pytest -q tests/integration/test_family_configs.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torchmoe.commands import cli
from torchmoe.run_folders.run_lock import LOCK_NAMES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# (file, ranks, the dry run's parameter line: Qwen/Qwen3-30B-A3B's published 30.5B / 3.3B;
# DeepSeek-V2-Lite's 15.7B, whose shapes torchtitan's DeepSeek-V3 16B has)
PLANS = [("qwen3_30b_a3b.toml", 64, "parameters: total 30.53 B, active 3.35 B"),
         ("deepseek_v3_16b.toml", 64, "parameters: total 15.71 B, active 2.66 B"),
         ("deepseek_v3_16b_muon.toml", 64, "parameters: total 15.71 B, active 2.66 B"),
         ("gpt_oss_20b.toml", 16, "parameters: total 20.91 B, active 3.61 B")]
# (file, a flavor of its family small enough for the suite: torchtitan's Qwen3 debugmodel_moe takes
# ~37 s here in CI, its 316 M parameters' initialisation and AdamW state; docs/models.md has its
# runs. DeepSeek-V3's debugmodel (33 M) and gpt-oss's (81 M) are the ones the files' comments
# name; document masking on for every family (gpt-oss's sinks and windows within documents); the
# Muon file's EP 8 set to 1 and Newton-Schulz in fp32, as its comment's CPU line says: bf16 NS
# took 100-460 s here.)
DEBUG_FLAVORS = [("qwen3_30b_a3b.toml", "tiny", True, []), ("deepseek_v3_16b.toml", "debugmodel", True, []),
                 ("deepseek_v3_16b_muon.toml", "debugmodel", True,
                  ["--parallelism.expert_parallel_degree", "1", "--optimizer.ns_dtype", "float32"]),
                 ("gpt_oss_20b.toml", "debugmodel", True, [])]


@pytest.mark.parametrize(("name", "world_size", "expected"), PLANS)
def test_each_config_plans_its_gpu_job(name: str, world_size: int, expected: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--config", str(CONFIGS / name), "--dry-run", "--world-size", str(world_size),
                     "--job.dump_folder", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert expected in " ".join(out.split()), out
    assert "fits:" in out and "error:" not in err, err


@pytest.mark.parametrize(("name", "flavor", "masking", "flags"), DEBUG_FLAVORS)
def test_each_config_trains_on_one_cpu_process_with_a_small_flavor(name: str, flavor: str, masking: bool,
                                                                   flags: list[str], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The file as shipped (bf16 autocast, full AC, its optimizer: AdamW or Muon, its data and
    tokenizer) on one process with a flavor of its family as the one change (and the Muon file's
    CPU flags, as its comment gives them): one step of 256 tokens, no compile and no
    checkpoint, for time; with document masking, whose varlen kernel is no autocast op (Qwen3's
    q/k norms handed it fp32 queries beside bf16 values under autocast: a crash)."""
    assert cli.main(["train", "--config", str(CONFIGS / name), "--model.flavor", flavor, "--training.steps", "1",
                     "--training.seq_len", "256", "--compile.enable", "false", "--checkpoint.enable", "false",
                     "--training.document_masking", str(masking).lower(), "--metrics.log_freq", "1",
                     *flags, "--job.dump_folder", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and 0 < record["loss"] < 20 and record["grad_norm"] > 0
    # A Muon file's opening lines show the split (`Optimization.description`); AdamW's show none.
    muon = 'name = "Muon"' in (CONFIGS / name).read_text()
    split = re.findall(r"^(Muon|AdamW): \d+ tensors, [\d,]+ elements$", capsys.readouterr().out, re.MULTILINE)
    assert split == (["Muon", "AdamW"] if muon else [])


@pytest.fixture(scope="module")
def qwen3_weights(tmp_path_factory) -> tuple[Path, Path]:
    """(a Hugging Face folder, a bare DCP folder: no run's config.toml) of Qwen3-MoE tiny weights."""
    from torchmoe.arch.qwen3 import FLAVORS
    from torchmoe.commands.convert import hf_to_dcp
    from torchmoe.hf import save_model
    from torchmoe.models.decoder.model import Transformer

    folder = tmp_path_factory.mktemp("qwen3")
    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed=1)
    save_model(model, folder / "hf")
    hf_to_dcp(folder / "hf", folder / "dcp")
    return folder / "hf", folder / "dcp"


LLAMA4_JOB = ["--config", str(CONFIGS / "debug_model.toml"), "--training.steps", "1"]
# Qwen3-MoE weights where a Llama 4 model is expected: the family is wrong, not the flavor or the
# folder. (command, its flags; {hf}/{dcp}: the folders, {tmp}: a scratch folder).
OTHER_FAMILY = {
    "train_from_hf": (["train", *LLAMA4_JOB, "--checkpoint.initial_load_path", "{hf}", "--checkpoint.initial_load_in_hf",
                       "true", "--job.dump_folder", "{tmp}/run"],
                      'model.name = "llama4": checkpoint.initial_load_path {hf} holds a Qwen3-MoE model (qwen3), not a '
                      'Llama 4 one', "fix: pass --model.name qwen3 --model.flavor tiny"),
    "train_from_dcp": (["train", *LLAMA4_JOB, "--checkpoint.initial_load_path", "{dcp}", "--job.dump_folder", "{tmp}/run"],
                       'model.name = "llama4": checkpoint.initial_load_path {dcp} holds a qwen3 model (its tensors fit '
                       "qwen3's tiny), not a llama4 one", "fix: pass --model.name qwen3 --model.flavor tiny"),
    "generate_from_dcp": (["generate", *LLAMA4_JOB, "--checkpoint", "{dcp}", "--prompt", "x"],
                          'model.name = "llama4": --checkpoint {dcp} holds a qwen3 model',
                          "fix: pass --model.name qwen3 --model.flavor tiny"),
    "convert_dcp": (["convert", "dcp-to-hf", "{dcp}", "{tmp}/out", "--model-name", "llama4", "--flavor", "tiny"],
                    '--model-name = "llama4": {dcp} holds a qwen3 model', "fix: pass --model-name qwen3 --flavor tiny"),
}


@pytest.mark.parametrize("case", list(OTHER_FAMILY))
def test_weights_of_another_family_name_it(tmp_path: Path, capsys: pytest.CaptureFixture[str], qwen3_weights,
                                           case: str) -> None:
    """Qwen3-MoE weights given to a Llama 4 job: one error (exit 2, nothing written) that names
    model.name (the family, not the flavor), the family the weights hold and the flags for it."""
    argv, *expected = OTHER_FAMILY[case]
    names = {"hf": qwen3_weights[0], "dcp": qwen3_weights[1], "tmp": tmp_path}
    assert cli.main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert all(e.format(**names) in err for e in expected), err
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name not in LOCK_NAMES]  # nothing written


# A [model] section naming the family or the flavor the way another tool or family does: the
# setting that is wrong is named, with what it means here.
NAMES = {
    ("qwen3_moe", "tiny"): ('model.name = "qwen3_moe"', 'did you mean "qwen3"? set model.name = "qwen3"'),
    ("Qwen3MoeForCausalLM", "tiny"): ('model.name = "Qwen3MoeForCausalLM"', 'did you mean "qwen3"?'),
    ("deepseekv3", "tiny"): ('model.name = "deepseekv3"', 'did you mean "deepseek_v3"?'),
    ("gpt-oss", "tiny"): ('model.name = "gpt-oss"', 'did you mean "gpt_oss"?'),
    ("llama4_text", "tiny"): ('model.name = "llama4_text"', 'did you mean "llama4"?'),
    ("kimi_k2", "tiny"): ('model.name = "kimi_k2"', 'did you mean "deepseek_v3"?'),
    ("llama3", "tiny"): ('model.name = "llama3"', "train this model family with torchtitan"),
    ("scout", "tiny"): ('model.name = "scout"', '"scout" is a flavor of "llama4": set model.name = "llama4" and '
                        'model.flavor = "scout"'),
    ("qwen3", "scout"): ('model.flavor = "scout": not a flavor of model.name = "qwen3" but of "llama4"',
                         'qwen3\'s flavors: "tiny", "debugmodel_moe", "30B-A3B", "235B-A22B"; or set model.name = '
                         '"llama4" to train its "scout"'),
    ("gpt_oss", "16B"): ('model.flavor = "16B": not a flavor of model.name = "gpt_oss" but of "deepseek_v3"',
                         'or set model.name = "deepseek_v3" to train its "16B"'),
    ("qwen3", "debugmodel"): ('not a flavor of model.name = "qwen3" but of "llama4" and "deepseek_v3" and "gpt_oss"',
                              'did you mean "debugmodel_moe"?'),
    ("gpt_oss", "20B"): ('model.flavor = "20B": not a flavor of model.name = "gpt_oss"', 'did you mean "20b"?'),
}


@pytest.mark.parametrize(("command", "name", "flavor"), [(c, *k) for k in NAMES for c in ("train", "generate")])
def test_a_family_or_flavor_named_otherwise_is_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          run_dir: Path, command: str, name: str, flavor: str) -> None:
    """train (checked before the model is built) and generate of a run's weights, with the flags
    asked for by name (a KeyError traceback before)."""
    job = ["--dry-run", "--job.dump_folder", str(tmp_path)] if command == "train" else \
        ["--prompt", "x", "--job.dump_folder", str(run_dir)]
    argv = [command, "--config", str(CONFIGS / "debug_model.toml"), "--model.name", name, "--model.flavor", flavor,
            *job]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert all(text in err for text in NAMES[name, flavor]), err


@pytest.mark.parametrize(("change", "message", "fix"), [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "its config.json cannot be used: quantization_config is set: the weights are quantized", None),
    ({"n_group": 3}, 'its config.json sets "n_group": 3, does not divide the 8 experts (n_routed_experts) into '
     "groups of 2 or more", 'set "n_group" in'),
    # Valid, but routing as the flavor the job names does not (a field no tensor shape shows): the
    # job's claim about the folder is wrong (leaving the flavor out trains the folder's model).
    ({"n_group": 2, "routed_scaling_factor": 1.0}, 'model.flavor = "tiny": contradicts checkpoint.initial_load_path',
     "its config.json differs from the flavor in n_group 2 (the flavor: 4), routed_scaling_factor 1.0 (the flavor: "
     "2.5) fix: leave model.flavor out of the job (--model.flavor none drops the job file's): the folder decides "
     "the model"),
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
    assert fix is None or fix in " ".join(err.split()), err
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


def test_gpt_oss_refuses_flex_attention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 and one message naming the key, the value and the fix; planned as for a GPU job
    (`--dry-run`), so the refusal comes before any process group or model."""
    assert cli.main(["train", "--config", str(CONFIGS / "gpt_oss_20b.toml"), "--model.attn_backend", "flex",
                     "--training.device", "cuda", "--dry-run", "--world-size", "2",
                     "--job.dump_folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "model.attn_backend = \"flex\": model.name = \"gpt_oss\" attends with sinks and sliding windows; " \
           "FlexAttention's block masks do not carry the sinks" in " ".join(err.split()), err
    assert 'fix: use model.attn_backend = "sdpa"' in err, err


def test_gpt_oss_plans_context_parallel_and_document_masking(tmp_path: Path) -> None:
    """gpt-oss's shipped SFT job (chat data: document masking on) on 16 ranks with cp 2: the dry
    run plans it (exit 0). Its sliding-window layers (window 128, pieces of 1024 tokens) wait for
    one halo of 127 keys per sequence on each rank, its full layers gather."""
    assert cli.main(["train", "--config", str(CONFIGS / "gpt_oss_20b_sft.toml"), "--model.flavor", "20b",
                     "--dry-run", "--world-size", "16", "--parallelism.context_parallel_degree", "2",
                     "--job.dump_folder", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "dry_run.json").read_text())
    modes = plan["context_parallel"]["modes"]
    assert modes["halo"]["layers"] == list(range(0, 24, 2)) and modes["global"]["layers"] == list(range(1, 24, 2))
    kv_per_token = 2 * 2 * 8 * 64  # (k, v) x bf16 bytes x kv heads x head dim
    sequences = 32 // 8  # the global batch over dp = 16 / cp
    assert modes["halo"]["bytes_per_step"] == 12 * 2 * sequences * 127 * kv_per_token  # forward and backward


@pytest.mark.parametrize(("config", "flags", "message", "fix"), [
    ("qwen3_30b_a3b.toml", [],
     "optimizer.qk_clip_threshold = 100.0: qwen3's attention normalises every layer's queries and keys (QK-norm), "
     "which bounds its logits: QK-Clip has nothing to clip", "fix: set it to 0"),
    ("deepseek_v3_16b_muon.toml", ["--parallelism.context_parallel_degree", "2"],
     "optimizer.qk_clip_threshold = 100.0: context parallelism splits each row's queries and keys between ranks",
     "fix: set parallelism.context_parallel_degree = 1, or optimizer.qk_clip_threshold = 0"),
    ("deepseek_v3_16b_muon.toml", ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"],
     "optimizer.qk_clip_threshold = 100.0: replica groups would each clip by their own rows' logits",
     "fix: set fault_tolerance.enable = false"),
    ("deepseek_v3_lora_sft.toml", ["--world-size", "128", "--model.flavor", "671B"],
     "optimizer.qk_clip_threshold = 100.0: LoRA freezes the query and key weights",
     "fix: set it to 0 for LoRA"),
    ("deepseek_v3_16b.toml", ["--optimizer.qk_clip_threshold", "-1"], "optimizer.qk_clip_threshold = -1.0: must be 0 "
     "(off) or a finite logit >= 0.01", "fix: use 0 to turn QK-Clip off"),
])
def test_qk_clip_refuses_what_it_cannot_clip(config: str, flags: list[str], message: str, fix: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Planned as for a GPU job (`--dry-run`, 64 ranks unless said): refused before any process group or model."""
    world = [] if "--world-size" in flags else ["--world-size", "64"]
    assert cli.main(["train", "--config", str(CONFIGS / config), "--optimizer.qk_clip_threshold", "100", *flags,
                     "--dry-run", *world, "--job.dump_folder", str(tmp_path)]) == 2
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
    (["--model.mtp_layers", "1", "--model.mtp_loss_coeff", "nan"], "model.mtp_loss_coeff = nan: must be >= 0",
     "fix: use a non-negative weight"),
    # the weight of no module (`config.dependent_keys`)
    (["--model.mtp_loss_coeff", "0.3"], "--model.mtp_loss_coeff = 0.3: has no effect: it only matters with "
     "model.mtp_layers > 0", "fix: add --model.mtp_layers 1, or drop --model.mtp_loss_coeff"),
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


# (fine-tuning file, the tiny checkpoint's family, its tokenizer fixture, the flags beyond the
# folder and the chat file: one process's layout).
SFT_CONFIGS = [("qwen3_30b_a3b_lora_sft.toml", "qwen3", "chatml", []),
               ("gpt_oss_20b_sft.toml", "gpt_oss", "harmony", []),
               ("deepseek_v3_lora_sft.toml", "deepseek_v3", "deepseek",
                ["--parallelism.pipeline_parallel_degree", "1", "--parallelism.expert_parallel_degree", "1"])]


def _tiny_folder(family: str, tokenizer: str, folder: Path) -> Path:
    """A tiny random checkpoint of `family` by transformers, with a chat fixture's tokenizer in it."""
    import shutil

    from tests.any_checkpoint import save_checkpoint
    from tests.chat_fixtures import HARMONY, HARMONY_SPECIALS, chatml, deepseek, tokenizer_folder

    made = {"chatml": lambda f: chatml(f, marked=False), "deepseek": lambda f: deepseek(f, marked=True),
            "harmony": lambda f: tokenizer_folder(f, HARMONY, HARMONY_SPECIALS, eos="<|return|>")}[tokenizer]
    tok = made(folder / "tokenizer")
    save_checkpoint(family, folder / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, folder / "model" / name)
    return folder / "model"


@pytest.mark.parametrize(("name", "family", "tokenizer", "flags"), SFT_CONFIGS)
def test_each_fine_tuning_config_trains_on_one_cpu_process_from_a_tiny_checkpoint(
        name: str, family: str, tokenizer: str, flags: list[str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The fine-tuning file as shipped (its chat data settings, loss mask, masking, bf16, full AC)
    on one process with a tiny checkpoint folder of its family and a small chat file as the
    changes: two steps of 256 tokens (no compile, no checkpoint, for time); the closing line
    reports the chat rows."""
    from tests.chat_jobs import write_chat_file

    folder = _tiny_folder(family, tokenizer, tmp_path / "tiny")
    data = write_chat_file(tmp_path / "chat.jsonl")
    assert cli.main(["train", "--config", str(CONFIGS / name), "--model.hf_assets_path", str(folder),
                     "--training.dataset_path", str(data), *flags, "--training.steps", "2",
                     "--training.seq_len", "256", "--training.local_batch_size", "1", "--training.global_batch_size",
                     "2", "--compile.enable", "false", "--checkpoint.enable", "false", "--metrics.log_freq", "1",
                     "--job.dump_folder", str(tmp_path / "run")]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(0 < r["loss"] < 20 and r["grad_norm"] > 0 for r in records)
    assert "chat data on this rank: data: " in capsys.readouterr().err


@pytest.mark.parametrize(("family", "tokenizer"), [("qwen3", "chatml"), ("gpt_oss", "harmony"),
                                                   ("deepseek_v3", "deepseek"), ("llama4", "chatml")])
def test_the_cpu_fine_tuning_recipe_runs_with_the_folder_and_the_chat_file_as_its_only_changes(
        family: str, tokenizer: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """configs/lora_sft_cpu.toml as its comment runs it: the folder and the chat file are the only
    changes (and, for time, two steps instead of 50); the model is the folder's, LoRA trains, the
    opening line is the recipe's own, and the export is a Hugging Face folder. Harmony's template
    is not prefix-stable across turns: the recipe's first run is refused with the fix its comment
    gives (`--training.loss_on last`), which then trains."""
    from tests.chat_jobs import write_chat_file

    folder = _tiny_folder(family, tokenizer, tmp_path / "tiny")
    data = write_chat_file(tmp_path / "chat.jsonl")
    run = tmp_path / "run"
    argv = ["train", "--config", str(CONFIGS / "lora_sft_cpu.toml"), "--model.hf_assets_path", str(folder),
            "--training.dataset_path", str(data), "--training.steps", "2", "--job.dump_folder", str(run)]
    if tokenizer == "harmony":
        assert cli.main(argv) == 2 and not (run / "metrics.jsonl").exists()
        assert 'fix: set training.loss_on = "last"' in " ".join(capsys.readouterr().err.split())
        assert "--training.loss_on last" in (CONFIGS / "lora_sft_cpu.toml").read_text()
        argv += ["--training.loss_on", "last"]
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(0 < r["loss"] < 20 and r["grad_norm"] > 0 for r in records)
    import math

    from torch.distributed.checkpoint import FileSystemReader

    shown = capsys.readouterr()
    lines = (shown.out + shown.err).splitlines()
    assert "chat SFT with LoRA on a CPU" in lines
    assert any(re.fullmatch(rf"training {family} \S+ \(.*\) on 1 x cpu: steps 1-2, 4,096 tokens each; .*", line)
               for line in lines)
    # What the opening says trains is what the checkpoint holds: the adapters, counted there.
    saved = FileSystemReader(str(run / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    adapters = sum(math.prod(m.size) for key, m in saved.items() if key.startswith("model.") and ".lora_" in key)
    said = next(line for line in lines if line.startswith("LoRA rank 8 (alpha 16) on attention, experts: "))
    count = re.search(r": ([\d.]+) (K|M) adapter parameters train; the base's .* are frozen$", said)
    assert count is not None and adapters > 0
    assert float(count[1]) * {"K": 1e3, "M": 1e6}[count[2]] == pytest.approx(adapters, rel=5e-3)
    assert (run / "checkpoint" / "step-2-hf" / "config.json").is_file()
