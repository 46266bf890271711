"""Model construction, initialisation, sizes and FLOPs."""

from __future__ import annotations

import pytest
import torch

from torchmoe.arch.registry import FLAVORS as FAMILIES
from torchmoe.arch.registry import build_model_args
from torchmoe.models.llama4 import FLAVORS, Transformer


def _meta_then_init(flavor: str, seed: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    model.to_empty(device="cpu")
    model.init_weights(seed=seed, buffer_device=torch.device("cpu"))
    return model


def test_meta_init_is_finite_and_seed_reproducible():
    a, b, c = (_meta_then_init("tiny", s) for s in (0, 0, 1))
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb), name
        if pa.numel() > 1 and "norm" not in name:
            assert not torch.equal(pa, pc), name
    for name, buf in a.named_buffers():
        assert torch.isfinite(torch.view_as_real(buf) if buf.is_complex() else buf).all(), name
    assert all(m.expert_bias.abs().sum() == 0 for m in a.moe_layers())
    logits = a(torch.randint(0, 512, (2, 96)))
    assert torch.isfinite(logits).all() and logits.shape == (2, 96, 512)


def test_debug_flavor_exercises_every_feature():
    args = FLAVORS["tiny"]
    assert 0 < len(args.moe_layer_ids) < args.n_layers  # dense and MoE layers interleaved
    assert False in args.rope_layers and True in args.rope_layers  # NoPE and RoPE layers
    assert args.attention_chunk_size and args.rope_scaling and args.use_qk_norm and args.attn_temperature_tuning
    for size in (args.n_heads, args.n_kv_heads, args.num_experts, args.ffn_hidden_dim, args.moe_hidden_dim,
                 args.vocab_size, args.dim):
        assert size % 4 == 0  # TP and EP up to 4


def test_param_count_matches_modules():
    model = _meta_then_init("tiny", 0)
    counts = FLAVORS["tiny"].param_counts()
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    assert counts["embedding"] == model.tok_embeddings.weight.numel()


@pytest.mark.parametrize(
    "flavor, total, active",
    # Published: Scout 109B total / 17B active, Maverick 400B / 17B. The Scout figure includes the
    # ~1.2B vision tower and projector, which a text model lacks: text-only is 107.8B.
    [("scout", 107.77e9, 17.17e9), ("maverick", 400.71e9, 17.18e9)],
)
def test_released_flavor_sizes(flavor, total, active):
    counts = FLAVORS[flavor].param_counts()
    assert counts["total"] == pytest.approx(total, rel=1e-3)
    assert counts["active"] == pytest.approx(active, rel=1e-3)
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    assert sum(p.numel() for p in model.parameters()) == counts["total"]


def test_flops_per_token_formula():
    args = FLAVORS["scout"]
    counts = args.param_counts()
    seq = 8192
    # 36 chunked RoPE layers see min(seq, chunk) = 8192 tokens, 12 NoPE layers the full 8192.
    attn = 12 * args.n_heads * args.head_dim * seq * args.n_layers
    assert args.flops_per_token(seq) == 6 * (counts["active"] - counts["embedding"]) + attn
    long = args.flops_per_token(32768)
    n_rope = sum(args.rope_layers)
    expected_attn = 12 * args.n_heads * args.head_dim * (n_rope * 8192 + (args.n_layers - n_rope) * 32768)
    assert long == 6 * (counts["active"] - counts["embedding"]) + expected_attn
    # Counted causally, a query attends half its context on average: half the attention FLOPs.
    assert args.flops_per_token(32768, causal=True) == 6 * (counts["active"] - counts["embedding"]) + expected_attn // 2


def test_build_model_args_overrides():
    args = build_model_args("llama4", "tiny", attn_backend="flex", use_grouped_mm=False, load_balance_coeff=0.0,
                            aux_loss_coeff=0.1)
    assert (args.attn_backend, args.use_grouped_mm, args.load_balance_coeff, args.aux_loss_coeff) == (
        "flex", False, None, 0.1)
    assert build_model_args("llama4", "tiny").load_balance_coeff == FLAVORS["tiny"].load_balance_coeff


@pytest.mark.parametrize(("name", "bias", "aux"), [("llama4", 1e-3, 0.0), ("deepseek_v3", 1e-3, 0.0),
                                                    ("qwen3", None, 1e-3), ("gpt_oss", None, 1e-3)])
def test_each_family_balances_by_its_recipe_by_default(name, bias, aux):
    """A `[model]` section that leaves both keys at -1 trains each family's recipe: the
    aux-loss-free bias where its Hugging Face model holds it or torchtitan trains it (DeepSeek-V3,
    Llama 4), the released configs' balance loss where it has no place for it (Qwen3-MoE, gpt-oss);
    every flavor of the family alike, and 0 turns either off."""
    from torchmoe.arch.registry import FLAVORS as FAMILIES
    from torchmoe.arch.registry import model_args_from_config
    from torchmoe.config import load_job_config

    for flavor in FAMILIES[name]:
        args = model_args_from_config(load_job_config(["--model.name", name, "--model.flavor", flavor]).model)
        assert (args.load_balance_coeff, args.aux_loss_coeff) == (bias, aux), flavor
    off = build_model_args(name, "tiny", load_balance_coeff=0.0, aux_loss_coeff=0.0)
    assert (off.load_balance_coeff, off.aux_loss_coeff) == (None, 0.0)


def test_flex_attention_matches_sdpa():
    model = _meta_then_init("tiny", 0)
    flex = Transformer(FLAVORS["tiny"].replace(attn_backend="flex"))
    flex.load_state_dict(model.state_dict())
    flex.init_buffers("cpu")
    tokens = torch.randint(0, 512, (1, 128))
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens), model(tokens), rtol=1e-4, atol=1e-4)


def test_longer_than_rope_cache_computes_on_the_fly():
    args = FLAVORS["tiny"].replace(max_seq_len=64)
    model = Transformer(args)
    model.init_weights(seed=0)
    big = Transformer(args.replace(max_seq_len=256))
    big.load_state_dict(model.state_dict())
    big.init_buffers("cpu")
    tokens = torch.randint(0, 512, (1, 200))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), big(tokens))


# The published sizes of the Qwen3-MoE releases (Qwen/Qwen3-30B-A3B and -235B-A22B model cards:
# 30.5B / 3.3B and 235B / 22B), exactly as the safetensors hold them.
@pytest.mark.parametrize(("flavor", "total", "active"), [("30B-A3B", 30_532_122_624, 3_353_032_704),
                                                         ("235B-A22B", 235_093_634_560, 22_190_763_520)])
def test_qwen3_flavors_have_the_published_sizes(flavor: str, total: int, active: int) -> None:
    args = FAMILIES["qwen3"][flavor]
    counts = args.param_counts()
    assert (counts["total"], counts["active"]) == (total, active)
    with torch.device("meta"):  # the model the counts describe (48/94 layers on the meta device)
        assert sum(p.numel() for p in Transformer(args).parameters()) == total


# DeepSeek-V3's published sizes: "671B total, 37B activated" (the MTP module's 14B aside, which
# the causal LM does not run), and torchtitan's 16B (DeepSeek-V2-Lite's 15.7B) and 236B
# (DeepSeek-V2's 236B / 21B) shapes.
@pytest.mark.parametrize(("flavor", "total", "active"), [("671B", 671_026_404_352, 37_552_282_624),
                                                         ("236B", 235_741_434_880, 21_375_800_320),
                                                         ("16B", 15_706_484_224, 2_661_150_208)])
def test_deepseek_v3_flavors_have_the_published_sizes(flavor: str, total: int, active: int) -> None:
    args = FAMILIES["deepseek_v3"][flavor]
    counts = args.param_counts()
    assert (counts["total"], counts["active"]) == (total, active)
    with torch.device("meta"):  # the model the counts describe
        assert sum(p.numel() for p in Transformer(args).parameters()) == total


def test_latent_attention_flops_count_the_value_width():
    """MLA's query/key heads are nope + rope (192) wide and its values 128: the scores and the
    weighted sum count each at its own width, 6 x heads x (192 + 128) per attended token, not
    12 x heads x 192 (what the kernel runs on the padded values is the step time's business)."""
    args = FAMILIES["deepseek_v3"]["671B"]
    counts = args.param_counts()
    seq = 4096
    attention = 6 * args.n_heads * (192 + 128) * seq * args.n_layers
    assert (args.head_dim, args.value_head_dim) == (192, 128)
    assert args.flops_per_token(seq) == 6 * (counts["active"] - counts["embedding"]) + attention
    assert args.flops_per_token(seq, causal=True) == 6 * (counts["active"] - counts["embedding"]) + attention // 2


@pytest.mark.parametrize(("flavor", "total", "active"), [("20b", 20_914_757_184, 3_608_307_264),
                                                         ("120b", 116_829_156_672, 5_132_849_472)])
def test_gpt_oss_flavors_have_the_published_sizes(flavor: str, total: int, active: int) -> None:
    """The model card's 20.91B / 3.61B and 116.83B / 5.13B: gpt-oss counts the output head but not
    the embedding table as active."""
    args = FAMILIES["gpt_oss"][flavor]
    assert (args.param_counts()["total"], args.param_counts()["active"]) == (total, active)
    with torch.device("meta"):
        assert sum(p.numel() for p in Transformer(args).parameters()) == total


def test_sliding_window_flops_count_the_window():
    """gpt-oss's sliding layers (the even ones) attend at most 128 positions, its full layers the
    whole context; the matmuls count the active parameters (which exclude the embedding here)."""
    args = FAMILIES["gpt_oss"]["120b"]
    seq = 4096
    per_key = 6 * args.n_heads * 2 * args.head_dim
    attention = per_key * (128 * 18 + seq * 18)
    assert args.flops_per_token(seq) == 6 * args.param_counts()["active"] + attention
    assert args.flops_per_token(seq, causal=True) == 6 * args.param_counts()["active"] + attention // 2
