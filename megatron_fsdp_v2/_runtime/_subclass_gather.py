"""Parameters whose tensor subclass defines FSDP2's all-gather extensions (torchao's float8
``WeightWithDynamicFloat8CastTensor``): the subclass rebuilt over the flat buffers, its
``fsdp_pre_all_gather`` called on this rank's rows, its all-gather inputs packed into flat
buffers of their own dtype and gathered once per group, and its ``fsdp_post_all_gather`` output
given to the module as the compute weight. :class:`ExtensionGather` is the part of a
:class:`~._flat_param_group.FlatParamGroup` that does this; *when* is decided by
``ComputeWeights`` as for plain groups.

[Note: FSDP2 all-gather extensions]
FSDP2's protocol (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``): before a gather,
``inputs, metadata = local.fsdp_pre_all_gather(mesh[, outer_size, outer_stride, module,
mp_policy])`` on the sharded local tensor (the signature of one or five arguments); each input is
gathered over the shard axis; after it, ``unsharded, inner = local.fsdp_post_all_gather(outputs,
metadata, param_dtype)`` the first time, which becomes the module's parameter, and
``local.fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded)`` on later gathers,
which must refresh ``unsharded`` in place because autograd may hold it (the outputs are in the
same storage as before). Here:

* Main weights stay plain ``main_dtype`` flat buffers (the optimizer updates fp32). The
  optimizer-facing parameter is a DTensor whose local tensor is the subclass rebuilt by
  ``__tensor_unflatten__`` over this rank's rows of ``main_weight`` (one inner tensor of the
  parameter's shape and dtype, checked at wrap time), so ``precompute_float8_dynamic_scale_
  for_fsdp`` finds it, sets ``_precomputed_scale`` on it and all-reduces all amaxes at once.
* Each all-gather input must have the shape of this rank's rows: input ``k`` of every parameter
  goes into a flat buffer of input ``k``'s dtype with the group's row layout (the same element
  offsets as ``main_weight``), this rank's rows into its own slot, and the buffer is gathered in
  place: one all-gather per input buffer per group (torchao: one, of FP8 bytes). A float8 dtype
  is issued as ``uint8`` (gloo cannot move it; the bytes are the same).
* The gathered outputs of a parameter are zero-copy views of those buffers, so
  ``fsdp_post_all_gather(out=...)`` reuse holds: ZeRO-3 gathers into the storage-freeing
  scratch buffers ``unsharded_model_weight:<k>`` (the same tensor objects each time), ``optim``/
  ``optim_grads`` into persistent replicated buffers (the FP8 bytes; the scales are the
  metadata, one per parameter), refreshed once after each optimizer step. ``post_all_gather``
  runs when the gather is waited on; registration of the compute parameters follows the wait.
* HSDP outer ``optim``: the main weights are each rank's sub-shard, so the inputs are packed
  into persistent buffers over the inner shard and gathered over the outer axis once after
  each step (:meth:`ExtensionGather.refresh_inner_shard`, metadata kept with them); every
  inner gather then all-gathers those buffers into the scratch buffers
  (:meth:`ExtensionGather.gather_scratch`). A dynamic amax gets the flattened mesh.
* ``no_shard`` gathers nothing: the compute parameter is the subclass rebuilt over the
  full-precision ``model_weight`` view, which torchao casts to float8 in each forward.
* Gradients are plain tensors of the compute dtype (``Float8Linear``'s weight gradient) and take
  the plain path into ``main_grad``.
* torchao float8 weights with precomputed scales skip ``fsdp_pre_all_gather``: the fused
  ``ops.fp8_quantize_`` writes the same bits into the FP8 buffer for the whole group in one call
  (``_float8_cast.fused_float8_cast``); the metadata is the same ``(scale,)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .. import _registry
from .._buffers._plan import Collective, Refresh
from .._profiling import traced
from ._float8_cast import fused_float8_cast
from ._issuer import CollectiveLaunch, Deferred, Pending
from ._subclass_faces import has_all_gather_extensions, inner_values, rewrap, values_names

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup
    from ._param_record import ParamRecord

__all__ = [
    "ExtensionGather", "has_all_gather_extensions", "inner_values", "rewrap", "values_names",
]

_FLOAT8 = {d for d in vars(torch).values() if isinstance(d, torch.dtype) and "float8" in str(d)}


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What the collective moves: float8 bytes as ``uint8`` (same bytes; gloo has no float8)."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


class ExtensionGather:
    """The all-gather extensions of one flat group (see [Note: FSDP2 all-gather extensions])."""

    # Cast torchao float8 weights with the fused kernel (see _float8_cast.py); False: always
    # through the protocol (tests compare both).
    fuse_float8 = True

    def __init__(self, group: FlatParamGroup, params: list[nn.Parameter]) -> None:
        self.group = group
        # Storage-free copies of the wrapped parameters: their subclass and configuration.
        with torch.no_grad():  # (a scale precomputed before wrapping is dropped: see rewrap)
            self.templates = [
                rewrap(p, torch.empty(0, dtype=p.dtype, device=group.device), False)
                for p in params
            ]
        # ids of the parameter objects the module held at wrap time (RegisteredParams maps them).
        self.original_ids = [id(p) for p in params]
        self.owners: list[nn.Module | None] = [None] * len(params)  # set by fully_shard
        self.mp_policy: Any = None
        # Whether some rank's shard holds no row of parameter i (see _check_empty_shards).
        layout = group.layout
        self._empty_somewhere = [
            any(lo == hi for lo, hi in (
                layout.local_item_range(i, *layout.shard_range(r))
                for r in range(layout.world_size)))
            for i in range(len(params))
        ] if group.plan.main_weight_span != (0, layout.total_numel) else [False] * len(params)
        # The mesh fsdp_pre_all_gather gets, as FSDP2's ``shard_mesh``: the shard axis the inputs
        # are gathered over (on HSDP the inner axis; torchao all-reduces a dynamic amax there,
        # which every replica computes alike).
        # Under HSDP outer optim each rank of the whole mesh holds distinct rows (a sub-shard):
        # the amax must cover them all, so it gets the flattened mesh.
        mesh, names = group.mesh, group.mesh.mesh_dim_names
        self.shard_mesh = mesh if mesh.ndim == 1 or names is None else mesh[names[-1]]
        if group.plan.refresh is Refresh.EXTENSION_OWN_SLOT_THEN_OUTER_GATHER:
            self.shard_mesh = mesh._flatten()
        self._persistent: list[torch.Tensor] = []  # optim/optim_grads: the gathered inputs
        # HSDP outer optim: the metadata and trailing shapes of the last inner-shard refresh.
        self._inner_metadata: tuple[list[Any], list[torch.Size]] = ([], [])
        self._viewed: list[torch.Tensor] | None = None  # the buffers compute params view

    # ------------------------------------------------------------------ the faces

    def wrap_local(self, index: int, values: torch.Tensor) -> torch.Tensor:
        """The subclass over ``values`` (a view of a flat buffer) for parameter ``index``."""
        return rewrap(self.templates[index], values)

    def placeholder(self, index: int) -> nn.Parameter:
        """A storage-free compute parameter until the first gather or refresh."""
        template = self.templates[index]
        return nn.Parameter(template, requires_grad=self.group.records[index].dist_param
                            .requires_grad)

    def bind_full_precision(self, model_weight: torch.Tensor) -> None:
        """``no_shard``: each compute parameter is the subclass over its full-precision view of
        ``model_weight`` (torchao casts it to float8 in each forward); bound once."""
        with torch.no_grad(), torch.inference_mode(False):
            for index, record in enumerate(self.group.records):
                item = record.item
                view = model_weight[item.offset : item.end].view(item.shape)
                self._set_compute_param(record, nn.Parameter(
                    self.wrap_local(index, view), requires_grad=record.dist_param.requires_grad))

    def forget_compute_params(self) -> None:
        """The buffers the compute parameters view may move (trace pool): rebuild them (not
        reuse them through ``out=``) at the next gather."""
        self._viewed = None

    def _set_compute_param(self, record: ParamRecord, param: nn.Parameter) -> None:
        record.compute_param = param
        _registry.register_records([record])
        self.group.weights.views_generation += 1

    # ------------------------------------------------------------------ the protocol

    def _check_empty_shards(self) -> None:
        """torchao float8 without a precomputed scale computes the weight's amax in
        ``fsdp_pre_all_gather`` and all-reduces it there: a rank holding no row of the weight
        cannot (the max of nothing raises on that rank while the others wait in the
        all-reduce). The layout and the scales are the same on every rank, so every rank raises
        here instead, before any collective."""
        for flag, record in zip(self._empty_somewhere, self.group.records):
            local = record.dist_param._local_tensor  # type: ignore[attr-defined]
            if flag and getattr(local, "_precomputed_scale", 0) is None:
                raise RuntimeError(
                    f"parameter '{record.fqn}' of {self.group.name}: some rank's shard holds no "
                    "row of it, so torchao cannot compute its float8 scale dynamically in "
                    "fsdp_pre_all_gather; call torchao's precompute_float8_dynamic_scale_for_"
                    "fsdp(model) after fully_shard (before the first forward) as well as after "
                    "every optimizer step"
                )

    def _pre_all_gather(self, record: ParamRecord) -> tuple[tuple[torch.Tensor, ...], Any]:
        local = record.dist_param._local_tensor  # type: ignore[attr-defined]
        params = inspect.signature(local.fsdp_pre_all_gather).parameters
        if len(params) == 1:
            inputs, metadata = local.fsdp_pre_all_gather(self.shard_mesh)
        else:
            item = record.item
            stride = tuple(torch.empty(item.shape, device="meta").stride())
            inputs, metadata = local.fsdp_pre_all_gather(
                self.shard_mesh, item.shape, stride, self.owners[record.index], self.mp_policy)
        for t in inputs:
            if t.shape != local.shape:
                raise NotImplementedError(
                    f"parameter '{record.fqn}' ({type(local).__qualname__}): fsdp_pre_all_gather "
                    f"returned an all-gather input of shape {tuple(t.shape)} for local rows of "
                    f"shape {tuple(local.shape)}; fully_shard gathers inputs with the rows of "
                    "the parameter's shard only. Use a plain nn.Parameter (torchao float8: "
                    "enable_fsdp_float8_all_gather=False)"
                )
        return tuple(inputs), metadata

    def _pack(self, buffer_for: Callable[[int, torch.dtype], torch.Tensor], base: int = 0
              ) -> tuple[list[torch.Tensor], list[Any], list[torch.Size]]:
        """Run every parameter's pre-all-gather and copy its inputs into its rows of this rank's
        slot of the input buffers (``buffer_for(k, dtype)``: flat buffer ``k``, starting at
        element ``base`` of the layout: 0 for a full-size one)."""
        group = self.group
        span = group.plan.main_weight_span
        self._check_empty_shards()
        fused = fused_float8_cast(group, buffer_for, base) if self.fuse_float8 else None
        if fused is not None:
            return fused
        calls = [self._pre_all_gather(r) for r in group.records]
        count = {len(inputs) for inputs, _ in calls}
        dtypes = {tuple(t.dtype for t in inputs) for inputs, _ in calls}
        if len(count) != 1 or len(dtypes) != 1:
            raise NotImplementedError(
                f"{group.name}: the parameters' fsdp_pre_all_gather return different numbers or "
                f"dtypes of all-gather inputs ({sorted(map(str, dtypes))}); fully_shard packs "
                "one flat buffer per input position"
            )
        buffers = [buffer_for(k, dtype) for k, dtype in enumerate(next(iter(dtypes)))]
        with torch.no_grad():
            for index, (inputs, _) in enumerate(calls):
                lo, hi = group.layout.local_item_range(index, *span)
                for buffer, t in zip(buffers, inputs):
                    if hi > lo:
                        buffer[lo - base : hi - base].copy_(t.reshape(-1))
        trailing = [inputs[0].shape[1:] if inputs else torch.Size() for inputs, _ in calls]
        return buffers, [metadata for _, metadata in calls], trailing

    @traced("mfsdp::gather")
    def gather(self, buffer_for: Callable[[int, torch.dtype], torch.Tensor],
               async_op: bool, what: str) -> Deferred:
        """Pre-all-gather, pack, all-gather in place (one per input buffer), and, when waited
        on, post-all-gather into the compute parameters."""
        group = self.group
        buffers, metadata, trailing = self._pack(buffer_for)
        lo, hi = group.plan.main_weight_span
        pendings = [
            group.issuer.launch(CollectiveLaunch(
                Collective.ALL_GATHER, _wire(buffer), _wire(buffer[lo:hi]), what=what,
            ), async_op)
            for buffer in buffers
        ]

        def finish() -> None:
            for pending in pendings:
                pending.finish()
            self._post_all_gather(buffers, metadata, trailing)

        return Deferred("all-gathers of the extension inputs, then post-all-gather", finish)

    def gather_scratch(self, async_op: bool, after: list[Pending] | None = None) -> Deferred:
        """ZeRO-3: into the storage-freeing scratch buffers ``unsharded_model_weight:<k>``.
        HSDP outer ``optim``: from the persistent inner-shard input buffers, which
        :meth:`refresh_inner_shard` filled (``after``: its outer all-gathers, one per buffer,
        each waited on where the inner gather of that buffer launches)."""
        if self.group.plan.refresh is not Refresh.EXTENSION_OWN_SLOT_THEN_OUTER_GATHER:
            return self.gather(self._scratch, async_op, "all-gather (all-gather extensions)")
        group, (metadata, trailing) = self.group, self._inner_metadata
        buffers = [self._scratch(k, shard.dtype) for k, shard in enumerate(self._persistent)]
        pendings = [
            group.issuer.launch(CollectiveLaunch(
                Collective.ALL_GATHER, _wire(buffer), _wire(shard),
                what="all-gather (all-gather extensions)", after=after[k] if after else None,
            ), async_op)
            for k, (buffer, shard) in enumerate(zip(buffers, self._persistent))
        ]

        def finish() -> None:
            for pending in pendings:
                pending.finish()
            self._post_all_gather(buffers, metadata, trailing)

        return Deferred("all-gathers of the extension inputs, then post-all-gather", finish)

    def refresh_inner_shard(self, async_op: bool) -> list[Pending]:
        """HSDP outer ``optim``: this rank's main sub-shard's all-gather inputs (the fused FP8
        cast, or ``fsdp_pre_all_gather``) into its slot of the persistent inner-shard buffers,
        then one in-place all-gather per buffer over the outer axis; the metadata (scales) is
        kept for the inner gathers until the next refresh."""
        group = self.group
        lo, _ = group.plan.model_weight_span  # the inner shard
        own_lo, own_hi = group.plan.main_weight_span
        buffers, metadata, trailing = self._pack(self._persistent_input, base=lo)
        self._inner_metadata = (metadata, trailing)
        return [
            group.issuer.launch(CollectiveLaunch(
                Collective.ALL_GATHER, _wire(buffer), _wire(buffer[own_lo - lo : own_hi - lo]),
                what="outer refresh all-gather (all-gather extensions)", axis="outer",
            ), async_op)
            for buffer in buffers
        ]

    def _scratch(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        group = self.group
        return group.allocator.allocate(self._key(k), group.layout.total_numel, dtype,
                                        group.device)

    def fill_without_collective(self) -> None:
        """The estimator's (meta buffers under a fake process group, where no collective
        runs): what a refresh (``optim``/``optim_grads``) or a gather (ZeRO-3, its scratch
        buffers then freed) leaves in the buffers and compute weights, the all-gather left out,
        so that ``memory_report`` and :attr:`gathered_dtypes` answer as after a real one."""
        plan = self.group.plan
        if plan.refresh is Refresh.EXTENSION_OWN_SLOT_THEN_OUTER_GATHER:
            self._inner_metadata = self._pack(self._persistent_input, plan.model_weight_span[0])[1:]
            buffers = [self._scratch(k, t.dtype) for k, t in enumerate(self._persistent)]
            self._post_all_gather(buffers, *self._inner_metadata)
        else:
            zero3 = plan.gathers_weights
            self._post_all_gather(*self._pack(self._scratch if zero3 else self._persistent_input))
        if plan.gathers_weights:
            self.free_scratch()

    @property
    def gathered_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtype of each all-gather input buffer (torchao float8: one, its float8 dtype),
        known once a gather or refresh ran; empty before."""
        return tuple(b.dtype for b in self._viewed or ())

    def _key(self, k: int) -> tuple[tuple[int, int], str]:
        return self.group.temporary_key(f"unsharded_model_weight:{k}")

    def pin_scratch(self) -> None:
        """The compute parameters view the gathered scratch buffers (``ScratchAllocator.pin``:
        a re-gather in this iteration must get the same memory)."""
        k = 0
        while self.group.allocator.get(self._key(k)) is not None:
            self.group.allocator.pin(self._key(k))
            k += 1

    def free_scratch(self) -> None:
        allocator = self.group.allocator
        k = 0
        while allocator.get(self._key(k)) is not None:
            allocator.free(self._key(k))
            k += 1

    def refresh_persistent(self, async_op: bool) -> Deferred:
        """``optim``/``optim_grads``: into the persistent replicated input buffers (the FP8
        bytes), allocated on the first refresh."""
        return self.gather(self._persistent_input, async_op,
                           "refresh all-gather (all-gather extensions)")

    def _persistent_input(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Persistent input buffer ``k`` over the plan's model-weight span: full (``optim``,
        ``optim_grads``), or the inner shard (HSDP outer ``optim``)."""
        lo, hi = self.group.plan.model_weight_span
        if k == len(self._persistent):
            self._persistent.append(torch.zeros(hi - lo, dtype=dtype, device=self.group.device))
        return self._persistent[k]

    def persistent_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._persistent)

    def side_tensors(self) -> list[torch.Tensor]:
        """The tensors this group's parameter objects hold outside its flat buffers: the tensor
        attributes of each compute weight and each optimizer-facing local tensor of a wrapper
        subclass that view none of the group's buffers -- torchao's scales (``_scale`` of the
        gathered ``Float8TrainingTensor``, ``_precomputed_scale`` of the weight). For
        ``memory_report``, which counts each storage once. (Attributes, not
        ``__tensor_flatten__``: torchao's tests ``if self._precomputed_scale``, a host sync on
        CUDA and an error on the estimator's meta tensors.)"""
        group = self.group
        own = {t.untyped_storage()._cdata for t in (group.main_weight, group.model_weight,
                                                     *self._persistent)}
        k = 0
        while (scratch := group.allocator.get(self._key(k))) is not None:
            own.add(scratch.untyped_storage()._cdata)
            k += 1
        found: list[torch.Tensor] = []
        for record in group.records:
            for holder in (record.compute_param,
                           record.dist_param._local_tensor):  # type: ignore[attr-defined]
                if not hasattr(holder, "__tensor_flatten__"):
                    continue
                found += [inner for inner in vars(holder).values()
                          if isinstance(inner, torch.Tensor)
                          and inner.untyped_storage()._cdata not in own]
        return found

    def _post_all_gather(self, buffers: list[torch.Tensor], metadata: list[Any],
                         trailing: list[torch.Size]) -> None:
        group = self.group
        reuse = self._viewed is not None and all(
            a is b for a, b in zip(self._viewed, buffers)) and len(self._viewed) == len(buffers)
        dtype = group.dtypes.model
        with torch.no_grad(), torch.inference_mode(False):
            for record, meta, rest in zip(group.records, metadata, trailing):
                item = record.item
                outputs = tuple(b[item.offset : item.end].view(-1, *rest) for b in buffers)
                local = record.dist_param._local_tensor  # type: ignore[attr-defined]
                if reuse:
                    local.fsdp_post_all_gather(outputs, meta, dtype, out=record.compute_param)
                    continue
                unsharded, _ = local.fsdp_post_all_gather(outputs, meta, dtype)
                if unsharded.shape != item.shape:
                    unsharded = unsharded.view(item.shape)
                self._set_compute_param(record, nn.Parameter(
                    unsharded, requires_grad=record.dist_param.requires_grad))
        self._viewed = list(buffers)
