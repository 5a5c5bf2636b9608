"""One flat group: its buffers and their lifecycle (compute weights made ready and
freed, gradients staged and reduced), executing the group's :class:`~._plan.BufferPlan`. No
hooks here (``_state.py`` decides *when*), no collective launch details (the group's
:class:`~._issuer.GroupIssuer` launches; ``_gather.py`` plans weight gathers and refreshes), no
strategy branches (``_plan.py``). The group builds the buffers and holds two components, each
owning its state: ``weights`` (:class:`~._compute_weights.ComputeWeights`, the compute weights
bound, gathered or refreshed, freed) and ``grads`` (:class:`~._grads.GroupGrads`: ``main_grad``,
the gradient path, what the optimizer sees as ``.grad``). The schedule talks to the group only.

[Note: buffer roles]
Every group owns up to three persistent flat buffers, laid out identically (see
[Note: row-aligned flat buffers] in ``_layout.py``); the plan says each one's extent:

* ``model_weight``: the compute weights, in the compute dtype. Compute parameters (the module's
  original ``nn.Parameter`` objects) are views into the unsharded buffer (``model_weight``
  itself, or the temporary ``unsharded_model_weight`` scratch buffer of a group that gathers), bound
  once: at wrap time, or at the first gather.
* ``main_weight``: what the optimizer updates, exposed as DTensor parameters whose local tensors
  are views into it. A separate buffer only when the main dtype differs from the compute dtype;
  otherwise it *is* this rank's part of ``model_weight``.
* ``main_grad``: what the optimizer reads, exposed as DTensor gradients viewing it. Allocated
  lazily and freed when gradients are cleared; the tensor object survives (storage freeing), so
  cached gradient views stay valid.

The compute weights of ``optim``/``optim_grads`` are refreshed after a step as [Note:
replicated-buffer refresh] in ``_gather.py`` says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .. import ops
from .._buffers._allocator import ScratchAllocator
from .._buffers._layout import BufferLayout
from .._buffers._plan import Extent, make_plan
from .._comm import _collectives as comm
from .._comm._collective_impl import GroupCollectives
from .._dtensor._parameter import as_parameter
from .._dtensor._tp_params import TPFace
from ..api import ResolvedDtypes, ShardingStrategy
from ._compute_weights import ComputeWeights
from ._grads import GroupGrads
from ._issuer import Deferred, GroupIssuer
from ._offload import HostOffload, OffloadConfig
from ._param_record import ParamRecord, contiguous_stride, mesh_device
from ._subclass_gather import ExtensionGather, has_all_gather_extensions, inner_values

if TYPE_CHECKING:
    from ._coalesce import ReductionCoalescer

__all__ = ["FlatParamGroup"]


class FlatParamGroup:
    """The flat buffers of one (device, dtype, requires_grad) group of one FSDP unit, with its
    compute weights (``weights``) and gradients (``grads``) as components."""

    def __init__(
        self,
        *,
        group_id: tuple[int, int],
        params: Sequence[nn.Parameter],
        tp_faces: Sequence[TPFace | None] | None = None,
        fqns: Sequence[str],
        layout: BufferLayout,
        mesh: DeviceMesh,
        process_group: dist.ProcessGroup | None = None,
        outer_process_group: dist.ProcessGroup | None = None,
        mesh_process_group: dist.ProcessGroup | None = None,
        strategy: ShardingStrategy,
        outer_strategy: ShardingStrategy = ShardingStrategy.NO_SHARD,
        dtypes: ResolvedDtypes,
        grad_pre_scale: float,
        allocator: ScratchAllocator,
        sync_from_rank0: bool = False,
        collective_impl: str = "native",
        meta_init_device: torch.device | None = None,
        host_offload: OffloadConfig | None = None,
    ) -> None:
        """Builds the buffers but leaves the module's parameters untouched: :meth:`bind`
        turns them into views of the buffers once every group of the unit was built (so a
        failure half-way changes nothing). ``sync_from_rank0``: start from the mesh rank 0's
        values (one broadcast per mesh axis), as DDP does.

        ``mesh``: 1-D, or 2-D for HSDP (dim 0 the outer axis, dim 1 the inner one). The layout,
        ``strategy`` and every collective of the inner schedule are over the inner (last) axis;
        ``outer_strategy`` applies along dim 0 of a 2-D mesh (see [Note: buffer plan]); with
        ``OPTIM`` the layout is over ``R * S`` sub-shards, and ``mesh_process_group`` (a group
        over the whole mesh) is where gradient norms are all-reduced. ``collective_impl``: see
        [Note: collective implementation] in ``_collective_impl.py``. ``tp_faces``: per
        parameter, its :class:`TPFace` when tensor parallelism made it a DTensor (the buffers
        then hold its TP-local tensor; see [Note: 2-D parameters]). ``host_offload``:
        ``CPUOffloadPolicy``'s copying path (main weights and gradients in host memory; see
        [Note: host offload] in ``_offload.py``)."""
        self.layout = layout
        self.tp_faces = list(tp_faces) if tp_faces is not None else [None] * len(params)
        # Per parameter: where clip_grad_norm_ reduces a TP-sharded gradient's norm (wiring).
        self.tp_norm_process_groups: list[dist.ProcessGroup | None] = [None] * len(params)
        self.mesh = mesh  # the optimizer-facing DTensors live on it (all of its dims)
        inner = mesh.ndim - 1
        self.rank = mesh.get_local_rank(inner)
        self.world_size = mesh.size(inner)  # of the inner axis
        self.strategy = strategy
        replicas = mesh.size(0) if mesh.ndim == 2 else 1
        extensions = has_all_gather_extensions(params[0])  # the whole group (build_groups)
        if host_offload is not None and (extensions or any(f is not None for f in self.tp_faces)):
            raise NotImplementedError(
                f"offload_policy=CPUOffloadPolicy() with parameter {fqns[0]!r}, "
                + ("gathered through all-gather extensions (FP8)" if extensions
                   else "a tensor-parallel DTensor")
                + ": its host copies are not implemented. Leave offload_policy unset for this "
                "unit"
            )
        self.plan = make_plan(
            strategy, dtypes, layout, self.rank, outer=outer_strategy if replicas > 1 else None,
            outer_rank=mesh.get_local_rank(0) if replicas > 1 else 0, outer_size=replicas,
            extensions=extensions, host_main=host_offload is not None,
        )
        if self.plan.norm_axis == "mesh" and mesh_process_group is None:
            mesh_process_group = mesh._flatten().get_group()
        # Outer axes first: (Replicate(), Shard(0)) on an HSDP mesh, (Shard(0), Shard(0)) with
        # outer optim.
        extent = self.plan.optimizer_placement
        self._placements: tuple[Placement, ...] = (
            (Shard(0) if extent is Extent.SUB_SHARD else Replicate(),) * inner
            + (Replicate() if extent is Extent.FULL else Shard(0),)
        )
        self.dtypes = dtypes
        self.grad_pre_scale = grad_pre_scale
        self.allocator = allocator
        # A module built under torch.device("meta") has no values yet: the buffers go on
        # ``meta_init_device`` (default: the mesh's device; the estimator's storage-free wraps
        # pass the meta device) and are filled at materialization (see [Note: meta
        # materialization]).
        self.pending_init = params[0].device.type == "meta"
        if self.pending_init:
            self.device = meta_init_device if meta_init_device is not None else mesh_device(mesh)
        else:
            self.device = params[0].device
        self.param_dtype = params[0].dtype  # the parameters' own dtype, before mp_policy
        # CPU offload's copying path: main weights and gradients in host memory.
        self.host_offload = (
            HostOffload(host_offload, self.device) if host_offload is not None else None
        )
        # The meta parameters the compute placeholders replace, until fully_shard swaps them.
        self.original_params: list[nn.Parameter] = list(params) if self.pending_init else []
        # The group's collectives, over process_group (the inner axis' ranks; see
        # ``_process_groups.unit_process_group``; default: the mesh's own group for that axis)
        # and, on a 2-D mesh, the outer axis' group (see [Note: who issues collectives] in
        # _issuer.py).
        # ``name`` names this group in errors and in the collective-order check; the root's lazy
        # init replaces it with the unit's fully qualified name.
        self.issuer = GroupIssuer(
            name=f"group of {fqns[0]!r}" + (f" (+{len(fqns) - 1})" if len(fqns) > 1 else ""),
            numel=layout.total_numel, device=self.device,
            process_group=process_group if process_group is not None else mesh.get_group(inner),
            outer_process_group=(
                outer_process_group if outer_process_group is not None or mesh.ndim != 2
                else mesh.get_group(0)
            ),
            mesh_process_group=mesh_process_group, collective_impl=collective_impl,
        )
        self.owner = ""  # "<Class> at 0x...": the unit, in error messages (set by fully_shard)
        self.uncovered = layout.uncovered_ranges()  # padding and alignment gaps
        self._group_id = group_id
        self.extension = ExtensionGather(self, list(params)) if extensions else None  # FP8

        # The persistent weight buffers ([Note: buffer roles]); main_weight may view model_weight.
        self.model_weight, self.main_weight = self._weight_buffers(
            None if self.pending_init else self._initial_flat(params, sync_from_rank0)
        )
        self.records = [
            ParamRecord(fqn, self, index, item, self._compute_param(param, self.tp_faces[index]),
                        self._build_dist_param(param, index), self._local_rows(index),
                        self.tp_faces[index])
            for index, (param, fqn, item) in enumerate(zip(params, fqns, layout.items))
        ]
        self.requires_grad = params[0].requires_grad
        self.weights = ComputeWeights(self)  # bound, gathered or refreshed, freed; WeightState
        self.grads = GroupGrads(self)  # main_grad, the gradient path, what the optimizer sees

    # ------------------------------------------------------------------ records

    @property
    def params(self) -> list[nn.Parameter]:
        return [r.compute_param for r in self.records]

    @property
    def dist_params(self) -> list[nn.Parameter]:
        return [r.dist_param for r in self.records]

    @property
    def fqns(self) -> list[str]:
        return [r.fqn for r in self.records]

    def local_row_range(self, index: int) -> tuple[int, int]:
        """Global dim-0 rows of parameter ``index`` in this rank's optimizer-facing shard."""
        return self.records[index].local_rows

    def dist_param_version(self) -> int:
        """The sum of the optimizer-facing parameters' version counters: changes with every
        in-place write through them."""
        return sum(r.dist_param._version for r in self.records)

    # ------------------------------------------------------------------ construction

    def _initial_flat(self, params: Sequence[nn.Parameter], sync_from_rank0: bool) -> torch.Tensor:
        """The parameters' current values packed into one full flat buffer of their own dtype
        (padding zeroed), broadcast from mesh rank 0 when ``sync_from_rank0``. Temporary: it
        lives while the group is built, like the parameters themselves."""
        flat = torch.zeros(self.layout.total_numel, dtype=params[0].dtype, device=self.device)
        offsets = [item.offset for item in self.layout.items]
        # .contiguous() copies only the rare non-contiguous parameter (e.g. a strided view).
        locals_ = [p if face is None else face.local_of(p)
                   for p, face in zip(params, self.tp_faces)]
        ops.pack_([inner_values(p).contiguous().view(-1) for p in locals_], offsets, flat)
        if sync_from_rank0:
            # Outer axis first (from its first rank), then the inner one: every rank ends with
            # mesh rank (0, 0)'s values.
            for group in self.sync_process_groups:
                comm.broadcast_from_first(flat, group)
        return flat

    @property
    def name(self) -> str:
        return self.issuer.name

    @name.setter
    def name(self, value: str) -> None:
        self.issuer.name = value

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The inner axis' group: the layout and every collective of the inner schedule."""
        return self.issuer.process_group

    @property
    def outer_process_group(self) -> dist.ProcessGroup | None:
        """HSDP: the ranks that hold the same inner shard (None on a 1-D mesh)."""
        return self.issuer.outer_process_group

    @property
    def axis_process_groups(self) -> dict[str, dist.ProcessGroup]:
        """The process group of each axis a plan step may name: ``"shard"`` (inner),
        ``"outer"`` and ``"mesh"`` (the whole mesh) where they exist."""
        return self.issuer.axis_process_groups

    @property
    def collectives(self) -> GroupCollectives:
        """Which calls carry this group's collectives, and the count of what ran."""
        return self.issuer.collectives

    @property
    def norm_process_group(self) -> dist.ProcessGroup:
        """Where the sum of squares of this group's optimizer-facing gradients is all-reduced
        (``clip_grad_norm_``): the plan's ``norm_axis``."""
        return self.axis_process_groups[self.plan.norm_axis]

    @property
    def sync_process_groups(self) -> list[dist.ProcessGroup]:
        """The groups a start-from-the-first-rank broadcast runs over, in order (outer axis
        first); groups of one rank are left out."""
        groups = [self.outer_process_group, self.process_group]
        return [g for g in groups if g is not None and dist.get_world_size(g) > 1]

    def _weight_buffers(self, initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``model_weight`` and ``main_weight`` built. ``initial``: the full flat values, or
        ``None`` (meta parameters): zeros until :meth:`write_full_param` fills each parameter's
        part."""
        plan, dtypes, device = self.plan, self.dtypes, self.device
        alloc = torch.zeros if initial is None else torch.empty  # padding must read as zeros
        lo, hi = plan.model_weight_span
        # Empty when every gather casts the main shard itself (Refresh.CAST_AT_GATHER).
        model_weight = alloc(hi - lo if plan.keeps_model_weight else 0, dtype=dtypes.model,
                             device=device)
        if initial is not None and plan.keeps_model_weight:
            ops.pack_([initial[lo:hi]], [0], model_weight)
        main_lo, main_hi = plan.main_weight_span
        if plan.main_weight_separate and self.host_offload is not None:  # host memory
            main_weight = self.host_offload.empty(main_hi - main_lo, dtypes.main,
                                                  zeros=initial is None)
            if initial is not None:  # from the device (pack_ wants one device)
                main_weight.copy_(initial[main_lo:main_hi])
        elif plan.main_weight_separate:
            main_weight = alloc(main_hi - main_lo, dtype=dtypes.main, device=device)
            if initial is not None:
                ops.pack_([initial[main_lo:main_hi]], [0], main_weight)
        else:
            main_weight = model_weight[main_lo - lo : main_hi - lo]
        return model_weight, main_weight

    def _compute_param(self, param: nn.Parameter, face: TPFace | None) -> nn.Parameter:
        """The compute parameter of ``param``: ``param`` itself, or for a meta parameter (whose
        storage cannot be replaced by one on another device) a new placeholder on the buffers'
        device with the same attributes, which fully_shard registers in ``param``'s modules (a
        DTensor in the compute placements for a tensor-parallel DTensor parameter)."""
        if param.device.type != "meta":
            return param
        empty = torch.empty(0, dtype=param.dtype, device=self.device)
        fresh = nn.Parameter(
            empty if face is None else face.compute_dtensor(empty),
            requires_grad=param.requires_grad,
        )
        for name, value in vars(param).items():
            setattr(fresh, name, value)
        return fresh

    @torch.no_grad()
    def write_full_param(self, index: int, full: torch.Tensor) -> None:
        """Write parameter ``index``'s whole value (shaped like it) into this rank's part of the
        weight buffers (meta materialization): the rows each buffer's extent covers, and
        nothing else, so a rank never keeps more than its own share."""
        item = self.layout.items[index]
        flat = full.detach().reshape(-1)
        buffers = []
        if self.plan.keeps_model_weight:
            buffers.append((self.model_weight, self.plan.model_weight_span))
        if self.plan.main_weight_separate:
            buffers.append((self.main_weight, self.plan.main_weight_span))
        for buffer, (start, end) in buffers:
            lo, hi = self.layout.local_item_range(index, start, end)
            if lo < hi:
                buffer[lo - start : hi - start].copy_(flat[lo - item.offset : hi - item.offset])

    def finish_materialization(self) -> None:
        """Every parameter was written (or the user took over with ``to_empty``): the weights
        are current, and the writes are not user edits to refresh from."""
        self.pending_init = False
        self.weights.forget_main_weight_edits()

    def local_view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Item ``index``'s rows in ``buffer``, which holds the main-weight span (the span the
        optimizer-facing parameters and gradients cover)."""
        item = self.layout.items[index]
        start, end = self.plan.main_weight_span
        lo, hi = self.layout.local_item_range(index, start, end)
        rows = (hi - lo) // item.row_numel
        return buffer[lo - start : hi - start].view(rows, *item.shape[1:])

    def _local_rows(self, index: int) -> tuple[int, int]:
        item = self.layout.items[index]
        lo, hi = self.layout.local_item_range(index, *self.plan.main_weight_span)
        start = min(max(lo - item.offset, 0), item.numel) // item.row_numel
        return start, start + (hi - lo) // item.row_numel

    def to_dtensor(self, local: torch.Tensor, index: int) -> DTensor:
        """``local`` (this rank's rows of parameter ``index`` in a main-weight-span buffer) as
        the optimizer-facing DTensor: on the group's mesh, or for a tensor-parallel parameter
        on the dp x TP mesh (see [Note: 2-D parameters])."""
        face = self.tp_faces[index]
        if face is not None:
            return face.dist_dtensor(local, self._placements)
        shape = self.layout.items[index].shape
        return DTensor.from_local(
            local, self.mesh, self._placements, run_check=False, shape=shape,
            stride=contiguous_stride(shape),
        )

    def _build_dist_param(self, param: nn.Parameter, index: int) -> nn.Parameter:
        local = self.local_view(self.main_weight, index)
        if self.extension is not None:  # the subclass over its rows; its inner state not copied
            local = self.extension.wrap_local(index, local)
        dist_param = as_parameter(self.to_dtensor(local, index), param.requires_grad)
        # Optimizer grouping and user code read attributes set on the original parameters
        # (not a tensor-parallel face's compute-only ones: spmd_types annotations).
        face = self.tp_faces[index]
        compute_only = face.compute_attrs if face is not None else frozenset()
        for name, value in vars(param).items():
            if name in compute_only:
                continue
            if self.extension is None or not name.startswith("_"):
                setattr(dist_param, name, value)
        return dist_param

    # ------------------------------------------------------------------ compute weights
    # What the hooks (_state.py, _unit_state.py) and the tree's callbacks (_context.py) ask of
    # the group's compute weights: they talk to the group, the group to its ComputeWeights
    # (which the wiring, the refresh buckets and FP8's gather reach directly).

    def ready_compute_weights(self, async_op: bool = False) -> bool:
        """Gather or refresh the compute weights (:meth:`ComputeWeights.ready_compute_weights`);
        whether a collective was issued."""
        return self.weights.ready_compute_weights(async_op)

    def wait_for_compute_weights(self) -> None:
        """Wait for the gather or refresh in flight, if any."""
        self.weights.wait_for_compute_weights()

    def free_gathered_weights(self) -> bool:
        """Free gathered weights (a group that gathers); whether it did."""
        return self.weights.free_gathered_weights()

    def reshard_after_forward(self) -> bool:
        """A unit's post-forward: free gathered weights, keeping a slice where the unit
        reshards to a smaller group (:meth:`ComputeWeights.reshard_after_forward`)."""
        return self.weights.reshard_after_forward()

    @property
    def is_gathered(self) -> bool:
        """Gathered weights are held, or their gather is in flight."""
        return self.weights.is_gathered

    @property
    def holds_weight_work(self) -> bool:
        """Gathered weights, or a gather or refresh in flight: something to free or wait for."""
        return self.weights.holds_weight_work

    @property
    def needs_refresh(self) -> bool:
        """The compute weights are older than updated main weights."""
        return self.weights.needs_refresh

    @property
    def views_generation(self) -> int:
        """Changes whenever the compute parameters are bound to another buffer."""
        return self.weights.views_generation

    def note_views_exposed(self) -> None:
        """The compute parameters are about to be used: keep their scratch buffer's memory
        (:meth:`ComputeWeights.note_views_exposed`)."""
        self.weights.note_views_exposed()

    def mark_main_weights_updated(self) -> None:
        """The main weights changed: refresh, or gather again, before the next use."""
        self.weights.mark_main_weights_updated()

    def detect_main_weight_edits(self) -> None:
        """Mark the main weights updated if an in-place op wrote an optimizer-facing parameter."""
        self.weights.detect_main_weight_edits()

    def drop_stale_gathered(self) -> bool:
        """Before a forward: free gathered weights older than the main weights."""
        return self.weights.drop_stale_gathered()

    def drop_gathered_views(self) -> None:
        """Scratch-buffer memory was replaced or released (a trace-pool replan,
        ``release_memory_pool()``): the compute views (:meth:`ComputeWeights.drop_gathered_views`)
        and the gradient aliases (:meth:`GroupGrads.forget_temporary_aliases`) over it let go."""
        self.grads.forget_temporary_aliases()
        self.weights.drop_gathered_views()

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` calls on the optimizer-facing parameters after wrapping:
        the compute parameters autograd sees must agree with them."""
        changed = False
        for index, record in enumerate(self.records):
            wanted = record.dist_param.requires_grad
            if record.compute_param.requires_grad != wanted:
                record.compute_param.requires_grad_(wanted)
                changed = True
                if not wanted:  # what it accumulated so far stays its gradient
                    self.grads.note_frozen(index)
        if changed:
            self.requires_grad = any(r.dist_param.requires_grad for r in self.records)

    def temporary_key(self, role: str) -> tuple[tuple[int, int], str]:
        """The allocator key of this group's scratch buffer ``role`` (see the plan's
        ``temporaries``)."""
        return (self._group_id, role)

    def end_window(self, async_op: bool, marks_updated: bool = True) -> Deferred:
        """The end of this group's accumulation window at the end of backward: the gradient
        state machine's window end (:meth:`GroupGrads.end_window`), whose ``finish()`` also marks
        the main weights updated: the optimizer step that usually follows changes them, so they
        are refreshed once before the next forward whatever updates them (an optimizer the step
        hook does not see, writes through ``to_local()``). ``marks_updated=False``: the caller
        marks them later (a backward over part of the graph, which no step follows before the
        root's graph is backwarded: ``FSDPContext.final_callback``)."""
        window = self.grads.end_window(async_op)

        def finish() -> None:
            window.finish()
            if marks_updated:
                self.mark_main_weights_updated()

        return Deferred("gradient window end, then main weights marked updated", finish)

    # ------------------------------------------------------------------ gradients (GroupGrads)
    # What the hooks (_state.py, _unit_state.py) and the tree's callbacks (_context.py) ask of
    # the group's gradients: they talk to the group, the group to its GroupGrads.

    def use_reduction_buckets(self, coalescer: ReductionCoalescer | None) -> None:
        """The tree's reduction buckets the delayed reduction goes into (None: its own)."""
        self.grads.coalescer = coalescer

    def prepare_gradients(self) -> None:
        """Before a backward: let autograd write the gradients into the flat buffers where the
        plan allows (see [Note: gradients in place] in ``_grad_staging.py``)."""
        self.grads.prepare_backward()

    def sweep_gradients(self) -> None:
        """Take in the installed gradients the optimizer cleared since they were shown."""
        self.grads.sweep()

    def reduce_gradients(self, is_last_backward: bool, async_op: bool) -> bool:
        """A unit's post-backward: stage and reduce this micro-batch's gradients as the plan
        says (:meth:`GroupGrads.reduce`); whether anything was staged or reduced."""
        return self.grads.reduce(is_last_backward, async_op)

    def finish_reductions(self, coalesced: bool = True) -> None:
        """Wait for the in-flight gradient reductions and fold them into ``main_grad``;
        ``coalesced=False`` leaves one queued in a reduction bucket (the final callback's)."""
        self.grads.wait_for_reduction(coalesced)

    def launch_window_steps(self, async_op: bool) -> None:
        """A window ended and its inner reductions finished: launch the plan's window steps
        (HSDP's outer reduction; nothing on a 1-D mesh; see [Note: outer reductions in
        backward] in ``_context.py``)."""
        self.grads.reduce_across_replicas(async_op)

    def discard_gradients(self, unconsumed: bool) -> None:
        """Recovery after a failed forward or backward: the compute parameters' ``.grad`` are
        dropped; ``unconsumed`` (a failed backward): every gradient no optimizer step consumed
        too, as ``zero_grad(set_to_none=True)``."""
        self.grads.drop_compute_grads()
        if unconsumed:
            self.grads.zero_grad(set_to_none=True)

    @property
    def pending_install(self) -> bool:
        """Gradients were staged or reduced that the optimizer has not been shown yet."""
        return self.grads.pending_install

    @property
    def finalization(self) -> Deferred | None:
        """The asynchronous ``finalize_backward()`` that launched this group's window end and
        has not finished it yet (see [Note: manual backward finalization] in
        ``_finalize.py``)."""
        return self.grads.finalization

    @finalization.setter
    def finalization(self, finalization: Deferred | None) -> None:
        self.grads.finalization = finalization

    @property
    def reduction_holds_temporary(self) -> bool:
        """An in-flight reduction holds a scratch buffer until finished."""
        return self.grads.reduction_holds_temporary

    @property
    def reduction_holds_memory(self) -> bool:
        """An in-flight reduction holds memory until finished (a scratch buffer, or a
        reduce-scatter's input copy in the transport)."""
        return self.grads.reduction_holds_memory

    @property
    def awaits_last_reduction(self) -> bool:
        """Locally accumulated micro-batches wait for the window's delayed collective."""
        return self.grads.awaits_last_reduction

    @property
    def awaits_window_steps(self) -> bool:
        """The plan's window steps (HSDP's outer reduction) are still to be launched."""
        return self.grads.awaits_window_steps

    # ------------------------------------------------------------------ accounting

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of each persistent buffer role this rank holds (grads at their step-time size)."""
        model = self.model_weight.numel() * self.model_weight.element_size()
        if self.extension is not None:  # the gathered FP8 bytes of optim/optim_grads
            model += self.extension.persistent_bytes()
        main = (
            self.main_weight.numel() * self.main_weight.element_size()
            if self.plan.main_weight_separate else 0
        )
        grad = self.grads.memory_bytes()
        padding_elems = self.layout.padding_numel
        if self.plan.model_weight is Extent.SHARD:
            padding_elems //= self.world_size
        return {
            "model_weights": model,
            "main_weights": main,
            "main_grads": grad,
            "padding": padding_elems * self.dtypes.model.itemsize,
        }
