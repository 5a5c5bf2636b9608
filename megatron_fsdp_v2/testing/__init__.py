"""Test helpers shipped with the package so downstream users can reuse them."""

from ._dist import run_distributed
from ._pool import DistributedTestError, RankPool, RankPools, preload_in_server

__all__ = ["DistributedTestError", "RankPool", "RankPools", "preload_in_server", "run_distributed"]
