"""Plain tensor-parallel parameters annotated by ``spmd_types`` read as the DTensors they denote
on the SPMD mesh (see the note below); called by ``_wrap_checks.collect_managed_params`` at wrap
time, before any buffer is built. No collective.

[Note: spmd_types parameters]
``spmd_types`` (meta-pytorch/spmd_types; torchtitan's default SPMD backend,
``--parallelism.spmd_backend spmd_types``) leaves a tensor-parallel parameter a plain tensor
holding this rank's TP-local piece and records what it is in attributes (``get_local_type``: a
per-mesh-axis type ``R``/``I``/``V``/``P``; ``get_partition_spec``: which axis shards which
dim, ``V`` + spec = ``S(d)``). FSDP2 (torch 2.14, ``_resolve_spmd_types_for_storage``) reads
them when ``fully_shard`` gets the SPMD mesh and ``dp_mesh_dims``, and so does this library, by
the same rules:

* every dim of the SPMD mesh gets a type: the data-parallel dims ``R`` (annotated ``R`` or not
  at all; anything else is refused: the dp reduction is fully_shard's), each other dim the
  parameter's own annotation (a missing one is refused, as FSDP2 does, except on a size-1 dim,
  which ``spmd_types`` drops from annotations: ``R`` there);
* the types become DTensor placements on the SPMD mesh (``R``/``I`` -> ``Replicate()``,
  ``S(d)`` -> ``Shard(d)``; a bare ``V`` has no dim and is refused like FSDP2 refuses it; ``P``,
  a partial parameter, is refused: FSDP2 stores it as a ``Partial()`` DTensor, the flat buffers
  hold no such thing), and the parameter is taken as ``DTensor.from_local(piece, mesh,
  placements)``, which then takes the path of [Note: SPMD parameters] in
  ``_dtensor/_tp_params.py`` unchanged: sharded over the dp dims as a plain tensor of the
  TP-local shape, optimizer-facing DTensors on the dp dims then the TP dims with FSDP2's
  placements, state dicts and checkpoints of the global tensor;
* what the module computes with stays what it was: the user's plain parameter object, bound to
  the TP-local view of the unsharded buffer, its annotations untouched (FSDP2 gives a plain
  tensor too and re-asserts the annotations there), so the model's own ``spmd_types``
  collectives and its type checker see what they saw before wrapping. Its gradient arrives
  plain; it is taken in the annotation's backward type (``R`` -> ``P``: the TP ranks' partial
  sums, all-reduced over TP before the dp reduction, as FSDP2's ``_get_grad_inner_tensor``
  does; ``I`` -> ``I``; ``S(d)`` -> ``S(d)``; ``P`` on the dp dims, kept: the dp reduction's
  input). The optimizer-facing parameters carry no annotation (FSDP2's are fresh DTensors).
  Under ``spmd_types``' type checker (a torch-function mode; torchtitan's
  ``--debug.spmd_typechecking``) the rebinding of the compute parameter to its buffer view runs
  with torch-function handling off (``set_compute_local``): it is bookkeeping, not an op of the
  model, as FSDP2 unshards with type checking off.

Without ``dp_mesh_dims`` an annotated parameter is refused, as FSDP2 refuses it: nothing says
which mesh its types are on, and a TP-local piece taken for a whole parameter would train and
checkpoint wrong values. ``spmd_types`` is only looked at when already imported (no annotation
can exist otherwise); it is never a requirement of the library.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .._dtensor._tp_params import SpmdMesh, TPFace, tp_face_of

__all__ = ["spmd_types_face"]

# The attributes spmd_types keeps its annotations in (runtime._LOCAL_TYPE_ATTR and
# _PARTITION_SPEC_ATTR): they stay on the compute parameter only.
_ANNOTATION_ATTRS = frozenset({"_local_type", "_partition_spec"})


def _spmd_module() -> Any:
    return sys.modules.get("spmd_types")


def spmd_types_face(fqn: str, param: nn.Parameter, dp_mesh: Any,
                    spmd_mesh: SpmdMesh | None) -> TPFace | None:
    """``None`` for a parameter without ``spmd_types`` annotations (or a DTensor); else the
    :class:`TPFace` of the DTensor it denotes on the SPMD mesh, whose compute parameter stays the
    plain ``param`` (see [Note: spmd_types parameters]). Raises ``ValueError`` or
    ``NotImplementedError`` naming the parameter for what cannot be read (no collective)."""
    spmd = _spmd_module()
    if spmd is None or isinstance(param, DTensor):
        return None
    local_type = dict(spmd.get_local_type(param))
    if not local_type:
        return None
    what = f"parameter '{fqn}' carries spmd_types annotations ({_describe(spmd, param)})"
    if spmd_mesh is None:
        raise ValueError(
            f"{what}, so it may be one rank's tensor-parallel piece: fully_shard reads them, as "
            "FSDP2 does, only with the whole SPMD mesh and the names of its data-parallel dims: "
            "fully_shard(module, mesh=<the mesh the annotations are on, with dim names>, "
            "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)) (torchtitan's "
            "resolve_fsdp_mesh gives both)"
        )
    placements, grad_placements = _placements(spmd, what, param, local_type, spmd_mesh)
    with torch.no_grad():
        dtensor = nn.Parameter(DTensor.from_local(param.detach(), spmd_mesh.mesh, placements,
                                                  run_check=False))
    face = tp_face_of(fqn, dtensor, dp_mesh, spmd_mesh)
    assert face is not None  # a DTensor on the SPMD mesh
    return dataclasses.replace(face, plain_grad_placements=grad_placements,
                               compute_attrs=_ANNOTATION_ATTRS)


def _placements(spmd: Any, what: str, param: torch.Tensor, local_type: dict[Any, Any],
                spmd_mesh: SpmdMesh) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """The parameter's placements on the SPMD mesh and its gradient's (the backward types)."""
    mesh = spmd_mesh.mesh
    names = mesh.mesh_dim_names
    assert names is not None  # resolve_dp_mesh requires names
    axes = {name: spmd.MeshAxis.of(mesh.get_group(name)) for name in names}
    spec = spmd.get_partition_spec(param)
    if spec is not None:  # V + the spec's dim = S(d)
        from spmd_types.types import partition_spec_to_shard_types

        local_type.update(partition_spec_to_shard_types(spec))
    dp_axes = tuple(axes[n] for n in spmd_mesh.dp_names if mesh.size(names.index(n)) > 1)
    fsdp_axis = _flatten(dp_axes) if dp_axes else None
    other_axes = {axes[n] for n in names if n not in spmd_mesh.dp_names}
    for axis, axis_type in local_type.items():
        if fsdp_axis is not None and axis <= fsdp_axis:  # MeshAxis order: a sub-axis of dp
            if axis_type is not spmd.R:
                raise ValueError(
                    f"{what}: it is {axis_type} on the data-parallel axis {axis}, and "
                    "fully_shard (like FSDP2) requires R there: it shards the parameter over "
                    "the data-parallel dims and reduces its gradient there itself. Annotate it "
                    "R on the data-parallel axes (or leave them out)"
                )
        elif axis not in other_axes:
            raise ValueError(
                f"{what}: it is annotated on the axis {axis}, which is neither a dim of the "
                f"SPMD mesh passed to fully_shard ({names}) nor within its data-parallel dims "
                f"{spmd_mesh.dp_names}; pass the mesh its annotations are on"
            )
    placements: list[Placement] = []
    grad_placements: list[Placement] = []
    for name in names:
        if name in spmd_mesh.dp_names:
            placements.append(Replicate())
            grad_placements.append(_placement(spmd, what, spmd.R.backward_type(), name))
            continue
        axis_type = local_type.get(axes[name])
        if axis_type is None:
            if mesh.size(names.index(name)) > 1:
                raise ValueError(
                    f"{what}: it has no type on the mesh dim '{name}' (not a data-parallel "
                    f"dim), which fully_shard (like FSDP2) needs to know what the parameter is "
                    f"there. Annotate every non-data-parallel dim of the mesh {names}"
                )
            axis_type = spmd.R  # a size-1 dim spmd_types dropped: whole there
        placements.append(_placement(spmd, what, axis_type, name))
        grad_placements.append(_placement(spmd, what, axis_type.backward_type(), name))
    if any(not isinstance(p, (Shard, Replicate)) for p in placements):
        raise NotImplementedError(
            f"{what}: it is P (partial) on a tensor-parallel dim; fully_shard holds parameters "
            "whose value is their pieces (R, I, or S(d) on each non-data-parallel dim), not "
            "pending sums. Reduce it before fully_shard, or pass it in ignored_params"
        )
    return tuple(placements), tuple(grad_placements)


def _placement(spmd: Any, what: str, axis_type: Any, name: str) -> Placement:
    try:
        placement: Placement = spmd.spmd_type_to_dtensor_placement(axis_type)
    except ValueError:  # a bare V: which dim it shards is unknown
        raise ValueError(
            f"{what}: it is V (varying) on the mesh dim '{name}' without a partition spec, so "
            "which tensor dim it shards is unknown (FSDP2 refuses it too). Annotate it S(dim) "
            "(spmd.assert_type(param, {..., axis: spmd.S(dim)})) or give a partition_spec"
        ) from None
    return placement


def _flatten(axes: tuple[Any, ...]) -> Any:
    from spmd_types._mesh_axis import flatten_axes

    return flatten_axes(axes)


def _describe(spmd: Any, param: torch.Tensor) -> str:
    spec = spmd.get_partition_spec(param)
    local_type = spmd.get_local_type(param)
    return f"local type {dict(local_type)}" + ("" if spec is None else f", partition spec {spec}")
