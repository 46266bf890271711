"""Mapping between torchmoe's Qwen3-MoE and Hugging Face ``Qwen3MoeForCausalLM`` / ``Qwen3MoeConfig``.

Configs map field by field (`args_from_hf_config`, `hf_config_from_args`); weights map name by
name. The routed experts are stored one tensor per expert and projection, as the released
checkpoints (and transformers' ``save_pretrained``) store them:

    HF  mlp.experts.{e}.gate_proj.weight [hidden, dim]   ours experts.w1 [E, hidden, dim]
    HF  mlp.experts.{e}.up_proj.weight   [hidden, dim]   ours experts.w3 [E, hidden, dim]
    HF  mlp.experts.{e}.down_proj.weight [dim, hidden]   ours experts.w2 [E, dim, hidden]

Hugging Face rotates half-split pairs (`rotate_half`), as torchmoe's ``rope_style = "half"`` does,
so q/k projections map unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.qwen3 import qwen3_moe
from torchmoe.models.hf_config_spec import (
    DECODER_FIELDS,
    IGNORED_FIELDS,
    MAX_EXPERTS,
    MAX_INT32,
    MAX_SIZE,
    POSITIVE,
    HFConfigValueError,
    HFConversionError,
    Spec,
    check_config,
    check_heads,
    check_layer_list,
    check_top_k,
    decoder_config,
    refuse_unknown_fields,
    require_round_trip,
    with_reference_defaults,
)
from torchmoe.models.hf_slices import HFSlice, per_expert_slice
from torchmoe.models.peft_targets import PeftTarget, dense_mlp_refused, peft_target_for

__all__ = ["MODEL_TYPES", "args_from_hf_config", "hf_config_from_args", "hf_slice", "peft_target", "text_tensor_name"]

MODEL_TYPES = ("qwen3_moe",)

# Every field args_from_hf_config reads, under its Hugging Face name: the decoder's, and Qwen3's
# own (transformers 5 writes the expert count as num_local_experts, the released files as num_experts).
_FIELDS: dict[str, Spec] = {
    **DECODER_FIELDS,
    "moe_intermediate_size": Spec("int", high=MAX_SIZE),
    "num_experts": Spec("int", high=MAX_EXPERTS),
    "num_local_experts": Spec("int", high=MAX_EXPERTS),
    "norm_topk_prob": Spec("bool"),
    "decoder_sparse_step": Spec("int", high=MAX_INT32),
    "mlp_only_layers": Spec("int_list", null=True),
    "use_sliding_window": Spec("bool"),
}
_ROPE_FIELDS: dict[str, Spec] = {"rope_type": Spec("str"), "type": Spec("str"), "rope_theta": POSITIVE}

# Fields that never change the forward pass beyond `IGNORED_FIELDS`: the auxiliary loss, the
# window size while sliding windows are off.
_IGNORED_FIELDS = IGNORED_FIELDS | {"router_aux_loss_coef", "sliding_window", "max_window_layers", "layer_types"}


# transformers' Qwen3MoeConfig default of the field whose absence is not null's meaning here
# (null: one key/value head per query head; absent: the released models' 4). The other fields'
# defaults below are its too (tests/unit/test_hf_config_defaults.py, per field).
_ABSENT = {"num_key_value_heads": 4}


def _expert_count(cfg: dict) -> int:
    return cfg.get("num_local_experts", cfg.get("num_experts", 128))


def _check_expert_names(cfg: dict) -> None:
    """transformers 5 writes the expert count as num_local_experts, the releases as num_experts:
    a file with both must say one number."""
    if "num_experts" in cfg and "num_local_experts" in cfg and cfg["num_experts"] != cfg["num_local_experts"]:
        raise HFConfigValueError("num_local_experts", cfg["num_local_experts"], f"differs from num_experts "
                                 f"({cfg['num_experts']}): both name the routed experts",
                                 f"the same integer as num_experts ({cfg['num_experts']}), or remove one of them")


def _check(cfg: dict) -> None:
    check_config(cfg, _FIELDS, _ROPE_FIELDS)
    check_heads(cfg, "", default_heads=32, default_hidden=2048)
    _check_expert_names(cfg)
    check_top_k(cfg.get("num_experts_per_tok", 8), _expert_count(cfg), "num_experts")
    n_layers = cfg.get("num_hidden_layers", 24)
    check_layer_list(cfg, "mlp_only_layers", "", f"a layer index from 0 to {n_layers - 1}",
                     f"a list of layer indices from 0 to {n_layers - 1}", lambda v: 0 <= v < n_layers)


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise HFConversionError(f"rope_type {rope_type!r} is not supported for Qwen3-MoE (only 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """`ModelArgs` equal to a Hugging Face Qwen3-MoE config; a value of the wrong type or range
    raises `HFConfigValueError`, other unsupported settings `HFConversionError`, each naming the
    field."""
    if cfg.get("model_type") not in MODEL_TYPES:
        raise HFConversionError(f"model_type {cfg.get('model_type')!r} is not a Qwen3-MoE model")
    cfg = with_reference_defaults(cfg, _ABSENT, _check)
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("attention_bias", False):
        raise HFConversionError("attention_bias = true is not supported: Qwen3-MoE projections have no bias")
    if cfg.get("use_sliding_window", False):
        raise HFConversionError("use_sliding_window = true is not supported: torchmoe's Qwen3-MoE attends over "
                                "the whole causal context on every layer")
    refuse_unknown_fields(cfg, set(_FIELDS) | _IGNORED_FIELDS, "Qwen3MoeConfig")
    n_layers = cfg.get("num_hidden_layers", 24)
    hidden = cfg.get("hidden_size", 2048)
    heads = cfg.get("num_attention_heads", 32)
    step = cfg.get("decoder_sparse_step", 1)
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(n_layers) if i in only_mlp or (i + 1) % step != 0)
    return qwen3_moe(
        dim=hidden, n_layers=n_layers, n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, vocab_size=cfg.get("vocab_size", 151936),
        ffn_hidden_dim=cfg.get("intermediate_size", 6144), moe_hidden_dim=cfg.get("moe_intermediate_size", 768),
        num_experts=_expert_count(cfg), top_k=cfg.get("num_experts_per_tok", 8),
        max_seq_len=cfg.get("max_position_embeddings", 32768), rope_theta=_rope_theta(cfg),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), norm_eps=cfg.get("rms_norm_eps", 1e-6),
        dense_layers=dense, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A ``Qwen3MoeConfig`` dict (config.json) describing `args`; raises `HFConversionError` for
    settings Hugging Face's Qwen3-MoE cannot express."""
    return require_round_trip(args, {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **decoder_config(args, dtype),
        "rope_parameters": {"rope_theta": args.rope_theta, "rope_type": "default"},
        "intermediate_size": args.ffn_hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(args.n_layers) if not args.is_moe_layer(i)],
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
    }, args_from_hf_config, "Qwen3-MoE")


# Our parameter name <-> HF name (Qwen3MoeForCausalLM); `{i}` is a layer index, `{p}` one of
# q/k/v/o, `{e}` an expert (per-expert tensors).
_NAME_PAIRS = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attention.w{p}.weight", "model.layers.{i}.self_attn.{p}_proj.weight"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.moe.router.gate.weight", "model.layers.{i}.mlp.gate.weight"),
]
_PATTERNS = [(re.compile(re.escape(ours).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>[qkvo])") + "$"),
              hf) for ours, hf in _NAME_PAIRS]


def hf_slice(name: str, shape: Sequence[int]) -> HFSlice | None:
    """The `HFSlice` of our state-dict entry `name` of shape `shape`; None for the router bias,
    which Hugging Face has no place for. Raises `HFConversionError` for other names."""
    if name.endswith("expert_bias"):
        return None
    if (experts := per_expert_slice(name, shape)) is not None:
        return experts
    for pattern, target in _PATTERNS:
        if m := pattern.match(name):
            return HFSlice(target.format(**m.groupdict()), tuple(shape))
    raise HFConversionError(f"no Hugging Face name for {name!r}")


def text_tensor_name(stored: str, args: ModelArgs) -> str | None:
    """A Qwen3-MoE checkpoint holds the text model only: every stored name is its own."""
    return stored


_PEFT_REFUSED = dense_mlp_refused("Qwen3-MoE")


def peft_target(name: str, shape: Sequence[int]) -> PeftTarget:
    """Where PEFT adapts our adapted weight or routed-expert adapter `name` (`peft_target_for`)."""
    return peft_target_for(name, shape, hf_slice, _PEFT_REFUSED)
