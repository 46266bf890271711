"""gpt-oss text models: the named flavors (`model.name = "gpt_oss"`).

    python -c "from torchmoe.arch.gpt_oss import FLAVORS; print(FLAVORS['120b'].param_counts())"

gpt-oss is `ModelArgs`'s GQA decoder with biases on the q/k/v/o projections, a learned sink logit
per head in every softmax (`attention_sinks`), the even layers attending over a sliding window of
128 positions and the odd ones over the whole causal context, YaRN-scaled RoPE on half-split
pairs; every layer is MoE, routed by a softmax over the top-k of biased logits (the same gates as
softmax scores renormalised over the top k), to experts with biases and a clamped SwiGLU
(`experts_style = "clamped_swiglu"`); no shared expert. The published active count leaves out the
embedding table (`active_counts_embedding`). Load balancing: the auxiliary balance loss at the
released configs' ``router_aux_loss_coef`` (0.001, torchmoe's sequence-wise form) and no
aux-loss-free expert bias, which ``GptOssForCausalLM`` has no place for.

Flavors carry torchtitan's names and shapes; ``20b`` and ``120b`` are the released config.json files.
"""

from __future__ import annotations

from torchmoe.arch.model_args import RELEASED_AUX_LOSS_COEFF, ModelArgs

# The released checkpoints' RoPE scaling (Hugging Face's `rope_parameters`).
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}


def gpt_oss(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, vocab_size: int,
            moe_hidden_dim: int, num_experts: int, top_k: int, sliding_window: int = 128,
            sliding_layers: list[int] | None = None, rope_theta: float = 150000.0, rope_scaling: dict | None = None,
            swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702, max_seq_len: int = 131072,
            norm_eps: float = 1e-5, tie_word_embeddings: bool = False) -> ModelArgs:
    """A gpt-oss architecture; `sliding_layers` defaults to the even layers (Hugging Face's
    ``layer_types`` default), `rope_scaling` to the released YaRN."""
    return ModelArgs(
        family="gpt_oss", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        vocab_size=vocab_size, norm_eps=norm_eps, max_seq_len=max_seq_len, rope_theta=rope_theta,
        rope_scaling=dict(YARN) if rope_scaling is None else rope_scaling, rope_style="half",
        no_rope_layers=[1] * n_layers, attention_chunk_size=None, use_qk_norm=False, attn_temperature_tuning=False,
        attention_bias=True, attention_sinks=True, sliding_window=sliding_window,
        sliding_layers=list(range(0, n_layers, 2)) if sliding_layers is None else sorted(sliding_layers),
        ffn_hidden_dim=moe_hidden_dim, moe_hidden_dim=moe_hidden_dim, moe_layers=list(range(n_layers)),
        num_experts=num_experts, top_k=top_k, num_shared_experts=0, score_func="softmax",
        score_before_experts=False, norm_topk_prob=True, router_bias=True, experts_style="clamped_swiglu",
        swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha, tie_word_embeddings=tie_word_embeddings,
        active_counts_embedding=False, norm_weight_in_fp32=True, load_balance_coeff=None,
        aux_loss_coeff=RELEASED_AUX_LOSS_COEFF,
    )


FLAVORS: dict[str, ModelArgs] = {
    # torchmoe's test model (1.1 M parameters): every gpt-oss option on, a window (8) shorter than
    # the tests' rows; sizes divisible by 4 for TP/EP up to 4.
    "tiny": gpt_oss(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16, vocab_size=512, moe_hidden_dim=64,
                    num_experts=8, top_k=2, sliding_window=8, max_seq_len=2048,
                    rope_scaling={**YARN, "factor": 4.0, "original_max_position_embeddings": 64}),
    # torchtitan's debug model (its shapes).
    "debugmodel": gpt_oss(dim=256, n_layers=4, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=2048,
                          moe_hidden_dim=2880, num_experts=8, top_k=4),
    # The released openai/gpt-oss-20b and openai/gpt-oss-120b config.json files.
    "20b": gpt_oss(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088,
                   moe_hidden_dim=2880, num_experts=32, top_k=4),
    "120b": gpt_oss(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088,
                    moe_hidden_dim=2880, num_experts=128, top_k=4),
}
