"""Parameters that tensor parallelism already made DTensors (FSDP x TP): what their two faces
are, and the checks that accept them.

[Note: 2-D parameters]
``parallelize_module(block, mesh["tp"], plan)`` leaves each parameter of a parallelized layer a
DTensor on the 1-D TP mesh: ``Shard(0)`` (colwise weight and bias, row-wise embedding),
``Shard(1)`` (rowwise weight, col-wise embedding) or ``Replicate()`` (rowwise bias, sequence-
parallel norms). ``fully_shard(block, mesh=mesh["dp"])`` then treats this rank's *TP-local*
tensor exactly as it treats a plain parameter: the layout, the flat buffers, the shards over the
dp mesh (uneven rows, every strategy) and every dp collective are those of a plain tensor of the
TP-local shape. What changes is the two faces of the record:

* compute parameter: the user's own DTensor parameter object, still on the TP mesh with the TP
  placements, whose ``_local_tensor`` is a view into the unsharded model-weight buffer (rebound
  where the plain path assigns ``.data``; FSDP2 also sets ``_local_tensor``). So the module's
  forward sees the DTensor ``parallelize_module`` expects, and its gradient arrives as a DTensor
  on the TP mesh.
* optimizer-facing parameter: a DTensor on the concatenation of the dp mesh and the TP mesh
  (``DeviceMesh._concatenate``, a slice of their common root mesh; FSDP2's rule), placements the
  dp placements followed by the TP ones: ``(Shard(0), Shard(1))``, ``(Shard(0), Replicate())``,
  and, where TP shards dim 0, ``(_StridedShard(0, split_factor=tp), Shard(0))`` as FSDP2 writes
  it: the dp shard is a piece *of each TP-local tensor*, not of the full tensor. Its local
  tensor views ``main_weight`` as before.

Gradients. A TP-local gradient is what the dp reduction sums, except for a ``Replicate()``
parameter whose gradient autograd returns as ``Partial()`` over the TP mesh (a sequence-parallel
norm: every TP rank holds part of the sequence). It is made ``Replicate()`` first (one TP
all-reduce, what FSDP2's post-backward does and what a plain TP step does at the optimizer):
an armed in-place gradient alias is a ``Replicate()`` DTensor, so autograd's ``grad += new``
redistributes there; a staged gradient goes through :meth:`TPFace.local_grad`. Those TP
collectives are the user's model's, like TP's own activations collectives.

``full_tensor()`` and ``redistribute`` of the optimizer-facing DTensors: the dp mesh dimension
holds uneven rows, so ``_redistribute.py`` gathers it first with the true sizes (the TP-local
tensor), then hands ``(Replicate(), <TP placements>)`` to torch, whose TP layout is its own
``torch.chunk`` one (see [Note: uneven redistribution]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import _registry

__all__ = ["TPFace", "tp_face_of"]

_RULE = (
    "fully_shard composes with tensor parallelism when the data-parallel mesh and the "
    "parameter's mesh are named sub-meshes of one root mesh, e.g. mesh = init_device_mesh("
    "'cuda', (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(block, mesh['tp'], "
    "plan); fully_shard(block, mesh=mesh['dp'])"
)


@dataclass(frozen=True, eq=False)
class TPFace:
    """How one tensor-parallel parameter is seen (see [Note: 2-D parameters])."""

    tp_mesh: DeviceMesh
    tp_placements: tuple[Placement, ...]
    shape: torch.Size  # global
    stride: tuple[int, ...]  # global, contiguous
    dist_mesh: DeviceMesh  # the dp mesh's dims, then the TP mesh's

    @property
    def dp_ndim(self) -> int:
        return self.dist_mesh.ndim - self.tp_mesh.ndim

    def compute_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (a view of this rank's TP-local rows in a weight buffer) as the TP DTensor
        the module computes with."""
        return DTensor.from_local(local, self.tp_mesh, self.tp_placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def dist_placements(self, dp_placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """The optimizer-facing placements: ``dp_placements`` (the group's, on the dp mesh)
        with a dp ``Shard(0)`` made strided where TP shards dim 0 too, then the TP ones."""
        split = math.prod(
            self.tp_mesh.size(i) for i, p in enumerate(self.tp_placements)
            if isinstance(p, Shard) and p.dim == 0
        )
        dp = tuple(
            _StridedShard(0, split_factor=split) if split > 1 and isinstance(p, Shard) else p
            for p in dp_placements
        )
        return dp + self.tp_placements

    def dist_dtensor(self, local: torch.Tensor, dp_placements: tuple[Placement, ...]) -> DTensor:
        """``local`` (this rank's rows of the TP-local tensor in a main-weight-span buffer) as
        the optimizer-facing DTensor on the dp x TP mesh."""
        return DTensor.from_local(local, self.dist_mesh, self.dist_placements(dp_placements),
                                  run_check=False, shape=self.shape, stride=self.stride)

    def tp_offsets(self) -> tuple[int, ...]:
        """Where this rank's TP-local tensor starts in the full tensor (DTensor's own offsets:
        TP's shards are ``torch.chunk`` pieces)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(self.shape, self.tp_mesh,
                                                           self.tp_placements)
        return tuple(offsets)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local part of a compute gradient, in the parameter's TP placements
        (a ``Partial()`` gradient of a ``Replicate()`` parameter is all-reduced over TP)."""
        if not isinstance(grad, DTensor):
            return grad  # user code assigned a local tensor: taken as the TP-local gradient
        if tuple(grad.placements) != self.tp_placements:
            grad = grad.redistribute(self.tp_mesh, self.tp_placements)
        return grad._local_tensor


def tp_face_of(fqn: str, param: nn.Parameter, dp_mesh: DeviceMesh) -> TPFace | None:
    """``None`` for a plain parameter; for a DTensor one, its :class:`TPFace`, or a
    ``ValueError``/``TypeError`` naming what cannot be composed (no collective)."""
    if not isinstance(param, DTensor):
        return None
    tp_mesh = param.device_mesh
    what = f"parameter '{fqn}' is a DTensor on {tp_mesh} with placements {param.placements}"
    for p in param.placements:
        if not (isinstance(p, (Shard, Replicate)) and not isinstance(p, _StridedShard)):
            raise ValueError(
                f"{what}; fully_shard composes with DTensor parameters placed Shard(d) or "
                "Replicate() (tensor parallelism), not Partial or strided ones (torch's "
                "fully_shard already applied?): pass it in ignored_params"
            )
    if tp_mesh == dp_mesh:
        raise ValueError(
            f"{what}: the data-parallel mesh itself (e.g. from distribute_tensor or torch's "
            "fully_shard), which fully_shard would shard over a second time; pass it in "
            f"ignored_params, or distribute it over a tensor-parallel mesh instead. {_RULE}"
        )
    if tp_mesh.mesh_dim_names is None or dp_mesh.mesh_dim_names is None:
        raise ValueError(f"{what}; both meshes need dimension names. {_RULE}")
    shared = set(tp_mesh.mesh_dim_names) & set(dp_mesh.mesh_dim_names)
    if shared:
        raise ValueError(
            f"{what}, which shares mesh dimension(s) {sorted(shared)} with the data-parallel "
            f"mesh {dp_mesh}: a parameter cannot be sharded twice over one axis. {_RULE}"
        )
    if tp_mesh.device_type != dp_mesh.device_type:
        raise ValueError(f"{what}, but the data-parallel mesh is on "
                         f"'{dp_mesh.device_type}'. {_RULE}")
    if tp_mesh._get_root_mesh() != dp_mesh._get_root_mesh():
        raise ValueError(
            f"{what}, and the data-parallel mesh {dp_mesh} is not a sub-mesh of the same root "
            f"mesh. {_RULE}"
        )
    try:
        dist_mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except RuntimeError as error:
        raise ValueError(f"{what}, which cannot be combined with the data-parallel mesh "
                         f"{dp_mesh} ({error}). {_RULE}") from None
    # The estimator wraps meta models with storage-free buffers (see [Note: meta buffers] in
    # _registry): there the TP-local meta shapes are all it needs.
    if param.device.type == "meta" and not _registry.meta_buffers[0]:
        raise NotImplementedError(
            f"{what}, on the meta device: fully_shard composes with tensor parallelism for "
            "materialized models; call module.to_empty(device=...) and initialize before "
            "fully_shard"
        )
    shape = param.shape
    return TPFace(tp_mesh, tuple(param.placements), shape, _contiguous_stride(shape), dist_mesh)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
