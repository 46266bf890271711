"""A file every rank needs, read by one: `one_reads(read, group)`.

    metadata = one_reads(lambda: read_metadata(folder), group)   # collective under a group

On a cluster's shared file system (Lustre, GPFS, NFS) every open, stat and listing is a request
to a metadata server, which serves the whole cluster: 1,000 ranks each reading a checkpoint's
`.metadata`, its checksums and the size of each of its 1,000 data files is a million requests at
the same moment, for answers that are the same on every rank. Rank 0 reads instead, and the
others receive what it read (or the user error it found, which every rank then raises) in one
broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from torchmoe.config.errors import ConfigError

__all__ = ["one_reads"]

_T = TypeVar("_T")


def one_reads(read: Callable[[], _T], group: dist.ProcessGroup | None = None) -> _T:
    """`read()` on rank 0 of `group` (default: the world), its result on every rank of it.
    Collective under a process group; without one (or alone in it) just `read()`.

    The result crosses a `broadcast_object_list` (pickled by rank 0, unpickled by the others),
    so it must be plain data: what `read` built after checking what it read, never a file's own
    pickle (the others would unpickle it unchecked).

    Raises:
        ConfigError: the one `read` raised on rank 0, on every rank. Any other error of `read`
            is rank 0's own failure: it leaves the others waiting in the broadcast, where the
            failure watch (`distributed.failure`) ends them.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return read()
    box: list = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = (read(), None)
        except ConfigError as err:
            box[0] = (None, err)
    dist.broadcast_object_list(box, group=group, group_src=0)
    value, refused = box[0]
    if refused is not None:
        raise refused
    return value
