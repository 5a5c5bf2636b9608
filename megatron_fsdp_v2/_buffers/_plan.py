"""The buffer plan: what a ZeRO strategy means for one flat group, as data.

[Note: buffer plan]
A :class:`BufferPlan` is computed once per group from (strategy, dtypes, layout, rank) and
states what design.md §3/§4 state as prose: for each buffer role its extent (the full buffer,
this rank's shard) and whether it aliases another role, the gradient path, which collectives
reduce gradients and refresh weights, and which scratch buffers exist. ``FlatParamGroup``
executes a plan and holds no strategy branches; ``tests/unit/test_plan.py`` checks the table
against design.md's.

Collectives are listed as *steps* (a tuple), each naming its mesh axis. A 1-D mesh has one axis
(``"shard"``) and one step per path. A second, outer mesh axis (HSDP, ``"outer"``: dim 0 of a
2-D mesh) adds steps instead of branches in the group: with ``outer=NO_SHARD`` the plan has
``window_steps = (all-reduce over "outer",)``, run once per group at the end of each
accumulation window over the inner-reduced optimizer-facing gradient shard
(``_reduce.reduce_window``; see design.md §"HSDP"). ``window_steps`` is empty on a 1-D mesh.

With ``outer=OPTIM`` (inner ``optim_grads_params`` only) the layout is built over ``R * S``
*sub-shards* (``build_layout(shapes, S * R)``): inner shard ``s`` (what ``model_weight`` holds,
and the slot of the inner collectives) is the ``R`` consecutive sub-shards ``[s * R, (s + 1) *
R)``, and this rank's sub-shard (outer index ``r``) is number ``s * R + r``. Main weights and
main gradients hold only the sub-shard (``Extent.SUB_SHARD``; DTensors ``(Shard(0), Shard(0))``).
Each micro-batch's inner reduce-scatter adds into a temporary ``window_grad`` scratch buffer of the
inner shard (``window_grad_span``); ``window_steps = (reduce-scatter over "outer",)`` reduces it
into ``main_grad`` once per window. The refresh casts the main sub-shard into its slot of
``model_weight`` and runs ``refresh_steps = (all-gather over "outer",)`` before the inner
gathers; gradient norms are all-reduced over the whole mesh (``norm_axis = "mesh"``).

``grads_in_place``: whether autograd writes gradients straight into the flat buffer the gradient
path fills first (see [Note: gradients in place] in ``_grad_staging.py``): ``main_grad`` on the
accumulate path when the gradient dtype is the compute dtype, the ``staged_grad``
scratch buffer on the reduce-each path when the communication dtype is the compute dtype and weights
are not gathered (``optim_grads``). Otherwise (a cast is needed; ZeRO-3, where the earlier
scratch buffer costs peak memory) each micro-batch's ``param.grad`` is staged with the ``pack_``
kernel.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..api import ResolvedDtypes, ShardingStrategy
from ._layout import BufferLayout

__all__ = [
    "BufferPlan", "Collective", "CollectiveStep", "Extent", "GradPath", "Refresh",
    "layout_world_size", "make_plan", "shards_outer_optim",
]


class Extent(enum.Enum):
    """How much of a group's flat buffer a role holds on this rank."""

    FULL = "full"
    SHARD = "shard"
    SUB_SHARD = "sub-shard"
    """HSDP outer ``optim``: this rank's ``1 / R`` of its inner shard (the optimizer-facing
    DTensors are ``(Shard(0), Shard(0))``)."""


class GradPath(enum.Enum):
    ACCUMULATE_THEN_REDUCE = "accumulate"
    """Micro-batches add into a full-size ``main_grad``; one collective on the last one
    (``no_shard``, ``optim``)."""
    REDUCE_EACH_MICRO_BATCH = "reduce each"
    """Every micro-batch is staged into a temporary ``staged_grad`` and reduced; the
    results add up in the ``main_grad`` shard (``optim_grads``, ``optim_grads_params``)."""


class Refresh(enum.Enum):
    """How compute weights follow an update of the main weights (see
    [Note: replicated-buffer refresh] in ``_runtime/_gather.py``)."""

    NONE = "none"
    """Compute weights *are* the main weights (same buffer): nothing to do."""
    CAST = "cast"
    """Cast the main weights into the model weights locally (no collective)."""
    CAST_OWN_SLOT_THEN_GATHER = "cast own slot, all-gather"
    """Cast this rank's main shard into its slot of the replicated model weights, then one
    in-place all-gather (ZeRO-1/2)."""
    CAST_AT_GATHER = "cast into each gather"
    """ZeRO-3 with a separate main buffer: every gather casts this rank's main shard straight
    into its own slot of the temporary ``unsharded_model_weight`` scratch buffer and all-gathers
    that slot in place, so no persistent compute-dtype shard exists (``model_weight`` is empty). One
    cast per gather (2N per iteration) instead of one per optimizer step, for a shard's worth of
    compute-dtype memory (FSDP2 also casts into its all-gather input at each gather)."""
    EXTENSION_OWN_SLOT_THEN_GATHER = "pre-all-gather own slot, all-gather"
    """ZeRO-1/2 with parameters that define FSDP2's all-gather extensions: the subclass's
    ``fsdp_pre_all_gather`` turns this rank's main shard into its all-gather inputs (FP8 bytes),
    copied into its slot of persistent replicated buffers of their own dtype, then one in-place
    all-gather per input buffer; ``model_weight`` is empty (see [Note: FSDP2 all-gather
    extensions] in ``_runtime/_subclass_gather.py``)."""
    CAST_OWN_SLOT_THEN_OUTER_GATHER = "cast own slot, outer all-gather"
    """HSDP outer ``optim``: cast the main sub-shard into its slot of the inner-shard model
    weights (a no-op when they alias), then one in-place all-gather over the outer axis rebuilds
    the inner shard; the inner gathers then spread it as in ZeRO-3."""
    EXTENSION_OWN_SLOT_THEN_OUTER_GATHER = "pre-all-gather own slot, outer all-gather"
    """HSDP outer ``optim`` with all-gather extensions: the main sub-shard's all-gather inputs
    (FP8 bytes) into its slot of persistent inner-shard buffers of their own dtype, then one
    in-place all-gather per input buffer over the outer axis; each inner gather spreads those
    buffers as in ZeRO-3; ``model_weight`` is empty."""


class Collective(enum.Enum):
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"


@dataclass(frozen=True)
class CollectiveStep:
    op: Collective
    axis: str = "shard"  # the mesh axis: "shard" (the 1-D mesh, or dim 1 of a 2-D one) or "outer"



@dataclass(frozen=True)
class BufferPlan:
    """One group's buffers and collectives. Spans are ``[start, end)`` in flat-buffer elements."""

    strategy: ShardingStrategy
    model_weight: Extent
    main_weight: Extent
    main_weight_separate: bool
    """Its own buffer (the main dtype differs from the compute dtype); else a view of
    ``model_weight`` (the rank's slot of it when ``model_weight`` is full and main is sharded)."""
    main_grad: Extent
    optimizer_placement: Extent
    """What the optimizer-facing DTensors hold: ``SHARD`` -> ``Shard(0)``, ``FULL`` ->
    ``Replicate()``. Always the main weights' extent; the main gradients the optimizer sees
    are the same span of ``main_grad``."""
    gathers_weights: bool
    """Compute weights are gathered into a temporary ``unsharded_model_weight`` scratch buffer
    around forward and backward, and freed after each (ZeRO-3)."""
    grad_path: GradPath
    reduce_steps: tuple[CollectiveStep, ...]
    refresh: Refresh
    refresh_steps: tuple[CollectiveStep, ...]
    gather_steps: tuple[CollectiveStep, ...]
    window_steps: tuple[CollectiveStep, ...]
    """Collectives at the end of each accumulation window, after ``reduce_steps`` were waited
    on, into the optimizer-facing part of ``main_grad`` (HSDP: the outer all-reduce in place, or
    the outer reduce-scatter of the ``window_grad`` scratch buffer)."""
    window_grad_span: tuple[int, int] | None
    """Where each micro-batch's reduction lands when it is not ``main_grad``: a temporary
    ``window_grad`` scratch buffer over this span, alive across the window and reduced into
    ``main_grad`` by ``window_steps`` (HSDP outer ``optim``: the inner shard). ``None``: the
    reductions add into ``main_grad`` directly."""
    norm_axis: str
    """The process group gradient norms are all-reduced over: ``"shard"`` (the inner one; the
    outer replicas hold the same gradients) or ``"mesh"`` (every rank holds a distinct
    sub-shard: HSDP outer ``optim``)."""
    temporaries: tuple[str, ...]
    """Scratch buffer roles this group may allocate (storage-freeing allocator)."""
    model_weight_span: tuple[int, int]
    main_weight_span: tuple[int, int]
    main_grad_span: tuple[int, int]
    shard_span: tuple[int, int]
    grads_in_place: bool = False
    """Compute parameters' ``.grad`` are preset to aliases of their regions of the buffer the
    gradient path writes first (``main_grad`` on the accumulate path, which then holds unscaled
    local sums and is scaled once before its delayed collective; ``staged_grad`` on the
    reduce-each path, allocated and zeroed at the unit's pre-backward), so autograd accumulates
    in place; see [Note: gradients in place] in ``_grad_staging.py``. False: staged by ``pack_``."""

    @property
    def keeps_model_weight(self) -> bool:
        """Whether ``model_weight`` is a persistent buffer (empty with
        :attr:`Refresh.CAST_AT_GATHER`: the main shard is cast into each gather instead)."""
        return self.refresh not in (Refresh.CAST_AT_GATHER, Refresh.EXTENSION_OWN_SLOT_THEN_GATHER,
                                    Refresh.EXTENSION_OWN_SLOT_THEN_OUTER_GATHER)

    @property
    def reduces_in_place(self) -> bool:
        """Whether the gradient collective runs on ``main_grad`` itself (accumulate path, same
        dtype): otherwise through a scratch buffer in the communication dtype."""
        return (
            "grad_comm" not in self.temporaries
            and self.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
        )


def shards_outer_optim(outer: ShardingStrategy, outer_size: int) -> bool:
    """Whether groups on a mesh with ``outer_size`` replicas along the outer axis, under outer
    strategy ``outer``, follow the outer ``optim`` plan (optimizer state sharded over every rank
    of the mesh; an outer axis of one replica has nothing to shard)."""
    return outer is ShardingStrategy.OPTIM and outer_size > 1


def layout_world_size(shard_size: int, outer: ShardingStrategy, outer_size: int) -> int:
    """How many slots a group's layout (``build_layout``) is built over: the ``shard_size``
    ranks of the inner axis, or under outer ``optim`` the ``outer_size * shard_size``
    sub-shards, inner shard ``s`` being sub-shards ``[s * R, (s + 1) * R)`` (see [Note: buffer
    plan])."""
    return shard_size * outer_size if shards_outer_optim(outer, outer_size) else shard_size


def make_plan(
    strategy: ShardingStrategy, dtypes: ResolvedDtypes, layout: BufferLayout, rank: int,
    outer: ShardingStrategy | None = None, outer_rank: int = 0, outer_size: int = 1,
    extensions: bool = False, host_main: bool = False,
) -> BufferPlan:
    """The plan of one group. The only place that turns a strategy into buffer decisions.

    ``strategy`` applies along the inner (``"shard"``) axis, whose ``rank`` this is. ``outer``:
    the strategy along the outer mesh axis of a 2-D (HSDP) mesh with more than one replica,
    ``None`` otherwise. ``NO_SHARD``: ``layout`` is over the inner axis, one outer all-reduce per
    window. ``OPTIM`` (inner ``OPTIM_GRADS_PARAMS`` only): ``layout`` is over ``outer_size *
    S`` sub-shards and ``outer_rank`` is this rank's index along the outer axis (see
    [Note: buffer plan]). ``extensions``: the group's parameters define FSDP2's all-gather
    extensions: where weights are sharded, the main weights get their own buffer and the
    gathered compute weights are the extensions' (``CAST_AT_GATHER`` under ZeRO-3,
    ``EXTENSION_OWN_SLOT_THEN_GATHER`` under ZeRO-1/2, ``EXTENSION_OWN_SLOT_THEN_OUTER_GATHER``
    with outer ``OPTIM``), never a compute-dtype copy. ``host_main``: CPU offload's copying
    path (ZeRO-3 only): the main weights are a buffer of their own (in host memory), copied
    into each gather like ``CAST_AT_GATHER`` casts them, so no device shard persists (see
    [Note: host offload] in ``_runtime/_offload.py``)."""
    if host_main and (outer is not None or not strategy.shards_model_weights):
        raise ValueError(
            f"host main weights need a 1-D mesh and sharded model weights, got strategy "
            f"{strategy.value!r}, outer {outer.value if outer is not None else None!r}"
        )
    if outer is ShardingStrategy.OPTIM:
        return _outer_optim_plan(strategy, dtypes, layout, rank, outer_rank, outer_size,
                                 extensions)
    if outer is not None and outer is not ShardingStrategy.NO_SHARD:
        raise ValueError(f"outer sharding strategy {outer.value!r}: use 'no_shard' or 'optim'")
    full = (0, layout.total_numel)
    shard = layout.shard_range(rank)
    # What each strategy shards is ShardingStrategy's table (api.py); the plan turns it into
    # buffers and collectives.
    shards_main = strategy.shards_main_weights
    shards_grads = strategy.shards_grads
    gathers = strategy.shards_model_weights
    separate = dtypes.main != dtypes.model or (extensions and shards_main) or host_main
    main_extent = Extent.SHARD if shards_main else Extent.FULL
    grad_path = (
        GradPath.REDUCE_EACH_MICRO_BATCH if shards_grads else GradPath.ACCUMULATE_THEN_REDUCE
    )
    reduce_op = Collective.REDUCE_SCATTER if shards_main else Collective.ALL_REDUCE

    if gathers:
        refresh = Refresh.CAST_AT_GATHER if separate else Refresh.NONE
    elif shards_main:
        refresh = (Refresh.EXTENSION_OWN_SLOT_THEN_GATHER if extensions
                   else Refresh.CAST_OWN_SLOT_THEN_GATHER)
    else:
        refresh = Refresh.CAST if separate else Refresh.NONE
    temporaries: list[str] = []
    if gathers:
        temporaries.append("unsharded_model_weight")
    if grad_path is GradPath.REDUCE_EACH_MICRO_BATCH:
        temporaries.append("staged_grad")
    else:
        # The delayed collective runs in place unless the communication dtype differs; an
        # unmarked loop (every backward "last") reduces later micro-batches through a
        # staged_grad too (see GroupGrads.reduce).
        if dtypes.comm != dtypes.grad:
            temporaries.append("grad_comm")
        temporaries.append("staged_grad")
    window_steps: tuple[CollectiveStep, ...] = ()
    if outer is not None:
        window_steps = (CollectiveStep(Collective.ALL_REDUCE, "outer"),)
        # What main_grad held when the window started (already reduced over every rank), kept
        # aside so the outer all-reduce does not count it R times (GroupGrads.reduce).
        temporaries.append("window_carry")
        if dtypes.comm != dtypes.grad:
            temporaries.append("outer_comm")
    return BufferPlan(
        strategy=strategy,
        model_weight=Extent.SHARD if gathers else Extent.FULL,
        main_weight=main_extent,
        main_weight_separate=separate,
        main_grad=Extent.SHARD if shards_grads else Extent.FULL,
        optimizer_placement=main_extent,
        gathers_weights=gathers,
        grad_path=grad_path,
        reduce_steps=(CollectiveStep(reduce_op),),
        refresh=refresh,
        refresh_steps=(
            (CollectiveStep(Collective.ALL_GATHER),)
            if refresh in (Refresh.CAST_OWN_SLOT_THEN_GATHER,
                           Refresh.EXTENSION_OWN_SLOT_THEN_GATHER) else ()
        ),
        gather_steps=(CollectiveStep(Collective.ALL_GATHER),) if gathers else (),
        window_steps=window_steps,
        window_grad_span=None,
        norm_axis="shard",
        temporaries=tuple(temporaries),
        model_weight_span=shard if gathers else full,
        main_weight_span=shard if shards_main else full,
        main_grad_span=shard if shards_grads else full,
        shard_span=shard,
        # The first buffer the gradient path writes must be in the compute dtype. Not with
        # gathered weights (ZeRO-3): its scratch buffer, allocated at the pre-backward, would add to
        # the gathered weights and the previous unit's scratch buffer in flight (see [Note:
        # gradients in place] in _grads.py for the measurement).
        grads_in_place=(
            dtypes.comm == dtypes.model and not gathers
            if grad_path is GradPath.REDUCE_EACH_MICRO_BATCH else dtypes.grad == dtypes.model
        ),
    )


def _outer_optim_plan(
    strategy: ShardingStrategy, dtypes: ResolvedDtypes, layout: BufferLayout, rank: int,
    outer_rank: int, outer_size: int, extensions: bool = False,
) -> BufferPlan:
    """HSDP with outer ``optim``: ZeRO-3 along the inner axis over inner shards of ``outer_size``
    sub-shards each, optimizer state (main weights and gradients) sharded along the outer axis
    too (see [Note: buffer plan]). ``extensions``: the inner shard is held as the extensions'
    all-gather inputs (FP8 bytes), not in the compute dtype, and the main weights get their own
    buffer (``EXTENSION_OWN_SLOT_THEN_OUTER_GATHER``)."""
    if strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(
            "outer_dp_sharding_strategy='optim' needs sharding_strategy='optim_grads_params' "
            f"along the inner axis, got {strategy.value!r}"
        )
    if layout.world_size % outer_size or not 0 <= outer_rank < outer_size:
        raise ValueError(
            f"outer optim: a layout over {layout.world_size} sub-shards does not split into "
            f"{outer_size} per inner shard (outer rank {outer_rank})"
        )
    sub = layout.shard_numel
    inner_start = rank * outer_size * sub
    shard = (inner_start, inner_start + outer_size * sub)  # the inner shard
    own = (inner_start + outer_rank * sub, inner_start + (outer_rank + 1) * sub)
    temporaries = ["unsharded_model_weight", "staged_grad", "window_grad",
                   "window_carry"]
    if dtypes.comm != dtypes.grad:
        temporaries.append("outer_comm")
    return BufferPlan(
        strategy=strategy,
        model_weight=Extent.SHARD,
        main_weight=Extent.SUB_SHARD,
        main_weight_separate=dtypes.main != dtypes.model or extensions,
        main_grad=Extent.SUB_SHARD,
        optimizer_placement=Extent.SUB_SHARD,
        gathers_weights=True,
        grad_path=GradPath.REDUCE_EACH_MICRO_BATCH,
        reduce_steps=(CollectiveStep(Collective.REDUCE_SCATTER),),
        refresh=(Refresh.EXTENSION_OWN_SLOT_THEN_OUTER_GATHER if extensions
                 else Refresh.CAST_OWN_SLOT_THEN_OUTER_GATHER),
        refresh_steps=(CollectiveStep(Collective.ALL_GATHER, "outer"),),
        gather_steps=(CollectiveStep(Collective.ALL_GATHER),),
        window_steps=(CollectiveStep(Collective.REDUCE_SCATTER, "outer"),),
        window_grad_span=shard,
        norm_axis="mesh",
        temporaries=tuple(temporaries),
        model_weight_span=shard,
        main_weight_span=own,
        main_grad_span=own,
        shard_span=shard,
        grads_in_place=False,  # gathered weights: see make_plan
    )
