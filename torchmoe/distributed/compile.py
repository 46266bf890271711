"""torch.compile per transformer block.

Blocks are compiled one by one (after activation checkpointing, before FSDP) so compile time
stays that of one block and FSDP's per-block communication stays outside the graphs.

Every block, dense and MoE, is one graph: the two MoE operators the compiler cannot trace as
they are (fp32 grouped GEMMs, the recomputation-aware token counting) are custom ops
(`models/llama4/moe_ops.py`), single nodes in the graph. Without EP every shape is static
(routed rows are always tokens x top_k; expert boundaries are tensor offsets). Under EP the
all-to-all needs its split sizes on the host: that read is the one graph break of an MoE block.
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
