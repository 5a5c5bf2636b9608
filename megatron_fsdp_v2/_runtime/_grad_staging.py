"""The staging of a flat group's per-micro-batch gradients: the ``param.grad`` of a backward
packed (scaled) into a full-size flat buffer, or written there by autograd itself through
aliases preset before the backward (see [Note: gradients in place]). A component of
:class:`~._grads.GroupGrads` (``grads.staging``), which decides where and when the gradients go
and reduces them; this one owns the aliases and does the copies.

[Note: gradients in place]
When the plan says ``grads_in_place`` (the first buffer the gradient path writes is in the
compute dtype), :meth:`GroupGrads.prepare_backward` runs before a unit's parameters receive
gradients (its pre-backward, and an activation-checkpoint recompute) and presets each compute
parameter's ``.grad`` to an alias of its region of that buffer; autograd's ``AccumulateGrad``
then adds into it in place (``grad += new``), as DDP's ``gradient_as_bucket_view`` and
Megatron's ``main_grad`` do. No staging copy, and no gradient-sized tensor per parameter lives
until the unit's post-backward.

* Accumulate path (``no_shard``, ``optim``): the aliases view ``main_grad``, zeroed when a
  window starts (state EMPTY). ``main_grad`` then holds *unscaled* local sums, and the
  pre-scale (``1/D`` or ``gradient_scaling_factor``) is applied once before the delayed
  collective (fused with the cast into the workspace when the communication dtype differs).
  Micro-batches staged on this path (below) are therefore staged unscaled too. A window that
  starts on REDUCED values (gradients zeroed in place or not cleared, a second backward over a
  retained graph) sets them aside first ([Note: HSDP window carry] in ``_grads.py``) and arms
  as from EMPTY (they go back if the backward brings this group nothing), or, under
  ``no_shard``, arms over them and adds onto them. A group that reduced
  in this window and has not installed yet sets no alias: those micro-batches take the staging
  path.
* Reduce-each path (``optim_grads``): the aliases view the unit's ``staged_grad``
  scratch buffer, allocated and zeroed at the pre-backward instead of the post-backward (while its
  autograd gradients would otherwise be alive: the same bytes, held as one scratch buffer); the
  post-backward scales it in place and reduces it. Not under ZeRO-3 (``optim_grads_params``,
  HSDP outer ``optim``): there the early scratch buffer adds to the unit's gathered weights, the
  prefetched previous unit's and the scratch buffer still in flight; measured (4 gloo ranks, 5.3M-
  parameter GPT, ``bench_training.py``), the allocator peak grew by one block's scratch buffer and
  peak RSS above the runtime by 3 MiB (203 -> 206), where ``no_shard``, ``optim`` and
  ``optim_grads`` stayed equal; so ZeRO-3 stages, as FSDP2 does.

A unit with units nested below it (typically the root: embeddings, output head) runs its
pre-backward when backward starts and its post-backward when it ends, so its buffer, armed, is
allocated at the activation peak although most of its gradients arrive at the end
(``FSDPState.prepare_gradients``):

* Accumulate path: it arms. Staged, each of its gradients would be an autograd tensor alive
  from its arrival to the end of backward, then copied into ``main_grad`` in the critical
  path, just before the last reduction. Measured (4 gloo ranks, 29.5M-parameter GPT whose
  root holds 8.4M parameters, fp32, ``bench_training.py``): the root's ``pack_`` of 34 ms per
  step goes away; peak RSS above base grows by 16 MiB (``no_shard`` 630 -> 646 MiB, DDP 679;
  ``optim`` 461 -> 477): the root's ``main_grad`` now lives during backward, less the head's
  gradient that no longer lives beside it.
* Reduce-each path: it stages. The buffer there is a scratch buffer that would otherwise not
  exist until the post-backward, when activations are gone.

The aliases are separate tensors over the buffer's storage (``Tensor.set_``), not autograd
views, so each has its own version counter: a parameter received a gradient in this backward
iff its alias' version moved (``AccumulateGrad`` is not called for a parameter nothing flowed
into), which keeps ``.grad=None`` for unused parameters exactly as before. Whatever ``.grad``
is after backward if it is not the alias (``create_graph=True`` makes ``AccumulateGrad`` replace
it with ``grad + new``; user code may assign it) holds that parameter's whole value: it is
staged over the parameter's region. After the reduction every compute ``.grad`` is ``None``
again; the aliases are cached (the buffers keep one tensor object across storage freeing;
a trace-pool arena that is replaced or released drops them: ``forget_temporary_aliases``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .. import ops
from .._buffers._plan import GradPath
from .._profiling import traced

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup

__all__ = ["GradStaging"]


class GradStaging:
    """A flat group's micro-batch gradients put into a full-size flat buffer: packed from
    ``param.grad``, or written there by autograd through aliases armed before the backward.
    Which buffer, and when, :class:`~._grads.GroupGrads` decides."""

    def __init__(self, group: FlatParamGroup) -> None:
        self.group = group  # its layout, records, TP faces and allocator: read only
        # [Note: gradients in place] The aliases of the buffer they were built over, and while
        # a backward writes through them, each armed parameter's alias version (else None).
        self._alias_base: torch.Tensor | None = None
        self._aliases: list[torch.Tensor] = []
        self._grad_aliases: list[torch.Tensor] = []  # what .grad is set to (TP: DTensors)
        self._armed: list[int | None] | None = None
        # [Note: SPMD parameters] (_tp_params.py): DTensors on an SPMD mesh take their
        # gradients' local tensors as they arrive on the dp dims (a Partial() there is not
        # all-reduced), which an in-place alias cannot: such groups stage.
        self.stages_spmd_grads = any(f is not None and f.dp_dims for f in group.tp_faces)

    @traced("mfsdp::stage")
    def stage(self, grads: Sequence[torch.Tensor | None], full_buffer: torch.Tensor,
              accumulate: bool, scale: float) -> None:
        """Write (or add) ``scale * param.grad`` into a full-size flat buffer."""
        layout = self.group.layout
        inputs, offsets = [], []
        for grad, item in zip(grads, layout.items):
            if grad is not None:
                inputs.append(grad if grad.is_contiguous() else grad.contiguous())
                offsets.append(item.offset)
        if not accumulate:
            # Regions nothing writes: padding, gaps, and parameters without a gradient.
            for lo, hi in self.group.uncovered:
                full_buffer[lo:hi].zero_()
            for grad, item in zip(grads, layout.items):
                if grad is None:
                    full_buffer[item.offset : item.end].zero_()
        if inputs:
            ops.pack_(inputs, offsets, full_buffer, scale=scale, accumulate=accumulate)

    def stage_over(self, grads: Sequence[torch.Tensor | None], buffer: torch.Tensor,
                   scale: float) -> None:
        """Gradients autograd or the user put in place of the aliases: overwrite their
        parameters' regions of ``buffer`` (they hold the whole value)."""
        if any(g is not None for g in grads):
            items = self.group.layout.items
            kept = [(g.contiguous(), item.offset) for g, item in zip(grads, items) if g is not None]
            ops.pack_([g for g, _ in kept], [o for _, o in kept], buffer, scale=scale,
                      accumulate=False)

    # ------------------------------------------------------------------ gradients in place

    @property
    def is_armed(self) -> bool:
        """The compute parameters' ``.grad`` are aliases a backward writes through."""
        return self._armed is not None

    def _aliases_of(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per parameter over its region of ``buffer`` (a full-size flat buffer),
        each with its own version counter (not an autograd view)."""
        if self._alias_base is not buffer:
            storage, base = buffer.untyped_storage(), buffer.storage_offset()
            aliases = []
            with torch.no_grad(), torch.inference_mode(False):
                for item in self.group.layout.items:
                    region = buffer[item.offset : item.end].view(item.shape)
                    aliases.append(
                        torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
                            storage, base + item.offset, region.shape, region.stride()
                        )
                    )
            self._aliases, self._alias_base = aliases, buffer
            # What a tensor-parallel parameter's ``.grad`` is set to: its alias as a DTensor
            # in the parameter's TP placements ([Note: 2-D parameters]).
            self._grad_aliases = [
                alias if face is None else face.compute_dtensor(alias)
                for alias, face in zip(aliases, self.group.tp_faces)
            ]
        return self._aliases

    def forget_temporary_aliases(self, persistent: torch.Tensor | None) -> None:
        """The memory scratch buffers live in was replaced or released (a trace-pool replan,
        ``release_memory_pool()``): drop aliases cached over a scratch buffer, which would
        keep the old arena alive until the next backward; they are rebuilt over the new one
        then. Aliases of ``persistent`` (the owner's ``main_grad``) stay."""
        if self._armed is None and self._alias_base is not None and (
            self._alias_base is not persistent
        ):
            self._aliases, self._grad_aliases, self._alias_base = [], [], None

    def arm(self, buffer: torch.Tensor) -> None:
        """Preset each trained compute parameter's ``.grad`` to its alias of ``buffer`` (a
        full-size flat buffer, zeroed where the window or micro-batch starts), so that autograd
        adds into it in place; a ``.grad`` left by user code is added into its alias first."""
        armed: list[int | None] = []
        aliases = self._aliases_of(buffer)
        for record, alias, grad_alias in zip(self.group.records, aliases, self._grad_aliases):
            param = record.compute_param
            if not param.requires_grad:
                armed.append(None)
                continue
            if param.grad is not None:  # left by user code: keep its contribution
                with torch.no_grad():  # entered only here: a measurable cost per group
                    left = param.grad if record.tp is None else record.tp.local_grad(param.grad)
                    alias.add_(left)
            param.grad = grad_alias
            # The object autograd adds into: a DTensor's own counter moves, not its local's.
            armed.append(grad_alias._version)
        self._armed = armed

    def take_armed(self) -> list[int | None] | None:
        """The armed versions of this backward (None: it was not armed); disarmed after."""
        armed, self._armed = self._armed, None
        return armed

    def disarm(self) -> None:
        """Drop the aliases of a backward that will not be reduced (gradients discarded)."""
        if self._armed is not None:
            self._armed = None
            self.clear_aliases()

    def clear_aliases(self) -> None:
        """The compute parameters' ``.grad`` let go of the aliases (and the reduce-each path's
        ``staged_grad`` they viewed is freed)."""
        for record in self.group.records:
            record.compute_param.grad = None
        if self.group.plan.grad_path is GradPath.REDUCE_EACH_MICRO_BATCH:
            self.group.allocator.free(self.group.temporary_key("staged_grad"))

    def collect(self, armed: list[int | None] | None
                ) -> tuple[list[torch.Tensor | None], list[bool]]:
        """This backward's gradients still to be staged (None: none, or already in the
        buffer), and per parameter whether it received one."""
        grads: list[torch.Tensor | None] = []
        received: list[bool] = []
        for index, record in enumerate(self.group.records):
            grad = record.compute_param.grad
            version = None if armed is None else armed[index]
            if version is not None and grad is self._grad_aliases[index]:
                received.append(grad._version != version)
                grad = None  # in the buffer already
            else:
                received.append(grad is not None)
                if grad is not None and grad.requires_grad:  # create_graph=True
                    grad = grad.detach()
                if grad is not None and record.tp is not None:
                    grad = record.tp.local_grad(grad)
            grads.append(grad)
        return grads, received
