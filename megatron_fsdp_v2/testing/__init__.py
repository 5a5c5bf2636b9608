"""Test helpers shipped with the package so downstream users can reuse them."""

from ._dist import run_distributed
from ._pool import (
    DistributedTestError,
    RankPool,
    RankPools,
    preload_in_server,
    release_process_groups,
)

__all__ = [
    "DistributedTestError", "RankPool", "RankPools", "preload_in_server", "release_process_groups",
    "run_distributed",
]
