"""torch.compile per transformer block.

Blocks are compiled one by one (after activation checkpointing, before FSDP) so compile time
stays that of one block and FSDP's per-block communication stays outside the graphs.

Every block, dense and MoE, is one graph: the MoE operators the compiler cannot trace as they are
(fp32 grouped GEMMs, the recomputation-aware counters) are custom ops (`nn/moe_ops.py`),
single nodes in the graph. Without EP every shape is static (routed rows are always
tokens x top_k; expert boundaries are tensor offsets), so those blocks are compiled with
``fullgraph=True``: a graph break there is a bug and fails loudly. Under CP the attention's K/V
exchanges (point-to-point sends, which dynamo does not trace) break its graph.

Under EP the all-to-all needs its split sizes on the host: that read is the one graph break EP
makes in an MoE block (with FSDP the routed experts are an FSDP unit of their own, and FSDP keeps
its hooks out of compiled graphs: two more breaks, around the experts). The rows each rank
receives change every step, so `apply_compile` sets, once, under EP:

- size-oblivious shapes (``backed_size_oblivious``): the first change of the split sizes
  recompiles the graphs after the break with the sizes symbolic, as dynamo does by default; but
  by default it also specialises sizes 0 and 1, and a rank that receives no row at all (every
  token routed to the other ranks' experts, which a strong load-balancing bias produces early in
  training) would compile those graphs again. Size-oblivious, one symbolic graph serves every
  size.
- for inductor, no peak-memory reordering in MoE blocks: it would move the shared expert's
  matmuls after the all-to-all waits they are placed before (`expert_parallel`), undoing the
  overlap; the program's order is the schedule. The forward's combine window still loses its
  matmul: inductor fuses ``w2 h`` with the add of the routed output into one ``addmm`` after the
  wait. The dispatch window and both backward windows keep theirs.

The trainer reports, with the first step's metrics, how many graphs dynamo compiled and how many
graph breaks it met (`DynamoCounts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchmoe import _torch_private as private
from torchmoe.config.job_config import Compile


def apply_compile(model: nn.Module, cfg: Compile, *, fullgraph: bool, expert_parallel: bool = False) -> None:
    """Compile every block of `model` in place with `cfg.backend`, when `cfg.components` holds
    'model' (torchtitan's 'loss' component is not compiled here: the loss runs eagerly).

    Args:
        fullgraph: refuse graph breaks (every layout without expert or context parallelism).
        expert_parallel: the MoE blocks exchange tokens by all-to-all (see module doc).
    """
    if "model" not in cfg.components:
        return
    if expert_parallel:
        private.size_oblivious_shapes()
    for name, block in list(model.layers.items()):
        keep_order = expert_parallel and block.moe_enabled and cfg.backend == "inductor"
        options = {"reorder_for_peak_memory": False} if keep_order else None
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph, backend=cfg.backend,
                                                         options=options))


@dataclass(frozen=True)
class DynamoCounts:
    """Dynamo's process-wide tallies: graphs compiled and graph breaks met while tracing (each
    break counted once per trace of the code around it, not per call)."""

    graphs: int
    graph_breaks: int

    @classmethod
    def now(cls) -> DynamoCounts:
        return cls(*private.dynamo_counters())

    def since(self, before: DynamoCounts) -> DynamoCounts:
        return DynamoCounts(self.graphs - before.graphs, self.graph_breaks - before.graph_breaks)
