"""`python -m torchmoe train --config configs/debug_model.toml` (and `torchrun ... -m torchmoe train ...`)."""

import sys

from torchmoe.distributed.interruption import Interrupted, interrupt_on_signals, report

try:
    with interrupt_on_signals():  # a signal during the CLI's own imports ends it in one line too
        from torchmoe.commands.cli import run
except Interrupted as stop:
    report(stop)
    sys.exit(stop.exit_status)
run()
