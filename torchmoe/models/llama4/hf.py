"""Mapping between torchmoe's Llama 4 and Hugging Face ``Llama4ForCausalLM`` / ``Llama4TextConfig``.

Configs map field by field (`args_from_hf_config`, `hf_config_from_args`); weights map name by
name, except the routed experts, which Hugging Face stores fused and input-major:

    HF  experts.gate_up_proj  [E, dim, 2 * hidden]  = cat(w1ᵀ, w3ᵀ, dim=-1)
    HF  experts.down_proj     [E, hidden, dim]      = w2ᵀ
    ours experts.w1 / w3      [E, hidden, dim];  experts.w2  [E, dim, hidden]

Multimodal ``Llama4ForConditionalGeneration`` checkpoints (the released ones) nest the text model
under ``language_model.``; their vision tower is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.models.hf_config_spec import (
    HFConfigValueError,
    HFConversionError,
    decoder_config,
    require_round_trip,
    with_reference_defaults,
)
from torchmoe.models.hf_slices import HFSlice
from torchmoe.models.llama4.hf_config_check import check_hf_config

# Fields of Llama4TextConfig that never change the text model's forward pass in training or
# evaluation (token ids, generation, dropout at 0, output switches) and are therefore accepted as-is.
_IGNORED_FIELDS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "initializer_range", "attention_dropout", "layer_types", "name_or_path",
    "_name_or_path", "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder",
    "is_encoder_decoder", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
    "cache_implementation", "for_llm_compressor", "quantization_config_ignore", "add_cross_attention", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "cross_attention_hidden_size",
    "is_decoder", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "torchscript", "chunk_size",
}


# Fields read below (checked or mapped) under their HF names, besides `_HF_FIELD_MAP`'s.
_CONSUMED_FIELDS = {
    "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size", "use_qk_norm",
    "attn_temperature_tuning", "floor_scale", "attn_scale", "interleave_moe_layer_step", "moe_layers",
    "tie_word_embeddings", "hidden_act", "attention_bias", "layer_types",
}


# transformers' Llama4TextConfig defaults of the fields whose absence is not null's meaning here
# (null: heads of hidden_size / heads, one key/value head per query head; absent: the released
# models' values). The other fields' defaults below are its too (tests/unit/test_hf_config_defaults.py).
_ABSENT = {"head_dim": 128, "num_key_value_heads": 8}


def text_config(config: dict) -> dict:
    """The text part of a Llama 4 config.json (multimodal configs nest it under ``text_config``)."""
    if config.get("model_type") == "llama4" and "text_config" in config:
        return config["text_config"]
    return config


def _rope(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 500000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFConversionError("partial_rotary_factor != 1 is not supported: Llama 4 rotates whole heads")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise HFConversionError(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), {k: params[k] for k in keys}


def args_from_hf_config(config: dict) -> ModelArgs:
    """`ModelArgs` equal to a Hugging Face Llama 4 (text) config; a value of the wrong type or
    range raises `HFConfigValueError` (`check_hf_config`), other unsupported settings
    `HFConversionError`, each naming the field."""
    cfg = text_config(config)
    prefix = "" if cfg is config else "text_config."
    if not isinstance(cfg, dict):
        raise HFConfigValueError("text_config", cfg, "not an object", "an object {...} holding the text model's config")
    if cfg.get("model_type", "llama4_text") != "llama4_text":
        raise HFConversionError(f"model_type {cfg.get('model_type')!r} is not a Llama 4 text model")
    cfg = with_reference_defaults(cfg, _ABSENT, lambda full: check_hf_config(full, prefix), prefix)
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("attention_bias", False):
        raise HFConversionError("attention_bias = true is not supported: Llama 4 projections have no bias")
    known = _CONSUMED_FIELDS | set(_HF_FIELD_MAP) | _IGNORED_FIELDS
    unknown = sorted(k for k in cfg if k not in known and not k.startswith("_"))
    if unknown:
        raise HFConversionError(f"unsupported Llama4TextConfig fields: {', '.join(unknown)}")
    theta, scaling = _rope(cfg)
    n_layers = cfg.get("num_hidden_layers", 48)
    hidden = cfg.get("hidden_size", 5120)
    n_heads = cfg.get("num_attention_heads", 40)
    args = ModelArgs(
        dim=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or hidden // n_heads,
        vocab_size=cfg.get("vocab_size", 202048),
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        max_seq_len=cfg.get("max_position_embeddings", 131072),
        rope_theta=theta,
        rope_scaling=scaling,
        no_rope_layer_interval=cfg.get("no_rope_layer_interval", 4),
        # HF treats an empty list as "derive from the interval".
        no_rope_layers=list(cfg["no_rope_layers"]) if cfg.get("no_rope_layers") else None,
        attention_chunk_size=cfg.get("attention_chunk_size", 8192),
        use_qk_norm=bool(cfg.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
        floor_scale=int(cfg.get("floor_scale", 8192)),
        attn_scale=float(cfg.get("attn_scale", 0.1)),
        ffn_hidden_dim=cfg.get("intermediate_size_mlp", 16384),
        moe_hidden_dim=cfg.get("intermediate_size", 8192),
        interleave_moe_layer_step=cfg.get("interleave_moe_layer_step", 1),
        moe_layers=list(cfg["moe_layers"]) if cfg.get("moe_layers") is not None else None,
        num_experts=cfg.get("num_local_experts", 16),
        top_k=cfg.get("num_experts_per_tok", 1),
        num_shared_experts=1,
        score_func="sigmoid",
        score_before_experts=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if cfg.get("layer_types") is not None:
        # HF picks each layer's attention mask from layer_types; it must say what the RoPE layout implies.
        implied = ["chunked_attention" if rope and args.attention_chunk_size is not None else "full_attention"
                   for rope in args.rope_layers]
        if list(cfg["layer_types"]) != implied:
            raise HFConversionError(f"layer_types {cfg['layer_types']} differ from the {implied} that "
                                    "no_rope_layers and attention_chunk_size imply")
    return args


# HF field -> ModelArgs field, for the fields whose names differ.
_HF_FIELD_MAP = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads", "rms_norm_eps": "norm_eps", "intermediate_size_mlp": "ffn_hidden_dim",
    "intermediate_size": "moe_hidden_dim", "num_local_experts": "num_experts", "num_experts_per_tok": "top_k",
}


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A ``Llama4TextConfig`` dict (config.json) describing `args`; raises `HFConversionError`
    for settings Hugging Face's Llama 4 cannot express."""
    if args.num_shared_experts != 1 or args.score_func != "sigmoid" or not args.score_before_experts:
        raise HFConversionError(
            "Hugging Face Llama 4 needs exactly one shared expert, sigmoid scores and scores applied "
            f"before the experts (got num_shared_experts={args.num_shared_experts}, "
            f"score_func={args.score_func!r}, score_before_experts={args.score_before_experts})"
        )
    rope: dict = {"rope_theta": args.rope_theta, "rope_type": "default"}
    if args.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **args.rope_scaling}
    return require_round_trip(args, {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        **decoder_config(args, dtype),
        "rope_parameters": rope,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope if args.rope_scaling is not None else None,
        "no_rope_layers": [int(x) for x in args.rope_layers],
        "no_rope_layer_interval": args.no_rope_layer_interval,
        "attention_chunk_size": args.attention_chunk_size,
        "use_qk_norm": args.use_qk_norm,
        "attn_temperature_tuning": args.attn_temperature_tuning,
        "floor_scale": args.floor_scale,
        "attn_scale": args.attn_scale,
        "intermediate_size_mlp": args.ffn_hidden_dim,
        "intermediate_size": args.moe_hidden_dim,
        "interleave_moe_layer_step": args.interleave_moe_layer_step,
        "moe_layers": sorted(args.moe_layer_ids),
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }, args_from_hf_config, "Llama 4")


# Our parameter name <-> HF name (Llama4ForCausalLM), for everything but the fused experts.
# `{i}` is a layer index, `{p}` one of q/k/v/o.
_NAME_PAIRS = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attention.w{p}.weight", "model.layers.{i}.self_attn.{p}_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.feed_forward.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.feed_forward.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.feed_forward.down_proj.weight"),
    ("layers.{i}.moe.router.gate.weight", "model.layers.{i}.feed_forward.router.weight"),
    ("layers.{i}.moe.shared_experts.w1.weight", "model.layers.{i}.feed_forward.shared_expert.gate_proj.weight"),
    ("layers.{i}.moe.shared_experts.w3.weight", "model.layers.{i}.feed_forward.shared_expert.up_proj.weight"),
    ("layers.{i}.moe.shared_experts.w2.weight", "model.layers.{i}.feed_forward.shared_expert.down_proj.weight"),
]


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>[qkvo])")
    return re.compile(pattern + "$")


_OURS_TO_HF = [(_template_regex(ours), hf) for ours, hf in _NAME_PAIRS]


def _hf_name(name: str) -> str | None:
    """The HF name of one of our non-expert parameters, or None."""
    for pattern, target in _OURS_TO_HF:
        if m := pattern.match(name):
            return target.format(**m.groupdict())
    return None


_EXPERTS_OURS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])$")
# Our persistent buffer without a Hugging Face counterpart (router state).
_NO_HF_COUNTERPART = "expert_bias"
SKIPPED_HF_PREFIXES = ("vision_model.", "multi_modal_projector.")
MULTIMODAL_TEXT_PREFIX = "language_model."


def hf_slice(name: str, shape: Sequence[int]) -> HFSlice | None:
    """The `HFSlice` of our state-dict entry `name` of shape `shape`; None for the router
    bias, which Hugging Face has no place for. Raises `HFConversionError` for other names."""
    if name.endswith(_NO_HF_COUNTERPART):
        return None
    if m := _EXPERTS_OURS.match(name):
        layer, kind = m.groups()
        prefix = f"model.layers.{layer}.feed_forward.experts."
        experts, rows, cols = shape
        if kind == "w2":  # ours [E, dim, hidden] -> HF down_proj [E, hidden, dim]
            return HFSlice(prefix + "down_proj", (experts, cols, rows), transposed=True)
        # ours [E, hidden, dim] -> HF gate_up_proj [E, dim, 2 * hidden], w1 first
        return HFSlice(prefix + "gate_up_proj", (experts, cols, 2 * rows), transposed=True,
                       offset=0 if kind == "w1" else rows)
    if (hf := _hf_name(name)) is None:
        raise HFConversionError(f"no Hugging Face name for {name!r}")
    return HFSlice(hf, tuple(shape))


def text_tensor_name(stored: str, args: ModelArgs) -> str | None:
    """The Llama4ForCausalLM name of a tensor stored in a text or multimodal checkpoint, or None
    for the vision tower's tensors."""
    if stored.startswith(SKIPPED_HF_PREFIXES):
        return None
    return stored.removeprefix(MULTIMODAL_TEXT_PREFIX)

