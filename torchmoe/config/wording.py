"""Counts in messages as people write them: "1 rank", "8 ranks", "1 micro-batch", "2 micro-batches".

    counted(world_size, "rank")            # "1 rank"
    counted(n, "micro-batch", "micro-batches")
"""

from __future__ import annotations

__all__ = ["counted"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, in the plural (`plural`, else `noun` + "s") unless `n` is 1; thousands
    separated by commas."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
