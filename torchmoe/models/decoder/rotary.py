"""Rotary position embeddings: each family's frequencies (Llama 3's long-context scaling, YaRN) and
the rotation of query/key coordinate pairs (interleaved or half-split).

    python -c "from torchmoe.arch.registry import FLAVORS; from torchmoe.models.decoder.rotary import \\
        precompute_freqs_cis; print(precompute_freqs_cis(FLAVORS['deepseek_v3']['16B'], 4).abs())"

Rotations are complex numbers (S, rope_dim / 2): ``magnitude * exp(i * position * inv_freq)``.
The magnitude is 1 except under YaRN, whose ``attention_factor`` scales the rotated coordinates
(Hugging Face multiplies its cos and sin by it).
"""

from __future__ import annotations

import math

import torch

from torchmoe.arch.model_args import ModelArgs

__all__ = ["apply_rotary_emb", "precompute_freqs_cis", "rope_frequencies", "yarn_mscale", "yarn_softmax_scale"]


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) fp32 of RoPE over `head_dim` coordinates, scaled as
    ``scaling["rope_type"]`` says: "llama3" (the default: Llama 4's) or "yarn" (DeepSeek-V3's)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type", "llama3") == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
    return _llama3_frequencies(inv_freq, scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's scaling divides low frequencies (wavelength > original_max / low_freq_factor) by
    ``factor``, keeps high frequencies, and interpolates smoothly in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low) if high != low else torch.zeros_like(wavelen)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than ``beta_slow`` times over the
    original context are divided by ``factor`` (interpolated), those turning more than
    ``beta_fast`` times kept (extrapolated), a linear ramp over the dimensions in between (its
    ends rounded outwards unless ``truncate`` is false)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no band: a step, not a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1 - ramp  # the share of each frequency kept as it is
    return (1.0 / (factor * base)) * (1 - extrapolated) + (1.0 / base) * extrapolated


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rotation_magnitude(scaling: dict | None) -> float:
    """YaRN's ``attention_factor`` (given, or ``mscale(factor, mscale) / mscale(factor,
    mscale_all_dim)`` when both are set, else ``mscale(factor)``); 1 for other scalings."""
    if scaling is None or scaling.get("rope_type", "llama3") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def yarn_softmax_scale(scaling: dict | None) -> float:
    """The multiplier of latent attention's softmax scale ``head_dim ** -0.5``: ``mscale(factor,
    mscale_all_dim) ** 2`` under YaRN with ``mscale_all_dim`` set (DeepSeek's), else 1."""
    if scaling is None or scaling.get("rope_type", "llama3") != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def precompute_freqs_cis(args: ModelArgs, seq_len: int, device: torch.device | None = None, *,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
    """Complex rotations (S, rope_dim // 2) for positions 0..seq_len-1, or for `positions` (S,)."""
    inv_freq = rope_frequencies(args.rope_dim, args.rope_theta, args.rope_scaling).to(device)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    freqs = torch.outer(positions.float(), inv_freq)  # (S, rope_dim/2)
    return torch.polar(torch.full_like(freqs, _rotation_magnitude(args.rope_scaling)), freqs)


def _rotate(x: torch.Tensor, fc: torch.Tensor, style: str) -> torch.Tensor:
    """`x` (B, S, H, d) rotated by `fc` (1, S, 1, d/2) complex, pairs as `style` says."""
    if style == "interleaved":
        out = torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * fc)
        return out.flatten(3).type_as(x)
    # "half": pair i is (x_i, x_{i + d/2}); the real and imaginary parts go back to the halves.
    half = x.shape[-1] // 2
    pairs = torch.stack((x[..., :half].float(), x[..., half:].float()), dim=-1)  # (B, S, H, d/2, 2)
    out = torch.view_as_real(torch.view_as_complex(pairs) * fc)
    return torch.cat((out[..., 0], out[..., 1]), dim=-1).type_as(x)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, style: str = "interleaved"):
    """Rotate pairs of q/k coordinates: interleaved (x0, x1), (x2, x3), ... (Llama 4, DeepSeek-V3),
    or half-split (x_i, x_{i + d/2}) (Qwen3, Hugging Face's `rotate_half`).

    xq: (B, S, H, d), xk: (B, S, Hkv, d), freqs_cis: (S, d/2) complex. (Complex, not real
    (cos, sin) pairs: FSDP's and DDP's mixed precision cast every floating-point argument of a
    block to the compute dtype, and complex tensors are left alone.)
    """
    fc = freqs_cis[None, :, None, :]  # (1, S, 1, d/2)
    return _rotate(xq, fc, style), _rotate(xk, fc, style)
