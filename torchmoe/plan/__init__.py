"""Planning without hardware: the dry run, per-rank memory and parameter layout estimates.

    python -m torchmoe train --config configs/llama4_128e.toml --dry-run --world-size 1024

- `layout`: where each parameter lives (pipeline stage, TP/EP/FSDP shard sizes).
- `memory`: per-rank memory estimate (parameters, gradients, optimizer, FSDP buffers, activations).
- `activations`: the bytes each block saves for backward (under AC), a pp rank's peak.
- `dry_run`: the printed report and ``dry_run.json``.
"""

from torchmoe.plan.dry_run import run_dry_run
from torchmoe.plan.memory import estimate_memory

__all__ = ["estimate_memory", "run_dry_run"]
