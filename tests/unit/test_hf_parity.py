"""Logits parity with transformers' Llama4ForCausalLM, both directions, per feature."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Llama4ForCausalLM, Llama4TextConfig  # noqa: E402

from tests.hf_parity import max_rel_err, perturb_constant_inits  # noqa: E402
from torchmoe.hf import HFConversionError, load_model, save_model  # noqa: E402
from torchmoe.models.llama4 import FLAVORS, Transformer  # noqa: E402
from torchmoe.models.llama4.hf import args_from_hf_config, hf_config_from_args  # noqa: E402
from torchmoe.weights.flavor_fit import matching_flavor  # noqa: E402

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=256,
             rope_parameters=_LLAMA3_ROPE)

# Each case turns on a feature; sequences (40 tokens) are longer than the attention chunk (16, and
# 12 which does not divide 40) and than the temperature-tuning floor scale (8).
CASES = {
    "scout_like": dict(interleave_moe_layer_step=1, attention_chunk_size=16, no_rope_layer_interval=2,
                       floor_scale=8, attn_scale=0.1),
    "maverick_like": dict(interleave_moe_layer_step=2, use_qk_norm=False, attention_chunk_size=12,
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, floor_scale=8),
    "top2_explicit_layers": dict(num_experts_per_tok=2, moe_layers=[0, 3], no_rope_layers=[1, 0, 1, 1],
                                 attention_chunk_size=None, attn_temperature_tuning=False),
    "tied_full_attention": dict(tie_word_embeddings=True, attention_chunk_size=None, floor_scale=4,
                                attn_scale=0.5, num_key_value_heads=4),
}


def _hf_model(overrides: dict, seed: int = 0) -> Llama4ForCausalLM:
    torch.manual_seed(seed)
    model = Llama4ForCausalLM(Llama4TextConfig(**{**_BASE, **overrides})).eval()
    return perturb_constant_inits(model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_torchmoe_and_back_fp32(case, tmp_path):
    hf = _hf_model(CASES[case])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    tokens = torch.randint(0, _BASE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == (2, 40, _BASE["vocab_size"])
    assert max_rel_err(ref, got) <= 1e-5

    save_model(ours, tmp_path / "back")
    hf_back = Llama4ForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert max_rel_err(got, hf_back(tokens).logits) <= 1e-5


# (flavor, tokens per sequence): tiny has every feature on (150 > its chunk 64 and floor scale 32);
# torchtitan's debugmodel has RoPE on every layer and full causal attention, its _irope variant
# NoPE on layers 0 and 4 and 256-token blocks on the others (512 tokens: two blocks).
OUR_INIT_CASES = [("tiny", 150), ("debugmodel", 300), ("debugmodel_irope", 512)]


@pytest.mark.parametrize(("flavor", "seq_len"), OUR_INIT_CASES, ids=[f for f, _ in OUR_INIT_CASES])
def test_torchmoe_to_hf_from_our_init(flavor, seq_len, tmp_path):
    """The other direction, from our own initialisation of a flavor: transformers' independent
    Llama 4 built from the config.json we write computes the same logits."""
    torch.manual_seed(0)  # for the inputs below
    args = FLAVORS[flavor]
    model = Transformer(args)
    model.init_weights(seed=0)
    save_model(model, tmp_path / "hf", max_shard_bytes=2**20)  # several shards + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    hf = Llama4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, args.vocab_size, (2, seq_len))
    with torch.no_grad():
        assert max_rel_err(model(tokens), hf(tokens).logits) <= 1e-5
    # And back again: identical parameters.
    again = load_model(tmp_path / "hf")
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


# What config.json says of torchtitan's debug flavors: no QK norm, no temperature tuning, NoPE
# layers listed (1 = RoPE) since torchtitan's i % 4 == 0 is not Hugging Face's default, torchtitan's
# llama3 RoPE scaling, and blocks of 256 on the RoPE layers of the _irope variant only.
_TORCHTITAN_HF_CONFIG = {
    "debugmodel": dict(no_rope_layers=[1, 1, 1, 1, 1, 1], attention_chunk_size=None),
    "debugmodel_irope": dict(no_rope_layers=[0, 1, 1, 1, 0, 1], attention_chunk_size=256),
}


@pytest.mark.parametrize("flavor", sorted(_TORCHTITAN_HF_CONFIG))
def test_hf_config_of_torchtitan_debug_flavors(flavor):
    config = hf_config_from_args(FLAVORS[flavor], torch.float32)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    assert {k: config[k] for k in ("use_qk_norm", "attn_temperature_tuning", "rope_scaling", "tie_word_embeddings",
                                   "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "intermediate_size", "intermediate_size_mlp", "moe_layers")} == {
        "use_qk_norm": False, "attn_temperature_tuning": False, "rope_scaling": rope, "tie_word_embeddings": False,
        "hidden_size": 256, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 16,
        "intermediate_size": 512, "intermediate_size_mlp": 768, "moe_layers": [1, 3, 5]}
    assert {k: config[k] for k in _TORCHTITAN_HF_CONFIG[flavor]} == _TORCHTITAN_HF_CONFIG[flavor]
    # transformers derives the same per-layer attention from it.
    hf_config = Llama4TextConfig(**config)
    chunked = "chunked_attention" if flavor.endswith("irope") else "full_attention"
    assert hf_config.layer_types == [chunked if rope else "full_attention" for rope in config["no_rope_layers"]]


def test_bf16_parity(tmp_path):
    """bf16 weights and activations in both models. Tolerance 2e-2 relative to the largest logit:
    bf16 has an 8-bit mantissa (2^-8 = 3.9e-3 per rounding) and the two implementations round
    the routed-expert gate product and attention internals in a different order, which
    accumulates over 4 layers; we measured 9.9e-3 here."""
    hf = _hf_model(CASES["scout_like"]).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf", dtype=torch.bfloat16)
    assert ours.output.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, _BASE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert max_rel_err(hf(tokens).logits, ours(tokens)) <= 2e-2


def test_multimodal_checkpoint_layout(tmp_path):
    """Released checkpoints are Llama4ForConditionalGeneration: text under language_model.,
    config under text_config, plus a vision tower that is skipped."""
    from safetensors.torch import load_file, save_file

    hf = _hf_model(CASES["scout_like"])
    hf.save_pretrained(tmp_path / "text")
    state = load_file(tmp_path / "text" / "model.safetensors")
    state = {f"language_model.{k}": v for k, v in state.items()}
    state["vision_model.patch_embedding.weight"] = torch.zeros(3)
    (tmp_path / "mm").mkdir()
    save_file(state, tmp_path / "mm" / "model.safetensors")
    text_cfg = json.loads((tmp_path / "text" / "config.json").read_text())
    (tmp_path / "mm" / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": text_cfg}))
    ours = load_model(tmp_path / "mm")
    tokens = torch.randint(0, _BASE["vocab_size"], (1, 20))
    with torch.no_grad():
        assert max_rel_err(hf(tokens).logits, ours(tokens)) <= 1e-5


def test_config_round_trip_covers_fields():
    cfg = Llama4TextConfig(**{**_BASE, **CASES["scout_like"]}).to_dict()
    args = args_from_hf_config(cfg)
    assert (args.dim, args.n_layers, args.num_experts, args.attention_chunk_size, args.floor_scale) == (64, 4, 4, 16, 8)
    assert args.rope_layers == [True, False, True, False]
    assert args.rope_scaling["factor"] == 8.0
    assert args_from_hf_config(hf_config_from_args(args, torch.float32)) == args


# The released text configs' settings on top of transformers' defaults (which are Scout's shapes).
_RELEASED = {
    "scout": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192},
                  max_position_embeddings=10485760),
    "maverick": dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, num_local_experts=128,
                     interleave_moe_layer_step=2, use_qk_norm=False, max_position_embeddings=1048576),
}


@pytest.mark.parametrize("flavor", sorted(_RELEASED))
def test_released_configs_match_the_release_flavors(flavor):
    """A Hugging Face folder of Scout (Maverick) is `scout` (`maverick`), not torchtitan's flavor of
    the same shapes (`17bx16e`, `17bx128e`), whose attention differs."""
    args = args_from_hf_config(Llama4TextConfig(**_RELEASED[flavor]).to_dict())
    assert matching_flavor(args) == flavor


@pytest.mark.parametrize(
    "field, value, message",
    [("hidden_act", "gelu", "hidden_act 'gelu'"),
     ("attention_bias", True, "attention_bias"),
     ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}, "rope_type 'yarn'"),
     ("some_new_field", 3, "unsupported Llama4TextConfig fields: some_new_field"),
     ("layer_types", ["full_attention"] * 4, "layer_types .* differ"),
     ("score_func", "softmax", "unsupported Llama4TextConfig fields: score_func")],
)
def test_unsupported_config_fields_are_refused(field, value, message):
    cfg = {**Llama4TextConfig(**_BASE).to_dict(), field: value}
    with pytest.raises(HFConversionError, match=message):
        args_from_hf_config(cfg)


def test_export_refuses_what_hf_cannot_express():
    args = FLAVORS["tiny"].replace(score_func="softmax")
    with pytest.raises(HFConversionError, match="sigmoid"):
        hf_config_from_args(args, torch.float32)


@pytest.mark.parametrize(("overrides", "fields"), [
    (dict(qk_rms_norm=True), "qk_rms_norm"),
    (dict(n_group=4, topk_group=2, routed_scaling_factor=2.5), "n_group, topk_group, routed_scaling_factor"),
    (dict(norm_topk_prob=True, rope_style="half"), "rope_style, norm_topk_prob"),
])
def test_export_refuses_the_other_families_options(overrides, fields):
    """Every option another family adds to ModelArgs is checked by reading the written config
    back: Llama 4's config.json has no place for it, so the export names it."""
    with pytest.raises(HFConversionError, match=f"Hugging Face Llama 4 cannot express these settings: {fields}$"):
        hf_config_from_args(FLAVORS["tiny"].replace(**overrides), torch.float32)


def test_nonzero_expert_bias_is_refused_on_export_unless_dropped_by_name(tmp_path):
    """Llama 4's Hugging Face model has no place for the expert bias: a non-zero one is refused
    (nothing written), naming the argument that lets the export drop it; with it, a warning."""
    from torchmoe.config import ConfigError

    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed=0)
    save_model(model, tmp_path / "zero")  # a zero bias: nothing is lost
    model.moe_layers()[0].expert_bias[0] = 0.5
    with pytest.raises(ConfigError) as err:
        save_model(model, tmp_path / "out")
    assert (err.value.key, err.value.value) == ("drop_expert_bias", False)
    assert "expert_bias (max |bias| 0.5) has no place in Hugging Face Llama 4" in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.warns(UserWarning, match="expert_bias"):
        save_model(model, tmp_path / "out", drop_expert_bias=True)
