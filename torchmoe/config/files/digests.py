"""The digest torchmoe records for the files it writes (checkpoints, token shards) and checks
before it reads them: xxh3_64 (`xxhash`, ~10 GB/s on one core), as hex.

    digest_file(path)   # "9c2b..."; ALGORITHM names it in the records that hold such digests

Here, below `data` and `weights`, so that both record the same digest of a file.
"""

from __future__ import annotations

import os

import xxhash

__all__ = ["ALGORITHM", "digest_file"]

ALGORITHM = "xxh3_64"
_CHUNK = 16 * 1024 * 1024


def digest_file(path: str | os.PathLike) -> str:
    """The xxh3_64 hex digest of the file at `path`, read in 16 MiB chunks.

    Raises:
        OSError: what the OS says about `path`.
    """
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
