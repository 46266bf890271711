"""DeepSeek-V3 text models (and Kimi K2, the same architecture): the named flavors
(`model.name = "deepseek_v3"`).

    python -c "from torchmoe.arch.deepseek_v3 import FLAVORS; print(FLAVORS['671B'].param_counts())"

DeepSeek-V3 is `ModelArgs`'s decoder with multi-head latent attention (`kv_lora_rank` > 0: the
query bottleneck `q_lora_rank`, the shared key/value latent, decoupled RoPE coordinates of
`qk_rope_head_dim` in interleaved pairs), YaRN-scaled RoPE (whose ``mscale_all_dim`` also scales
the softmax), its first `first_k_dense` layers dense (HF ``first_k_dense_replace``), and in the
others fine-grained routed experts plus `num_shared_experts` shared ones, routed by sigmoid (or
softmax, DeepSeek-V2's, in torchtitan's smaller flavors) scores limited to the `topk_group` best
of `n_group` expert groups, gates renormalised (`norm_topk_prob`) and multiplied by
`routed_scaling_factor`. The aux-loss-free bias is ``load_balance_coeff``'s expert bias, which
Hugging Face stores as ``e_score_correction_bias``.

Flavors carry torchtitan's names and shapes; ``671B`` is the released DeepSeek-V3 config.json.
"""

from __future__ import annotations

from torchmoe.arch.model_args import ModelArgs


def yarn(factor: float, original: int, mscale: float) -> dict:
    """DeepSeek's YaRN scaling, as Hugging Face's ``rope_parameters`` spell it (`mscale` and
    `mscale_all_dim` equal, so the rotations keep magnitude 1 and the softmax scale takes
    ``mscale(factor, mscale) ** 2``)."""
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale}


def deepseek_v3(*, dim: int, n_layers: int, n_heads: int, vocab_size: int, ffn_hidden_dim: int,
                moe_hidden_dim: int, num_experts: int, num_shared_experts: int, top_k: int, first_k_dense: int,
                q_lora_rank: int, kv_lora_rank: int = 512, qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64,
                v_head_dim: int = 128, score_func: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
                routed_scaling_factor: float = 1.0, norm_topk_prob: bool = False, rope_theta: float = 10000.0,
                rope_scaling: dict | None = None, max_seq_len: int = 163840, norm_eps: float = 1e-6,
                tie_word_embeddings: bool = False) -> ModelArgs:
    """A DeepSeek-V3 architecture (module docstring); `q_lora_rank` 0 is a full-rank query."""
    return ModelArgs(
        family="deepseek_v3", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=qk_nope_head_dim + qk_rope_head_dim, vocab_size=vocab_size, norm_eps=norm_eps,
        max_seq_len=max_seq_len, rope_theta=rope_theta, rope_scaling=rope_scaling, rope_style="interleaved",
        no_rope_layers=[1] * n_layers, attention_chunk_size=None, use_qk_norm=False, attn_temperature_tuning=False,
        q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, ffn_hidden_dim=ffn_hidden_dim,
        moe_hidden_dim=moe_hidden_dim, moe_layers=list(range(first_k_dense, n_layers)), num_experts=num_experts,
        top_k=top_k, num_shared_experts=num_shared_experts, score_func=score_func, score_before_experts=False,
        norm_topk_prob=norm_topk_prob, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor, tie_word_embeddings=tie_word_embeddings, mtp_supported=True,
        router_gate_fp32=True,
    )


FLAVORS: dict[str, ModelArgs] = {
    # torchmoe's test model (1.1 M parameters): every DeepSeek-V3 option on (the query bottleneck,
    # values narrower than query/key heads, YaRN with its softmax scale, groups, scaled and
    # renormalised gates, a dense first layer); sizes divisible by 4 for TP/EP up to 4.
    "tiny": deepseek_v3(dim=128, n_layers=4, n_heads=4, vocab_size=512, ffn_hidden_dim=256, moe_hidden_dim=64,
                        num_experts=8, num_shared_experts=1, top_k=2, first_k_dense=1, q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=4,
                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_scaling=yarn(4.0, 256, 1.0), max_seq_len=2048),
    # torchtitan's (DeepSeek-V2-Lite's router: softmax scores, no groups).
    "debugmodel": deepseek_v3(dim=256, n_layers=6, n_heads=16, vocab_size=2048, ffn_hidden_dim=1024,
                              moe_hidden_dim=256, num_experts=8, num_shared_experts=2, top_k=3, first_k_dense=1,
                              q_lora_rank=0, score_func="softmax", rope_scaling=yarn(40.0, 4096, 0.70),
                              max_seq_len=16384),
    "16B": deepseek_v3(dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_hidden_dim=10944,
                       moe_hidden_dim=1408, num_experts=64, num_shared_experts=2, top_k=6, first_k_dense=1,
                       q_lora_rank=0, score_func="softmax", rope_scaling=yarn(40.0, 4096, 0.70), max_seq_len=16384),
    "236B": deepseek_v3(dim=5120, n_layers=60, n_heads=128, vocab_size=102400, ffn_hidden_dim=12288,
                        moe_hidden_dim=1536, num_experts=160, num_shared_experts=2, top_k=6, first_k_dense=1,
                        q_lora_rank=1536, score_func="softmax", n_group=8, topk_group=3, routed_scaling_factor=16.0,
                        rope_scaling=yarn(40.0, 4096, 1.0), max_seq_len=16384),
    # The released deepseek-ai/DeepSeek-V3 config.json (Kimi K2: 384 experts, 64 heads, 1 group).
    "671B": deepseek_v3(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_dim=18432,
                        moe_hidden_dim=2048, num_experts=256, num_shared_experts=1, top_k=8, first_k_dense=3,
                        q_lora_rank=1536, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_scaling=yarn(40.0, 4096, 1.0)),
}
