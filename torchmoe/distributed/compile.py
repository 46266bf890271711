"""torch.compile per transformer block.

Blocks are compiled one by one (after activation checkpointing, before FSDP) so compile time
stays that of one block and FSDP's per-block communication stays outside the graphs.

Every block, dense and MoE, is one graph: the two MoE operators the compiler cannot trace as
they are (fp32 grouped GEMMs, the recomputation-aware token counting) are custom ops
(`models/llama4/moe_ops.py`), single nodes in the graph. Without EP every shape is static
(routed rows are always tokens x top_k; expert boundaries are tensor offsets), so blocks are
compiled with ``fullgraph=True``: a graph break there is a bug and fails loudly. Under EP the
all-to-all needs its split sizes on the host: that read is the one graph break of an MoE block.

The trainer reports, with the first step's metrics, how many graphs dynamo compiled and how many
graph breaks it met (`DynamoCounts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchmoe.config.job_config import Compile


def apply_compile(model: nn.Module, cfg: Compile, *, fullgraph: bool) -> None:
    """Compile every block of `model` in place with `cfg.backend`, when `cfg.components` holds
    'model' (torchtitan's 'loss' component is not compiled here: the loss runs eagerly).

    Args:
        fullgraph: refuse graph breaks (every layout without expert parallelism).
    """
    if "model" not in cfg.components:
        return
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph, backend=cfg.backend))


@dataclass(frozen=True)
class DynamoCounts:
    """Dynamo's process-wide tallies: graphs compiled and graph breaks met while tracing (each
    break counted once per trace of the code around it, not per call)."""

    graphs: int
    graph_breaks: int

    @classmethod
    def now(cls) -> DynamoCounts:
        from torch._dynamo.utils import counters

        return cls(counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))

    def since(self, before: DynamoCounts) -> DynamoCounts:
        return DynamoCounts(self.graphs - before.graphs, self.graph_breaks - before.graph_breaks)
