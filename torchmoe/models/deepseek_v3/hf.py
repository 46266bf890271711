"""Mapping between torchmoe's DeepSeek-V3 and Hugging Face ``DeepseekV3ForCausalLM`` /
``DeepseekV3Config`` (Kimi K2's checkpoints are this model type too).

Configs map field by field (`args_from_hf_config`, `hf_config_from_args`); weights map name by
name, the routed experts one tensor per expert and projection as the released checkpoints (and
transformers' ``save_pretrained``) store them:

    HF  mlp.experts.{e}.gate_proj.weight [hidden, dim]   ours experts.w1 [E, hidden, dim]
    HF  mlp.experts.{e}.up_proj.weight   [hidden, dim]   ours experts.w3 [E, hidden, dim]
    HF  mlp.experts.{e}.down_proj.weight [dim, hidden]   ours experts.w2 [E, dim, hidden]
    HF  mlp.gate.e_score_correction_bias [E]             ours moe.expert_bias (the aux-loss-free bias)

With ``rope_interleave`` (the releases') Hugging Face rotates interleaved pairs of the rope
coordinates, as torchmoe's ``rope_style = "interleaved"`` does; it writes the rotated query and
key in half-split order, a permutation both share, so the attention scores are the same and the
projections map unchanged. ``rope_interleave = false`` is ``rope_style = "half"``.

Multi-token prediction layers (``num_nextn_predict_layers``: the released ``model.layers.61``) are
torchmoe's ``mtp_layers`` (`models.decoder.mtp`): the block's tensors under the block's names, and

    HF  model.layers.{i}.enorm / hnorm / eh_proj     ours mtp.{i}.enorm / hnorm / eh_proj
    HF  model.layers.{i}.shared_head.norm            ours mtp.{i}.norm

The release also stores each MTP layer's ``embed_tokens`` and ``shared_head.head``: copies of the
main model's embedding and head, which the modules share. Saving writes them (`hf_copies`: the
engines serving the MTP weights read them there); loading reads the main ones. A model with fewer
MTP layers than the checkpoint (transformers' causal LM has none) skips the rest.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from torchmoe.arch.deepseek_v3 import deepseek_v3
from torchmoe.arch.model_args import ModelArgs
from torchmoe.models.hf_config_spec import (
    DECODER_FIELDS,
    IGNORED_FIELDS,
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_SIZE,
    POSITIVE,
    ROPE_FIELDS,
    HFConfigValueError,
    HFConversionError,
    Spec,
    check_config,
    decoder_config,
    refuse_unknown_fields,
    require_round_trip,
    rope_or_yarn,
    with_reference_defaults,
)
from torchmoe.models.hf_slices import HFSlice, per_expert_slice
from torchmoe.models.peft_targets import PeftTarget, dense_mlp_refused, peft_target_for

__all__ = ["MODEL_TYPES", "args_from_hf_config", "hf_config_from_args", "hf_copies", "hf_slice", "peft_target",
           "text_tensor_name"]

MODEL_TYPES = ("deepseek_v3", "kimi_k2")

_FIELDS: dict[str, Spec] = {
    **DECODER_FIELDS,
    "head_dim": Spec("int", low=2, high=MAX_SIZE, null=True),  # Hugging Face writes qk_rope_head_dim here
    "moe_intermediate_size": Spec("int", high=MAX_SIZE),
    "n_routed_experts": Spec("int", high=MAX_EXPERTS),
    "num_local_experts": Spec("int", high=MAX_EXPERTS),
    "n_shared_experts": Spec("int", low=0, high=MAX_EXPERTS, null=True),
    "routed_scaling_factor": POSITIVE,
    "kv_lora_rank": Spec("int", high=MAX_SIZE),
    "q_lora_rank": Spec("int", low=0, high=MAX_SIZE, null=True),  # null: a full-rank query projection
    "qk_rope_head_dim": Spec("int", low=2, high=MAX_SIZE),
    "qk_nope_head_dim": Spec("int", low=0, high=MAX_SIZE),
    "v_head_dim": Spec("int", high=MAX_SIZE, null=True),
    "qk_head_dim": Spec("int", high=MAX_SIZE),
    "n_group": Spec("int", high=MAX_EXPERTS, null=True),
    "topk_group": Spec("int", high=MAX_EXPERTS, null=True),
    "first_k_dense_replace": Spec("int", low=0, high=MAX_LAYERS, null=True),
    "moe_layer_freq": Spec("int", high=MAX_LAYERS),
    "norm_topk_prob": Spec("bool", null=True),
    "rope_interleave": Spec("bool", null=True),
    "num_nextn_predict_layers": Spec("int", low=0, high=MAX_LAYERS),
    "scoring_func": Spec("str"),
    "topk_method": Spec("str"),
}
# Fields that never change the causal LM's forward pass beyond `IGNORED_FIELDS`: expert placement
# hints, the auxiliary loss the releases trained with.
_IGNORED_FIELDS = IGNORED_FIELDS | {"auto_map", "pretraining_tp", "ep_size", "aux_loss_alpha", "seq_aux"}


# transformers' DeepseekV3Config defaults of the fields whose absence is not null's meaning here
# (null: no groups, no shared expert, a full-rank query; absent: the released model's values).
# The other fields' defaults below are its too (tests/unit/test_hf_config_defaults.py, per field).
# Not num_key_value_heads: its default (128) differs from the query heads of any other shape,
# which transformers' latent attention cannot run (it repeats the heads 0 times).
_ABSENT = {"n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "n_shared_experts": 1, "q_lora_rank": 1536,
           "num_nextn_predict_layers": 1}


def _check(cfg: dict) -> None:
    check_config(cfg, _FIELDS, ROPE_FIELDS)
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts", 256))
    if "num_local_experts" in cfg and "n_routed_experts" in cfg and cfg["num_local_experts"] != experts:
        raise HFConfigValueError("num_local_experts", cfg["num_local_experts"],
                                 f"differs from n_routed_experts ({experts}): both name the routed experts",
                                 f"{experts}, or remove one of them")
    heads = cfg.get("num_attention_heads", 128)
    if (cfg.get("num_key_value_heads") or heads) != heads:
        raise HFConfigValueError("num_key_value_heads", cfg["num_key_value_heads"], "differs from "
                                 f"num_attention_heads ({heads}): latent attention has one key and value per query "
                                 "head", f"{heads}, or null")
    rope_dim, nope = cfg.get("qk_rope_head_dim", 64), cfg.get("qk_nope_head_dim", 128)
    if rope_dim % 2:
        raise HFConfigValueError("qk_rope_head_dim", rope_dim, "is odd: RoPE rotates pairs", "an even integer")
    for name, value in (("head_dim", rope_dim), ("qk_head_dim", rope_dim + nope)):
        if cfg.get(name) is not None and cfg[name] != value:
            raise HFConfigValueError(name, cfg[name], f"disagrees with qk_rope_head_dim ({rope_dim}) and "
                                     f"qk_nope_head_dim ({nope}), from which Hugging Face derives it",
                                     f"{value}, or remove it")
    n_group, top_k = cfg.get("n_group") or 1, cfg.get("num_experts_per_tok", 8)
    topk_group = cfg.get("topk_group") or 1
    if experts % n_group or experts // n_group < 2:
        raise HFConfigValueError("n_group", n_group, f"does not divide the {experts} experts (n_routed_experts) "
                                 "into groups of 2 or more", "a divisor of n_routed_experts")
    if topk_group > n_group or top_k > topk_group * (experts // n_group):
        raise HFConfigValueError("topk_group", topk_group, f"of n_group {n_group} cannot hold num_experts_per_tok "
                                 f"({top_k}) of {experts // n_group} experts each",
                                 f"an integer from {-(-top_k // (experts // n_group))} to {n_group}")


def _refuse_unsupported(cfg: dict) -> None:
    if cfg.get("quantization_config") is not None:
        raise HFConversionError("quantization_config is set: the weights are quantized (the released DeepSeek-V3 "
                                "files are fp8 blocks with weight_scale_inv tensors); dequantise them to bf16 first "
                                "(DeepSeek's inference/fp8_cast_bf16.py)")
    for name, value, supported in (("hidden_act", cfg.get("hidden_act", "silu"), "silu"),
                                   ("scoring_func", cfg.get("scoring_func", "sigmoid"), "sigmoid"),
                                   ("topk_method", cfg.get("topk_method", "noaux_tc"), "noaux_tc"),
                                   ("moe_layer_freq", cfg.get("moe_layer_freq", 1), 1)):
        if value != supported:
            raise HFConversionError(f"{name} {value!r} is not supported (DeepseekV3ForCausalLM runs {supported!r})")
    if cfg.get("attention_bias", False):
        raise HFConversionError("attention_bias = true is not supported: torchmoe's latent attention has no biases")
    refuse_unknown_fields(cfg, set(_FIELDS) | _IGNORED_FIELDS | {"quantization_config"}, "DeepseekV3Config")


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """`ModelArgs` equal to a Hugging Face DeepSeek-V3 config; a value of the wrong type or range
    raises `HFConfigValueError`, other unsupported settings `HFConversionError`, each naming the
    field."""
    if cfg.get("model_type") not in MODEL_TYPES:
        raise HFConversionError(f"model_type {cfg.get('model_type')!r} is not a DeepSeek-V3 model")
    cfg = with_reference_defaults(cfg, _ABSENT, _check)
    _refuse_unsupported(cfg)
    theta, scaling = rope_or_yarn(cfg, "DeepSeek-V3", 10000.0, "factor 40, original_max_position_embeddings 4096")
    n_layers = cfg.get("num_hidden_layers", 61)
    return deepseek_v3(
        dim=cfg.get("hidden_size", 7168), n_layers=n_layers, n_heads=cfg.get("num_attention_heads", 128),
        vocab_size=cfg.get("vocab_size", 129280), ffn_hidden_dim=cfg.get("intermediate_size", 18432),
        moe_hidden_dim=cfg.get("moe_intermediate_size", 2048),
        num_experts=cfg.get("n_routed_experts", cfg.get("num_local_experts", 256)),
        num_shared_experts=cfg.get("n_shared_experts") or 0, top_k=cfg.get("num_experts_per_tok", 8),
        first_k_dense=min(cfg.get("first_k_dense_replace") or 0, n_layers), q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg.get("kv_lora_rank", 512), qk_nope_head_dim=cfg.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim", 64), v_head_dim=cfg.get("v_head_dim") or 128,
        n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=cfg.get("max_position_embeddings", 4096), norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    ).replace(rope_style="interleaved" if cfg.get("rope_interleave", True) is not False else "half",
              mtp_layers=cfg["num_nextn_predict_layers"])


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A ``DeepseekV3Config`` dict (config.json) describing `args`; raises `HFConversionError` for
    settings Hugging Face's DeepSeek-V3 cannot express (its router scores with sigmoid only:
    torchtitan's softmax-scored flavors, DeepSeek-V2's router, have no DeepseekV3 form)."""
    if args.score_func != "sigmoid":
        raise HFConversionError(f"score_func {args.score_func!r}: Hugging Face's DeepseekV3ForCausalLM scores "
                                "experts with sigmoid only (the softmax-scored flavors debugmodel, 16B and 236B "
                                "follow DeepSeek-V2's router)")
    first_dense = min(args.moe_layer_ids, default=args.n_layers)
    rope = {"rope_theta": args.rope_theta, "rope_type": "default"} if args.rope_scaling is None else {
        "rope_theta": args.rope_theta, **args.rope_scaling}
    return require_round_trip(args, {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **decoder_config(args, dtype),
        "head_dim": args.qk_rope_head_dim,
        "rope_parameters": rope,
        "rope_interleave": args.rope_style == "interleaved",
        "intermediate_size": args.ffn_hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "n_routed_experts": args.num_experts,
        "n_shared_experts": args.num_shared_experts,
        "num_experts_per_tok": args.top_k,
        "first_k_dense_replace": first_dense,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "routed_scaling_factor": args.routed_scaling_factor,
        "norm_topk_prob": args.norm_topk_prob,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "num_nextn_predict_layers": args.mtp_layers,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }, args_from_hf_config, "DeepSeek-V3")


# Our parameter name <-> HF name (DeepseekV3ForCausalLM); `{i}` is a layer index.
_NAME_PAIRS = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wq_a.weight", "model.layers.{i}.self_attn.q_a_proj.weight"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight"),
    ("layers.{i}.attention.wq_b.weight", "model.layers.{i}.self_attn.q_b_proj.weight"),
    ("layers.{i}.attention.wkv_a.weight", "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"),
    ("layers.{i}.attention.kv_norm.weight", "model.layers.{i}.self_attn.kv_a_layernorm.weight"),
    ("layers.{i}.attention.wkv_b.weight", "model.layers.{i}.self_attn.kv_b_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.moe.router.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    ("layers.{i}.moe.expert_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    ("layers.{i}.moe.shared_experts.w1.weight", "model.layers.{i}.mlp.shared_experts.gate_proj.weight"),
    ("layers.{i}.moe.shared_experts.w3.weight", "model.layers.{i}.mlp.shared_experts.up_proj.weight"),
    ("layers.{i}.moe.shared_experts.w2.weight", "model.layers.{i}.mlp.shared_experts.down_proj.weight"),
    ("mtp.{i}.enorm.weight", "model.layers.{i}.enorm.weight"),
    ("mtp.{i}.hnorm.weight", "model.layers.{i}.hnorm.weight"),
    ("mtp.{i}.eh_proj.weight", "model.layers.{i}.eh_proj.weight"),
    ("mtp.{i}.norm.weight", "model.layers.{i}.shared_head.norm.weight"),
]
# An MTP layer's copies of the main model's embedding and head (the release stores them).
_MTP_SHARED = (".embed_tokens.weight", ".shared_head.head.weight")
_PATTERNS = [(re.compile(re.escape(ours).replace(r"\{i\}", r"(?P<i>\d+)") + "$"), hf) for ours, hf in _NAME_PAIRS]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def hf_slice(name: str, shape: Sequence[int]) -> HFSlice:
    """The `HFSlice` of our state-dict entry `name` of shape `shape` (the expert bias included:
    Hugging Face keeps it as ``e_score_correction_bias``). Raises `HFConversionError` for other
    names."""
    if (experts := per_expert_slice(name, shape)) is not None:
        return experts
    for pattern, target in _PATTERNS:
        if m := pattern.match(name):
            return HFSlice(target.format(**m.groupdict()), tuple(shape))
    raise HFConversionError(f"no Hugging Face name for {name!r}")


def hf_copies(args: ModelArgs) -> list[tuple[str, HFSlice]]:
    """Each MTP layer's copies of the embedding and the output head (the embedding when tied),
    as the release stores them."""
    head = "tok_embeddings.weight" if args.tie_word_embeddings else "output.weight"
    shape = (args.vocab_size, args.dim)
    return [pair for i in args.mtp_layer_ids for pair in (
        ("tok_embeddings.weight", HFSlice(f"model.layers.{i}.embed_tokens.weight", shape)),
        (head, HFSlice(f"model.layers.{i}.shared_head.head.weight", shape)))]


def text_tensor_name(stored: str, args: ModelArgs) -> str | None:
    """A stored name as the model's, or None for what a model of `args` does not read: the
    multi-token prediction layers past its ``mtp_layers`` (indices from ``n_layers`` on), and each
    one's copies of the main embedding and head."""
    if (m := _LAYER.match(stored)) and (i := int(m.group(1))) >= args.n_layers:
        if i >= args.n_layers + args.mtp_layers or stored.endswith(_MTP_SHARED):
            return None
    return stored


_PEFT_REFUSED = dense_mlp_refused("DeepSeek-V3")


def peft_target(name: str, shape: Sequence[int]) -> PeftTarget:
    """Where PEFT adapts our adapted weight or routed-expert adapter `name` (`peft_target_for`)."""
    return peft_target_for(name, shape, hf_slice, _PEFT_REFUSED)
