"""A file system without flock, for tests/integration/test_run_safety.py: on this folder's
PYTHONPATH with TORCHMOE_FLOCK_ERRNO naming an errno (ENOSYS: Lustre mounted without `flock`;
ENOLCK: NFSv3 without a lock daemon), every `fcntl.flock` of the process fails with it, as the
kernel says it there. Without the variable it does nothing."""

import errno
import fcntl
import os

_name = os.environ.get("TORCHMOE_FLOCK_ERRNO")
if _name:
    _code = getattr(errno, _name)

    def _no_flock(fd, operation):
        raise OSError(_code, os.strerror(_code))

    fcntl.flock = _no_flock
