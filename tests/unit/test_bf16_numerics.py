"""Where bf16 rounds, each family rounds as its transformers model does: the router's gate matmul
(DeepSeek-V3's in fp32, the others' in bf16) and the RMSNorm's order of weight multiply and cast
(gpt-oss's before the cast, the others' after it). Same weights, same bf16 inputs: the same experts
for every token, and bit-equal norms.

    python -m pytest -q tests/unit/test_bf16_numerics.py

The routing cases have the power to see a wrong precision: each checks that the other precision
(torchmoe's router with the family's `router_gate_fp32` flipped) picks another expert set for at
least 1% of the tokens, so a bf16 gate where the reference runs fp32 (or the reverse) fails.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchmoe.arch.model_args import ModelArgs  # noqa: E402
from torchmoe.arch.registry import FLAVORS  # noqa: E402
from torchmoe.models.decoder.model import Transformer  # noqa: E402
from torchmoe.models.decoder.moe import MoE  # noqa: E402
from torchmoe.models.registry import hf_mapping_for_config  # noqa: E402

# Large enough that logits rounded to bf16 reorder the experts of some tokens (1.7% of them at
# 64 experts and hidden 512 for DeepSeek-V3's router); small enough for a unit test.
DIM, EXPERTS, TOP_K, TOKENS = 512, 64, 4, 4096


def _deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=DIM, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=8,
                              topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
                              moe_intermediate_size=32, intermediate_size=32)
    router = DeepseekV3TopkRouter(config)  # its weight and bias stay fp32 in a bf16 model
    return config, router, lambda out: (out[2], out[1])


def _qwen3():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
                            moe_intermediate_size=32, intermediate_size=32)
    return config, Qwen3MoeTopKRouter(config).to(torch.bfloat16), lambda out: (out[2], out[1])


def _gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = GptOssConfig(hidden_size=DIM, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=32)
    return config, GptOssTopKRouter(config).to(torch.bfloat16), lambda out: (out[2], out[1])


def _llama4():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    config = Llama4TextConfig(hidden_size=DIM, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                              intermediate_size=32, intermediate_size_mlp=32)

    def chosen(out):  # (T, E) scores: the sigmoid of the chosen logits, zero elsewhere
        scores = out[0]
        top = scores.float().topk(TOP_K, dim=-1)
        return top.indices, top.values

    return config, Llama4Router(config).to(torch.bfloat16), chosen


ROUTERS = {"deepseek_v3": _deepseek_v3, "qwen3": _qwen3, "gpt_oss": _gpt_oss, "llama4": _llama4}


def _args(config) -> ModelArgs:
    """torchmoe's `ModelArgs` of a transformers config, read as a config.json is."""
    d = config.to_dict()
    return hf_mapping_for_config(d).args_from_hf_config(d)


def _our_router(args: ModelArgs, reference: torch.nn.Module) -> MoE:
    """A bf16 MoE layer of `args` whose router holds `reference`'s gate weight (and bias)."""
    moe = MoE(args).to(torch.bfloat16)
    with torch.no_grad():
        moe.router.gate.weight.copy_(reference.weight)
        if moe.router.gate.bias is not None:
            moe.router.gate.bias.copy_(reference.bias)
    return moe


def _other_sets(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of tokens whose (T, k) expert sets differ."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1).float().mean().item()


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_bf16_routing_selects_the_experts_transformers_selects(family):
    config, reference, chosen = ROUTERS[family]()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():  # values bf16 holds, so both sides hold the same weights
            p.copy_((torch.randn(p.shape, generator=generator) * DIM**-0.5).to(torch.bfloat16))
        if family == "deepseek_v3":
            reference.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=generator) * 0.01)
    args = _args(config)
    x = torch.randn(TOKENS, DIM, generator=generator).to(torch.bfloat16)
    with torch.no_grad():
        want, want_gates = chosen(reference(x))
        ours = _our_router(args, reference)
        bias = reference.e_score_correction_bias if family == "deepseek_v3" else ours.expert_bias
        gates, selected, _, _ = ours.router(x, bias)
        flipped = _our_router(args.replace(router_gate_fp32=not args.router_gate_fp32), reference)
        _, other, _, _ = flipped.router(x, bias)
    assert _other_sets(want, selected) == 0.0
    # Gates: the same scores of the same experts, rounded where transformers rounds them to bf16.
    order_want, order_ours = want.argsort(-1), selected.argsort(-1)
    torch.testing.assert_close(gates.gather(-1, order_ours), want_gates.float().gather(-1, order_want),
                               rtol=2**-8, atol=0)
    assert _other_sets(want, other) >= 0.01  # the test's power: the other precision routes otherwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_gate_gradients_are_the_upcast_linear_s(dtype):
    """`Fp32Linear` (which saves its operands, not their fp32 copies) gives autograd's gradients
    of ``F.linear`` on fp32 upcasts, cast back to each operand's dtype; with and without a bias,
    under autocast too (which it leaves off inside)."""
    from torchmoe.models.decoder.moe import Fp32Linear

    generator = torch.Generator().manual_seed(3)
    for bias in (False, True):
        gate = Fp32Linear(48, 16, bias=bias).to(dtype)
        with torch.no_grad():
            for p in gate.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
        x = torch.randn(2, 10, 48, generator=generator).to(dtype).requires_grad_()
        grad = torch.randn(2, 10, 16, generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = gate(x)
        out.backward(grad)
        leaves = [t.detach().clone().requires_grad_() for t in (x, *gate.parameters())]
        ref = torch.nn.functional.linear(*(t.float() for t in leaves))
        ref.backward(grad)
        assert out.dtype == torch.float32 and torch.equal(out, ref)
        for got, want in zip((x, *gate.parameters()), leaves):
            assert got.grad.dtype == dtype and torch.equal(got.grad, want.grad)


# ---- RMSNorm ---------------------------------------------------------------------------------------


def _hf_norms(family: str, dim: int, eps: float):
    """transformers' RMSNorm of `family` (its weight fp32 where its bf16 model keeps it fp32:
    gpt-oss's `_keep_in_fp32_modules`)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama4.modeling_llama4 import Llama4TextRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    cls = {"llama4": Llama4TextRMSNorm, "qwen3": Qwen3MoeRMSNorm, "deepseek_v3": DeepseekV3RMSNorm,
           "gpt_oss": GptOssRMSNorm}[family]
    norm = cls(dim, eps=eps)
    return norm if family == "gpt_oss" else norm.to(torch.bfloat16)


def _our_norms(family: str) -> dict[str, torch.nn.Module]:
    """Every RMSNorm with a weight of the family's test model, in bf16, by name."""
    model = Transformer(FLAVORS[family]["tiny"]).to(torch.bfloat16)
    norms = {name: m for name, m in model.named_modules()
             if type(m).__name__ == "RMSNorm" and m.weight is not None}
    assert "norm" in norms and "layers.0.attention_norm" in norms
    return norms


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_bf16_rms_norms_equal_transformers_bit_for_bit(family):
    """Each weighted RMSNorm of the family's model (the blocks', the final one, Qwen3's per-head
    and DeepSeek's latent ones) against transformers' module of the family, bf16 in and out, the
    inputs spread over 6 orders of magnitude and the weights drawn off one."""
    generator = torch.Generator().manual_seed(1)
    for name, ours in _our_norms(family).items():
        dim = ours.weight.shape[0]
        weight = (1 + torch.randn(dim, generator=generator) * 0.3).to(torch.bfloat16)
        theirs = _hf_norms(family, dim, ours.eps)
        x = (torch.randn(64, dim, generator=generator) * 10 ** torch.empty(64, 1).uniform_(-3, 3, generator=generator))
        x = x.to(torch.bfloat16)
        with torch.no_grad():
            ours.weight.copy_(weight)
            theirs.weight.copy_(weight)
            got, want = ours(x), theirs(x)
        assert got.dtype == want.dtype == torch.bfloat16, name
        assert torch.equal(got, want), f"{name}: {(got != want).float().mean().item():.1%} of elements differ"


def test_llama4_qk_l2_norm_equals_transformers_bit_for_bit():
    """Llama 4's weightless QK norm (`Llama4TextL2Norm`) in bf16."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm

    model = Transformer(FLAVORS["llama4"]["tiny"]).to(torch.bfloat16)
    ours = model.layers["0"].attention.qk_norm
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16) * 37
    with torch.no_grad():
        assert torch.equal(ours(x), Llama4TextL2Norm(ours.eps)(x))
