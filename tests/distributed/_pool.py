"""The rank pools of ``megatron_fsdp_v2.testing`` under the short name the test modules import
(``from _pool import RankPools``); see the Note there."""

from megatron_fsdp_v2.testing import RankPool, RankPools

__all__ = ["RankPool", "RankPools"]
