"""The values of a Hugging Face Llama 4 config.json, checked before a model is built from them.

    check_hf_config(text_config(config))     # raises HFConfigValueError naming the field

Every field `args_from_hf_config` reads is checked here, in one place, as
`models.hf_config_spec` describes: its JSON type, its range, and the fields that must agree
(heads divisible by key/value heads, an even head size, top-k within the experts, per-layer
lists that cover the layers).
"""

from __future__ import annotations

from torchmoe.models.hf_config_spec import (
    DECODER_FIELDS,
    MAX_EXPERTS,
    MAX_INT32,
    MAX_SIZE,
    POSITIVE,
    HFConfigValueError,
    Spec,
    check_fields,
    check_heads,
    check_layer_list,
)

__all__ = ["check_hf_config"]

# Every field of Llama4TextConfig that args_from_hf_config reads, under its Hugging Face name.
_FIELDS: dict[str, Spec] = {
    **DECODER_FIELDS,
    "partial_rotary_factor": POSITIVE,
    "no_rope_layers": Spec("int_list", null=True),
    "no_rope_layer_interval": Spec("int", high=MAX_INT32),
    "attention_chunk_size": Spec("int", high=MAX_INT32, null=True),  # null: full attention
    "use_qk_norm": Spec("bool"),
    # An integer in transformers' first Llama 4 release (4: on).
    "attn_temperature_tuning": Spec("flag"),
    "floor_scale": Spec("int", high=MAX_INT32),
    "attn_scale": Spec("number", low=None),
    "intermediate_size_mlp": Spec("int", high=MAX_SIZE),
    "interleave_moe_layer_step": Spec("int", high=MAX_INT32),
    "moe_layers": Spec("int_list", null=True),
    "num_local_experts": Spec("int", high=MAX_EXPERTS),
    "layer_types": Spec("str_list", null=True),  # what they must say: args_from_hf_config
}
# The RoPE object's fields (rope_parameters, or the older rope_scaling).
_ROPE_FIELDS: dict[str, Spec] = {
    "rope_type": Spec("str"), "type": Spec("str"), "rope_theta": POSITIVE, "partial_rotary_factor": POSITIVE,
    "factor": POSITIVE, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
    "original_max_position_embeddings": Spec("int", high=MAX_INT32),
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_hf_config(cfg: dict, prefix: str = "") -> None:
    """Check every field `args_from_hf_config` reads from the text config `cfg` (see the module
    docstring); `prefix` names where `cfg` is in the file (``text_config.`` in a multimodal one).

    Raises:
        HFConfigValueError: the first field of the wrong type or range, or that disagrees with another.
    """
    check_fields(_FIELDS, cfg, prefix)
    for rope in ("rope_parameters", "rope_scaling"):
        params = cfg.get(rope)
        if isinstance(params, dict):
            check_fields(_ROPE_FIELDS, params, f"{prefix}{rope}.")
            missing = [k for k in _LLAMA3_KEYS if k not in params]
            if params.get("rope_type", params.get("type")) == "llama3" and missing:
                raise HFConfigValueError(prefix + rope, params, f"llama3 RoPE scaling needs {', '.join(missing)}",
                                         f"an object with {', '.join(_LLAMA3_KEYS)} for rope_type \"llama3\"")
    n_layers = cfg.get("num_hidden_layers", 48)
    check_heads(cfg, prefix, default_heads=40, default_hidden=5120)
    experts, top_k = cfg.get("num_local_experts", 16), cfg.get("num_experts_per_tok", 1)
    if top_k > experts:
        raise HFConfigValueError(prefix + "num_experts_per_tok", top_k, f"more than the {experts} experts "
                                 "(num_local_experts)", f"an integer from 1 to {experts}")
    check_layer_list(cfg, "no_rope_layers", prefix, "0 (NoPE) or 1 (RoPE)", f"a list of {n_layers} entries, 0 or 1",
                lambda v: v in (0, 1))
    no_rope = cfg.get("no_rope_layers")
    if no_rope and len(no_rope) < n_layers:
        raise HFConfigValueError(prefix + "no_rope_layers", no_rope, f"has {len(no_rope)} entries for {n_layers} "
                                 "layers (num_hidden_layers)", f"a list of {n_layers} entries, 0 or 1")
    check_layer_list(cfg, "moe_layers", prefix, f"a layer index from 0 to {n_layers - 1}",
                f"a list of layer indices from 0 to {n_layers - 1}", lambda v: 0 <= v < n_layers)
    moe = cfg.get("moe_layers") or []
    if len(set(moe)) != len(moe):
        raise HFConfigValueError(prefix + "moe_layers", moe, "names a layer twice", "a list of distinct layer indices")
