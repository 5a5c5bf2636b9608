"""One parameter group: its flat buffers and their lifecycle (unshard, reshard, gradient reduction,
gradient install). No hooks here; ``_state.py`` decides *when* each step runs.

[Note: buffer roles]
Every group owns up to three persistent flat buffers, laid out identically (see
[Note: row-aligned flat buffers] in ``_layout.py``):

* ``model_weight``: the compute weights, in the compute dtype. Full size (replicated) for
  ``no_shard``/``optim``/``optim_grads``; this rank's shard for ``optim_grads_params``, which
  gathers into a temporary ``unsharded_model_weight`` bucket around forward and backward.
  Compute parameters (the module's original ``nn.Parameter`` objects) are views into the
  unsharded buffer, bound once: at wrap time, or at the first gather for ZeRO-3.
* ``main_weight``: what the optimizer updates, exposed as DTensor parameters whose local tensors
  are views into it. Sharded except for ``no_shard``. It is a separate buffer only when the main
  dtype differs from the compute dtype; otherwise it *is* this rank's part of ``model_weight``.
* ``main_grad``: what the optimizer reads, exposed as DTensor gradients viewing it. Full size for
  ``no_shard``/``optim`` (micro-batches accumulate locally and one collective runs on the last
  one), a shard for ``optim_grads``/``optim_grads_params`` (every micro-batch is reduce-scattered
  and the shards accumulate). Allocated lazily on first use and freed when gradients are cleared;
  the tensor object survives (storage freeing), so cached gradient views stay valid.

[Note: replicated-buffer refresh]
With replicated compute weights and sharded main weights (``optim``, ``optim_grads``), an
optimizer step leaves every rank's ``model_weight`` stale outside its own shard. The step marks
the group stale; the next unshard (the unit's pre-forward) casts this rank's main shard into its
own slot of ``model_weight`` (``refresh_from_shard_``) and runs one in-place
``all_gather_into_tensor`` over ``model_weight``. That is the strategy's single all-gather.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _collectives as comm
from . import ops
from ._allocator import BucketAllocator
from ._layout import BufferLayout
from .api import ResolvedDtypes, ShardingStrategy

__all__ = ["GradState", "ParamGroup", "finalize_unsynchronized"]


class GradState(enum.Enum):
    """What ``main_grad`` holds."""

    EMPTY = "empty"
    """Nothing: the next gradient write overwrites (storage may be freed)."""
    ACCUMULATING = "accumulating"
    """Local, unreduced sums in the full-size ``main_grad`` (``no_shard``/``optim`` between the
    first and the last micro-batch)."""
    REDUCED = "reduced"
    """Reduced sums in this rank's part of ``main_grad``; new micro-batches are reduced first and
    then added."""


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


class ParamGroup:
    """The flat buffers of one (device, dtype, requires_grad) bucket of one FSDP unit."""

    def __init__(
        self,
        *,
        group_id: tuple[int, int],
        params: Sequence[nn.Parameter],
        fqns: Sequence[str],
        layout: BufferLayout,
        mesh: DeviceMesh,
        process_group: dist.ProcessGroup | None = None,
        strategy: ShardingStrategy,
        dtypes: ResolvedDtypes,
        grad_pre_scale: float,
        allocator: BucketAllocator,
        sync_from_rank0: bool = False,
    ) -> None:
        """Builds the buffers but leaves the module's parameters untouched: :meth:`bind`
        turns them into views of the buffers once every group of the unit was built (so a
        failure half-way changes nothing). ``sync_from_rank0``: start from the mesh rank 0's
        values (one broadcast), as DDP does."""
        self.group_id = group_id
        self.params = list(params)  # compute parameters (the module's original objects)
        self.fqns = list(fqns)
        self.layout = layout
        self.mesh = mesh
        # Collectives run on ``process_group`` (a group over the mesh's ranks; see
        # ``_init.comm_group``), default: the mesh's own group.
        self.process_group = process_group if process_group is not None else mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.world_size = mesh.size()
        self.strategy = strategy
        self.dtypes = dtypes
        self.grad_pre_scale = grad_pre_scale
        self.allocator = allocator
        self.streams = comm.streams_for(params[0].device)
        self.requires_grad = self.params[0].requires_grad
        self.device = self.params[0].device
        # Names this group in errors and in the collective-order check; the root's lazy init
        # replaces it with the unit's fully qualified name.
        self.name = f"group of {self.fqns[0]!r}" + (f" (+{len(self.fqns) - 1})" if len(self.fqns) > 1 else "")
        self.debug_collectives = os.environ.get("MFSDP_DEBUG_COLLECTIVES", "0") == "1"

        self._offsets = [item.offset for item in layout.items]
        self._uncovered = layout.uncovered_ranges()
        self._shard_start, self._shard_end = layout.shard_range(self.rank)
        # The span of the flat buffer behind the optimizer-facing tensors.
        if strategy.shards_main_weights:
            self._local_start, self._local_end = self._shard_start, self._shard_end
        else:
            self._local_start, self._local_end = 0, layout.total_numel
        self._separate_main = dtypes.main != dtypes.model
        self._unshard_key = (group_id, "unsharded_model_weight")
        self._rs_key = (group_id, "reduce_scatter_input")
        self._comm_key = (group_id, "grad_comm")

        self._build_weight_buffers(self._initial_flat(sync_from_rank0))
        self.dist_params = self._build_dist_params()

        # Gradient state (see GradState). main_grad is created lazily.
        self.grad_state = GradState.EMPTY
        self._main_grad: torch.Tensor | None = None  # storage freed while EMPTY
        # [Note: gradients the optimizer sees] DTensor views of main_grad, one per parameter
        # (None: empty local shard), built once so optimizers keyed on gradient identity see
        # stable objects; ``_installed[i]`` is the view currently exposed as ``.grad`` (None: the
        # parameter has no gradient, as in torch when nothing flowed into it).
        self._grad_views: list[DTensor | None] | None = None
        self._installed: list[DTensor | None] = [None] * len(self.params)
        self._grads_installed = False
        # Parameters that received a gradient on this rank since the last install, and whether
        # anything was staged or reduced that the optimizer has not been shown yet.
        self._received_grad = [False] * len(self.params)
        self._uninstalled = False
        self._pending_reductions: list[tuple[comm.CommHandle | None, Callable[[], None]]] = []

        self._weights_stale = False  # see [Note: replicated-buffer refresh]
        self._main_version = self._dist_param_version()
        self._unsharded = not strategy.shards_model_weights
        self._unshard_handle: comm.CommHandle | None = None

    # ------------------------------------------------------------------ construction

    def _initial_flat(self, sync_from_rank0: bool) -> torch.Tensor:
        """The parameters' current values packed into one full flat buffer of their own dtype
        (padding zeroed), broadcast from mesh rank 0 when ``sync_from_rank0``. Temporary: it
        lives while the group is built, like the parameters themselves."""
        dtype = self.params[0].dtype
        flat = torch.zeros(self.layout.total_numel, dtype=dtype, device=self.device)
        ops.pack_(
            # copies only the rare non-contiguous parameter (e.g. a strided view)
            [p.detach().contiguous().view(-1) for p in self.params], self._offsets, flat,
        )
        if sync_from_rank0 and self.world_size > 1:
            comm.broadcast_from_first(flat, self.process_group)
        return flat

    def _build_weight_buffers(self, initial: torch.Tensor) -> None:
        layout, dtypes, device = self.layout, self.dtypes, self.device
        if self.strategy.shards_model_weights:
            model_span = (self._shard_start, self._shard_end)
        else:
            model_span = (0, layout.total_numel)
        self.model_weight = torch.empty(
            model_span[1] - model_span[0], dtype=dtypes.model, device=device
        )
        ops.pack_([initial[model_span[0] : model_span[1]]], [0], self.model_weight)
        if self._separate_main:
            self.main_weight = torch.empty(
                self._local_end - self._local_start, dtype=dtypes.main, device=device
            )
            ops.pack_([initial[self._local_start : self._local_end]], [0], self.main_weight)
        elif self.strategy.shards_model_weights:
            self.main_weight = self.model_weight
        else:
            self.main_weight = self.model_weight[self._local_start : self._local_end]
        self._views_bound = False

    def bind(self) -> None:
        """Make the compute parameters zero-copy views of the unsharded weights, which releases
        their original storage. A ZeRO-3 group has no unsharded bucket until its first gather
        (so wrapping never holds a full-size copy): until then they hold an empty placeholder.
        With ``sync_from_rank0`` this is also where replicas start agreeing."""
        if not self.strategy.shards_model_weights:
            self._bind_compute_views(self.model_weight)
            self._views_bound = True
        else:
            with torch.no_grad():
                for param in self.params:
                    param.data = torch.empty(0, dtype=self.dtypes.model, device=self.device)

    def _bind_compute_views(self, unsharded_model_weight: torch.Tensor) -> None:
        # Outside inference mode: a view made inside it could never be updated in place again.
        with torch.no_grad(), torch.inference_mode(False):
            for param, item in zip(self.params, self.layout.items):
                param.data = unsharded_model_weight[item.offset : item.end].view(item.shape)

    def _local_view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Item ``index``'s local rows in ``buffer``, which holds [_local_start, _local_end)."""
        item = self.layout.items[index]
        lo, hi = self.layout.local_item_range(index, self._local_start, self._local_end)
        rows = (hi - lo) // item.row_numel
        flat = buffer[lo - self._local_start : hi - self._local_start]
        return flat.view(rows, *item.shape[1:]) if len(item.shape) > 0 else flat.view(())

    def local_row_range(self, index: int) -> tuple[int, int]:
        """Global dim-0 rows of parameter ``index`` that this rank's optimizer-facing shard holds."""
        item = self.layout.items[index]
        lo, hi = self.layout.local_item_range(index, self._local_start, self._local_end)
        start = min(max(lo - item.offset, 0), item.numel) // item.row_numel
        return start, start + (hi - lo) // item.row_numel

    def _to_dtensor(self, local: torch.Tensor, index: int) -> DTensor:
        shape = self.layout.items[index].shape
        placement = Shard(0) if self.strategy.shards_main_weights else Replicate()
        return DTensor.from_local(
            local, self.mesh, [placement], run_check=False, shape=shape,
            stride=_contiguous_stride(shape),
        )

    def _build_dist_params(self) -> list[nn.Parameter]:
        dist_params = []
        for index, param in enumerate(self.params):
            local = self._local_view(self.main_weight, index)
            dist_param = nn.Parameter(self._to_dtensor(local, index), requires_grad=param.requires_grad)
            # Optimizer grouping and checkpoint code read attributes set on the original params.
            for name, value in vars(param).items():
                if not name.startswith("_mfsdp"):
                    setattr(dist_param, name, value)
            dist_param._mfsdp_param_group = self  # type: ignore[attr-defined]
            dist_param._mfsdp_index = index  # type: ignore[attr-defined]
            dist_params.append(dist_param)
        return dist_params

    # ------------------------------------------------------------------ weights

    @property
    def needs_refresh(self) -> bool:
        return self._weights_stale

    def mark_main_weights_updated(self) -> None:
        """The optimizer (or a checkpoint load) changed the main weights: refresh compute weights
        before their next use. A no-op where compute weights alias the main weights in place."""
        if self._separate_main or (
            self.strategy.shards_main_weights and not self.strategy.shards_model_weights
        ):
            self._weights_stale = True

    def _dist_param_version(self) -> int:
        return sum(p._version for p in self.dist_params)

    def detect_main_weight_edits(self) -> None:
        """Mark the group stale when an in-place op on an optimizer-facing parameter (e.g.
        ``nn.init.normal_(p)``, ``p.copy_(x)``) bumped its version counter since the last look.
        See [Note: replicated-buffer refresh] for what this does not see."""
        version = self._dist_param_version()
        if version != self._main_version:
            self._main_version = version
            self.mark_main_weights_updated()

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` calls on the optimizer-facing parameters after wrapping:
        the compute parameters autograd sees must agree with them."""
        changed = False
        for param, dist_param in zip(self.params, self.dist_params):
            if param.requires_grad != dist_param.requires_grad:
                param.requires_grad_(dist_param.requires_grad)
                changed = True
        if changed:
            self.requires_grad = any(p.requires_grad for p in self.dist_params)
            self._grad_views = None  # rebuilt: views exist only for parameters that train

    def _launch(
        self, what: str, launch: comm.Launch, *, async_op: bool, reduce: bool
    ) -> comm.CommHandle | None:
        """Issue one of this group's collectives (see [Note: asynchronous collectives])."""
        if self.debug_collectives:
            comm.check_collective_order(
                self.process_group, f"{what} of {self.name} ({self.layout.total_numel} elements)",
                self.device,
            )
        return self.streams.run(launch, async_op=async_op, reduce=reduce)

    def unshard(self, async_op: bool = False) -> bool:
        """Make the full compute weights available (possibly asynchronously; see
        :meth:`wait_for_unshard`). Returns whether a collective was issued."""
        # Buckets and views made under inference mode could never be updated in place again.
        with torch.inference_mode(False):
            return self._unshard(async_op)

    def _unshard(self, async_op: bool) -> bool:
        if self.strategy.shards_model_weights:
            if self._unsharded:
                return False
            if self._weights_stale:
                ops.refresh_from_shard_(self.main_weight, self.model_weight, 0)
                self._weights_stale = False
            output = self.allocator.allocate(
                self._unshard_key, self.layout.total_numel, self.dtypes.model, self.device
            )
            if not self._views_bound:  # views stay valid across storage freeing from now on
                self._bind_compute_views(output)
                self._views_bound = True
            shard, group = self.model_weight, self.process_group
            self._unshard_handle = self._launch(
                "all-gather", lambda a: comm.all_gather_into(output, shard, group, a),
                async_op=async_op, reduce=False,
            )
            self._unsharded = True
            return True
        if not self._weights_stale:
            return False
        if self._separate_main:
            ops.refresh_from_shard_(self.main_weight, self.model_weight, self._local_start)
        if self.strategy.shards_main_weights:
            output, group = self.model_weight, self.process_group
            own_slot = output[self._shard_start : self._shard_end]
            self._unshard_handle = self._launch(
                "refresh all-gather", lambda a: comm.all_gather_into(output, own_slot, group, a),
                async_op=async_op, reduce=False,
            )
        self._weights_stale = False
        return self.strategy.shards_main_weights

    def wait_for_unshard(self) -> None:
        handle, self._unshard_handle = self._unshard_handle, None
        if handle is not None:
            handle.wait()

    def reshard(self) -> bool:
        """Free the gathered weights of a sharded-weight group; returns whether it did. Waits
        for an in-flight gather or refresh first (one launched for a unit that control flow
        then skipped must finish before its buffer is reused or overwritten)."""
        self.wait_for_unshard()
        if not self.strategy.shards_model_weights or not self._unsharded:
            return False
        self.allocator.free(self._unshard_key)
        self._unsharded = False
        return True

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded

    # ------------------------------------------------------------------ gradients

    @property
    def main_grad_numel(self) -> int:
        return self.layout.shard_numel if self.strategy.shards_grads else self.layout.total_numel

    def _ensure_main_grad(self) -> torch.Tensor:
        """``main_grad`` with its storage allocated (one tensor object for life, so cached
        gradient views stay valid; see [Note: storage-freeing buckets])."""
        main_grad = self._main_grad
        if main_grad is None:
            main_grad = torch.empty(self.main_grad_numel, dtype=self.dtypes.grad, device=self.device)
            self._main_grad = main_grad
        elif main_grad.untyped_storage().nbytes() == 0:
            main_grad.untyped_storage().resize_(main_grad.numel() * main_grad.element_size())
        return main_grad

    def _main_grad_local(self) -> torch.Tensor:
        """The part of ``main_grad`` behind the optimizer-facing gradients."""
        main_grad = self._ensure_main_grad()
        if self.strategy is ShardingStrategy.OPTIM:
            return main_grad[self._shard_start : self._shard_end]
        return main_grad

    def release_grad_storage(self) -> None:
        if self._main_grad is not None:
            self._main_grad.untyped_storage().resize_(0)
        self.grad_state = GradState.EMPTY
        self._installed = [None] * len(self.params)
        self._grads_installed = False

    def _stage(self, grads: Sequence[torch.Tensor | None], full_buffer: torch.Tensor,
               accumulate: bool) -> None:
        """Write (or add) ``scale * param.grad`` into a full-size flat buffer."""
        inputs, offsets = [], []
        for grad, offset in zip(grads, self._offsets):
            if grad is not None:
                inputs.append(grad if grad.is_contiguous() else grad.contiguous())
                offsets.append(offset)
        if not accumulate:
            # Regions nothing writes: padding, gaps, and parameters without a gradient.
            for lo, hi in self._uncovered:
                full_buffer[lo:hi].zero_()
            for grad, item in zip(grads, self.layout.items):
                if grad is None:
                    full_buffer[item.offset : item.end].zero_()
        if inputs:
            ops.pack_(inputs, offsets, full_buffer, scale=self.grad_pre_scale, accumulate=accumulate)

    def reduce_grads(self, is_last_backward: bool, async_op: bool = False) -> bool:
        """Stage this micro-batch's ``param.grad`` and run the strategy's collective.

        Returns whether anything was staged or reduced. See the table in ``design.md``:
        ``no_shard``/``optim`` accumulate locally and reduce once on the last micro-batch;
        ``optim_grads``/``optim_grads_params`` reduce-scatter every micro-batch.
        """
        if not self.requires_grad:
            return False
        # Gradients the optimizer cleared since they were installed must not be added to.
        self.sweep_cleared_grads()
        grads = [param.grad for param in self.params]
        has_new = False
        for index, grad in enumerate(grads):
            if grad is not None:
                has_new = self._received_grad[index] = True
        delayed = not self.strategy.shards_grads and self.grad_state is not GradState.REDUCED
        if not has_new and not (is_last_backward and self.grad_state is GradState.ACCUMULATING):
            return False
        if delayed:
            main_grad = self._ensure_main_grad()
            if has_new:
                self._stage(grads, main_grad, accumulate=self.grad_state is GradState.ACCUMULATING)
            self.grad_state = GradState.ACCUMULATING
            if is_last_backward:
                self._reduce_accumulated(async_op)
        else:
            self._reduce_micro_batch(grads, async_op)
        self._uninstalled = True
        for param in self.params:
            param.grad = None
        return True

    def _reduce_accumulated(self, async_op: bool) -> None:
        """The delayed collective of ``no_shard`` (all-reduce) and ``optim`` (reduce-scatter), in
        place on ``main_grad`` when the communication dtype allows it."""
        main_grad = self._ensure_main_grad()
        reduce_all = self.strategy is ShardingStrategy.NO_SHARD
        shard = slice(self._shard_start, self._shard_end)
        group = self.process_group
        if self.dtypes.comm == self.dtypes.grad:
            if reduce_all:
                launch = lambda a: comm.all_reduce_inplace(main_grad, group, a)  # noqa: E731
            else:
                launch = lambda a: comm.reduce_scatter_into(main_grad[shard], main_grad, group, a)  # noqa: E731
            what = "all-reduce" if reduce_all else "reduce-scatter"
            self._track(self._launch(what, launch, async_op=async_op, reduce=True), lambda: None)
        else:
            workspace = self.allocator.allocate(
                self._comm_key, self.layout.total_numel, self.dtypes.comm, self.device
            )
            ops.reduce_scatter_copy_in_(main_grad, workspace)
            if reduce_all:
                reduced, target = workspace, main_grad
                launch = lambda a: comm.all_reduce_inplace(workspace, group, a)  # noqa: E731
            else:
                reduced, target = workspace[shard], main_grad[shard]
                launch = lambda a: comm.reduce_scatter_into(reduced, workspace, group, a)  # noqa: E731

            def finish() -> None:
                ops.reduce_scatter_copy_out_(reduced, target)
                self.allocator.free(self._comm_key)

            what = "all-reduce" if reduce_all else "reduce-scatter"
            self._track(self._launch(what, launch, async_op=async_op, reduce=True), finish)
        self.grad_state = GradState.REDUCED

    def _reduce_micro_batch(self, grads: Sequence[torch.Tensor | None], async_op: bool) -> None:
        """Reduce this micro-batch through a temporary full-size bucket in the communication
        dtype, then add (or write) the result into this rank's part of ``main_grad``."""
        reduce_scatter_input = self.allocator.allocate(
            self._rs_key, self.layout.total_numel, self.dtypes.comm, self.device
        )
        self._stage(grads, reduce_scatter_input, accumulate=False)
        accumulate = self.grad_state is not GradState.EMPTY
        target = self._main_grad_local()
        group = self.process_group
        reduced: torch.Tensor | None
        if self.strategy is ShardingStrategy.NO_SHARD:
            reduced = reduce_scatter_input
            launch = lambda a: comm.all_reduce_inplace(reduce_scatter_input, group, a)  # noqa: E731
        elif not accumulate and self.dtypes.comm == self.dtypes.grad:
            # First write, same dtype: reduce straight into the persistent shard.
            reduced = None
            launch = lambda a: comm.reduce_scatter_into(target, reduce_scatter_input, group, a)  # noqa: E731
        else:
            reduced = reduce_scatter_input[self._shard_start : self._shard_end]
            launch = lambda a: comm.reduce_scatter_into(reduced, reduce_scatter_input, group, a)  # noqa: E731

        def finish() -> None:
            if reduced is not None:
                ops.reduce_scatter_copy_out_(reduced, target, accumulate=accumulate)
            self.allocator.free(self._rs_key)

        what = "all-reduce" if self.strategy is ShardingStrategy.NO_SHARD else "reduce-scatter"
        self._track(self._launch(what, launch, async_op=async_op, reduce=True), finish)
        self.grad_state = GradState.REDUCED

    def _track(self, handle: comm.CommHandle | None, finish: Callable[[], None]) -> None:
        if handle is None:
            finish()
        else:
            self._pending_reductions.append((handle, finish))

    @property
    def awaits_last_reduction(self) -> bool:
        """Locally accumulated micro-batches wait for the delayed collective of the last one."""
        return self.grad_state is GradState.ACCUMULATING and self._uninstalled

    @property
    def has_pending_reduction(self) -> bool:
        return bool(self._pending_reductions)

    def wait_for_reduction(self) -> None:
        """Wait for in-flight gradient collectives and fold their results into ``main_grad``."""
        pending, self._pending_reductions = self._pending_reductions, []
        for handle, finish in pending:
            if handle is not None:
                handle.wait()
            finish()

    def _grad_view(self, index: int) -> DTensor | None:
        """The DTensor view of parameter ``index``'s gradient in ``main_grad`` (None when its local
        shard is empty or it does not train). See [Note: gradients the optimizer sees]."""
        if self._grad_views is None:
            local = self._main_grad_local()
            self._grad_views = []
            for i, param in enumerate(self.dist_params):
                view = self._local_view(local, i)
                self._grad_views.append(
                    self._to_dtensor(view, i) if view.numel() > 0 and param.requires_grad else None
                )
        return self._grad_views[index]

    def install_grads(self) -> None:
        """Expose reduced gradients as DTensor ``.grad`` of the optimizer-facing parameters.

        A parameter gets ``grad=None``, as in single-process torch, when it has no gradient:
        nothing flowed into it since its gradient was last cleared. Locally that is known; for
        the other ranks the reduced values tell (a parameter some rank used has a non-zero
        reduced gradient in general), so a parameter unused here whose local reduced gradient
        is exactly zero gets None. Empty local shards always get None (fused optimizers
        mishandle zero-size tensors)."""
        if self.grad_state is not GradState.REDUCED:
            return
        self._ensure_main_grad()
        any_installed = False
        for index, param in enumerate(self.dist_params):
            view = self._grad_view(index)
            if view is not None and not (
                self._received_grad[index] or self._installed[index] is not None
            ):
                if not bool(view._local_tensor.any()):
                    view = None
            param.grad = view
            self._installed[index] = view
            any_installed |= view is not None
        self._received_grad = [False] * len(self.params)
        self._uninstalled = False
        self._grads_installed = any_installed
        if not any_installed:  # nothing to show: all zeros, start the next window afresh
            self.release_grad_storage()

    def finalize_unsynchronized_grads(self) -> bool:
        """Reduce and install gradients that no backward marked as the last of its window
        (``set_is_last_backward(False)`` throughout). Returns whether there were any."""
        if not self._uninstalled:
            return False
        if self.grad_state is GradState.ACCUMULATING:
            self._reduce_accumulated(async_op=False)
        self.wait_for_reduction()
        self.install_grads()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.dist_params:
            if set_to_none:
                param.grad = None
        for param in self.params:
            param.grad = None
        self._received_grad = [False] * len(self.params)
        self._uninstalled = False
        if set_to_none or self.grad_state is GradState.EMPTY:
            self.release_grad_storage()
            return
        self._ensure_main_grad().zero_()
        # Zeros are valid local partial sums: no_shard/optim go back to the cheap delayed path.
        self.grad_state = (
            GradState.REDUCED if self.strategy.shards_grads else GradState.ACCUMULATING
        )

    def sweep_cleared_grads(self) -> None:
        """Take in what the user did to the installed gradients since the optimizer step:

        * all set to ``None`` (``optimizer.zero_grad()``): free the storage, start afresh;
        * some set to ``None`` (an optimizer over part of the parameters): zero those, so the
          next backward starts them from zero while the others accumulate, as torch does;
        * replaced by another tensor: adopt its values;
        * zeroed in place (``zero_grad(set_to_none=False)``), ``no_shard``/``optim``: the zeros
          are valid local partial sums, so the next window takes the delayed path (one
          collective) again.
        """
        if not self._grads_installed:
            return
        live = False
        cleared = []
        for index, param in enumerate(self.dist_params):
            view = self._installed[index]
            if view is None:
                continue
            grad = param.grad
            if grad is view:
                live = True
            elif grad is None:
                cleared.append(index)
                self._installed[index] = None
            else:
                with torch.no_grad():
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    view._local_tensor.copy_(local)
                param.grad = view
                live = True
        if not live:
            self.release_grad_storage()
            return
        for index in cleared:
            view = self._grad_view(index)
            assert view is not None
            view._local_tensor.zero_()
        if not self.strategy.shards_grads and self.grad_state is GradState.REDUCED:
            if not bool(self._main_grad_local().any()):
                self._ensure_main_grad().zero_()
                self.grad_state = GradState.ACCUMULATING

    # ------------------------------------------------------------------ accounting

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of each persistent buffer role this rank holds (grads at their step-time size)."""
        model = self.model_weight.numel() * self.model_weight.element_size()
        main = (
            self.main_weight.numel() * self.main_weight.element_size() if self._separate_main else 0
        )
        grad = self.main_grad_numel * self.dtypes.grad.itemsize if self.requires_grad else 0
        padding_elems = self.layout.padding_numel
        if self.strategy.shards_model_weights:
            padding_elems //= self.world_size
        return {
            "model_weights": model,
            "main_weights": main,
            "main_grads": grad,
            "padding": padding_elems * self.dtypes.model.itemsize,
        }


def finalize_unsynchronized(groups: Iterable[ParamGroup], where: str) -> None:
    """Reduce and expose gradients that no backward marked as the last of its window, so that
    ``where`` (the optimizer step, clipping) never silently works on missing gradients."""
    finalized = [group for group in groups if group.finalize_unsynchronized_grads()]
    if finalized:
        warnings.warn(
            f"{where} found gradients that were never synchronized across ranks: every backward "
            "since the last step ran with set_is_last_backward(False) (or inside no_sync()). "
            "fully_shard reduced them now, without overlap; call "
            "model.set_is_last_backward(True) before the last micro-batch's backward (or leave "
            "the no_sync() context for it) so the reduction overlaps backward",
            UserWarning,
            stacklevel=3,
        )
