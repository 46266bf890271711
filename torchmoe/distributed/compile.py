"""torch.compile per transformer block.

Blocks are compiled one by one (after activation checkpointing, before FSDP) so compile time
stays that of one block and FSDP's per-block communication stays outside the graphs.

MoE blocks are not one graph. Without EP their shapes are static (routed rows are always
tokens × top_k; expert boundaries are tensor offsets), but the token-count bookkeeping breaks the
graph on purpose (see `moe._accumulate_token_counts`), and fp32 grouped GEMMs run eagerly (the
compiler's `_grouped_mm` takes bf16 only). Under EP the number of received rows depends on the
routing, so those regions see varying shapes (dynamic-shape compilation after the first change).
"""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.config.job_config import Compile


def apply_compile(model: nn.Module, cfg: Compile) -> None:
    """Compile every block of `model` in place with `cfg.backend`, when `cfg.components` holds
    'model' (torchtitan's 'loss' component is not compiled here: the loss runs eagerly)."""
    if "model" not in cfg.components:
        return
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, fullgraph=False, backend=cfg.backend))
