"""MXFP4 weights (the OCP microscaling format gpt-oss releases its experts in), dequantised on load.

    values = dequantize(blocks, scales)             # (..., G, 16) uint8, (..., G) uint8 -> (..., 32 G) fp32
    load_packed(view, [(file, "..._blocks"), (file, "..._scales")])   # this rank's box, into `view`

A packed tensor ``name`` is stored as ``name_blocks`` (each byte two 4-bit E2M1 values, the low
nibble first) and ``name_scales`` (one power-of-two exponent per 32 values, biased by 127), over
the last dim of the matrix ``[E, out, in]``; the unpacked tensor Hugging Face's model holds is its
transpose ``[E, in, out]``. Loading reads only the blocks and scales of the box this rank's shard
covers (the scale groups around it, when a shard's input range does not start on one), with
safetensors' own slicing.

A scale is an E8M0 byte: 2^(byte - 127), and 0xFF is NaN (the OCP MX spec): its whole block of 32
values is NaN, as the spec says, and the loader refuses it by name like any NaN weight. Scales
of 0xFE and below are finite however large (0xFE with a code of 6 is 6 x 2^127, 1e38): the
loader's bound on every weight (`finite.WEIGHT_BOUND`, 2^16) refuses a scale byte above 140
(6 x 2^13 = 49,152 is the most a block under it holds) wherever its block is not all zeros.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from torchmoe import _torch_private as private
from torchmoe.models.hf_config_spec import HFConversionError

__all__ = ["BLOCK", "check_packed", "dequantize", "load_packed", "packed_names"]

# E2M1: sign, two exponent bits, one mantissa bit.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one scale: 16 bytes
_SCALE_BIAS = 127
_SCALE_NAN = 0xFF  # E8M0's one NaN; it has no inf


def packed_names(name: str) -> tuple[str, str]:
    """The stored names of a packed tensor's blocks and scales."""
    return f"{name}_blocks", f"{name}_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., G, 16) uint8 blocks and (..., G) uint8 scales -> (..., G * 32) fp32 values; a block
    whose scale is 0xFF (NaN) is NaN."""
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    pairs = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # (..., G, 16, 2)
    exponents = scales.to(torch.int32) - _SCALE_BIAS
    values = torch.ldexp(pairs.reshape(*blocks.shape[:-1], BLOCK), exponents.unsqueeze(-1))  # (..., G, 32)
    # ldexp would read 0xFF as 2^128: 0.5 x 2^128 is a finite 1.7e38, and 0 x 2^128 is 0.
    values = values.masked_fill((scales == _SCALE_NAN).unsqueeze(-1), float("nan"))
    return values.reshape(*scales.shape[:-1], -1)


def check_packed(name: str, size: tuple[int, ...], blocks: tuple[tuple[int, ...], torch.dtype],
                 scales: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Raise `HFConversionError` unless the stored (shape, dtype) of the blocks and scales pack a
    tensor ``name`` of Hugging Face size ``[E, in, out]``."""
    experts, inputs, outputs = size
    groups = -(-inputs // BLOCK)
    want = {"blocks": ((experts, outputs, groups, BLOCK // 2), blocks),
            "scales": ((experts, outputs, groups), scales)}
    for part, (shape, (got, dtype)) in want.items():
        if tuple(got) != shape or dtype != torch.uint8:
            raise HFConversionError(f"{name}_{part} is {str(dtype).removeprefix('torch.')} {tuple(got)}; MXFP4 "
                                    f"of {name} {tuple(size)} is uint8 {shape}")


def load_packed(view: torch.Tensor, parts: list[tuple[Path, str]]) -> None:
    """Fill `view` (HF orientation ``[E, in, out]``, or a DTensor of it: this rank's shard) with
    the dequantised values of a packed tensor; `parts`: the (file, stored name) of its blocks and
    of its scales."""
    if isinstance(view, torch.distributed.tensor.DTensor):
        local = view.to_local()
        _, offset = private.local_shape_and_offset(view.shape, view.device_mesh, view.placements)
    else:
        local, offset = view, (0, 0, 0)
    if local.numel() == 0:
        return
    (e0, a0, b0), (ne, na, nb) = offset, local.shape
    g0, g1 = a0 // BLOCK, -(-(a0 + na) // BLOCK)
    box = (slice(e0, e0 + ne), slice(b0, b0 + nb), slice(g0, g1))
    read = []
    for file, stored in parts:
        with safe_open(file, framework="pt") as f:
            read.append(f.get_slice(stored)[box])
    values = dequantize(*read)[..., a0 - g0 * BLOCK:a0 - g0 * BLOCK + na]  # (ne, nb, na): [E, out, in]
    local.copy_(values.transpose(1, 2))
