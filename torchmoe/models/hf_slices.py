"""Where each of our tensors lives in a Hugging Face checkpoint (`HFSlice`): what every family's
mapping (``models/<family>/hf.py``) returns and `hf_files.hf_storage` reads and writes by.

Three layouts occur in released checkpoints:

    whole          ours is the stored tensor (attention, norms, a dense MLP)
    fused          ours is a block of a stored tensor, possibly transposed (Llama 4's routed experts:
                   w1 and w3 are the two halves of ``gate_up_proj`` [E, dim, 2 * hidden])
    per expert     ours [E, rows, cols] is E stored tensors [rows, cols], one per expert (Qwen3's
                   and DeepSeek-V3's ``mlp.experts.{e}.gate_proj.weight``)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["HFSlice", "per_expert_slice"]


@dataclass(frozen=True)
class HFSlice:
    """Where one of our tensors lives in a Hugging Face checkpoint.

    Our tensor, in Hugging Face orientation (`view`: dims 1 and 2 swapped for Llama 4's routed
    experts, which HF stores input-major), is the block of `hf_name` (full size `size`) that starts
    at `offset` along the last dim: the fused ``gate_up_proj`` holds w1 at 0 and w3 at `hidden`.

    `per_expert`: `hf_name` is a template holding ``{e}``, and expert e's matrix (our
    ``[e, :, :]``) is stored whole as ``hf_name.format(e=e)`` of size ``size[1:]``.
    """

    hf_name: str
    size: tuple[int, ...]
    transposed: bool = False
    offset: int = 0
    per_expert: bool = False

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (ours, possibly a DTensor) as a view in HF orientation; shares its storage."""
        return tensor.transpose(1, 2) if self.transposed else tensor

    def stored(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor this slice covers (name -> its full size), in expert order."""
        if not self.per_expert:
            return {self.hf_name: self.size}
        return {self.hf_name.format(e=e): self.size[1:] for e in range(self.size[0])}

    def label(self) -> str:
        """The stored name for messages (``{e}`` as ``*`` for per-expert tensors)."""
        return self.hf_name.format(e="*") if self.per_expert else self.hf_name


_SWIGLU_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])$")
_SWIGLU_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def per_expert_slice(name: str, shape: Sequence[int]) -> HFSlice | None:
    """The per-expert slice of our SwiGLU experts' `name` (``layers.{i}.moe.experts.w1`` ...) as
    Qwen3-MoE's and DeepSeek-V3's checkpoints store them (``model.layers.{i}.mlp.experts.{e}.
    gate_proj.weight``: w1 gate_proj, w3 up_proj, w2 down_proj); None for other names."""
    if m := _SWIGLU_EXPERTS.match(name):
        layer, kind = m.groups()
        return HFSlice(f"model.layers.{layer}.mlp.experts.{{e}}.{_SWIGLU_PROJ[kind]}.weight", tuple(shape),
                       per_expert=True)
    return None
