"""Any released checkpoint of a family torchmoe trains, not only the shipped flavors: a run from a
Hugging Face folder builds the model its config.json describes (`weight_sources.folder_model`).

    python -m pytest -q tests/unit/test_any_checkpoint.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.any_checkpoint import CONFIGS, ODD_SHAPES, VOCAB, reference_model, save_checkpoint
from tests.hf_parity import max_rel_err, random_tokens
from torchmoe.arch.registry import FolderModel, model_args_from_config
from torchmoe.config import ConfigError, load_job_config
from torchmoe.models.decoder.model import Transformer
from torchmoe.weight_sources.folder_model import with_folder_model
from torchmoe.weight_sources.initial_load import load_initial_weights
from torchmoe.weights.flavor_fit import matching_flavor

FAMILIES = sorted(CONFIGS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("any")
    return {family: save_checkpoint(family, root / family) for family in FAMILIES}


def _resolved(folder: Path, *flags: str, check: bool = True):
    """The job of `flags` starting from `folder`, its model built from it (`check`: as `torchmoe
    train` builds it, the keys the flags set checked against the folder)."""
    set_keys: set[str] = set()
    cfg = load_job_config(["--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", str(folder),
                           *flags], set_keys=set_keys)
    return with_folder_model(cfg, set_keys=set_keys if check else None)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_folder_builds_the_model_with_transformers_logits(family: str, folders: dict[str, Path]) -> None:
    """The folder's config.json, of sizes no flavor has, is the model: its family and
    architecture, the weights loaded as `torchmoe train` loads them, transformers' logits (fp32)."""
    cfg = _resolved(folders[family])
    assert isinstance(cfg.model, FolderModel) and cfg.model.name == family and cfg.model.flavor == family
    args = model_args_from_config(cfg.model)
    assert matching_flavor(args) is None
    assert args.architecture_differences(cfg.model.architecture) == []
    tokens = random_tokens(VOCAB)
    with torch.no_grad():
        want = reference_model(family)(tokens).logits
        got = _loaded(cfg)(tokens)
    assert max_rel_err(want, got) <= 1e-5


def _loaded(cfg) -> Transformer:
    """The job's folder model with the folder's weights, loaded as `torchmoe train` loads them."""
    args = model_args_from_config(cfg.model)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)  # the buffers; then every weight from the folder
    load_initial_weights(cfg.checkpoint, cfg.model.flavor, args, model)
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_of_any_expert_shape_gives_transformers_logits(family: str, tmp_path: Path) -> None:
    """Expert hidden sizes of 20 or 12 under model dims of 30 or 36 (`ODD_SHAPES`: no 16-byte
    rows in bf16, some not in fp32), which crashed the grouped GEMM in bf16 ("strides should be
    multiple of 16 bytes"): transformers' logits within 1e-5 in fp32 (its per-expert loop: its
    own grouped GEMM raises too), and in bf16 compute the per-expert loop's logits bit for bit.
    (bf16 against transformers would only measure bf16: it flips a near-tied routing of one
    token per row for gpt-oss here, in transformers' bf16 as in ours.)"""
    sizes = ODD_SHAPES[family]
    cfg = _resolved(save_checkpoint(family, tmp_path / family, sizes=sizes))
    args = model_args_from_config(cfg.model)
    assert args.dim == sizes["hidden_size"] and args.moe_hidden_dim == sizes.get(
        "moe_intermediate_size", sizes.get("intermediate_size"))
    model, tokens = _loaded(cfg), random_tokens(VOCAB)
    with torch.no_grad():
        assert max_rel_err(reference_model(family, **sizes)(tokens).logits, model(tokens)) <= 1e-5
        model.autocast_dtype = torch.bfloat16
        grouped = model(tokens)
        for moe in model.moe_layers():
            moe.experts.use_grouped_mm = False
        looped = model(tokens)
    assert grouped.dtype == torch.bfloat16 and torch.equal(grouped, looped)


def test_the_folder_says_what_it_holds(folders: dict[str, Path]) -> None:
    """Moonlight's form (a full-rank query, one group, plain RoPE, a dense first layer), gpt-oss
    with another window pattern, Qwen3-MoE with other head counts: each read as the file says."""
    ds = model_args_from_config(_resolved(folders["deepseek_v3"]).model)
    assert (ds.q_lora_rank, ds.n_group, ds.topk_group, ds.rope_scaling, ds.rope_theta) == (0, 1, 1, None, 50000.0)
    assert (sorted(ds.moe_layer_ids), ds.num_shared_experts, ds.routed_scaling_factor) == ([1, 2], 2, 2.446)
    oss = model_args_from_config(_resolved(folders["gpt_oss"]).model)
    assert (oss.n_layers, oss.sliding_layers, oss.sliding_window, oss.rope_scaling["factor"]) == (3, [1, 2], 4, 2.0)
    qwen = model_args_from_config(_resolved(folders["qwen3"]).model)
    assert (qwen.dim, qwen.n_heads, qwen.n_kv_heads, qwen.head_dim, qwen.num_experts) == (48, 6, 2, 8, 6)
    assert (sorted(qwen.moe_layer_ids), qwen.ffn_hidden_dim, qwen.moe_hidden_dim) == ([1, 2], 40, 24)


def test_the_job_s_training_settings_apply_to_the_folder_s_model(folders: dict[str, Path]) -> None:
    """`[model]` keys that are not the architecture (the balance losses, the kernel) still apply."""
    args = model_args_from_config(_resolved(folders["qwen3"], "--model.aux_loss_coeff", "0.25",
                                            "--model.z_loss_coeff", "0.5").model)
    assert (args.aux_loss_coeff, args.z_loss_coeff, args.dim) == (0.25, 0.5, 48)


def test_a_flavor_that_contradicts_the_folder_is_refused(folders: dict[str, Path]) -> None:
    """The job names a flavor whose architecture is not the folder's: exit 2 naming model.flavor,
    what differs and the fix (not a guess at which of the two the user meant)."""
    folder = folders["qwen3"]
    with pytest.raises(ConfigError) as caught:
        _resolved(folder, "--model.name", "qwen3", "--model.flavor", "30B-A3B")
    err = caught.value
    assert (err.key, err.value) == ("model.flavor", "30B-A3B")
    assert err.problem == (f"contradicts checkpoint.initial_load_path {folder}: its config.json differs from the "
                           "flavor in dim 48 (the flavor: 2048), n_layers 3 (the flavor: 48), n_heads 6 (the flavor: "
                           "32), n_kv_heads 2 (the flavor: 4) and 9 more")
    assert err.fix == ("leave model.flavor out of the job (--model.flavor none drops the job file's): the folder "
                       "decides the model, model.flavor sizes runs from scratch; or point "
                       "checkpoint.initial_load_path at a checkpoint of flavor 30B-A3B")


def test_none_drops_the_job_file_s_model_for_the_folder_s(folders: dict[str, Path], tmp_path: Path) -> None:
    """A shipped job file names a family and flavor; fine-tuning a folder of another size (or
    family) from it needs no edited copy: `--model.flavor none` (and `--model.name none`) leave the
    file's claim out, as the refusal above says, and the folder decides."""
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "qwen3"\nflavor = "30B-A3B"\n')
    with pytest.raises(ConfigError, match="contradicts checkpoint.initial_load_path"):
        _resolved(folders["qwen3"], "--config", str(job))
    cfg = _resolved(folders["qwen3"], "--config", str(job), "--model.flavor", "none")
    assert (cfg.model.name, cfg.model.flavor, model_args_from_config(cfg.model).dim) == ("qwen3", "qwen3", 48)
    cfg = _resolved(folders["gpt_oss"], "--config", str(job), "--model.name", "none", "--model.flavor", "none")
    assert (cfg.model.name, model_args_from_config(cfg.model).n_layers) == ("gpt_oss", 3)


def test_a_family_that_contradicts_the_folder_is_refused(folders: dict[str, Path]) -> None:
    folder = folders["qwen3"]
    with pytest.raises(ConfigError) as caught:
        _resolved(folder, "--model.name", "gpt_oss")
    err = caught.value
    assert (err.key, err.value) == ("model.name", "gpt_oss")
    assert err.problem == f"checkpoint.initial_load_path {folder} holds a Qwen3-MoE model (qwen3), not a gpt-oss one"
    assert err.fix == ("pass --model.name qwen3, or leave model.name out of the job (--model.name none drops the job "
                       "file's): the folder decides the model")


SAYS = {"llama4": 'Llama 4: "llama4" or "llama4_text"', "qwen3": 'Qwen3-MoE: "qwen3_moe"',
        "deepseek_v3": 'DeepSeek-V3: "deepseek_v3" or "kimi_k2"', "gpt_oss": 'gpt-oss: "gpt_oss"'}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_json_without_model_type_says_so(family: str, folders: dict[str, Path], tmp_path: Path) -> None:
    """A missing model_type was read as "llama4_text": a Qwen3-MoE folder's fields were then
    blamed on Llama 4. It is named missing, with the families' types and the one its
    architectures point at."""
    import json
    import shutil

    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("model_type")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        _resolved(folder)
    known = "llama4, llama4_text, qwen3_moe, deepseek_v3, kimi_k2, gpt_oss"
    assert caught.value.problem == (f'its config.json cannot be used: "model_type" is missing, so the family cannot be '
                                    f"told: add the family's, one of {known} (its architectures "
                                    f'{json.dumps(config["architectures"])} say {SAYS[family]})')
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        _resolved(folder)
    assert caught.value.problem.endswith(f"one of {known}") and "llama4_text model" not in str(caught.value)


def test_what_the_job_leaves_unset_or_names_rightly_is_no_contradiction(folders: dict[str, Path]) -> None:
    """The defaults (llama4, tiny) are no claim; the folder's own name as the flavor (what the
    run's config.toml writes) and its family are the folder's; eval and generate do not check."""
    folder = folders["gpt_oss"]
    for flags in ([], ["--model.name", "gpt_oss", "--model.flavor", "gpt_oss"]):
        assert _resolved(folder, *flags).model.name == "gpt_oss"
    assert _resolved(folder, "--model.name", "qwen3", "--model.flavor", "30B-A3B", check=False).model.name == "gpt_oss"


def test_a_job_from_scratch_keeps_its_flavor(folders: dict[str, Path], tmp_path: Path) -> None:
    """Without initial_load_in_hf the flavor sizes the run (a DCP folder or none); so does a plan
    (`absent_ok`) for a folder this machine lacks, which a run refuses."""
    cfg = load_job_config(["--model.name", "qwen3", "--checkpoint.initial_load_path", str(folders["qwen3"])])
    assert with_folder_model(cfg) is cfg and model_args_from_config(cfg.model).dim == 128
    cfg = load_job_config(["--model.name", "qwen3", "--checkpoint.initial_load_in_hf", "true",
                           "--checkpoint.initial_load_path", str(tmp_path / "elsewhere")])
    assert with_folder_model(cfg, absent_ok=True) is cfg
    with pytest.raises(ConfigError, match="No such file or directory"):  # the OS's word for the path, first
        with_folder_model(cfg)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        with_folder_model(cfg)


_GENERIC_FIX = ("use a checkpoint of a family torchmoe trains (Llama 4, Qwen3-MoE, DeepSeek-V3, gpt-oss) in a form it "
                "computes exactly (docs/models.md lists, family by family, the config.json settings it reads and "
                "those it refuses)")

# (family, config.json edits, the message's problem, its fix: None for `_GENERIC_FIX`)
REFUSED = {
    "qwen3_rope_type": ("qwen3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                        "its config.json cannot be used: rope_type 'linear' is not supported for Qwen3-MoE (only "
                        "'default')", None),
    "qwen3_attention_bias": ("qwen3", {"attention_bias": True}, "its config.json cannot be used: attention_bias = true "
                             "is not supported: Qwen3-MoE projections have no bias", None),
    "qwen3_hidden_act": ("qwen3", {"hidden_act": "gelu"}, "its config.json cannot be used: hidden_act 'gelu' is not "
                         "supported (only 'silu')", None),
    "qwen3_unknown_field": ("qwen3", {"attn_logit_softcapping": 30.0}, "its config.json cannot be used: unsupported "
                            "Qwen3MoeConfig fields: attn_logit_softcapping", None),
    "qwen3_odd_head_dim": ("qwen3", {"head_dim": 7}, 'its config.json sets "head_dim": 7, gives heads of 7 dimensions: '
                           "RoPE needs an even number", 'set "head_dim" in {folder}/config.json to an even integer'),
    "deepseek_scoring": ("deepseek_v3", {"scoring_func": "softmax"}, "its config.json cannot be used: scoring_func "
                         "'softmax' is not supported (DeepseekV3ForCausalLM runs 'sigmoid')", None),
    "deepseek_kv_heads": ("deepseek_v3", {"num_key_value_heads": 1}, 'its config.json sets "num_key_value_heads": 1, '
                          "differs from num_attention_heads (3): latent attention has one key and value per query head",
                          'set "num_key_value_heads" in {folder}/config.json to 3, or null'),
    "gpt_oss_quantized": ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, "its config.json cannot be "
                          "used: quantization_config.quant_method 'fp8' is not supported: torchmoe dequantises the "
                          "released MXFP4 experts ('mxfp4') on load; convert other quantized weights to bf16 first",
                          None),
    "gpt_oss_rope_type": ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                          "its config.json cannot be used: rope_type 'dynamic' is not supported for gpt-oss ('default' "
                          "or 'yarn')", None),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_family_cannot_represent_is_one_error_naming_the_field(case: str, tmp_path: Path) -> None:
    family, edits, problem, fix = REFUSED[case]
    folder = save_checkpoint(family, tmp_path / "hf", **edits)
    with pytest.raises(ConfigError) as caught:
        _resolved(folder)
    err = caught.value
    assert (err.key, err.value) == ("checkpoint.initial_load_path", str(folder))
    assert err.problem == problem, err.problem
    assert err.fix == (_GENERIC_FIX if fix is None else fix.format(folder=folder))


def test_an_export_keeps_what_a_release_s_config_json_says(folders: dict[str, Path], tmp_path: Path) -> None:
    """What an export of a run from a release writes (`base_files.merged_config`: the release's
    config.json under torchmoe's of the trained model), for the releases' forms the tiny folders
    lack: gpt-oss's MXFP4 folder (its quantization_config dropped: the export's weights are
    unquantized, and transformers would dequantize them again), Llama 4's multimodal folder (its
    text model's fields, the wrapper's token ids; no vision config), a transformers 4
    `torch_dtype` (the dtype written). Each reads back as the same model, in torchmoe and in
    transformers' config."""
    import json

    import transformers

    from torchmoe.hf_files.base_files import merged_config
    from torchmoe.hf_files.hf_storage import read_hf_args
    from torchmoe.models.registry import hf_mapping

    release = json.loads((folders["gpt_oss"] / "config.json").read_text())
    text = json.loads((folders["llama4"] / "config.json").read_text())
    quantized = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}  # the releases'
    releases = {
        "gpt_oss": {**release, "quantization_config": quantized, "torch_dtype": "bfloat16"},
        "llama4": {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "eos_token_id": 7,
                   "pad_token_id": 9, "image_token_index": 200092, "vision_config": {"hidden_size": 88},
                   "text_config": {k: v for k, v in text.items() if k not in ("eos_token_id", "pad_token_id")}},
    }
    for family, config in releases.items():
        args = read_hf_args(folders[family], key="k", fix="f")
        written = hf_mapping(args).hf_config_from_args(args, torch.float32)
        merged = merged_config(config, written)
        folder = tmp_path / family
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(merged))
        assert args.architecture_differences(hf_mapping(args).args_from_hf_config(merged)) == []
        assert transformers.AutoConfig.from_pretrained(folder).dtype == torch.float32
        if family == "gpt_oss":
            assert "quantization_config" not in merged and merged["torch_dtype"] == merged["dtype"] == "float32"
            assert {k: merged[k] for k in config if k not in ("quantization_config", "torch_dtype")} == \
                {k: v for k, v in config.items() if k not in ("quantization_config", "torch_dtype")}
        else:
            assert "vision_config" not in merged and "image_token_index" not in merged
            assert merged["model_type"] == "llama4_text" and (merged["eos_token_id"], merged["pad_token_id"]) == (7, 9)
            assert {k: merged[k] for k in config["text_config"]} == config["text_config"]
