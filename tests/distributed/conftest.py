import os
import sys

# The spawned ranks import the test modules by name; make this folder importable for them.
sys.path.insert(0, os.path.dirname(__file__))

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from _pool import RankPools  # noqa: E402


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPools]:
    """Spawned ranks shared by the cases of one test module (see ``_pool.py``)."""
    pools = RankPools()
    yield pools
    pools.close()
