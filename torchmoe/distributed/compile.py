"""torch.compile per transformer block.

Blocks are compiled one by one (after activation checkpointing, before FSDP) so compile time
stays that of one block and FSDP's per-block communication stays outside the graphs. The MoE
path has static shapes (routed rows are always tokens × top_k; expert boundaries are tensor
offsets, not shapes), so no dynamic-shape recompilation occurs; the token-count bookkeeping is
excluded from the graph on purpose (see `moe._accumulate_token_counts`).
"""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> None:
    """Compile every block of `model` in place."""
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, fullgraph=False))
