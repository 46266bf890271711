"""Paces training steps, for tests/distributed/test_fault_tolerance.py: on this folder's
PYTHONPATH with TORCHMOE_TEST_STEP_S set, each committed step of a process takes at least that
many seconds, the rest slept after it. The kill test's survivor must still be training when the
relaunched groups come back (their start takes seconds): sleeping steps of the tiny model last
that long without taking the cores from the suite's other worker, as a larger model's steps did.
Without the variable it does nothing.

`torchmoe.training.loop` is patched as it is imported (an import hook: this runs at interpreter start,
before torchmoe is imported)."""

import importlib.abc
import importlib.machinery
import os
import sys
import time

_STEP_S = float(os.environ.get("TORCHMOE_TEST_STEP_S") or 0)


def _pace(module) -> None:
    committed_step = module.Trainer._committed_step

    def paced(self):
        began = time.monotonic()
        result = committed_step(self)
        time.sleep(max(0.0, _STEP_S - (time.monotonic() - began)))
        return result

    module.Trainer._committed_step = paced


class _PaceTrainer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torchmoe.training.loop":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            _pace(module)

        spec.loader.exec_module = exec_module
        return spec


if _STEP_S > 0:
    sys.meta_path.insert(0, _PaceTrainer())
