"""Python's garbage collector runs after every gc_freq-th step only."""

from __future__ import annotations

import gc

import pytest

from torchmoe.performance.garbage_collection import GarbageCollection


def test_collects_at_its_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    schedule = GarbageCollection(3)
    try:
        assert not gc.isenabled() and calls == [2]  # automatic collection off, one full pass at start
        for step in range(1, 8):
            schedule.step(step)
        assert calls == [2, 1, 1]  # after steps 3 and 6
    finally:
        schedule.close()
    assert gc.isenabled()


def test_zero_leaves_python_in_charge(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    schedule = GarbageCollection(0)
    for step in range(1, 5):
        schedule.step(step)
    schedule.close()
    assert gc.isenabled() and calls == []
