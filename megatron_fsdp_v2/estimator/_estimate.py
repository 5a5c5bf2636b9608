"""``estimate``: a run's per-rank memory and per-iteration collectives, before renting the GPUs.

[Note: estimating with the runtime]
The estimate runs the library's own wrapping code (``fully_shard``: layouts, padding splits,
buffer plans) on a model built under ``torch.device("meta")``, in one process, under PyTorch's
fake process group backend (``"fake"``: every collective is a no-op) at the requested world
size and rank. Inside ``meta_buffers()`` (see [Note: meta buffers] in ``_registry``) the flat
buffers go on the meta device, so nothing is allocated and no forward is run. The answers come
from the objects the runtime itself executes, not from a second copy of their math:

* persistent memory: ``memory_report`` of the wrapped model (each group's ``memory_bytes``);
* collectives: each group's ``BufferPlan`` steps (``gather_steps``, ``reduce_steps``,
  ``refresh_steps``, ``window_steps``) times how often the schedule runs them per iteration,
  over the group's own buffer sizes;
* the temporary peak: the plan's ``temporaries``, replayed through a ``ScratchAllocator`` (the
  accounting ``memory_report`` reads) in the order the hooks of ``_state.py`` allocate and free
  them in a training iteration (see ``replay_temporaries`` in ``_replay.py``);
* FP8 parameters (torchao float8 with FP8 all-gathers): their FP8 buffers, gathered dtypes and
  scales come from running the scale precompute and each group's refresh or gather without its
  collective on the meta model (see [Note: estimating FP8 parameters] in ``_fp8.py``).

What the estimate assumes: a training loop of ``micro_batches`` forward/backward passes marked
with ``set_is_last_backward`` (only the last is last), every unit running once per micro-batch
in module order (a decoder stack), ``overlap=True`` and the other defaults of ``fully_shard``,
``zero_grad`` between iterations, no gradient clipping (``clip_grad_norm_`` adds one all-reduce
of the squared norm when gradients are sharded), and the iterations after the first (the first
has no refresh to do). Activations and the model's own non-parameter buffers are not modelled.
The command line (``python -m megatron_fsdp_v2.estimator``) is ``main`` in ``_cli.py``.

[Note: estimating FSDP x TP]
With ``tp > 1`` the model is parallelized as a real run does it (``parallelize_module`` with the
caller's plan on the ``"tp"`` dimension of a ``(dp, tp)`` mesh, on meta tensors under the fake
group), so each parameter is a DTensor whose local tensor has the TP-local shape of this rank,
and ``fully_shard`` over the ``"dp"`` dimension lays out and shards those local tensors exactly
as in a real run (see [Note: 2-D parameters] in ``_dtensor/_tp_params.py``). Everything below is
then the dp accounting above, per rank: memory, and the dp collectives (their process group has
``world_size // tp`` ranks). Not counted: TP's own collectives (activations, and the all-reduce
of a ``Replicate()`` parameter's ``Partial()`` gradient), which are the model's, not FSDP's.
With ``mesh_shape=(R, S)`` as well (HSDP x TP) the mesh is ``(R, S, tp)`` named ``("replicate",
"shard", "tp")`` and ``fully_shard`` runs over its ``("replicate", "shard")`` dims: the HSDP
accounting of the TP-local tensors (inner S ranks, outer R).

[Note: estimating Muon]
``optimizer="muon"`` builds the step's :class:`~.._runtime._whole_matrices.WholeMatrices` plan
over the wrapped model's trainable matrices, as the step itself does (owners and splits are
pure layout math, so the fake group serves), and counts what one step sends: one all-to-all
each way per process group that has a matrix split across ranks (none under ``no_shard`` or
where every matrix is whole on one rank), and this rank's bytes in both (bfloat16 rows plus
one flag element per piece; ``WholeMatrices.step_collectives``). A step per iteration, so
these are per iteration too. Memory: one momentum buffer per matrix, AdamW's state for the
rest; the exchange's own buffers (this rank's sends and receives, the owned whole matrices and
Newton-Schulz's temporaries) live only during the step and are not in ``temporary_peak``.

A process that already has a default process group cannot host the fake one: ``estimate``
raises ``RuntimeError`` there (run it before ``init_process_group``, or in another process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _registry
from .._buffers._plan import Collective, GradPath
from .._frontend._fully_shard import fully_shard
from .._runtime._flat_param_group import FlatParamGroup
from .._runtime._memory import MemoryReport, memory_report
from .._runtime._whole_matrices import WholeMatrices
from ..api import MixedPrecisionPolicy, ShardingStrategy
from ._fp8 import convert_to_float8, fp8_groups_filled, gathered_dtypes, refuse_other_subclasses
from ._replay import replay_temporaries

__all__ = ["Estimate", "estimate", "meta_buffers", "optimizer_state_bytes"]

_KIND = {
    Collective.ALL_GATHER: "all_gather",
    Collective.REDUCE_SCATTER: "reduce_scatter",
    Collective.ALL_REDUCE: "all_reduce",
}
OPTIMIZERS = ("adamw", "sgd", "sgd_momentum", "muon")


@dataclass
class GroupShard:
    """Where one group's buffers sit in its flat layout on the estimated rank."""

    unit: str
    index: int
    total_numel: int
    model_weight_span: tuple[int, int]
    main_weight_span: tuple[int, int]
    main_grad_span: tuple[int, int]


@dataclass
class Estimate:
    """The answer of :func:`estimate` for one rank of one configuration."""

    memory: MemoryReport
    """What ``memory_report(model, optimizer)`` gives on this rank after an iteration's last
    backward, before ``optimizer.step()`` (``optimizer_state``: the chosen optimizer's)."""
    collectives: dict[str, tuple[int, int]]
    """Per iteration: kind -> (count, payload bytes: the full buffer each collective covers, as
    ``examples/comm_counter.py`` counts it)."""
    padding_ratio: float
    optimizer_state: dict[str, int]
    """Bytes of optimizer state on this rank for each of ``OPTIMIZERS``."""
    wire_bytes: dict[str, float] = field(default_factory=dict)
    """Per iteration: kind -> bytes one rank sends under ring algorithms (``2 (n-1)/n`` of the
    payload for an all-reduce over ``n`` ranks, ``(n-1)/n`` otherwise; ``comm_counter.py``'s
    convention): the number to compare strategies by."""
    shards: list[GroupShard] = field(default_factory=list)
    world_size: int = 1
    rank: int = 0

    @property
    def bytes_communicated(self) -> float:
        """Wire bytes per iteration, all kinds together."""
        return sum(self.wire_bytes.values())


@contextlib.contextmanager
def meta_buffers() -> Iterator[None]:
    """Groups built from meta parameters put their flat buffers on the meta device (no
    storage); see [Note: meta buffers] in ``_registry``. For the estimator only: such a model
    cannot run."""
    previous = _registry.meta_buffers[0]
    _registry.meta_buffers[0] = True
    try:
        yield
    finally:
        _registry.meta_buffers[0] = previous


def _check_args(world_size: int, rank: int, micro_batches: int, optimizer: str,
                mesh_shape: tuple[int, int] | None, tp: int = 1) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if mesh_shape is not None:
        tp = tp if isinstance(tp, int) and tp >= 1 else 1  # a bad tp: _check_tp's error
        if (len(mesh_shape) != 2 or any(not isinstance(d, int) or d < 1 for d in mesh_shape)
                or mesh_shape[0] * mesh_shape[1] * tp != world_size):
            raise ValueError(
                f"mesh_shape must be (R, S) with R * S == world_size ({world_size})"
                + (f" // tp ({tp})" if tp > 1 else "") + f", got {mesh_shape!r}"
            )
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "estimate() runs the library under a fake process group of its own, and this "
            "process already has a default process group; call estimate() before "
            "init_process_group, or in a separate process (e.g. python -m "
            "megatron_fsdp_v2.estimator)"
        )


def _check_tp(tp: int, tp_plan: Mapping[str, Any] | None, world_size: int) -> None:
    if not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(f"tp must be a positive int dividing world_size ({world_size}), got "
                         f"{tp!r}")
    if tp == 1:
        if tp_plan is not None:
            raise ValueError("tp_plan given with tp=1: pass tp=N (the TP degree) as well")
        return
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise ValueError(
            "tp > 1 needs tp_plan: a parallelize_module plan of the root module, e.g. "
            "{'blocks.*.up': ColwiseParallel(), 'blocks.*.down': RowwiseParallel()} (the "
            "presets' tp_plan functions build one)"
        )


def _unit_selector(wrap: Any) -> Callable[[nn.Module], bool]:
    if isinstance(wrap, tuple) and all(isinstance(c, type) for c in wrap):
        return lambda m: isinstance(m, wrap)
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    raise TypeError(
        f"wrap must be a tuple of module classes or a predicate module -> bool, got {wrap!r}"
    )


def estimate(
    model_fn: Callable[[], nn.Module],
    *,
    world_size: int,
    wrap: tuple[type, ...] | Callable[[nn.Module], bool] = (),
    micro_batches: int = 1,
    sharding_strategy: ShardingStrategy | str | int = "optim_grads_params",
    mp_policy: MixedPrecisionPolicy | None = None,
    mesh_shape: tuple[int, int] | None = None,
    outer_dp_sharding_strategy: ShardingStrategy | str | int = "no_shard",
    rank: int = 0,
    optimizer: str = "adamw",
    max_padding_ratio: float = 0.01,
    tp: int = 1,
    tp_plan: Mapping[str, Any] | None = None,
    float8: bool = False,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
) -> Estimate:
    """Estimate ``rank``'s memory and the collectives of one training iteration when the model
    ``model_fn()`` builds is wrapped with ``fully_shard`` (each module ``wrap`` selects, then the
    root) over ``world_size`` ranks. See [Note: estimating with the runtime] for what is assumed
    and what is not modelled (activations).

    ``model_fn`` is called under ``torch.device("meta")``; no forward runs, so the model need not
    be runnable. ``wrap``: a tuple of module classes or a predicate. ``mesh_shape``: ``(R, S)``
    for HSDP (``outer_dp_sharding_strategy`` along R). ``optimizer``: whose state
    ``memory.optimizer_state`` reports (``"adamw"``: two moments of the main weights plus a
    4-byte step per parameter; ``"sgd"``: none; ``"sgd_momentum"``: one buffer); every one of
    them is in ``optimizer_state``; ``"muon"``: ``torch.optim.Muon`` on the trainable 2-D
    parameters (one momentum buffer each) and AdamW on the others, and its step's whole-matrix
    exchange in ``collectives["all_to_all"]`` (see [Note: estimating Muon]). Leaves no process
    group and no library state behind.

    ``tp > 1``: FSDP x tensor parallelism (see [Note: estimating FSDP x TP]): ``world_size``
    ranks on a ``(world_size // tp, tp)`` mesh named ``("dp", "tp")``, ``tp_plan`` (required) a
    ``parallelize_module`` plan of the root (``{"blocks.*.up": ColwiseParallel(), ...}``; the
    presets' ``tp_plan`` functions build one), then ``fully_shard`` over the dp mesh. With
    ``mesh_shape=(R, S)`` too (``R * S * tp == world_size``), HSDP x TP: a ``(R, S, tp)`` mesh
    named ``("replicate", "shard", "tp")``, ``fully_shard`` over ``("replicate", "shard")``.

    FP8 parameters (torchao float8 linears with FP8 all-gathers; see [Note: estimating FP8
    parameters] in ``_fp8.py``): ``float8=True`` converts the linears inside the ``wrap`` units
    whose dims are multiples of 16 with ``Float8LinearConfig(enable_fsdp_float8_all_gather=
    True)`` (the command line's ``--param-dtype fp8``, with bf16 compute); a ``model_fn`` that
    converts its model itself is estimated the same way. Assumed: ``precompute_float8_dynamic_
    scale_for_fsdp(model)`` after every optimizer step (its all-reduce is counted). Needs
    torchao.

    ``reshard_after_forward``: ``fully_shard``'s, for every unit; an ``int`` ``n`` (ZeRO-3)
    counts each micro-batch's backward all-gather over the groups of ``n`` ranks (its wire
    bytes with their size) and the ``1/n`` slices kept from forward to backward in the
    temporary peak (see [Note: resharding to a smaller group] in
    ``_runtime/_compute_weights.py``). ``False`` is not modelled (``NotImplementedError``).

    ``cpu_offload``: ``offload_policy=CPUOffloadPolicy()`` on every unit, as on a GPU mesh (the
    copying path of [Note: host offload] in ``_runtime/_offload.py``): the main weights and
    gradients in their own host buffers (no device shard), and ``memory.offloaded_bytes`` (=
    ``memory.host_bytes``) their bytes plus the chosen optimizer's state.
    """
    _check_args(world_size, rank, micro_batches, optimizer, mesh_shape, tp)
    if reshard_after_forward is False:
        raise NotImplementedError(
            "estimate(reshard_after_forward=False): the kept weights' schedule is not modelled;"
            " estimate with True (the default) or an int"
        )
    _check_tp(tp, tp_plan, world_size)
    selects = _unit_selector(wrap)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    dtensor_ops = tp > 1
    try:
        tp_mesh = None
        if tp > 1 and mesh_shape is None:
            root_mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
            mesh, tp_mesh = root_mesh["dp"], root_mesh["tp"]
        elif tp > 1 and mesh_shape is not None:  # HSDP x TP, as test_hsdp_tp.py builds it
            root_mesh = init_device_mesh("cpu", (*mesh_shape, tp),
                                         mesh_dim_names=("replicate", "shard", "tp"))
            mesh, tp_mesh = root_mesh["replicate", "shard"], root_mesh["tp"]
        elif mesh_shape is None:
            mesh = init_device_mesh("cpu", (world_size,))
        else:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        with torch.device("meta"):
            model = model_fn()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
        placed = next((n for n, p in model.named_parameters() if p.device.type != "meta"), None)
        if placed is not None:
            raise ValueError(
                f"model_fn built parameter {placed!r} on a real device; estimate calls it under "
                "torch.device('meta') so that nothing is allocated: do not pass device=... or "
                "move the model inside model_fn"
            )
        if float8:
            convert_to_float8(model, selects)
        has_fp8 = refuse_other_subclasses(model)
        # DTensor ops on this estimate's meshes follow: TP's parallelize_module, FP8's scale
        # precompute (see _forget_dtensor_shardings).
        dtensor_ops = tp_mesh is not None or has_fp8
        if dtensor_ops:
            _forget_dtensor_shardings()
        if tp_mesh is not None:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, tp_mesh, dict(tp_plan or {}))
        units = [m for m in model.modules() if m is not model and selects(m)]
        options: dict[str, Any] = dict(
            mesh=mesh, sharding_strategy=sharding_strategy, mp_policy=mp_policy,
            check_ranks=False, sync_module_states=False, max_padding_ratio=max_padding_ratio,
            outer_dp_sharding_strategy=outer_dp_sharding_strategy,
            # None: each strategy's default (True would be refused by the others than ZeRO-3).
            reshard_after_forward=None if reshard_after_forward is True else reshard_after_forward,
        )
        if cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy()
        with meta_buffers():
            for unit in reversed(units):  # children before their parents
                fully_shard(unit, **options)
            fully_shard(model, **options)
        return _measure(model, micro_batches, optimizer, world_size, rank, has_fp8)
    finally:
        _registry.reset()
        dist.destroy_process_group()
        if dtensor_ops:
            _forget_dtensor_shardings()


def _forget_dtensor_shardings() -> None:
    """Empty DTensor's sharding-propagation caches (Python and the C++ fast path). Their
    entries hold the device meshes of the calls that filled them, and a mesh compares equal to
    another estimate's mesh of the same shape whose process groups differ: ``nn.Parameter(dtensor)``
    in ``parallelize_module`` would come back on a mesh whose groups were destroyed with an
    earlier estimate's fake process group, and FP8's scale precompute would all-reduce over
    such a group."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _states(model: nn.Module) -> list[tuple[str, Any]]:
    return [(name or "<root>", s) for name, s in _registry.unit_states(model)]


def _measure(model: nn.Module, micro_batches: int, optimizer: str, world_size: int,
             rank: int, has_fp8: bool) -> Estimate:
    states = _states(model)
    groups = [g for _, s in states for g in s.groups]
    extra = fp8_groups_filled(model, groups) if has_fp8 else []
    report = memory_report(model)
    report.temporary_peak = replay_temporaries([s for _, s in states], micro_batches)
    state_bytes = {name: optimizer_state_bytes(groups, name) for name in OPTIMIZERS}
    report.optimizer_state = state_bytes[optimizer]
    # CPU offload: the offloaded groups' optimizer state is host memory too (memory_report
    # counted their main weights and gradients; not fields, see MemoryReport.__post_init__).
    offloaded_state = optimizer_state_bytes([g for g in groups if g.host_offload is not None],
                                            optimizer)
    report._offloaded_bytes += offloaded_state
    report._host_bytes += offloaded_state
    shards = [
        GroupShard(name, i, g.layout.total_numel, g.plan.model_weight_span,
                   g.plan.main_weight_span, g.plan.main_grad_span)
        for name, s in states for i, g in enumerate(s.groups)
    ]
    collectives, wire = _collectives(groups, micro_batches, extra)
    if optimizer == "muon":
        count, sent = muon_exchange(groups)
        collectives["all_to_all"] = (count, sent)
        wire["all_to_all"] = float(sent)
    return Estimate(report, collectives, report.padding_ratio, state_bytes, wire, shards,
                    world_size, rank)


def optimizer_state_bytes(groups: list[FlatParamGroup], optimizer: str) -> int:
    """Bytes of ``optimizer``'s state for the parameters of ``groups`` on this rank once it has
    stepped: per trainable parameter, ``k`` tensors shaped like its local main-weight shard
    (AdamW: 2 and a float32 ``step`` scalar; SGD with momentum: 1; plain SGD: none). A rank
    holding no rows of a parameter still holds its (zero-row) gradient, so the optimizer keeps
    state for it there too: the step scalar, and empty tensors."""
    per_param = {"adamw": 2, "sgd": 0, "sgd_momentum": 1}.get(optimizer, 0)
    total = 0
    for group in groups:
        if not group.requires_grad:
            continue
        for param in group.dist_params:
            local = param.to_local()  # type: ignore[attr-defined]
            if optimizer == "muon":  # Muon's momentum for matrices, AdamW for the rest
                if param.ndim == 2:
                    total += local.numel() * local.element_size()
                    continue
                total += 2 * local.numel() * local.element_size()
                total += torch.tensor(0.0).element_size()
                continue
            total += per_param * local.numel() * local.element_size()
            if optimizer == "adamw":
                total += torch.tensor(0.0).element_size()  # the step count (float32)
    return total


def muon_exchange(groups: list[FlatParamGroup]) -> tuple[int, int]:
    """The all-to-alls of one Muon step on this rank and the bytes it sends in them (see
    [Note: estimating Muon])."""
    matrices = [p for g in groups if g.requires_grad for p in g.dist_params if p.ndim == 2]
    if not matrices:
        return 0, 0
    if any(t is not None for g in groups for t in g.tp_faces):
        raise NotImplementedError(
            "estimate(optimizer='muon') with tp > 1: the whole-matrix exchange of tensor-"
            "parallel matrices gathers every rank's blocks at run time, which the fake process "
            "group cannot; estimate with optimizer='adamw' and add Muon's momentum by hand"
        )
    plan = WholeMatrices(matrices)
    return plan.step_collectives(torch.bfloat16)


def _collectives(groups: list[FlatParamGroup], micro_batches: int,
                 extra: list[tuple[str, int, int]]) -> tuple[dict[str, tuple[int, int]],
                                                            dict[str, float]]:
    """Each group's plan steps, times how often an iteration of ``micro_batches`` runs them,
    over the buffers they cover (payload: the full buffer of the step's process group), and the
    wire bytes of the same collectives; plus ``extra`` (kind, payload, group size) collectives
    once per iteration (the FP8 scale precompute's)."""
    totals = {kind: [0, 0] for kind in _KIND.values()}
    wire = dict.fromkeys(_KIND.values(), 0.0)

    def add(op: Collective, count: int, numel: int, dtype: torch.dtype, axis: str = "shard"
            ) -> None:
        kind = _KIND[op]
        payload = count * numel * dtype.itemsize
        totals[kind][0] += count
        totals[kind][1] += payload
        n = dist.get_world_size(group.axis_process_groups[axis])
        factor = (2.0 if op is Collective.ALL_REDUCE else 1.0) * (n - 1) / n
        wire[kind] += payload * factor

    for group in groups:
        plan, dtypes, full = group.plan, group.dtypes, group.layout.total_numel
        inner_shard = plan.shard_span[1] - plan.shard_span[0]
        # One all-gather per gathered dtype: the compute dtype, or an FP8 group's input buffers.
        for step in plan.gather_steps:  # before forward and before backward, each micro-batch
            for dtype in gathered_dtypes(group):
                if group.weights.post_forward_size:  # the backward's within the group of n ranks
                    add(step.op, micro_batches, full, dtype)
                    add(step.op, micro_batches, full, dtype, "post_forward")
                else:
                    add(step.op, 2 * micro_batches, full, dtype)
        for step in plan.refresh_steps:  # once, after the optimizer step
            for dtype in gathered_dtypes(group):
                add(step.op, 1, full if step.axis == "shard" else inner_shard, dtype, step.axis)
        if not group.requires_grad:
            continue
        per_window = plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
        for step in plan.reduce_steps:
            add(step.op, 1 if per_window else micro_batches, full, dtypes.comm)
        for step in plan.window_steps:
            if plan.window_grad_span is not None:
                lo, hi = plan.window_grad_span
            else:
                lo, hi = plan.main_weight_span
            add(step.op, 1, hi - lo, dtypes.comm, step.axis)
    for kind, payload, n in extra:
        totals[kind][0] += 1
        totals[kind][1] += payload
        wire[kind] += payload * (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n
    return {kind: (c, b) for kind, (c, b) in totals.items()}, wire
