"""Mapping between torchmoe's gpt-oss and Hugging Face ``GptOssForCausalLM`` / ``GptOssConfig``.

Configs map field by field (`args_from_hf_config`, `hf_config_from_args`); weights map name by
name. The routed experts are stored as transformers stores them, input-major, gate and up
interleaved, with their biases:

    HF  mlp.experts.gate_up_proj      [E, dim, 2 * hidden]   ours experts.w13 [E, 2 * hidden, dim] (transposed)
    HF  mlp.experts.gate_up_proj_bias [E, 2 * hidden]        ours experts.b13
    HF  mlp.experts.down_proj         [E, hidden, dim]       ours experts.w2  [E, dim, hidden] (transposed)
    HF  mlp.experts.down_proj_bias    [E, dim]               ours experts.b2
    HF  self_attn.sinks               [H]                    ours attention.sinks

The released checkpoints hold the expert matrices in MXFP4 (``gate_up_proj_blocks`` and
``_scales``, ``quantization_config.quant_method = "mxfp4"``): `hf_files.hf_storage` dequantises
them on load (`hf_files.mxfp4`). Hugging Face rotates half-split pairs, as ``rope_style =
"half"`` does. The router's softmax over its top-k logits is torchmoe's softmax scores
renormalised over the top k (`norm_topk_prob`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from torchmoe.arch.gpt_oss import gpt_oss
from torchmoe.arch.model_args import ModelArgs
from torchmoe.models.hf_config_spec import (
    DECODER_FIELDS,
    IGNORED_FIELDS,
    MAX_EXPERTS,
    MAX_INT32,
    POSITIVE,
    ROPE_FIELDS,
    HFConfigValueError,
    HFConversionError,
    Spec,
    check_config,
    check_heads,
    check_top_k,
    decoder_config,
    refuse_unknown_fields,
    require_round_trip,
    rope_or_yarn,
    with_reference_defaults,
)
from torchmoe.models.hf_slices import HFSlice
from torchmoe.models.peft_targets import PeftTarget, peft_target_for

__all__ = ["MODEL_TYPES", "args_from_hf_config", "hf_config_from_args", "hf_slice", "peft_target", "text_tensor_name"]

MODEL_TYPES = ("gpt_oss",)

_FIELDS: dict[str, Spec] = {
    **DECODER_FIELDS,
    "num_local_experts": Spec("int", high=MAX_EXPERTS),
    "sliding_window": Spec("int", high=MAX_INT32, null=True),
    "layer_types": Spec("str_list", null=True),
    "swiglu_limit": POSITIVE,
    "swiglu_alpha": POSITIVE,
    "quantization_config": Spec("object", null=True),
}
_LAYER_TYPES = ("sliding_attention", "full_attention")

# Fields that never change the causal LM's forward pass beyond `IGNORED_FIELDS`: the auxiliary
# loss the releases trained with, the releases' duplicates of fields above (experts_per_token,
# initial_context_length).
_IGNORED_FIELDS = IGNORED_FIELDS | {"router_aux_loss_coef", "experts_per_token", "initial_context_length"}


def _sliding_layers(cfg: dict, n_layers: int) -> list[int]:
    """The layers attending over the sliding window: ``layer_types``' sliding ones (by default the
    even layers, as Hugging Face derives them); none without a window."""
    types = cfg.get("layer_types")
    if types is None:
        types = [_LAYER_TYPES[i % 2] for i in range(n_layers)]
    if len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        bad = next((t for t in types if t not in _LAYER_TYPES), None)
        problem = (f"holds {bad!r}" if bad is not None else f"has {len(types)} entries for {n_layers} layers "
                   "(num_hidden_layers)")
        raise HFConfigValueError("layer_types", types, problem,
                                 f"a list of {n_layers} entries, each 'sliding_attention' or 'full_attention'")
    if cfg.get("sliding_window") is None:
        return []
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


# transformers' GptOssConfig defaults of the fields whose absence is not null's meaning here
# (null: heads of hidden_size / heads, one key/value head per query head, no window; absent: the
# released models' values), and the RoPE object it sets when a file has none. The other fields'
# defaults below are its too (tests/unit/test_hf_config_defaults.py, per field).
_ABSENT = {"head_dim": 64, "num_key_value_heads": 8, "sliding_window": 128}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _check(cfg: dict) -> None:
    check_config(cfg, _FIELDS, ROPE_FIELDS)
    check_heads(cfg, "", default_heads=64, default_hidden=2880)
    check_top_k(cfg.get("num_experts_per_tok", 4), cfg.get("num_local_experts", 128), "num_local_experts")


def _refuse_unsupported(cfg: dict) -> None:
    quant = cfg.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise HFConversionError(f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported: "
                                "torchmoe dequantises the released MXFP4 experts ('mxfp4') on load; convert other "
                                "quantized weights to bf16 first")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act {cfg['hidden_act']!r} is not supported (GptOssForCausalLM's experts "
                                "run their clamped SwiGLU, which config.json names 'silu')")
    if not cfg.get("attention_bias", True):
        raise HFConversionError("attention_bias = false is not supported: gpt-oss's projections have biases")
    refuse_unknown_fields(cfg, set(_FIELDS) | _IGNORED_FIELDS, "GptOssConfig")


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """`ModelArgs` equal to a Hugging Face gpt-oss config (`HFConfigValueError` for a bad value,
    `HFConversionError` for a setting torchmoe cannot run: each names the field)."""
    if cfg.get("model_type") not in MODEL_TYPES:
        raise HFConversionError(f"model_type {cfg.get('model_type')!r} is not a gpt-oss model")
    cfg = with_reference_defaults(cfg, _ABSENT, _check)
    _refuse_unsupported(cfg)
    theta, scaling = rope_or_yarn(cfg, "gpt-oss", 150000.0, "factor 32, original_max_position_embeddings 4096",
                                  default=_DEFAULT_ROPE)
    n_layers = cfg.get("num_hidden_layers", 36)
    heads = cfg.get("num_attention_heads", 64)
    hidden = cfg.get("hidden_size", 2880)
    return gpt_oss(
        dim=hidden, n_layers=n_layers, n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, vocab_size=cfg.get("vocab_size", 201088),
        moe_hidden_dim=cfg.get("intermediate_size", 2880), num_experts=cfg.get("num_local_experts", 128),
        top_k=cfg.get("num_experts_per_tok", 4), sliding_window=cfg.get("sliding_window") or 0,
        sliding_layers=_sliding_layers(cfg, n_layers), rope_theta=theta, rope_scaling=scaling,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        max_seq_len=cfg.get("max_position_embeddings", 131072), norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    ).replace(rope_scaling=scaling)


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A ``GptOssConfig`` dict (config.json) describing `args`; raises `HFConversionError` for
    settings Hugging Face's gpt-oss cannot express."""
    sliding = set(args.sliding_layers or ())
    rope = {"rope_theta": args.rope_theta, "rope_type": "default"} if args.rope_scaling is None else {
        "rope_theta": args.rope_theta, **args.rope_scaling}
    return require_round_trip(args, {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **decoder_config(args, dtype),
        "rope_parameters": rope,
        "intermediate_size": args.moe_hidden_dim,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "sliding_window": args.sliding_window or None,
        "layer_types": [_LAYER_TYPES[0] if i in sliding else _LAYER_TYPES[1] for i in range(args.n_layers)],
        "swiglu_limit": args.swiglu_limit,
        "swiglu_alpha": args.swiglu_alpha,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": True,
    }, args_from_hf_config, "gpt-oss")


# Our parameter name <-> HF name (GptOssForCausalLM); `{i}` is a layer index, `{p}` one of q/k/v/o,
# `{b}` weight or bias.
_NAME_PAIRS = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attention.w{p}.{b}", "model.layers.{i}.self_attn.{p}_proj.{b}"),
    ("layers.{i}.attention.sinks", "model.layers.{i}.self_attn.sinks"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.moe.router.gate.{b}", "model.layers.{i}.mlp.router.{b}"),
    ("layers.{i}.moe.experts.b13", "model.layers.{i}.mlp.experts.gate_up_proj_bias"),
    ("layers.{i}.moe.experts.b2", "model.layers.{i}.mlp.experts.down_proj_bias"),
]
_PATTERNS = [(re.compile(re.escape(ours).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>[qkvo])")
                         .replace(r"\{b\}", r"(?P<b>weight|bias)") + "$"), hf) for ours, hf in _NAME_PAIRS]
# Stored input-major: our [E, out, in] is their [E, in, out].
_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w13|w2)$")
_EXPERT_PROJ = {"w13": "gate_up_proj", "w2": "down_proj"}


def hf_slice(name: str, shape: Sequence[int]) -> HFSlice | None:
    """The `HFSlice` of our state-dict entry `name` of shape `shape`; None for the aux-loss-free
    expert bias, which Hugging Face has no place for. Raises `HFConversionError` for other names."""
    if name.endswith("expert_bias"):
        return None
    if m := _EXPERTS.match(name):
        layer, kind = m.groups()
        e, rows, cols = shape
        return HFSlice(f"model.layers.{layer}.mlp.experts.{_EXPERT_PROJ[kind]}", (e, cols, rows), transposed=True)
    for pattern, target in _PATTERNS:
        if m := pattern.match(name):
            return HFSlice(target.format(**m.groupdict()), tuple(shape))
    raise HFConversionError(f"no Hugging Face name for {name!r}")


def text_tensor_name(stored: str, args: ModelArgs) -> str | None:
    """A gpt-oss checkpoint holds the text model only: every stored name is its own."""
    return stored


def peft_target(name: str, shape: Sequence[int]) -> PeftTarget:
    """Where PEFT adapts our adapted weight or routed-expert adapter `name` (`peft_target_for`;
    the experts' module is marked ``is_transposed``, which PEFT reads)."""
    return peft_target_for(name, shape, hf_slice, {})
