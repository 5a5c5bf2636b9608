"""Test helpers shipped with the package so downstream users can reuse them."""

from ._dist import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
