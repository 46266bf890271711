"""LoRA adapters in PEFT's format, per family (Qwen3-MoE, gpt-oss, DeepSeek-V3 on tiny random
transformers models): what torchmoe exports, ``peft.PeftModel.from_pretrained`` loads onto the
transformers model with torchmoe's logits (fp32, 1e-5), the routed experts' adapters included;
the merged export loads in transformers with the same logits; adapters written by PEFT itself
import into torchmoe with PEFT's logits and gradients; what PEFT cannot hold is refused, naming
lora.export and offering the merged export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.hf_parity import max_rel_err, perturb_constant_inits, random_tokens  # noqa: E402
from torchmoe.components.peft_adapter import load_peft_adapter, save_merged_model, save_peft_adapter  # noqa: E402
from torchmoe.config.errors import ConfigError  # noqa: E402
from torchmoe.config.job_config import LoRA  # noqa: E402
from torchmoe.hf import load_model  # noqa: E402
from torchmoe.models.decoder.lora import apply_lora  # noqa: E402
from torchmoe.nn.lora import is_adapter_name  # noqa: E402

_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2,
               max_position_embeddings=256)
FAMILIES = {
    # a dense first layer (mlp_only_layers) beside an MoE layer
    "qwen3": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=32,
                                                  num_key_value_heads=2, head_dim=16, num_experts=6,
                                                  norm_topk_prob=True, mlp_only_layers=[0])),
    # experts stored input-major with interleaved gate/up columns and biases; a router bias
    "gpt_oss": (GptOssForCausalLM, GptOssConfig(**_COMMON, intermediate_size=32, num_key_value_heads=2, head_dim=16,
                                                num_local_experts=6, sliding_window=8)),
    # MLA (the query bottleneck), a dense first layer, a shared expert, groups
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        **_COMMON, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=10)),
}
# Every target PEFT holds for each family (Qwen3-MoE and DeepSeek-V3: not the dense MLP and the
# shared experts, see test_peft_cannot_hold_dense_mlp_adapters_of_qwen3_and_deepseek).
PEFT_TARGETS = ["attention", "experts", "router"]
ALL_TARGETS = ["attention", "mlp", "shared_experts", "experts", "router"]


def _hf(family: str):
    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    return perturb_constant_inits(cls(config).eval())


def _adapted(hf, folder, targets, seed: int = 1, rank: int = 4, alpha: float = 6.0):
    """torchmoe's model of `hf` (saved to `folder`) with adapters on `targets`, B and A random."""
    hf.save_pretrained(folder)
    ours = load_model(folder)
    cfg = LoRA(enable=True, targets=targets, rank=rank, alpha=alpha)
    apply_lora(ours, cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if is_adapter_name(name):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
    return ours, cfg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_adapter_loads_in_peft_with_our_logits(family, tmp_path):
    hf = _hf(family)
    ours, cfg = _adapted(hf, tmp_path / "hf", PEFT_TARGETS)
    tokens = random_tokens(96)
    with torch.no_grad():
        base = hf(tokens).logits
        got = ours(tokens)
    save_peft_adapter(ours, tmp_path / "adapter", cfg)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 6.0 and config["peft_type"] == "LORA"
    assert "model.layers.1.mlp.experts.gate_up_proj" in config["target_parameters"]
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        ref = peft_model(tokens).logits
    assert max_rel_err(ref, got) <= 1e-5
    assert max_rel_err(base, got) > 0.1  # the adapters change the model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merged_export_loads_in_transformers_with_our_logits(family, tmp_path):
    hf = _hf(family)
    cls, config = FAMILIES[family]
    targets = ALL_TARGETS if family == "deepseek_v3" else PEFT_TARGETS + (["mlp"] if family == "qwen3" else [])
    ours, _ = _adapted(hf, tmp_path / "hf", targets)
    tokens = random_tokens(96)
    save_merged_model(ours, tmp_path / "merged")
    merged = cls.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert max_rel_err(merged(tokens).logits, ours(tokens)) <= 1e-5


def test_adapter_round_trip_continues_where_it_left(tmp_path):
    """Exported, then imported into a fresh adapted model: the same adapter tensors, bit for bit."""
    hf = _hf("deepseek_v3")
    ours, cfg = _adapted(hf, tmp_path / "hf", PEFT_TARGETS)
    save_peft_adapter(ours, tmp_path / "adapter", cfg)
    fresh, _ = _adapted(hf, tmp_path / "hf2", PEFT_TARGETS, seed=7)
    load_peft_adapter(fresh, tmp_path / "adapter", cfg)
    saved = dict(ours.named_parameters())
    for name, p in fresh.named_parameters():
        if is_adapter_name(name):
            assert torch.equal(p, saved[name]), name


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_pefts_own_adapter_imports_with_its_logits_and_gradients(family, tmp_path):
    """An adapter PEFT made (get_peft_model, its B drawn off zero, save_pretrained) read into
    torchmoe: the same logits, and the same gradients of every adapter tensor for one loss."""
    hf = _hf(family)
    ours, cfg = _adapted(hf, tmp_path / "hf", PEFT_TARGETS, seed=9)  # saves hf before PEFT wraps it
    router = "mlp.gate.weight" if family == "qwen3" else "mlp.router.weight"
    config = peft.LoraConfig(r=4, lora_alpha=6, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", router])
    peft_model = peft.get_peft_model(hf, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
    peft_model.save_pretrained(tmp_path / "adapter")
    load_peft_adapter(ours, tmp_path / "adapter", cfg)
    for moe in ours.moe_layers():  # the logits' gradients alone: transformers adds no balance loss here
        moe.aux_loss_coeff = moe.z_loss_coeff = 0.0
    tokens = random_tokens(96)
    weights = torch.randn(2, 40, 96, generator=generator)
    ref = peft_model(tokens).logits
    got = ours(tokens)
    assert max_rel_err(ref, got) <= 1e-5
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    # Our gradients, written through the same mapping as the adapters, against PEFT's.
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if is_adapter_name(name):
                p.copy_(p.grad)
    save_peft_adapter(ours, tmp_path / "grads", cfg)
    ours_grads = load_file(tmp_path / "grads" / "adapter_model.safetensors")
    peft_grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if "lora_" in n}
    assert sorted(ours_grads) == sorted(peft_grads)
    for name, grad in ours_grads.items():
        assert max_rel_err(peft_grads[name], grad) <= 1e-5, name


@pytest.mark.parametrize("family,target,title", [("qwen3", "mlp", "Qwen3-MoE"),
                                                 ("deepseek_v3", "shared_experts", "DeepSeek-V3")])
def test_peft_cannot_hold_dense_mlp_adapters_of_qwen3_and_deepseek(family, target, title, tmp_path):
    ours, cfg = _adapted(_hf(family), tmp_path / "hf", [target])
    with pytest.raises(ConfigError) as e:
        save_peft_adapter(ours, tmp_path / "adapter", cfg)
    assert str(e.value) == (
        f'lora.export = "adapter": PEFT (transformers 5) reads target modules named gate_proj/up_proj/down_proj '
        f'of {title} as routed experts, so it cannot load adapters on the dense MLP (lora.targets "mlp") or the '
        f'shared experts ("shared_experts")\n  fix: set lora.export = "merged" (the model with each adapter '
        f'folded into its weight)')
    assert not (tmp_path / "adapter").exists()


def test_import_refuses_another_rank(tmp_path):
    hf = _hf("qwen3")
    ours, cfg = _adapted(hf, tmp_path / "hf", PEFT_TARGETS)
    save_peft_adapter(ours, tmp_path / "adapter", cfg)
    other, other_cfg = _adapted(hf, tmp_path / "hf2", PEFT_TARGETS, rank=8, alpha=6.0)
    with pytest.raises(ConfigError, match=r"its adapter_config.json has r = 4, the run 8"):
        load_peft_adapter(other, tmp_path / "adapter", other_cfg)
