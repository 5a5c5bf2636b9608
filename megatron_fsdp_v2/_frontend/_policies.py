"""``fully_shard``'s options beyond FSDP2's, grouped the way users choose them: how the collectives
run (:class:`CommPolicy`), how the unit's state is laid out over the mesh (:class:`ShardingPolicy`),
and how a unit starts (:class:`InitPolicy`). FSDP2's own keywords (``mesh``,
``reshard_after_forward``, ``mp_policy``, ``offload_policy``, ``ignored_params``,
``shard_placement_fn``, ``dp_mesh_dims``) and ``sharding_strategy`` stay flat.

[Note: grouped and flat options]
Every field of a policy is also accepted as a flat keyword of ``fully_shard`` under the same name
(the earlier surface; scripts and torchtitan-style callers pass them so), with the same defaults
and the same meaning: :func:`flat_options` turns the policies into the flat keywords and the rest
of ``fully_shard`` (validation, the cross-rank check, the wiring) sees only those. A field given
both ways is refused with a ``TypeError`` naming the keyword and the policy, even when the values
agree: a policy's field holds a value whether or not it was written, so "the same field in a
policy" would otherwise depend on whether its value happens to be the default. Values are
validated once, by ``_wrap_options.parse_options``, whichever way they came.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypedDict

import torch.nn as nn

from .._comm._process_groups import DEFAULT_TIMEOUT
from ..api import ShardingStrategy

__all__ = ["CommPolicy", "FlatOptions", "InitPolicy", "ShardingPolicy", "flat_options"]


@dataclasses.dataclass(frozen=True)
class CommPolicy:
    """How a unit's collectives run and what its gradient reduction computes.

    Attributes:
        overlap: prefetch all-gathers (next unit in forward, previous in backward, in the
            order recorded in the first forward), launch every ZeRO-1/2 refresh at the start
            of forward, and run gradient reductions in the background. ``False`` runs every
            collective synchronously (same numbers, for debugging). The root's value applies
            to the whole tree.
        timeout: limit of each of the library's collectives (``timedelta`` or seconds; default
            5 minutes): if a rank fails and leaves the others waiting in a collective, they raise
            after this long instead of hanging. They run on the mesh's group when it has this
            timeout already, else on a group over the mesh's ranks created with it (one per
            distinct value; split from the mesh's group when the default group is bound to a
            device). ``None``: the mesh's own group and its timeout.
        collective_impl: ``"native"`` (default) issues each collective as itself
            (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``).
            ``"auto"`` issues, per backend, buffer size and group size, an equivalent measured
            faster on that backend, with no extra memory and bitwise the same results: on gloo
            a reduce-scatter of a buffer of 1 MiB or more as an in-place all-reduce of its
            input scratch buffer, an all-gather of 4 MiB or more as one broadcast per rank into
            place; on NCCL (and other backends) the native ones.
            Applies to this unit's groups (each unit follows its own setting).
            :meth:`FSDPModule.collective_stats` reports what ran. See design.md "Collective
            selection".
        reduce_bucket_size_mb: ``None`` (the default): one delayed gradient collective per
            flat group per window. A size in MiB (DDP's ``bucket_cap_mb``): ``no_shard``
            and ``optim`` coalesce the delayed all-reduces / reduce-scatters of consecutive
            groups, in backward order, into one collective per bucket of at most this size
            (plus the remainder at the end of backward), through a scratch buffer of that
            size; bitwise the same gradients (``no_shard`` on 3+ gloo ranks: up to the
            summation order, as DDP's buckets). Worth it for many small units, whose
            per-collective launch cost dominates. ``optim_grads``/``optim_grads_params`` are
            unaffected; ``overlap=False`` runs every reduction at once, uncoalesced. Every unit
            of a model must pass the same value (``ValueError`` at the first forward); a 2-D
            (HSDP) mesh raises ``NotImplementedError``. See README "Many small units".
        refresh_bucket_size_mb: ``None`` (the default): one all-gather per flat group
            rebuilds the replicated compute weights after each optimizer step (``optim``,
            ``optim_grads``). A size in MiB (DeepSpeed's ``allgather_bucket_size``): those
            all-gathers of consecutive groups, in forward order, run as one per bucket of at
            most this size (gathered bytes), through scratch buffers (at most two alive);
            bitwise the same weights. Worth it for many small units. ``no_shard`` and
            ``optim_grads_params`` are unaffected. Every unit of a model must pass the same
            value (``ValueError`` at the first forward); a 2-D (HSDP) mesh raises
            ``NotImplementedError``. See README "Many small units".
        enable_trace_pool: serve scratch buffers (ZeRO-3's gathered weights, reduce-scatter
            inputs, communication workspaces) from one persistent arena per device, planned
            from the lifetimes recorded in the first iteration, instead of allocating and
            freeing them each time: every scratch buffer keeps its address across iterations (what
            CUDA graphs need), for an arena as large as the planned peak held between steps. A
            changed trace (new shapes or control flow) is served outside the arena and planned
            at the next iteration; see README "Trace-planned pool" and
            :meth:`FSDPModule.release_memory_pool`. Same numbers as ``False`` (the default).
            Every unit of a tree must pass the same value (``ValueError`` at the first forward).
        gradient_scaling_factor: ``None`` averages gradients over the mesh (DDP/FSDP2); a number
            sums them and multiplies by it (Megatron-FSDP). FSDP2's
            ``set_gradient_divide_factor(f)`` later sets ``1/f`` for one unit.
    """

    overlap: bool = True
    timeout: timedelta | float | None = DEFAULT_TIMEOUT
    collective_impl: str = "native"
    reduce_bucket_size_mb: float | None = None
    refresh_bucket_size_mb: float | None = None
    enable_trace_pool: bool = False
    gradient_scaling_factor: float | None = None


@dataclasses.dataclass(frozen=True)
class ShardingPolicy:
    """How a unit's state is laid out over the mesh beyond ``sharding_strategy``.

    Attributes:
        outer_dp_sharding_strategy: the strategy along the outer axis of a 2-D (HSDP) mesh.
            ``"no_shard"`` (the default): every replica keeps the inner schedule and all-reduces
            the reduced gradient shard over the outer axis once per accumulation window;
            gradients are averaged over all R x S ranks. ``"optim"`` (inner
            ``"optim_grads_params"`` only, else ``ValueError``): main weights, gradients and
            optimizer state are sharded over all R x S ranks (DTensors ``(Shard(0), Shard(0))``);
            each window ends with one outer reduce-scatter of the inner-reduced shard, and
            after the step one outer all-gather rebuilds the inner shard before the inner
            gathers. With a 1-D mesh only ``"no_shard"`` is accepted.
        max_padding_ratio: split a group into several flat groups when row alignment would pad it
            by more than this fraction.
    """

    outer_dp_sharding_strategy: ShardingStrategy | str | int = "no_shard"
    max_padding_ratio: float = 0.01


@dataclasses.dataclass(frozen=True)
class InitPolicy:
    """How a unit starts: where its first values come from and what is verified across ranks
    when it is wrapped.

    Attributes:
        sync_module_states: start every rank from the mesh's first rank's parameters and
            buffers (one broadcast per flat group, and one per buffer; per mesh axis on a
            2-D mesh), as DDP does at construction; this applies to every strategy, ZeRO-3
            included. ``False`` keeps each rank's own values: only safe when every rank built
            identical weights (same seed), else replicas silently train different models.
        param_init_fn: for a module built under ``torch.device("meta")``: ``fn(module)``
            initializes ``module``'s own parameters and buffers in place (FSDP1's name),
            called instead of ``module.reset_parameters()`` on every module holding a meta
            parameter or buffer when the model is materialized (first forward, or the first
            state-dict or checkpoint call), in module order of the whole tree, each rank keeping
            its own rows only; see README "Large models". Without it, every such module needs
            ``reset_parameters()``. Every rank must use the same seed (nothing is broadcast).
        check_ranks: verify with one small all-gather that every rank wraps the same module
            with the same arguments.
    """

    sync_module_states: bool = True
    param_init_fn: Callable[[nn.Module], None] | None = None
    check_ranks: bool = True


class FlatOptions(TypedDict, total=False):
    """The policies' fields as flat keywords of ``fully_shard`` (see [Note: grouped and flat
    options])."""

    overlap: bool
    timeout: timedelta | float | None
    collective_impl: str
    reduce_bucket_size_mb: float | None
    refresh_bucket_size_mb: float | None
    enable_trace_pool: bool
    gradient_scaling_factor: float | None
    outer_dp_sharding_strategy: ShardingStrategy | str | int
    max_padding_ratio: float
    sync_module_states: bool
    param_init_fn: Callable[[nn.Module], None] | None
    check_ranks: bool


# Each policy keyword with its class; the order is the order fields are reported in.
_POLICIES: tuple[tuple[str, type], ...] = (
    ("comm_policy", CommPolicy), ("sharding_policy", ShardingPolicy), ("init_policy", InitPolicy),
)
_POLICY_OF_FIELD = {
    f.name: (keyword, cls) for keyword, cls in _POLICIES for f in dataclasses.fields(cls)
}


def flat_options(policies: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """Every policy field as a flat keyword: a policy's value when the policy is given, else the
    flat keyword when given, else the field's default. ``policies`` maps each policy keyword to
    the object passed (or ``None``); ``flat`` holds the flat keywords passed. Raises
    ``TypeError`` for an unknown keyword, a policy of the wrong type, or a field given both as a
    flat keyword and through its policy (before anything is done)."""
    unknown = sorted(set(flat) - set(_POLICY_OF_FIELD))
    if unknown:
        raise TypeError(
            f"fully_shard() got an unexpected keyword argument {unknown[0]!r}; the keywords "
            f"beyond FSDP2's are the fields of {', '.join(c.__name__ for _, c in _POLICIES)}: "
            f"{', '.join(_POLICY_OF_FIELD)}"
        )
    for keyword, cls in _POLICIES:
        given = policies.get(keyword)
        if given is not None and not isinstance(given, cls):
            raise TypeError(
                f"fully_shard({keyword}=...) must be a megatron_fsdp_v2.{cls.__name__} or None, "
                f"got {type(given).__name__}"
            )
    both = [name for name in flat if policies.get(_POLICY_OF_FIELD[name][0]) is not None]
    if both:
        name = both[0]
        keyword, cls = _POLICY_OF_FIELD[name]
        raise TypeError(
            f"fully_shard() got {name}= both as a keyword and through {keyword}= (a field of "
            f"{cls.__name__}); pass it one way: {keyword}={cls.__name__}(..., {name}=...) or "
            f"the flat {name}=..."
        )
    options: dict[str, Any] = {}
    for keyword, cls in _POLICIES:
        policy = policies.get(keyword)
        for field in dataclasses.fields(cls):
            if policy is not None:
                options[field.name] = getattr(policy, field.name)
            elif field.name in flat:
                options[field.name] = flat[field.name]
            else:
                options[field.name] = field.default
    return options
