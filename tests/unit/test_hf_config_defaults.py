"""A config.json field that is absent means what transformers' config class makes of it: for every
field of every family, torchmoe reads the file without it as it reads the config transformers
builds from that file (its default, or what it derives from the other fields).

    python -m pytest -q tests/unit/test_hf_config_defaults.py
"""

from __future__ import annotations

import json
import logging

import pytest

transformers = pytest.importorskip("transformers")
from huggingface_hub.errors import StrictDataclassClassValidationError  # noqa: E402
from transformers import DeepseekV3Config, GptOssConfig, Llama4TextConfig, Qwen3MoeConfig  # noqa: E402

from torchmoe.arch.model_args import ModelArgs  # noqa: E402
from torchmoe.models.hf_config_spec import HFConversionError  # noqa: E402
from torchmoe.models.registry import hf_mapping_for_config  # noqa: E402

_DEFAULT_NOTE = " (transformers' default: the file does not set it)"

# Per family, configs whose every field differs from transformers' default where it can (so that a
# default read wrongly shows), in two shapes.
BASES = {
    "qwen3": (Qwen3MoeConfig, [
        dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, max_position_embeddings=256, mlp_only_layers=[0], rms_norm_eps=1e-5,
             tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
        dict(vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, num_experts=4, num_experts_per_tok=1,
             decoder_sparse_step=2, max_position_embeddings=128),
    ]),
    "deepseek_v3": (DeepseekV3Config, [
        dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=32, n_shared_experts=2,
             num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False,
             first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
             v_head_dim=10, max_position_embeddings=256, rms_norm_eps=1e-5, rope_interleave=False,
             num_nextn_predict_layers=0),
        dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
             num_attention_heads=2, num_key_value_heads=2, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
             topk_group=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=6, max_position_embeddings=128, tie_word_embeddings=True,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "rope_theta": 500.0, "mscale": 0.8, "mscale_all_dim": 0.6}),
    ]),
    "gpt_oss": (GptOssConfig, [
        dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
             max_position_embeddings=256, swiglu_limit=5.0, swiglu_alpha=1.5, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "rope_theta": 1000.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": True}),
        dict(vocab_size=80, hidden_size=128, intermediate_size=16, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=8, num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=128,
             layer_types=["full_attention", "sliding_attention"],
             rope_parameters={"rope_type": "default", "rope_theta": 300.0}),
    ]),
    "llama4": (Llama4TextConfig, [
        dict(vocab_size=96, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=256, attention_chunk_size=32, interleave_moe_layer_step=2, use_qk_norm=False,
             attn_temperature_tuning=False, floor_scale=64, attn_scale=0.2, no_rope_layer_interval=2,
             rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
        dict(vocab_size=80, hidden_size=256, intermediate_size=16, intermediate_size_mlp=24, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=8, num_local_experts=4, moe_layers=[0, 2],
             no_rope_layers=[0, 1, 1], attention_chunk_size=None, max_position_embeddings=128,
             rope_parameters={"rope_type": "llama3", "rope_theta": 700.0, "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 2.0, "original_max_position_embeddings": 32}),
    ]),
}
# Fields of a saved config.json that are no field of the model (metadata, or the type itself).
_METADATA = ("transformers_version", "model_type", "architectures")
# Read otherwise on purpose: DeepSeek-V3's num_key_value_heads defaults to 128, whatever the query
# heads; transformers' SDPA attention runs one key and value per query head regardless (its eager
# attention fails), which is how torchmoe reads a file without the field.
_READ_OTHERWISE = {("deepseek_v3", "num_key_value_heads")}


def _read(config: dict) -> ModelArgs | str:
    """torchmoe's reading of a config.json, or its refusal's message (without the note that a
    value is transformers' default: both readings name the same value)."""
    try:
        return hf_mapping_for_config(config).args_from_hf_config(config)
    except HFConversionError as err:
        return str(err).replace(_DEFAULT_NOTE, "")


def _file(cls: type, fields: dict) -> dict:
    """The config.json transformers writes (every field) for `fields`."""
    return json.loads(cls(**fields).to_json_string(use_diff=False))


def _same_model(a: ModelArgs | str, b: ModelArgs | str) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return not a.architecture_differences(b) and (a.max_seq_len, a.mtp_layers) == (b.max_seq_len, b.mtp_layers)


@pytest.mark.parametrize("family", sorted(BASES))
def test_every_absent_field_reads_as_transformers_reads_it(family):
    cls, bases = BASES[family]
    logging.getLogger("transformers").setLevel(logging.ERROR)  # its notes on YaRN factors the bases set
    differ = []
    for i, base in enumerate(bases):
        full = _file(cls, base)
        assert not isinstance(_read(full), str), _read(full)
        for field in sorted(set(full) - set(_METADATA)):
            if (family, field) in _READ_OTHERWISE:
                continue
            without = {k: v for k, v in full.items() if k != field}
            try:
                filled = _file(cls, {k: v for k, v in without.items() if k not in _METADATA})
            except StrictDataclassClassValidationError:  # transformers refuses the file without it
                continue
            ours, theirs = _read(without), _read(filled)
            if not _same_model(ours, theirs):
                differ.append(f"base {i}, {field} absent: {ours!r:.200} != transformers' {theirs!r:.200}")
    assert not differ, "\n".join(differ)


@pytest.mark.parametrize(("family", "fields", "expected"), [
    # The issue's example: DeepSeek-V3's routing is group-limited (4 of 8 groups) unless the file says otherwise.
    ("deepseek_v3", dict(n_routed_experts=64, num_experts_per_tok=4), dict(n_group=8, topk_group=4)),
    ("deepseek_v3", dict(n_routed_experts=64, n_group=None, topk_group=None), dict(n_group=1, topk_group=1)),
    ("deepseek_v3", dict(num_hidden_layers=5), dict(moe_layers=[3, 4], num_shared_experts=1, q_lora_rank=1536)),
    ("gpt_oss", dict(num_attention_heads=16), dict(n_kv_heads=8, head_dim=64, sliding_window=128)),
    ("gpt_oss", dict(sliding_window=None), dict(sliding_window=0, sliding_layers=[])),
    ("qwen3", dict(num_attention_heads=16), dict(n_kv_heads=4)),
    ("llama4", dict(num_attention_heads=16, hidden_size=512), dict(n_kv_heads=8, head_dim=128)),
])
def test_absent_and_null_fields_named(family, fields, expected):
    """Members read on their own: an absent field is transformers' default, a null one what
    transformers derives or what torchmoe reads as off."""
    cls = BASES[family][0]
    config = {"model_type": cls.model_type, **{k: v for k, v in fields.items()}}
    config.setdefault("num_hidden_layers", 4)
    args = _read(config)
    assert not isinstance(args, str), args
    assert {k: getattr(args, k) for k in expected} == expected
    if family == "gpt_oss" and "sliding_window" not in fields:  # the YaRN transformers sets when a file has none
        assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["factor"] == 32.0


def test_a_default_that_does_not_fit_says_so():
    """A value the file does not set, refused: the message says it is transformers' default (the
    fix, setting the field, is the same)."""
    from torchmoe.models.hf_config_spec import HFConfigValueError

    with pytest.raises(HFConfigValueError) as caught:
        hf_mapping_for_config({"model_type": "deepseek_v3"}).args_from_hf_config(
            {"model_type": "deepseek_v3", "n_routed_experts": 8})
    assert caught.value.field == "n_group" and caught.value.value == 8
    assert str(caught.value) == ("n_group = 8: does not divide the 8 experts (n_routed_experts) into groups of 2 or "
                                 "more" + _DEFAULT_NOTE)
