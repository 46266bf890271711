"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.helpers import leave_world


@pytest.fixture
def fake_world():
    """A fake process group (no communication: collectives leave their outputs as they are) of
    any size, this process being `rank`."""

    def init(rank: int, world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    leave_world()
