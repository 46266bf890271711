"""Qwen3-MoE text models: the named flavors (`model.name = "qwen3"`).

    python -c "from torchmoe.arch.qwen3 import FLAVORS; print(FLAVORS['30B-A3B'].param_counts())"

Qwen3-MoE is the GQA decoder of `ModelArgs` with RMSNorm of every query and key head before RoPE
(`qk_rms_norm`), RoPE on half-split pairs, plain causal attention on every layer, and a softmax
router over all experts whose top-k scores scale the experts' outputs, renormalised to sum to 1
when `norm_topk_prob`; no shared expert. Layer ``i`` is an MoE layer unless it is listed in
Hugging Face's ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
(`moe_layers` holds the result); dense layers use `ffn_hidden_dim` (HF ``intermediate_size``).

Load balancing follows the released recipe, which Hugging Face's format can hold: an auxiliary
balance loss at the configs' ``router_aux_loss_coef`` (0.001; torchmoe's is the sequence-wise form
of `aux_loss_coeff`, where the Qwen3 report's is over the global batch) and no aux-loss-free
expert bias, which ``Qwen3MoeForCausalLM`` has no place for (an export would route without it).
"""

from __future__ import annotations

from torchmoe.arch.model_args import RELEASED_AUX_LOSS_COEFF, ModelArgs


def qwen3_moe(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, vocab_size: int,
              ffn_hidden_dim: int, moe_hidden_dim: int, num_experts: int, top_k: int, max_seq_len: int,
              rope_theta: float = 1_000_000.0, norm_topk_prob: bool = True, norm_eps: float = 1e-6,
              dense_layers: tuple[int, ...] = (), tie_word_embeddings: bool = False) -> ModelArgs:
    """A Qwen3-MoE architecture; `dense_layers` are Hugging Face's ``mlp_only_layers``."""
    return ModelArgs(
        family="qwen3", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        vocab_size=vocab_size, norm_eps=norm_eps, max_seq_len=max_seq_len, rope_theta=rope_theta,
        rope_scaling=None, rope_style="half", no_rope_layers=[1] * n_layers, attention_chunk_size=None,
        use_qk_norm=False, qk_rms_norm=True, attn_temperature_tuning=False, ffn_hidden_dim=ffn_hidden_dim,
        moe_hidden_dim=moe_hidden_dim, moe_layers=[i for i in range(n_layers) if i not in dense_layers],
        num_experts=num_experts, top_k=top_k, num_shared_experts=0, score_func="softmax",
        score_before_experts=False, norm_topk_prob=norm_topk_prob, tie_word_embeddings=tie_word_embeddings,
        load_balance_coeff=None, aux_loss_coeff=RELEASED_AUX_LOSS_COEFF,
    )


FLAVORS: dict[str, ModelArgs] = {
    # torchmoe's test model (1.1 M parameters): a dense first layer and MoE layers, sizes divisible
    # by 4 for TP/EP up to 4.
    "tiny": qwen3_moe(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16, vocab_size=512,
                      ffn_hidden_dim=256, moe_hidden_dim=64, num_experts=8, top_k=2, max_seq_len=2048,
                      rope_theta=10000.0, dense_layers=(0,)),
    # torchtitan's debug model (its shapes and names).
    "debugmodel_moe": qwen3_moe(dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128, vocab_size=2048,
                                ffn_hidden_dim=3072, moe_hidden_dim=768, num_experts=64, top_k=8, max_seq_len=4096),
    # The released Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json files.
    "30B-A3B": qwen3_moe(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
                         ffn_hidden_dim=6144, moe_hidden_dim=768, num_experts=128, top_k=8, max_seq_len=40960),
    "235B-A22B": qwen3_moe(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, vocab_size=151936,
                           ffn_hidden_dim=12288, moe_hidden_dim=1536, num_experts=128, top_k=8, max_seq_len=40960),
}
