"""The estimator: a run's per-rank memory and per-iteration collectives before renting the GPUs
(:func:`estimate`; the command line is ``python -m megatron_fsdp_v2.estimator``)."""

from ._cli import main
from ._estimate import Estimate, estimate

__all__ = ["Estimate", "estimate", "main"]
