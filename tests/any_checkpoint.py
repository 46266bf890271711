"""Tiny random Hugging Face checkpoints, made by transformers, whose sizes match no shipped flavor:
what the tests of "any released checkpoint" start from (`weight_sources.folder_model`).

    folder = save_checkpoint("qwen3", tmp_path / "qwen3")   # config.json + model.safetensors
    hf = reference_model("qwen3")                            # the same weights, in transformers

Each family's config is a variant the shipped flavors lack: Llama 4 with 3 layers of 6 heads,
chunked attention and a NoPE last layer; Qwen3-MoE with 6 heads of 8 over a
48-wide model, 3 layers and a dense first one; gpt-oss with another layer count and a window
pattern that is not the released even/odd one; DeepSeek-V3 in Moonlight's form (a full-rank
query, one expert group, a dense first layer, plain RoPE at theta 50000, the remote-code fields
its config.json carries). Vocabularies hold the byte tokenizer's ids (512).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.hf_parity import perturb_constant_inits

VOCAB = 512

CONFIGS: dict[str, dict] = {
    "llama4": dict(model_type="llama4_text", vocab_size=VOCAB, hidden_size=48, intermediate_size=24,
                   intermediate_size_mlp=40, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                   head_dim=8, num_local_experts=6, num_experts_per_tok=1, interleave_moe_layer_step=1,
                   attention_chunk_size=16, no_rope_layer_interval=3, floor_scale=8, attn_scale=0.1,
                   max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen3": dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=48, intermediate_size=40,
                  moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                  head_dim=8, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                  max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=VOCAB, hidden_size=48, intermediate_size=24,
                    num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                    num_local_experts=6, num_experts_per_tok=2, sliding_window=4, max_position_embeddings=512,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                    rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 32,
                                     "rope_theta": 150000.0}),
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                        moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                        n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1,
                        routed_scaling_factor=2.446, norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=None,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
}

# Each family's config with expert shapes no 16-byte row holds in bf16 (8 elements) and some not
# in fp32 (4): the experts' hidden size and the model dim (`nn.grouped_gemm`). transformers runs them.
ODD_SHAPES: dict[str, dict] = {
    "llama4": dict(hidden_size=30, intermediate_size=20),
    "qwen3": dict(hidden_size=30, moe_intermediate_size=20),
    "gpt_oss": dict(hidden_size=36, intermediate_size=20),
    "deepseek_v3": dict(hidden_size=36, moe_intermediate_size=12),
}

# What Moonlight's config.json says beyond transformers' DeepseekV3Config (its remote code's
# fields, the older RoPE spelling), with the values of the release.
_MOONLIGHT_FIELDS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "ep_size": 1,
                     "aux_loss_alpha": 0.001, "seq_aux": True, "pretraining_tp": 1, "num_nextn_predict_layers": 0,
                     "rope_scaling": None, "rope_theta": 50000.0,
                     "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}


def reference_model(family: str, seed: int = 0, **sizes: int) -> torch.nn.Module:
    """The transformers model of `family`'s config (`sizes` replacing its fields, e.g. its
    `ODD_SHAPES`), fp32, its constant inits perturbed (and gpt-oss's biases and sinks drawn large
    enough to matter)."""
    import transformers

    cfg = {**CONFIGS[family], **sizes}
    config_class = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    # transformers' default experts call torch's grouped GEMM, which raises on rows of other
    # than 16 bytes ("strides should be multiple of 16 bytes"); its per-expert loop runs any size.
    loop = {"experts_implementation": "eager"} if sizes else {}
    model = perturb_constant_inits(transformers.AutoModelForCausalLM.from_config(config_class, **loop).eval())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if family == "gpt_oss" and name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    return model


def save_checkpoint(family: str, folder: Path, seed: int = 0, sizes: dict[str, int] | None = None,
                    **edits: object) -> Path:
    """`reference_model(family, seed, **sizes)` saved by transformers to `folder`, its config.json
    then given `edits` (a key set to None is written as null); DeepSeek-V3's in Moonlight's spelling."""
    reference_model(family, seed, **(sizes or {})).save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if family == "deepseek_v3":
        config.pop("rope_parameters")
        config.update(_MOONLIGHT_FIELDS)
    path.write_text(json.dumps({**config, **edits}, indent=2))
    return folder
