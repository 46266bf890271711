"""Bounded memo tables for the planner's pure functions, keyed by what their result depends on.

    table: dict = {}
    split = memoised(table, (repr(args), dims, seq_len, stages), lambda: split_by_cost(...))

The layout search (`plan.search`) asks for the same stage split, parameter list and per-rank
state of a layout family for each of its variants; a table is cleared when it reaches `limit`
entries so that a long-lived process never grows without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


def memoised(table: dict, key: Hashable, compute: Callable[[], T], *, limit: int = 4096) -> T:
    """``table[key]``, computed by `compute()` the first time."""
    if key not in table:
        if len(table) >= limit:
            table.clear()
        table[key] = compute()
    return table[key]
