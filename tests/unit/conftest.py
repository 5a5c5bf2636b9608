"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_mesh() -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh in which this process is rank 1 of a fake world of 2: DTensors get built
    and their local ops run, collectives move no data."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()
