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

__all__ = ["SpmdMesh", "TPFace", "tp_face_of"]

_RULE = (
    "fully_shard composes with tensor parallelism when the data-parallel mesh and the "
    "parameter's mesh are named sub-meshes of one root mesh, e.g. mesh = init_device_mesh("
    "'cuda', (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(block, mesh['tp'], "
    "plan); fully_shard(block, mesh=mesh['dp'])"
)


@dataclass(frozen=True)
class SpmdMesh:
    """FSDP2's SPMD mesh (``fully_shard(mesh=..., dp_mesh_dims=...)``): the whole mesh and the
    names of its data-parallel dims (shard and replicate)."""

    mesh: DeviceMesh
    dp_names: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class TPFace:
    """How one tensor-parallel parameter is seen (see [Note: 2-D parameters]). ``tp_mesh`` is
    ``None`` for a DTensor on an SPMD mesh of data-parallel dims only; ``compute_mesh`` and
    ``compute_placements``, where the compute parameter lives when that is not the TP mesh (a
    DTensor on a whole SPMD mesh, [Note: SPMD parameters])."""

    tp_mesh: DeviceMesh | None
    tp_placements: tuple[Placement, ...]
    shape: torch.Size  # global
    stride: tuple[int, ...]  # global, contiguous
    dist_mesh: DeviceMesh  # the dp mesh's dims, then the TP mesh's
    compute_mesh: DeviceMesh | None = None  # None: tp_mesh
    compute_placements: tuple[Placement, ...] | None = None  # None: tp_placements
    # SPMD faces: the data-parallel dims of the compute mesh, whose gradient placement
    # local_grad keeps as it arrives ([Note: SPMD parameters]).
    dp_dims: tuple[int, ...] = ()
    # A plain TP-local parameter annotated by spmd_types ([Note: spmd_types parameters] in
    # _frontend/_spmd_types.py): the module computes with the plain tensor, whose gradient
    # arrives plain in these placements on the compute mesh (the annotation's backward type);
    # ``compute_attrs``: its annotation attributes, which stay on the compute parameter only.
    plain_grad_placements: tuple[Placement, ...] | None = None
    compute_attrs: frozenset[str] = frozenset()

    @property
    def plain_compute(self) -> bool:
        """The compute parameter is a plain tensor (spmd_types), not a DTensor."""
        return self.plain_grad_placements is not None

    def local_of(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s TP-local tensor: itself when plain, else its DTensor's local tensor."""
        return param if self.plain_compute else param._local_tensor  # type: ignore[attr-defined]

    @property
    def dp_ndim(self) -> int:
        return self.dist_mesh.ndim - (0 if self.tp_mesh is None else self.tp_mesh.ndim)

    def _compute_spec(self) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        if self.compute_mesh is not None and self.compute_placements is not None:
            return self.compute_mesh, self.compute_placements
        assert self.tp_mesh is not None  # a face without TP dims has a compute mesh
        return self.tp_mesh, self.tp_placements

    def compute_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (a view of this rank's TP-local rows in a weight buffer) as the DTensor
        the module computes with (on the TP mesh, or the SPMD mesh); ``local``
        itself for a plain (spmd_types) compute parameter."""
        if self.plain_compute:
            return local  # type: ignore[return-value]
        mesh, placements = self._compute_spec()
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def dist_placements(self, dp_placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """The optimizer-facing placements: ``dp_placements`` (the group's, on the dp mesh)
        with a dp ``Shard(0)`` made strided where TP shards dim 0 too, then the TP ones."""
        tp_mesh = self.tp_mesh
        split = 1 if tp_mesh is None else math.prod(
            tp_mesh.size(i) for i, p in enumerate(self.tp_placements)
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

        if self.tp_mesh is None:
            return (0,) * len(self.shape)
        _, offsets = compute_local_shape_and_global_offset(self.shape, self.tp_mesh,
                                                           self.tp_placements)
        return tuple(offsets)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local part of a compute gradient, in the parameter's compute
        placements on the TP dims (a ``Partial()`` gradient of a ``Replicate()`` parameter is
        all-reduced there); on an SPMD face's data-parallel dims the gradient's own placement
        is kept, as FSDP2 keeps it: a ``Partial()`` there is this rank's share, which the dp
        reduction then averages ([Note: SPMD parameters])."""
        mesh, placements = self._compute_spec()
        if not isinstance(grad, DTensor):
            if self.plain_grad_placements is None:
                return grad  # user code assigned a local tensor: taken as the TP-local gradient
            # spmd_types: what the plain gradient is, per the annotation's backward type.
            grad = DTensor.from_local(grad, mesh, self.plain_grad_placements, run_check=False,
                                      shape=self.shape, stride=self.stride)
        if self.dp_dims:
            placements = tuple(grad.placements[i] if i in self.dp_dims else p
                               for i, p in enumerate(placements))
        if tuple(grad.placements) != placements:
            grad = grad.redistribute(mesh, placements)
        return grad._local_tensor


def tp_face_of(fqn: str, param: nn.Parameter, dp_mesh: DeviceMesh,
               spmd: SpmdMesh | None = None) -> TPFace | None:
    """``None`` for a plain parameter; for a DTensor one, its :class:`TPFace`, or a
    ``ValueError``/``TypeError`` naming what cannot be composed (no collective). ``spmd``: the
    SPMD mesh ``dp_mesh`` was taken from with ``dp_mesh_dims`` (a DTensor on it takes
    [Note: SPMD parameters]; one on a TP sub-mesh the usual way)."""
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
    if spmd is not None and tp_mesh == spmd.mesh:
        return _spmd_face(what, param, dp_mesh, spmd)
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
    shape = param.shape
    return TPFace(tp_mesh, tuple(param.placements), shape, _contiguous_stride(shape), dist_mesh)


# [Note: SPMD parameters]
# With FSDP2's ``dp_mesh_dims`` (torchtitan's SPMD mode) a parameter is a DTensor on the whole
# SPMD mesh: ``Replicate()`` on the data-parallel dims, its tensor-parallel placements on the
# others (``distribute_module``/``distribute_tensor`` over the mesh). Its TP part is those
# other dims and placements, so it takes the FSDP x TP path of [Note: 2-D parameters]
# unchanged (its local tensor is the TP-local tensor), except for its compute face: the module
# computes with the user's DTensor on the SPMD mesh (its inputs are DTensors there), so the
# compute parameter keeps that mesh and those placements, and so do the in-place gradient
# aliases and ``local_grad``'s target. The optimizer-facing DTensor is on the dp mesh's dims
# then the other dims (``DeviceMesh._concatenate``; the SPMD mesh itself when its dp dims come
# first, as torchtitan's; with a non-dp dim before a dp dim it is that mesh reordered dp first,
# where FSDP2 keeps the SPMD mesh's order: the same values), with FSDP2's
# placements: ``Shard(0)`` (``_StridedShard`` where TP shards dim 0 too) on the shard dim,
# ``Replicate()`` on the replicate dim, the TP placements on the rest. A mesh of data-parallel
# dims only leaves no TP part (``tp_mesh`` None): the optimizer-facing DTensor is the plain
# one's. A gradient that arrives ``Partial()`` over a dp dim (inputs sharded over it as
# DTensors) keeps that placement: its local tensor is this rank's share of the dp reduction,
# which averages it, as FSDP2 does (``_get_grad_inner_tensor`` redistributes the non-dp dims
# only). Made ``Replicate()`` first, it was summed over dp and then averaged: dp times FSDP2's
# gradient (DTensor's backward of a loss that is ``Partial()`` over dp seeds every rank with
# one, which FSDP2's average compensates; FSDP2's result is the one process's on the global
# batch). The alias ``+=`` of [Note: gradients in place] would make it ``Replicate()``
# (DTensor redistributes the operand to the alias' placement), so groups with such faces
# stage their gradients, as FSDP2 does (``GradStaging.stages_spmd_grads``).


def _spmd_face(what: str, param: DTensor, dp_mesh: DeviceMesh, spmd: SpmdMesh) -> TPFace:
    mesh = spmd.mesh
    names = mesh.mesh_dim_names
    assert names is not None  # resolve_dp_mesh requires names
    placements = tuple(param.placements)
    for name in spmd.dp_names:
        placement = placements[names.index(name)]
        if not placement.is_replicate():
            raise ValueError(
                f"{what}: with dp_mesh_dims a parameter must be Replicate() on every "
                f"data-parallel dim (as FSDP2 requires), got {placement} on '{name}'; "
                "distribute it Replicate() over the data-parallel dims (fully_shard shards it "
                "there) and with its tensor-parallel placements over the others"
            )
    tp_names = tuple(n for n in names if n not in spmd.dp_names)
    tp_placements = tuple(placements[names.index(n)] for n in tp_names)
    tp_mesh = (None if not tp_names
               else mesh[tp_names[0]] if len(tp_names) == 1 else mesh[tp_names])
    dist_mesh = dp_mesh if tp_mesh is None else DeviceMesh._concatenate([dp_mesh, tp_mesh])
    shape = param.shape
    return TPFace(tp_mesh, tp_placements, shape, _contiguous_stride(shape), dist_mesh,
                  compute_mesh=mesh, compute_placements=placements,
                  dp_dims=tuple(names.index(n) for n in spmd.dp_names))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
