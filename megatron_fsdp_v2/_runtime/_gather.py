"""How one group's compute weights are gathered (ZeRO-3) or refreshed from updated main weights:
functions over flat buffers that cast what the plan says, describe the all-gather and launch it
through the group's issuer, returning its :class:`~._issuer.Pending` handle. *When* they run is
decided by ``FlatParamGroup.ready_compute_weights``; see [Note: who issues collectives] in
``_issuer.py``.

[Note: replicated-buffer refresh]
With replicated compute weights and sharded main weights (``optim``, ``optim_grads``), an
optimizer step leaves every rank's ``model_weight`` stale outside its own shard. The group is
marked stale (see design.md §4 for what marks it); the next ``ready_compute_weights`` (the unit's
pre-forward) casts this rank's main shard into its own slot of ``model_weight``
(``refresh_from_shard_``) and runs one in-place ``all_gather_into_tensor`` over ``model_weight``:
the strategy's single all-gather (:func:`refresh_weights`). Writes through
``p.to_local()``/``p.data`` in the middle of an accumulation window are not seen
(``FSDPModule.mark_main_weights_updated``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import ops
from .._buffers._plan import BufferPlan, Collective, Refresh
from .._profiling import traced
from ._issuer import CollectiveLaunch, GroupIssuer, Pending

__all__ = ["cast_and_gather_weights", "gather_weights", "refresh_weights"]


@traced("mfsdp::gather")
def gather_weights(
    unsharded_model_weight: torch.Tensor, model_weight_shard: torch.Tensor,
    issuer: GroupIssuer, async_op: bool, after: Pending | None = None, axis: str = "shard",
    complete: Callable[[], None] | None = None,
) -> Pending:
    """ZeRO-3: gather every rank's model-weight shard into the temporary unsharded scratch buffer.
    ``after``: a refresh that rebuilds the shard first (HSDP outer ``optim``: the outer
    all-gather), waited on where the gather launches (on CUDA: by the side stream, in stream
    order; on gloo: the work, before the gather is issued). ``axis="post_forward"``: the
    gather within the group of ``reshard_after_forward=n`` from the slices kept after forward
    (see [Note: resharding to a smaller group] in ``_compute_weights.py``), ``complete``
    freeing them."""
    what = "all-gather" if axis == "shard" else f"{axis} all-gather"
    return issuer.launch(CollectiveLaunch(
        Collective.ALL_GATHER, unsharded_model_weight, model_weight_shard, what=what,
        axis=axis, after=after, complete=complete,
    ), async_op)


def cast_and_gather_weights(
    unsharded_model_weight: torch.Tensor, main_weight_shard: torch.Tensor, offset: int,
    issuer: GroupIssuer, async_op: bool,
) -> Pending:
    """ZeRO-3 with a separate main buffer (``Refresh.CAST_AT_GATHER``): cast this rank's main
    shard into its own slot of the temporary unsharded scratch buffer (``offset``: where the slot
    starts), then all-gather that slot in place. The same bits as casting into a persistent
    shard first and gathering from it."""
    ops.refresh_from_shard_(main_weight_shard, unsharded_model_weight, offset)
    own_slot = unsharded_model_weight[offset : offset + main_weight_shard.numel()]
    return gather_weights(unsharded_model_weight, own_slot, issuer, async_op)


@traced("mfsdp::refresh")
def refresh_weights(
    plan: BufferPlan, main_weight: torch.Tensor, model_weight: torch.Tensor,
    issuer: GroupIssuer, async_op: bool,
) -> Pending | None:
    """Rebuild compute weights from updated main weights (see [Note: replicated-buffer
    refresh]): cast the main weights into their slot of ``model_weight`` (when separate), then
    the plan's ``refresh_steps`` (in-place all-gathers of that slot over the step's axis).
    Returns the pending all-gather, if the plan has one."""
    if plan.refresh is Refresh.NONE:
        return None
    offset = plan.main_weight_span[0] - plan.model_weight_span[0]
    if plan.main_weight_separate:
        # Cast the main weights (all of them, or this rank's shard) into their place.
        ops.refresh_from_shard_(main_weight, model_weight, offset)
    if not plan.refresh_steps:
        return None
    (step,) = plan.refresh_steps
    assert step.op is Collective.ALL_GATHER, step
    own_slot = model_weight[offset : offset + main_weight.numel()]
    what = "refresh all-gather" if step.axis == "shard" else f"{step.axis} refresh all-gather"
    return issuer.launch(
        CollectiveLaunch(step.op, model_weight, own_slot, what=what, axis=step.axis), async_op
    )
