"""The training stack's logger: every part logs under one name, `torchmoe.trainer`, the name its
lines carried when the trainer was one module (users filter the run's log files by it)."""

import logging

logger = logging.getLogger("torchmoe.trainer")
