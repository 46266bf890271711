"""Logits parity with transformers' Qwen3MoeForCausalLM, both directions, per feature; the family
detected from config.json's model_type; what the model cannot represent refused naming the field."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from tests.hf_parity import (  # noqa: E402
    assert_bf16_parity,
    assert_our_model_loads_in_transformers,
    assert_round_trip,
    perturb_constant_inits,
)
from torchmoe.arch.qwen3 import FLAVORS  # noqa: E402
from torchmoe.hf import HFConversionError  # noqa: E402
from torchmoe.models.decoder.model import Transformer  # noqa: E402
from torchmoe.models.hf_config_spec import HFConfigValueError  # noqa: E402
from torchmoe.models.qwen3.hf import args_from_hf_config, hf_config_from_args  # noqa: E402
from torchmoe.weights.flavor_fit import matching_flavor  # noqa: E402

_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
             max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             rms_norm_eps=1e-6)

# Each case turns on an option: top-k renormalised or not, dense layers by mlp_only_layers and by
# decoder_sparse_step, tied embeddings, a head size other than hidden / heads, plain MHA.
CASES = {
    "norm_topk": dict(norm_topk_prob=True),
    "raw_topk_dense_first": dict(norm_topk_prob=False, mlp_only_layers=[0]),
    "sparse_step_2": dict(decoder_sparse_step=2, norm_topk_prob=True, num_experts_per_tok=3),
    "tied_mha_wide_heads": dict(tie_word_embeddings=True, num_key_value_heads=4, head_dim=24, norm_topk_prob=True,
                                mlp_only_layers=[3]),
}


def _hf_model(overrides: dict, seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return perturb_constant_inits(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**_BASE, **overrides})).eval())


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_torchmoe_and_back_fp32(case, tmp_path):
    assert_round_trip(_hf_model(CASES[case]), tmp_path, family="qwen3", vocab=_BASE["vocab_size"])


def test_torchmoe_to_hf_from_our_init(tmp_path):
    """From our own initialisation of the test flavor (a dense first layer, norm_topk_prob):
    transformers' model built from the config.json we write computes the same logits."""
    torch.manual_seed(0)
    ours = Transformer(FLAVORS["tiny"])
    ours.init_weights(seed=3)
    with torch.no_grad():  # ones and zeros at init: perturb what a swap or a dropped op would hide
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    assert_our_model_loads_in_transformers(ours, Qwen3MoeForCausalLM, tmp_path / "hf")


def test_bf16_parity(tmp_path):
    assert_bf16_parity(_hf_model(CASES["norm_topk"]), tmp_path / "hf", _BASE["vocab_size"], 2e-2)


# The released config.json files (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B), as published.
_RELEASED = {
    "30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4),
    "235B-A22B": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                      num_attention_heads=64, num_key_value_heads=4),
}
_RELEASED_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize("flavor", sorted(_RELEASED))
def test_released_configs_are_the_flavors(flavor):
    args = args_from_hf_config({**_RELEASED_COMMON, **_RELEASED[flavor]})
    assert args == FLAVORS[flavor]
    assert matching_flavor(args) == flavor
    assert args_from_hf_config(hf_config_from_args(args, torch.bfloat16)) == args


@pytest.mark.parametrize(("field", "value", "message"), [
    ("use_sliding_window", True, "use_sliding_window = true is not supported"),
    ("attention_bias", True, "attention_bias = true is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope_type 'yarn' is not supported"),
    ("moe_router_jitter", 0.1, "unsupported Qwen3MoeConfig fields: moe_router_jitter"),
])
def test_what_the_model_cannot_represent_is_refused(field, value, message):
    with pytest.raises(HFConversionError, match=message):
        args_from_hf_config({**_RELEASED_COMMON, **_RELEASED["30B-A3B"], field: value})


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("num_experts_per_tok", 129, "more than the 128 experts"),
    ("mlp_only_layers", [0, 48], "holds 48, not a layer index from 0 to 47"),
    ("num_key_value_heads", 5, "not a multiple of it"),
    ("moe_intermediate_size", "768", "a string, not an integer"),
    ("norm_topk_prob", 1, "an integer, not true or false"),
    ("num_local_experts", 64, "differs from num_experts (128)"),
    ("rms_norm_eps", float("nan"), "not a finite number"),
    ("decoder_sparse_step", 0, "out of range"),
])
def test_bad_values_name_the_field(field, value, problem):
    with pytest.raises(HFConfigValueError) as err:
        args_from_hf_config({**_RELEASED_COMMON, **_RELEASED["30B-A3B"], field: value})
    assert err.value.field == field and problem in str(err.value)


def test_export_refuses_what_hf_cannot_express():
    with pytest.raises(HFConversionError, match="cannot express these settings: num_shared_experts"):
        hf_config_from_args(FLAVORS["tiny"].replace(num_shared_experts=1), torch.float32)
