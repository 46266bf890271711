"""Llama 4 text models: the named flavors.

    python -c "from torchmoe.arch.llama4 import FLAVORS; print(FLAVORS['scout'].param_counts())"

Flavors are a plain dict of `ModelArgs` (`arch/model_args.py`): torchmoe's own (`tiny`,
`bench256`, and the Hugging Face releases `scout` and `maverick`), then torchtitan v0.2.2's
Llama 4 flavors under torchtitan's names.
"""

from __future__ import annotations

from torchmoe.arch.model_args import LLAMA4_ROPE_SCALING, ModelArgs

# ---- torchmoe's flavors ------------------------------------------------------------------------

# The released Llama 4 text configs, exactly (Hugging Face meta-llama/Llama-4-Scout-17B-16E and
# Llama-4-Maverick-17B-128E): QK norm (Scout), temperature tuning, 8192-token chunked attention on
# RoPE layers, NoPE on layers (i + 1) % 4 == 0.
_SCOUT = ModelArgs()
_MAVERICK = ModelArgs(
    num_experts=128,
    interleave_moe_layer_step=2,
    use_qk_norm=False,
    rope_scaling=None,
)

_TORCHMOE_FLAVORS: dict[str, ModelArgs] = {
    # Tiny (2.4 M parameters): every feature (dense + MoE layers, NoPE + chunked RoPE layers,
    # temperature tuning, llama3 rope scaling, shared expert) at sizes divisible by 4 for TP/EP up
    # to 4. The default CPU job and the tests' model.
    "tiny": ModelArgs(
        dim=128,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=16,
        vocab_size=512,
        max_seq_len=2048,
        rope_theta=10000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        attention_chunk_size=64,
        floor_scale=32,
        ffn_hidden_dim=384,
        moe_hidden_dim=256,
        interleave_moe_layer_step=2,
        num_experts=8,
        top_k=1,
    ),
    # The benchmark reference config of scripts/bench_train.py (issue 4): MoE every 2nd layer.
    # (torchtitan's debugmodel has its shapes, with another RoPE.)
    "bench256": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=16,
        head_dim=16,
        vocab_size=2048,
        max_seq_len=2048,
        rope_theta=10000.0,
        rope_scaling=None,
        attention_chunk_size=None,
        no_rope_layer_interval=1_000_000,
        use_qk_norm=False,
        attn_temperature_tuning=False,
        ffn_hidden_dim=768,
        moe_hidden_dim=512,
        interleave_moe_layer_step=2,
        num_experts=8,
        top_k=1,
    ),
    "scout": _SCOUT,
    "maverick": _MAVERICK,
}


# ---- torchtitan v0.2.2's flavors (torchtitan/models/llama4/__init__.py), under its names ---------
# Its model: head_dim = dim // n_heads; no QK norm, no temperature tuning, no weight tying; RoPE
# theta 500000 with LLAMA4_ROPE_SCALING (17bx128e: none); hidden dims from its multiple_of /
# ffn_dim_multiplier rule (written out below); MoE layers where (i + 1) % step == 0. Every layer
# uses RoPE and plain causal attention. The _irope variants make layer i NoPE iff i % 4 == 0 (not
# Hugging Face's (i + 1) % 4, hence the explicit lists) and RoPE layers attend within fixed blocks
# (torchtitan's fixed_attn_block_size). torchtitan's irope flavors also mask documents apart,
# which torchmoe does not (docs/models.md, "Flavors"); their attention runs on torchmoe's default backend.


def _torchtitan(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int, ffn_hidden_dim: int,
                moe_hidden_dim: int, num_experts: int, interleave_moe_layer_step: int, rope_scaling: dict | None,
                max_seq_len: int = 1_048_576) -> ModelArgs:
    """A torchtitan Llama 4 flavor without NoPE layers (one routed expert per token + one shared)."""
    return ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=dim // n_heads,
        vocab_size=vocab_size, max_seq_len=max_seq_len, rope_theta=500000.0, rope_scaling=rope_scaling,
        no_rope_layers=[1] * n_layers, attention_chunk_size=None, use_qk_norm=False, attn_temperature_tuning=False,
        ffn_hidden_dim=ffn_hidden_dim, moe_hidden_dim=moe_hidden_dim,
        interleave_moe_layer_step=interleave_moe_layer_step, num_experts=num_experts, top_k=1, num_shared_experts=1,
    )


def _irope(args: ModelArgs, block: int) -> ModelArgs:
    """torchtitan's `_irope` variant of `args`: NoPE on layers 0, 4, 8, ...; RoPE layers attend
    within blocks of `block` tokens."""
    return args.replace(no_rope_layers=[int(i % 4 != 0) for i in range(args.n_layers)], attention_chunk_size=block)


# dim 256: dense hidden int(2 * 4 * 256 / 3) = 682 -> 768 (multiple of 256); experts int(682 / 2) = 341 -> 512.
_TT_DEBUG = _torchtitan(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, ffn_hidden_dim=768,
                        moe_hidden_dim=512, num_experts=8, interleave_moe_layer_step=2,
                        rope_scaling=dict(LLAMA4_ROPE_SCALING))
# dim 5120, ffn_dim_multiplier 1.2, multiple_of 2048: dense int(1.2 * 13653) = 16383 -> 16384;
# experts int(16383 / 2) = 8191 -> 8192.
_TT_17B = dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, vocab_size=202048, ffn_hidden_dim=16384,
               moe_hidden_dim=8192)
_TT_16E = _torchtitan(**_TT_17B, num_experts=16, interleave_moe_layer_step=1, rope_scaling=dict(LLAMA4_ROPE_SCALING),
                      max_seq_len=10_485_760)
_TT_128E = _torchtitan(**_TT_17B, num_experts=128, interleave_moe_layer_step=2, rope_scaling=None)

_TORCHTITAN_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": _TT_DEBUG,
    "debugmodel_irope": _irope(_TT_DEBUG, 256),
    "17bx16e": _TT_16E,
    "17bx16e_irope": _irope(_TT_16E, 8192),
    "17bx128e": _TT_128E,
    "17bx128e_irope": _irope(_TT_128E, 8192),
}

# torchmoe's first: where several flavors have a checkpoint's shapes, the first is suggested
# (`fit.require_fit`), and the Hugging Face releases' architectures are `scout` and `maverick`.
FLAVORS: dict[str, ModelArgs] = {**_TORCHMOE_FLAVORS, **_TORCHTITAN_FLAVORS}

