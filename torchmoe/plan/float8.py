"""Float8's rules, planned: which linears become float8, whether TP runs in float8, which
routed-expert modules are converted. One set of rules for the conversion
(`torchmoe.distributed.float8`), the TP plan, the TP byte count (`plan.tp_comm`) and the dry run.

    python -c "from torchmoe.plan.float8 import float8_linear_eligible as e; print(e('layers.0.attention.wq', 128, 128, []))"
"""

from __future__ import annotations

from torchmoe.config.job_config import Float8

__all__ = ["FLOAT8_TILE", "float8_linear_eligible", "float8_tp_enabled", "selected_by"]

# Float8 GEMM tiles: both dims of a float8 matmul operand must be multiples of this.
FLOAT8_TILE = 16


def float8_tp_enabled(cfg: Float8) -> bool:
    """The seed's rule: TP itself runs in float8 when float8 linears are on with a recipe that is
    not rowwise (tensorwise); rowwise recipes keep TP communication in high precision."""
    return cfg.enable and cfg.recipe_name not in ("rowwise", "rowwise_with_gw_hp")


def float8_linear_eligible(fqn: str, out_features: int, in_features: int, filter_fqns: list[str]) -> bool:
    """The nn.Linear `fqn` (out x in) becomes a ``Float8Linear``: not named by `filter_fqns`, not a
    multi-token prediction module's input projection (replicated under TP, its DTensor input
    takes no float8 style; a small matmul next to the module's block), both dims float8 tiles.
    The one rule the conversion, the TP plan's count and the dry run share."""
    return (not any(f in fqn for f in filter_fqns) and not fqn.startswith("mtp.")
            and out_features % FLOAT8_TILE == 0 and in_features % FLOAT8_TILE == 0)


def selected_by(fqn: str, moe_fqns: list[str]) -> bool:
    """`float8.moe_fqns` selects module `fqn` when one of its entries is part of the name."""
    return any(f in fqn for f in moe_fqns)
