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
