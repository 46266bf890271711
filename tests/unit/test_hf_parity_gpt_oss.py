"""Logits parity with transformers' GptOssForCausalLM, both directions, per feature; the released
MXFP4 experts dequantised on load (checked against transformers' own dequantisation); the family
detected from config.json's model_type; what the model cannot represent refused naming the field."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

from tests.hf_parity import (  # noqa: E402
    assert_bf16_parity,
    assert_our_model_loads_in_transformers,
    assert_round_trip,
    max_rel_err,
    mxfp4_folder,
    mxfp4_pack,
    mxfp4_values,
    perturb_constant_inits,
    random_tokens,
)
from torchmoe.arch.gpt_oss import FLAVORS  # noqa: E402
from torchmoe.hf import HFConversionError, load_model  # noqa: E402
from torchmoe.hf_files import mxfp4  # noqa: E402
from torchmoe.models.decoder.model import Transformer  # noqa: E402
from torchmoe.models.gpt_oss.hf import args_from_hf_config, hf_config_from_args  # noqa: E402
from torchmoe.models.hf_config_spec import HFConfigValueError  # noqa: E402
from torchmoe.weights.flavor_fit import matching_flavor  # noqa: E402
from torchmoe.weights.weight_files import UnreadableWeights  # noqa: E402

_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 16, "rope_theta": 150000.0}
_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
             max_position_embeddings=256, sliding_window=8, rope_parameters=_YARN, rms_norm_eps=1e-5)

# Each case turns on an option: the released layer pattern (even layers sliding) with YaRN unrounded
# and a window shorter than the rows; the clamp active (a limit the activations cross) with another
# gain; a window longer than a chunk of the row and other layers sliding, under plain RoPE; no
# window at all; MHA with tied embeddings and a rounded YaRN ramp.
CASES = {
    "released_pattern": dict(),
    "clamped": dict(swiglu_limit=0.3, swiglu_alpha=1.2),
    "odd_layers_slide_plain_rope": dict(sliding_window=13, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0},
                                        layer_types=["full_attention", "sliding_attention"] * 2),
    "no_window": dict(layer_types=["full_attention"] * 4),
    "tied_mha_rounded_yarn": dict(tie_word_embeddings=True, num_key_value_heads=4,
                                  rope_parameters={**_YARN, "truncate": True}),
}


def _hf_model(overrides: dict, seed: int = 0) -> GptOssForCausalLM:
    """A random gpt-oss whose biases and sinks are drawn large enough to matter (transformers
    starts them at zero or at std 0.02)."""
    torch.manual_seed(seed)
    model = perturb_constant_inits(GptOssForCausalLM(GptOssConfig(**{**_BASE, **overrides})).eval())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_torchmoe_and_back_fp32(case, tmp_path):
    assert_round_trip(_hf_model(CASES[case]), tmp_path, family="gpt_oss", vocab=_BASE["vocab_size"])


def test_sinks_window_and_clamp_each_change_the_logits(tmp_path):
    """What the parity above rests on: each gpt-oss feature moves the logits far beyond the bound,
    so a model without it could not pass."""
    hf = _hf_model(CASES["clamped"])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    tokens = random_tokens(_BASE["vocab_size"])
    with torch.no_grad():
        ref = ours(tokens)
        for layer in ours.layers.values():
            layer.attention.sinks.fill_(-1e4)
        assert max_rel_err(ref, ours(tokens)) > 1e-2
    for change in ({"sliding_layers": []}, {"swiglu_limit": 100.0}):
        other = load_model(tmp_path / "hf")
        other.args = other.args.replace(**change)
        variant = Transformer(other.args)
        variant.load_state_dict(other.state_dict())
        with torch.no_grad():
            assert max_rel_err(ref, variant.eval()(tokens)) > 1e-3, change


def test_torchmoe_to_hf_from_our_init(tmp_path):
    """From our own initialisation of the test flavor (window 8 over rows of 96): transformers'
    model built from the config.json we write computes the same logits."""
    ours = Transformer(FLAVORS["tiny"])
    ours.init_weights(seed=3)
    with torch.no_grad():  # ones and zeros at init: perturb what a swap or a dropped op would hide
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    assert_our_model_loads_in_transformers(ours, GptOssForCausalLM, tmp_path / "hf")


def test_bf16_parity(tmp_path):
    assert_bf16_parity(_hf_model(CASES["released_pattern"]), tmp_path / "hf", _BASE["vocab_size"], 3e-2)


# ---- the released MXFP4 experts -----------------------------------------------------------------


def test_dequantize_is_transformers_dequantisation():
    """Random bytes and exponents: our values are transformers' (`convert_moe_packed_tensors`,
    which also returns them input-major) exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 134, (3, 10, 4), dtype=torch.uint8, generator=generator)
    ours = mxfp4.dequantize(blocks, scales)  # (E, out, in)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out)
    assert ours.shape == (3, 10, 128)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=0, atol=0)


def test_released_mxfp4_experts_load_dequantised(tmp_path):
    """A checkpoint in the releases' form (expert matrices as blocks and scales, quantization_config
    mxfp4) loads as the unquantised model computes: transformers' model with the same values."""
    cfg = dict(CASES["released_pattern"], intermediate_size=64)
    hf = _hf_model(cfg)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in hf.model.layers:
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)  # (E, in, out)
                param.copy_(mxfp4_values((param.shape[0], param.shape[2], param.shape[1]), generator).transpose(1, 2))
    hf.save_pretrained(tmp_path / "hf")
    mxfp4_folder(tmp_path / "hf", tmp_path / "hf")

    ours = load_model(tmp_path / "hf")
    tokens = random_tokens(_BASE["vocab_size"])
    with torch.no_grad():
        assert max_rel_err(hf(tokens).logits, ours(tokens)) <= 1e-5
        torch.testing.assert_close(ours.layers["1"].moe.experts.w13,
                                   hf.model.layers[1].mlp.experts.gate_up_proj.transpose(1, 2), rtol=0, atol=0)


def test_mxfp4_parts_of_the_wrong_shape_are_refused(tmp_path):
    hf = _hf_model(dict(intermediate_size=64))
    hf.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    blocks, scales = mxfp4_pack(torch.zeros(weights[name].transpose(1, 2).shape))
    del weights[name]
    weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks[:, :-1].contiguous(), scales[:, :-1].contiguous()
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnreadableWeights, match=r"down_proj_blocks is uint8 \(6, 63, 2, 16\); MXFP4 of"):
        load_model(tmp_path / "hf")


def _packed_folder(tmp_path, name: str, scale: int | None = None, nibble: int | None = None, **edits) -> None:
    """A gpt-oss folder whose expert tensor `name` is MXFP4-packed, with its first scale byte set
    to `scale` (and its first block's bytes to `nibble`), and the tensors of `edits` replaced."""
    hf = _hf_model(dict(intermediate_size=64))
    hf.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    values = mxfp4_values(tuple(weights[name].transpose(1, 2).shape), torch.Generator().manual_seed(0))
    blocks, scales = mxfp4_pack(values)
    if scale is not None:
        scales[0, 0, 0] = scale
    if nibble is not None:
        blocks[0, 0, 0] = nibble
    del weights[name]
    weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    weights.update(edits)
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})


_UP = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("nibble", [0x00, 0x11, 0x77])
def test_a_scale_byte_of_0xff_is_nan_and_refused(tmp_path, nibble):
    """E8M0's 0xFF is NaN in the OCP MX spec: its block is NaN, whatever its codes (ldexp read it as
    2^128: codes of 0 loaded as 0, codes of 0.5 as a finite 1.7e38). Refused, naming the tensor."""
    _packed_folder(tmp_path, _UP, scale=0xFF, nibble=nibble)
    with pytest.raises(UnreadableWeights, match=r"the weights hold NaN or inf in model\.layers\.1\.mlp\.experts\."
                                                r"gate_up_proj \(MXFP4 blocks and scales\)"):
        load_model(tmp_path / "hf")
    blocks = torch.full((1, 16), nibble, dtype=torch.uint8)
    assert mxfp4.dequantize(blocks, torch.tensor([0xFF], dtype=torch.uint8)).isnan().all()


@pytest.mark.parametrize(("scale", "nibble", "largest"), [(0xFE, 0x22, "1.7e+38"), (250, 0x77, "6.38e+37"),
                                                     (141, 0x77, "9.83e+04")])
def test_scales_that_give_absurd_weights_are_refused(tmp_path, scale, nibble, largest):
    """Finite but absurd: a scale byte of 254 (codes of 1: 2^127) or 250 (codes of 6: 6e37)
    passed the finite check; 141 is the first whose 6 x 2^14 passes the bound."""
    _packed_folder(tmp_path, _UP, scale=scale, nibble=nibble)
    message = f"beyond ±65,536, which no trained model reaches (largest |value|: {_UP} (MXFP4 blocks and scales) " \
              f"({largest}))"
    with pytest.raises(UnreadableWeights, match=re.escape(message)):
        load_model(tmp_path / "hf")


def test_the_largest_scale_under_the_bound_loads(tmp_path):
    """A scale byte of 140 (6 x 2^13 = 49,152 at most) is within the bound: loaded as it is."""
    _packed_folder(tmp_path, _UP, scale=140, nibble=0x77)
    model = load_model(tmp_path / "hf")
    assert model.layers["1"].moe.experts.w13.abs().max() == 6 * 2.0**13


@pytest.mark.parametrize("tensor", ["model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.down_proj_bias",
                                    "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.router.bias"])
def test_sinks_biases_and_norms_beyond_the_bound_are_refused(tmp_path, tensor):
    """gpt-oss sinks of 3e38 were accepted; so were biases and norm weights as large."""
    hf = _hf_model(dict(intermediate_size=64))
    hf.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights[tensor] = weights[tensor].clone()
    weights[tensor].view(-1)[1] = -3e38
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnreadableWeights, match=rf"beyond ±65,536.*\(largest \|value\|: {tensor} \(3e\+38\)\)"):
        load_model(tmp_path / "hf")


# ---- configs ------------------------------------------------------------------------------------

# The released config.json files (openai/gpt-oss-20b, openai/gpt-oss-120b), as published.
_RELEASED = {"20b": dict(num_hidden_layers=24, num_local_experts=32),
             "120b": dict(num_hidden_layers=36, num_local_experts=128)}
_RELEASED_COMMON = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_key_value_heads": 8, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def _released(flavor: str) -> dict:
    n = _RELEASED[flavor]["num_hidden_layers"]
    return {**_RELEASED_COMMON, **_RELEASED[flavor],
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]}


@pytest.mark.parametrize("flavor", sorted(_RELEASED))
def test_released_configs_are_the_flavors(flavor):
    args = args_from_hf_config(_released(flavor))
    assert args == FLAVORS[flavor]
    assert matching_flavor(args) == flavor
    assert args_from_hf_config(hf_config_from_args(args, torch.bfloat16)) == args


@pytest.mark.parametrize(("field", "value", "message"), [
    ("quantization_config", {"quant_method": "fp8"}, "quant_method 'fp8' is not supported"),
    ("attention_bias", False, "attention_bias = false is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_type 'llama3' is not supported"),
    ("use_sliding_window", True, "unsupported GptOssConfig fields: use_sliding_window"),
])
def test_what_the_model_cannot_represent_is_refused(field, value, message):
    with pytest.raises(HFConversionError, match=message):
        args_from_hf_config({**_released("20b"), field: value})


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("num_experts_per_tok", 33, "more than the 32 experts"),
    ("layer_types", ["sliding_attention"] * 3, "has 3 entries for 24 layers"),
    ("layer_types", ["local"] * 24, "holds 'local'"),
    ("sliding_window", 0, "out of range"),
    ("swiglu_limit", "7", "a string, not a number"),
    ("num_key_value_heads", 5, "not a multiple of it"),
])
def test_bad_values_name_the_field(field, value, problem):
    with pytest.raises(HFConfigValueError) as err:
        args_from_hf_config({**_released("20b"), field: value})
    assert err.value.field == field and problem in str(err.value)


def test_export_refuses_what_hf_cannot_express():
    with pytest.raises(HFConversionError, match="cannot express these settings: num_shared_experts"):
        hf_config_from_args(FLAVORS["tiny"].replace(num_shared_experts=1), torch.float32)
