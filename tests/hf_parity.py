"""What the Hugging Face parity tests of every family share: the error measure, the tokens, and the
perturbation of what transformers initialises to constants (so a swapped or dropped weight shows).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Parameters and buffers transformers initialises to ones or zeros, by name ending: norms (to
# perturb around one) and routers and their biases (to draw).
_NORMS = "norm"
_ROUTERS = ("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")
_BUFFERS = ("e_score_correction_bias",)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of `a` and `b`, relative to the largest magnitude of `a`."""
    return ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()


def random_tokens(vocab: int, seq_len: int = 40) -> torch.Tensor:
    """(2, seq_len) token ids below `vocab`, the same on every call."""
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(1))


def perturb_constant_inits(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its norms moved off one and its routers (and DeepSeek's selection bias) drawn
    off zero, in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _NORMS in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith(_ROUTERS):
                p.normal_(0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith(_BUFFERS):
                b.normal_(0, 0.1)
    return model


def assert_round_trip(hf, folder: Path, *, family: str, vocab: int) -> None:
    """`hf` (a transformers causal LM) saved to `folder`, loaded by torchmoe as `family`, computes
    the same logits (1e-5); saved back, transformers loads it as the same architecture and model
    type with the same logits again."""
    from torchmoe.hf import load_model, save_model

    hf.save_pretrained(folder / "hf")
    ours = load_model(folder / "hf")
    assert ours.args.family == family
    tokens = random_tokens(vocab)
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == (2, 40, vocab)
    assert max_rel_err(ref, got) <= 1e-5

    save_model(ours, folder / "back")
    config = json.loads((folder / "back" / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type and config["architectures"] == [type(hf).__name__]
    hf_back = type(hf).from_pretrained(folder / "back").eval()
    with torch.no_grad():
        assert max_rel_err(got, hf_back(tokens).logits) <= 1e-5


def assert_our_model_loads_in_transformers(ours: torch.nn.Module, hf_class: type, folder: Path,
                                           flavor: str = "tiny") -> None:
    """`ours` (a torchmoe model whose constant inits the caller perturbed) saved to `folder` is
    read by transformers' `hf_class` with the same logits over 96 tokens (1e-5), and read back by
    torchmoe as `flavor`."""
    from torchmoe.hf import load_model, save_model
    from torchmoe.weights.flavor_fit import matching_flavor

    save_model(ours.eval(), folder)
    hf = hf_class.from_pretrained(folder).eval()
    tokens = random_tokens(ours.args.vocab_size, 96)
    with torch.no_grad():
        assert max_rel_err(hf(tokens).logits, ours(tokens)) <= 1e-5
    assert matching_flavor(load_model(folder).args) == flavor


def assert_bf16_parity(hf, folder: Path, vocab: int, bound: float) -> None:
    """`hf` in bf16, saved and loaded by torchmoe in bf16: logits within `bound` of transformers'
    (bf16 rounds differently along two op orders: its 8 bits of mantissa set the bound)."""
    from torchmoe.hf import load_model

    hf = hf.to(torch.bfloat16)
    hf.save_pretrained(folder)
    ours = load_model(folder, dtype=torch.bfloat16)
    tokens = random_tokens(vocab)
    with torch.no_grad():
        assert max_rel_err(hf(tokens).logits, ours(tokens)) <= bound


# ---- MXFP4 ----------------------------------------------------------------------------------------

BLOCK = 32  # values per scale


def mxfp4_pack(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, out, in) values that MXFP4 holds exactly (from `mxfp4_values`) -> (blocks, scales)."""
    e, rows, cols = values.shape
    groups = values.reshape(e, rows, cols // BLOCK, BLOCK)
    exponents = torch.floor(torch.log2(groups.abs().amax(-1).clamp_min(2.0**-100) / 6.0)).clamp_min(-127)
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    index = (scaled.abs().unsqueeze(-1) - codes).abs().argmin(-1) + 8 * (scaled < 0)
    assert torch.equal(torch.exp2(exponents).unsqueeze(-1) * codes[index % 8] * torch.where(index >= 8, -1, 1), groups)
    nibbles = index.to(torch.uint8).reshape(e, rows, cols // BLOCK, BLOCK // 2, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4), (exponents + 127).to(torch.uint8)


def mxfp4_values(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Values MXFP4 holds exactly: E2M1 codes times a power of two per group of 32 (one of which
    is the group's largest, 6 x 2^k, so the scale is 2^k)."""
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = codes[torch.randint(0, 8, shape, generator=generator)]
    values = values * torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
    groups = values.view(*shape[:-1], -1, BLOCK)
    groups[..., 0] = 6.0
    exponents = torch.randint(-9, -5, groups.shape[:-1], generator=generator).float()
    return (groups * torch.exp2(exponents).unsqueeze(-1)).view(shape)


def mxfp4_exact_experts(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give `model`'s (gpt-oss) expert matrices values MXFP4 holds exactly (`mxfp4_values`), in place."""
    with torch.no_grad():
        for moe in model.moe_layers():
            for w in (moe.experts.w13, moe.experts.w2):
                w.copy_(mxfp4_values(tuple(w.shape), generator))


def mxfp4_folder(folder: Path, out: Path) -> Path:
    """The single-file Hugging Face gpt-oss folder `folder` (expert matrices of `mxfp4_values`)
    written to `out` in the releases' form: each expert matrix as MXFP4 blocks and scales,
    config.json's quantization_config mxfp4."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    for name in [n for n in weights if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4_pack(weights.pop(name).transpose(1, 2).contiguous())
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out
