"""Logits parity with transformers' DeepseekV3ForCausalLM, both directions, per feature; the family
detected from config.json's model_type; the released config.json is the 671B flavor; what the
model cannot represent refused naming the field."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from tests.hf_parity import (  # noqa: E402
    assert_bf16_parity,
    assert_our_model_loads_in_transformers,
    assert_round_trip,
    max_rel_err,
    perturb_constant_inits,
    random_tokens,
)
from torchmoe.arch.deepseek_v3 import FLAVORS  # noqa: E402
from torchmoe.hf import HFConversionError, load_model  # noqa: E402
from torchmoe.models.decoder.model import Transformer  # noqa: E402
from torchmoe.models.deepseek_v3.hf import args_from_hf_config, hf_config_from_args  # noqa: E402
from torchmoe.models.hf_config_spec import HFConfigValueError  # noqa: E402
from torchmoe.weights.flavor_fit import matching_flavor  # noqa: E402

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
             first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
             v_head_dim=10, max_position_embeddings=256, rope_parameters=_YARN, rms_norm_eps=1e-6)

# Each case turns on an option: the released form (query bottleneck, groups, YaRN with its
# softmax scale, values narrower than keys), a full-rank query, no groups and raw gates, YaRN's
# rotation magnitude (mscale != mscale_all_dim), plain RoPE, half-split RoPE, every layer MoE
# with two shared experts, tied embeddings.
CASES = {
    "released_form": {},
    "full_rank_query_no_groups": dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                      routed_scaling_factor=1.0),
    "yarn_magnitude": dict(rope_parameters={**_YARN, "mscale": 0.8, "mscale_all_dim": 0.6}),
    "plain_rope_half_pairs": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rope_interleave=False),
    "all_moe_two_shared_tied": dict(first_k_dense_replace=0, n_shared_experts=2, tie_word_embeddings=True,
                                    num_experts_per_tok=3, topk_group=3),
}


def _hf_model(overrides: dict, seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    return perturb_constant_inits(DeepseekV3ForCausalLM(DeepseekV3Config(**{**_BASE, **overrides})).eval())


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_torchmoe_and_back_fp32(case, tmp_path):
    assert_round_trip(_hf_model(CASES[case]), tmp_path, family="deepseek_v3", vocab=_BASE["vocab_size"])


def test_the_expert_bias_is_hf_e_score_correction_bias(tmp_path):
    """The aux-loss-free bias only selects: a changed bias changes the logits through the experts
    chosen, on both sides, and loads into `moe.expert_bias`."""
    hf = _hf_model({})
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    stored = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(ours.layers["1"].moe.expert_bias, stored)
    tokens = random_tokens(_BASE["vocab_size"])
    with torch.no_grad():
        before = ours(tokens)
        ours.layers["1"].moe.expert_bias.mul_(-20)
        stored.mul_(-20)
        after = ours(tokens)
        assert max_rel_err(before, after) > 1e-3
        assert max_rel_err(hf(tokens).logits, after) <= 1e-5


def test_torchmoe_to_hf_from_our_init(tmp_path):
    """From our own initialisation of the test flavor: transformers' model built from the
    config.json we write computes the same logits, and the folder reads back as the flavor."""
    torch.manual_seed(0)
    ours = Transformer(FLAVORS["tiny"])
    ours.init_weights(seed=3)
    with torch.no_grad():  # ones and zeros at init: perturb what a swap or a dropped op would hide
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for moe in ours.moe_layers():
            moe.expert_bias.normal_(0, 0.05)
    assert_our_model_loads_in_transformers(ours, DeepseekV3ForCausalLM, tmp_path / "hf")


def test_bf16_parity(tmp_path):
    # HF routes from fp32 router weights too.
    assert_bf16_parity(_hf_model({}), tmp_path / "hf", _BASE["vocab_size"], 3e-2)


# deepseek-ai/DeepSeek-V3's config.json as published (transformers 4 spelling: rope_scaling, the
# auto_map of its remote code, fp8 quantization removed as a bf16 conversion does).
_RELEASED = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_the_released_config_is_the_671b_flavor():
    args = args_from_hf_config(_RELEASED)
    assert args.mtp_layers == 1 and args.replace(mtp_layers=0) == FLAVORS["671B"]  # its MTP layer 61
    assert matching_flavor(args) == "671B"
    assert args_from_hf_config(hf_config_from_args(args, torch.bfloat16)) == args
    counts = args.param_counts()  # the published "671B total, 37B activated" (MTP module aside)
    assert (counts["total"] - counts["mtp"], counts["active"]) == (671_026_404_352, 37_552_282_624)


def test_kimi_k2s_config_reads_as_deepseek_v3():
    """moonshotai/Kimi-K2's config.json (model_type kimi_k2: 384 experts in one group, 64 heads,
    YaRN x32 on theta 50000): the published 1T total / 32B activated parameters."""
    kimi = {**_RELEASED, "model_type": "kimi_k2", "n_routed_experts": 384, "num_attention_heads": 64,
            "num_key_value_heads": 64, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 2.827, "vocab_size": 163840, "num_nextn_predict_layers": 0,
            "rope_theta": 50000.0, "max_position_embeddings": 131072,
            "rope_scaling": {**_RELEASED["rope_scaling"], "factor": 32.0, "beta_fast": 1.0}}
    args = args_from_hf_config(kimi)
    assert (args.family, args.num_experts, args.n_group, args.routed_scaling_factor) == ("deepseek_v3", 384, 1, 2.827)
    counts = args.param_counts()
    assert (counts["total"], counts["active"]) == (1_026_408_209_408, 32_861_477_888)


def test_multi_token_prediction_layers_load_or_are_skipped(tmp_path):
    """transformers' own folders announce one MTP layer (num_nextn_predict_layers defaults to 1)
    and hold none: they load as the causal LM. A folder with the MTP layer (model.layers.{n_layers}.*,
    as released, with its copies of the embedding and head) loads it, and a model without MTP
    skips it: its tensors are not "tensors this model has no place for"."""
    from safetensors.torch import load_file, save_file

    from torchmoe.hf import load_hf_weights

    hf = _hf_model({})
    hf.save_pretrained(tmp_path / "hf")
    assert hf.config.num_nextn_predict_layers == 1 and load_model(tmp_path / "hf").args.mtp_layers == 0
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights.update({k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in weights.items()
                    if k.startswith("model.layers.2.")})
    weights.update({"model.layers.3.eh_proj.weight": torch.randn(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
                    "model.layers.3.hnorm.weight": torch.ones(64), "model.layers.3.shared_head.norm.weight": torch.ones(64),
                    "model.layers.3.embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
                    "model.layers.3.shared_head.head.weight": weights["lm_head.weight"].clone()})
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(tmp_path / "hf")
    assert ours.args.mtp_layers == 1 and torch.equal(ours.mtp["3"].eh_proj.weight, weights["model.layers.3.eh_proj.weight"])
    tokens = random_tokens(_BASE["vocab_size"])
    without = Transformer(ours.args.replace(mtp_layers=0))
    load_hf_weights(without.state_dict(), tmp_path / "hf", without.args, key="hf_dir", fix="")
    with torch.no_grad():
        assert max_rel_err(hf(tokens).logits, ours(tokens)) <= 1e-5
        assert torch.equal(without(tokens), ours(tokens))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}, "dequantise them to bf16"),
    ("scoring_func", "softmax", "scoring_func 'softmax' is not supported"),
    ("topk_method", "greedy", "topk_method 'greedy' is not supported"),
    ("moe_layer_freq", 2, "moe_layer_freq 2 is not supported"),
    ("attention_bias", True, "attention_bias = true is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_type 'linear' is not supported"),
    ("index_topk", 2048, "unsupported DeepseekV3Config fields: index_topk"),
])
def test_what_the_model_cannot_represent_is_refused(field, value, message):
    with pytest.raises(HFConversionError, match=message):
        args_from_hf_config({**_RELEASED, field: value})


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("num_key_value_heads", 8, "one key and value per query head"),
    ("n_group", 7, "does not divide the 256 experts"),
    ("topk_group", 9, "of n_group 8 cannot hold"),
    ("qk_rope_head_dim", 63, "is odd"),
    ("kv_lora_rank", "512", "a string, not an integer"),
    ("routed_scaling_factor", 0, "out of range"),
    ("head_dim", 128, "disagrees with qk_rope_head_dim (64)"),
    ("n_routed_experts", 2**20, "out of range"),
])
def test_bad_values_name_the_field(field, value, problem):
    with pytest.raises(HFConfigValueError) as err:
        args_from_hf_config({**_RELEASED, field: value})
    assert err.value.field == field and problem in str(err.value)


def test_export_refuses_what_hf_cannot_express():
    with pytest.raises(HFConversionError, match="scores experts with sigmoid only"):
        hf_config_from_args(FLAVORS["16B"], torch.bfloat16)
    with pytest.raises(HFConversionError, match="cannot express these settings: score_before_experts"):
        hf_config_from_args(FLAVORS["tiny"].replace(score_before_experts=True), torch.float32)
