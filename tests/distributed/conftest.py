import os
import sys

# The spawned ranks import the test modules by name; make this folder importable for them.
sys.path.insert(0, os.path.dirname(__file__))

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from megatron_fsdp_v2.testing import RankPools  # noqa: E402


@pytest.fixture(scope="session")
def ranks() -> Iterator[RankPools]:
    """Spawned gloo ranks, one pool per world size, shared by every case of the session.

    Starting a pool costs a process group (the ranks fork from a preloaded server); sharing them
    across modules pays that once per world size. A failing case closes its pool, and the next
    case of that size starts a fresh one (see [Note: rank pools] in
    ``megatron_fsdp_v2/testing/_pool.py``).
    """
    pools = RankPools()
    yield pools
    pools.close()
