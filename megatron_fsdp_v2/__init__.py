"""megatron_fsdp_v2: fully sharded data parallel training for PyTorch on flat buffers.

Wrap modules with :func:`fully_shard`, pick a ZeRO strategy (``no_shard``, ``optim``,
``optim_grads``, ``optim_grads_params``), and train with a plain ``torch.optim`` optimizer.
"""

from . import checkpoint
from ._comm._collective_impl import CollectiveCount
from ._frontend._fully_shard import (
    FSDPModule,
    MemoryReport,
    UnshardHandle,
    fully_shard,
    memory_report,
)
from ._frontend._policies import CommPolicy, InitPolicy, ShardingPolicy
from .api import MixedPrecisionPolicy, ShardingStrategy
from .checkpoint._streaming import iter_full_weights
from .estimator import Estimate, estimate
from .ops import build_info
from .utils import clip_grad_norm_

__all__ = [
    "CollectiveCount",
    "CommPolicy",
    "Estimate",
    "FSDPModule",
    "InitPolicy",
    "MemoryReport",
    "MixedPrecisionPolicy",
    "ShardingPolicy",
    "ShardingStrategy",
    "UnshardHandle",
    "build_info",
    "checkpoint",
    "clip_grad_norm_",
    "estimate",
    "fully_shard",
    "iter_full_weights",
    "memory_report",
]
