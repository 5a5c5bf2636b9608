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
* ``no_shard`` gathers nothing: the compute parameter is the subclass rebuilt over the
  full-precision ``model_weight`` view, which torchao casts to float8 in each forward.
* Gradients are plain tensors of the compute dtype (``Float8Linear``'s weight gradient) and take
  the plain path into ``main_grad``.
* torchao float8 weights with precomputed scales skip ``fsdp_pre_all_gather``: the fused
  ``ops.fp8_quantize_`` writes the same bits into the FP8 buffer for the whole group in one call
  (``_fused_float8_cast``); the metadata is the same ``(scale,)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .. import ops
from .._buffers._plan import Collective
from .._profiling import traced
from ._issuer import CollectiveLaunch, Pending

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup
    from ._param_record import ParamRecord

__all__ = ["ExtensionGather", "has_all_gather_extensions", "inner_values", "rewrap"]

_FLOAT8 = {d for d in vars(torch).values() if isinstance(d, torch.dtype) and "float8" in str(d)}


def has_all_gather_extensions(param: torch.Tensor) -> bool:
    """Whether ``param``'s class defines FSDP2's all-gather extension methods."""
    return hasattr(param, "fsdp_pre_all_gather") and hasattr(param, "fsdp_post_all_gather")


def inner_values(param: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``param``'s values: the one inner tensor of an extension
    subclass (see [Note: FSDP2 all-gather extensions]), else ``param`` detached."""
    if not has_all_gather_extensions(param):
        return param.detach()
    names, _ = param.__tensor_flatten__()  # type: ignore[attr-defined]
    (inner,) = [t for t in (getattr(param, n) for n in names) if isinstance(t, torch.Tensor)]
    return inner.detach()


def rewrap(template: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``template``'s subclass (same configuration) rebuilt over the plain tensor ``values``."""
    names, context = template.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {n: getattr(template, n) for n in names}
    (name,) = [n for n, t in inner.items() if t.shape == template.shape]
    inner[name] = values
    return type(template).__tensor_unflatten__(  # type: ignore[attr-defined]
        inner, context, values.shape, values.stride()
    )


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What the collective moves: float8 bytes as ``uint8`` (same bytes; gloo has no float8)."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


class ExtensionGather:
    """The all-gather extensions of one flat group (see [Note: FSDP2 all-gather extensions])."""

    # Cast torchao float8 weights with the fused kernel (see _fused_float8_cast); False: always
    # through the protocol (tests compare both).
    fuse_float8 = True

    def __init__(self, group: FlatParamGroup, params: list[nn.Parameter]) -> None:
        self.group = group
        # Storage-free copies of the wrapped parameters: their subclass and configuration.
        with torch.no_grad():
            self.templates = [
                rewrap(p, torch.empty(0, dtype=p.dtype, device=group.device)) for p in params
            ]
        # ids of the parameter objects the module held at wrap time (ParamSlots maps them).
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
        mesh, names = group.mesh, group.mesh.mesh_dim_names
        self.shard_mesh = mesh if mesh.ndim == 1 or names is None else mesh[names[-1]]
        self._persistent: list[torch.Tensor] = []  # optim/optim_grads: the gathered inputs
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
        from .. import _registry  # noqa: PLC0415 - _registry imports this package for typing

        record.compute_param = param
        _registry.register_records([record])
        self.group.views_generation += 1

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

    def _pack(self, buffer_for: Callable[[int, torch.dtype], torch.Tensor]
              ) -> tuple[list[torch.Tensor], list[Any], list[torch.Size]]:
        """Run every parameter's pre-all-gather and copy its inputs into its rows of this rank's
        slot of the input buffers (``buffer_for(k, dtype)``: full-size flat buffer ``k``)."""
        group = self.group
        span = group.plan.main_weight_span
        self._check_empty_shards()
        fused = self._fused_float8_cast(buffer_for)
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
                        buffer[lo:hi].copy_(t.reshape(-1))
        trailing = [inputs[0].shape[1:] if inputs else torch.Size() for inputs, _ in calls]
        return buffers, [metadata for _, metadata in calls], trailing

    def _fused_float8_cast(self, buffer_for: Callable[[int, torch.dtype], torch.Tensor]
                           ) -> tuple[list[torch.Tensor], list[Any], list[torch.Size]] | None:
        """torchao's ``WeightWithDynamicFloat8CastTensor`` with precomputed scales: its
        ``fsdp_pre_all_gather`` is ``(rows * scale).clamp(-max, max).to(float8)`` into a new
        tensor with metadata ``(scale,)``; the library's fused ``ops.fp8_quantize_`` writes the
        same bits (tested against it) straight into this rank's slot of the FP8 buffer for the
        whole group in one call, saving the per-parameter tensors and copies. None: take the
        protocol (another class, a scale not precomputed, mixed float8 formats)."""
        group = self.group
        locals_ = [r.dist_param._local_tensor for r in group.records]  # type: ignore[attr-defined]
        if not self.fuse_float8 or not all(
            type(t).__qualname__ == "WeightWithDynamicFloat8CastTensor"
            and type(t).__module__.startswith("torchao.float8")
            and isinstance(getattr(t, "_precomputed_scale", None), torch.Tensor)
            for t in locals_
        ):
            return None
        formats = {t._dtype for t in locals_}
        if len(formats) != 1 or not group.main_weight.is_contiguous():
            return None
        (fmt,) = formats
        buffer = buffer_for(0, fmt)
        span = group.plan.main_weight_span
        scales = [t._precomputed_scale for t in locals_]
        inputs = [group.local_view(group.main_weight, i) for i in range(len(locals_))]
        offsets = [group.layout.local_item_range(i, *span)[0] for i in range(len(locals_))]
        amaxes = torch.empty(len(locals_), dtype=torch.float32, device=group.device)
        ops.fp8_quantize_(inputs, [s.reshape(()) for s in scales], offsets, buffer,
                          list(amaxes.unbind()))
        trailing = [r.item.shape[1:] for r in group.records]
        return [buffer], [(scale,) for scale in scales], trailing

    @traced("mfsdp::gather")
    def gather(self, buffer_for: Callable[[int, torch.dtype], torch.Tensor],
               async_op: bool, what: str) -> Pending:
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

        return Pending(None, finish)

    def gather_scratch(self, async_op: bool) -> Pending:
        """ZeRO-3: into the storage-freeing scratch buffers ``unsharded_model_weight:<k>``."""
        group = self.group

        def buffer_for(k: int, dtype: torch.dtype) -> torch.Tensor:
            return group.allocator.allocate(self._key(k), group.layout.total_numel, dtype,
                                            group.device)

        return self.gather(buffer_for, async_op, "all-gather (all-gather extensions)")

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

    def refresh_persistent(self, async_op: bool) -> Pending:
        """``optim``/``optim_grads``: into the persistent replicated input buffers (the FP8
        bytes), allocated on the first refresh."""
        group = self.group

        def buffer_for(k: int, dtype: torch.dtype) -> torch.Tensor:
            if k == len(self._persistent):
                self._persistent.append(
                    torch.zeros(group.layout.total_numel, dtype=dtype, device=group.device))
            return self._persistent[k]

        return self.gather(buffer_for, async_op, "refresh all-gather (all-gather extensions)")

    def persistent_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._persistent)

    def side_tensors(self) -> list[torch.Tensor]:
        """The tensors this group's parameter objects hold outside its flat buffers: the inner
        tensors (``__tensor_flatten__``) of each compute weight and each optimizer-facing local
        tensor that view none of the group's buffers -- torchao's scales (``_scale`` of the
        gathered ``Float8TrainingTensor``, ``_precomputed_scale`` of the weight). For
        ``memory_report``, which counts each storage once."""
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
                flatten = getattr(holder, "__tensor_flatten__", None)
                if flatten is None:
                    continue
                for name in flatten()[0]:
                    inner = getattr(holder, name, None)
                    if isinstance(inner, torch.Tensor) and \
                            inner.untyped_storage()._cdata not in own:
                        found.append(inner)
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
