"""DTensor redistribution of the library's uneven shards: ``full_tensor()``, ``redistribute()``,
torch's full state dicts and the implicit redistributions of DTensor's op dispatch give the right
values for DTensors on a mesh that ``fully_shard`` shards over, or raise. Installed at the first
``fully_shard`` by ``_torch_patches/_redistribute.py`` (this module holds what the replacements
do, not the patching); DTensors on other meshes take torch's path untouched.

[Note: uneven redistribution]
The optimizer-facing DTensors (parameters, their gradients, and whatever is derived from them:
``exp_avg = zeros_like(p)``, ``p * 2``, ``p.t()``) hold the rows the flat-buffer layout gives
each rank (``FlatParamGroup.local_row_range``), not the ``torch.chunk`` rows DTensor assumes:
possibly none, possibly more than ``ceil(n / world)``. DTensor turns ``Shard(d)`` into
``Replicate()`` by padding every local tensor to the ``torch.chunk`` size it computes from the
global shape, all-gathering and unpadding by those sizes, so on our shards it returns wrong
values (or fails on a shape mismatch) without any error.

What both layouts share: along one mesh dimension, the shards are contiguous ranges of tensor
dim ``d`` in mesh-rank order. So a gather that learns the true sizes first is right for both:
one all-gather of each rank's local size along ``d`` (a few bytes), one all-gather of the
shards padded to the largest, then unpad by the true sizes. That is what
``_uneven_gather.gather_shard`` does, over the mesh dimension's own process group.

Every redistribution goes through
``torch.distributed.tensor._redistribute.redistribute_local_tensor`` (explicit ones from
``Redistribute``, backward ones from ``NestedRedistribute``, implicit ones from the op
dispatcher in ``_dispatch.py``, ``from_local``'s backward in ``_api.py``; modules that imported
it by name hold their own reference, so each is patched). The replacement
(:func:`redistribute_local_tensor`) calls the original for everything that is not on a mesh
registered by ``fully_shard`` (``_uneven_meshes.register_mesh``), and for a source on a
registered mesh that cannot hold the library's rows ([Note: deciding by tensor]). Otherwise, when
the source is sharded (``Shard``) along exactly one mesh dimension of size > 1 and that
dimension's placement changes, it first gathers along that dimension with the true sizes, then
hands the result (now ``Replicate()`` there) to the original for the rest, which is then
layout-independent: a
``Replicate -> Shard`` produces ``torch.chunk`` pieces, DTensor's own meaning of ``Shard``, and
partial reductions along other dimensions run over equal shapes. A transform that leaves the
sharded dimension as it is (e.g. ``(Partial(), Shard(0)) -> (Replicate(), Shard(0))``) goes to
the original unchanged: it never reads the row layout.

The decision depends only on the specs (mesh, placements, global shape), which every rank
shares, so every rank takes the same branch and issues the same collectives: no deadlock.

Refused with ``NotImplementedError`` (before any collective; every rank raises):

* ``(Shard(0), Shard(0))`` on a 2-D mesh used with ``outer_dp_sharding_strategy="optim"``,
  of a size some parameter there has: rank (r, s) holds sub-shard ``s * R + r`` (inner
  first), while DTensor's nested ``Shard`` means outer first; a ``distribute_tensor`` result
  on the same mesh is outer first, and the spec cannot tell the two apart, so neither can be
  gathered safely. The library's
  ``checkpoint.get_full_state_dict`` / ``get_state_dict`` handle these units.
* ``_StridedShard`` sources on a registered mesh (a view of an uneven shard has no strided
  equivalent);
* on a dp x TP mesh, a unit's dp ``_StridedShard(d)`` kept in the target while TP stops
  sharding ``d`` (a colwise parameter redistributed TP-only to ``Replicate()``): the result
  would hold torch's strided rows of the whole tensor, which torch itself gathers wrongly for
  uneven sizes; it returned reordered rows before, silently (``test_spmd_activations.py``);
* any of the above while tracing (``torch.compile``/export of DTensor code): the size exchange
  is data dependent. The library's own forward/backward runs on plain compute parameters and
  never reaches DTensor redistribution.

Three more places read the rows through the spec alone, and are handled here too: the op
dispatcher's implicit redistribution of an argument *into* ``Shard`` next to one of ours
(``p + replicated_x``: :func:`redistribute_local_args` cuts it at our rows; on a dp x TP mesh,
``t.copy_(replicated)`` too, where DTensor's ``copy_`` redistributes the source: the TP piece
is torch's, its dp rows ours), ``copy_`` between
two DTensors of the same placements but different rows (``p.copy_(distribute_tensor(...))``:
``_copy_rows.py``), and torch's full optimizer state dict, which pairs each rank's states in
its own order while a rank with an empty shard of a parameter has no state for it
(``_runtime/_optim_state_check.py`` refuses that case on every rank before any gather).

[Note: deciding by tensor]
A mesh ``fully_shard`` shards over also carries DTensors that are not the library's: the
user's ``distribute_tensor`` results, and on a dp x TP mesh registered from FSDP2's SPMD mesh
(``dp_mesh_dims``, torchtitan's ``full_dtensor`` backend) the activations, ``Shard`` on the dp
dims (their batch, ``torch.chunk`` rows) next to the TP placements. Taking them through the
uneven path costs a size all-gather per redistribution on any mesh, and on the SPMD mesh it
gathers activations over dp before every TP-only redistribution (torchtitan: 219 all-gathers
per step against FSDP2's 55). Which path a tensor takes must be the same on every
rank of the mesh (the two paths issue different collectives), and a tensor of ours may hold
``torch.chunk``'s row count on some ranks and not on others, so this rank's local shape cannot
decide. The spec can: the library's rows along a dp dim are rows of dim 0 of a parameter
(``register_mesh(row_counts=...)`` records every parameter's global dim-0 size), and the
gradients, optimizer states and derived tensors that keep that dimension (``p * 2``,
``zeros_like(p)``, ``p.t()``, a reduction over other dims) keep its size. So a source whose
dp-sharded dims (plain ``Shard``; ``_StridedShard`` there is a unit's) have sizes that no
parameter on the mesh has dim 0 of goes to torch's path; any other, the uneven one, which is
right for ``torch.chunk`` rows as well (an activation that happens to share a parameter's
size only costs the gather). The sizes are global and every rank wraps the same modules, so
every rank decides alike, with no communication. The one guess that can be wrong, a view of
ours that changed the sharded dimension's size (``p.flatten()``), is caught: before torch's
path each rank compares its local sizes along those dims with ``torch.chunk``'s, and a rank
whose rows are not raises (ranks whose rows happen to agree go on and wait), never wrong values.
The op dispatcher's line-up (:func:`redistribute_local_args`), the ``copy_`` handler
(``_copy_rows.py``) and random init (``_random_init.py``) use the same test
(:func:`chunk_rows`), on every registered mesh: 1-D,
HSDP's 2-D and dp x TP ones (the wrap registers each unit's parameter sizes with its mesh).

Not covered: gradients flowing back *into* a parameter through ``full_tensor()``/
``redistribute()`` (``Replicate -> Shard`` in backward produces ``torch.chunk`` rows, not the
parameter's), and ops other than ``copy_`` that combine one of our DTensors with a
``torch.chunk``-sharded one of the same placements (see design.md, "DTensor paths").
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.tensor import Replicate, Shard

from ._uneven_gather import (
    ALTERNATIVE,
    dp_sharded_mesh_dims,
    gather_shard,
    gather_sizes,
    is_shard_like,
)
from ._uneven_meshes import any_mesh_registered, mesh_kind, row_counts_of, tp_dims_of

__all__ = ["chunk_rows", "redistribute_local_args", "redistribute_local_tensor"]

# torch's ``redistribute_local_tensor`` and ``OpDispatcher.redistribute_local_args``, as the
# patch passes them in.
TorchRedistribute = Callable[..., torch.Tensor]
TorchRedistributeArgs = Callable[[Any, Any, bool], None]


def redistribute_local_tensor(
    torch_redistribute: TorchRedistribute, local_tensor: torch.Tensor, current_spec: Any,
    target_spec: Any, **kwargs: Any,
) -> torch.Tensor:
    """``redistribute_local_tensor`` with uneven shards on registered meshes gathered right;
    ``torch_redistribute`` (torch's function) does everything else."""
    mesh = current_spec.mesh
    outer_optim = mesh_kind(mesh) if any_mesh_registered() else None
    if outer_optim is None or mesh != target_spec.mesh:
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)
    source, target = tuple(current_spec.placements), tuple(target_spec.placements)
    tp_dims = tp_dims_of(mesh)
    if tp_dims:
        return _redistribute_2d(torch_redistribute, local_tensor, current_spec, target_spec,
                                tp_dims, **kwargs)
    sharded = dp_sharded_mesh_dims(source, mesh)
    if not sharded or not mesh._is_current_rank_part_of_mesh():
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)
    what = f"redistributing a DTensor {source} -> {target} on {mesh}"
    if any(not source[i].is_shard() for i in sharded):
        raise NotImplementedError(
            f"{what}: a strided shard (_StridedShard) on a mesh used by fully_shard may be "
            f"derived from an uneven shard and cannot be gathered correctly; {ALTERNATIVE}"
        )
    if chunk_rows(local_tensor, current_spec, sharded, what):
        # [Note: deciding by tensor]: no parameter on the mesh has its sharded sizes.
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)
    if len(sharded) > 1:
        if outer_optim:
            raise NotImplementedError(
                f"{what}: on a mesh used with outer_dp_sharding_strategy='optim', fully_shard "
                "holds sub-shards in inner-first order while DTensor's (Shard, Shard) means "
                "outer first, and the two cannot be told apart, so neither is gathered; "
                f"{ALTERNATIVE}"
            )
        # Never ours: on other registered meshes a unit shards over one mesh dimension.
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)
    return _gather_then_torch(torch_redistribute, local_tensor, current_spec, target_spec,
                              sharded[0], what, **kwargs)


def _gather_then_torch(
    torch_redistribute: TorchRedistribute, local_tensor: torch.Tensor, current_spec: Any,
    target_spec: Any, i: int, what: str, **kwargs: Any,
) -> torch.Tensor:
    """The source's uneven mesh dimension ``i`` gathered with the true sizes, then torch's
    redistribution for the rest (nothing to gather when ``i`` and the layout-reading dims keep
    their placements)."""
    mesh = current_spec.mesh
    source, target = tuple(current_spec.placements), tuple(target_spec.placements)
    others_keep_layout = all(
        t == s or (s.is_partial() and t.is_replicate())
        for j, (s, t) in enumerate(zip(source, target)) if j != i
    )
    if source[i] == target[i] and others_keep_layout:
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)
    _refuse_while_tracing(what)
    shard = source[i]
    assert isinstance(shard, Shard)
    dim = shard.dim if shard.dim >= 0 else shard.dim + local_tensor.dim()
    shape = tuple(current_spec.shape) if current_spec.tensor_meta is not None else None
    gathered = gather_shard(local_tensor, mesh, i, dim, shape, what)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    replicated = DTensorSpec(
        mesh, source[:i] + (Replicate(),) + source[i + 1 :], tensor_meta=current_spec.tensor_meta
    )
    if replicated.placements == target:
        return gathered
    return torch_redistribute(gathered, replicated, target_spec, **kwargs)


def _refuse_while_tracing(what: str) -> None:
    """The uneven gather reads every rank's size at run time, which tracing cannot express."""
    from torch.distributed.tensor._redistribute import _are_we_tracing

    if _are_we_tracing():
        raise NotImplementedError(
            f"{what} while tracing (torch.compile / export): fully_shard's shards are uneven "
            "and their gather needs the sizes of every rank at run time; redistribute "
            f"outside the compiled region, or {ALTERNATIVE}"
        )


def _redistribute_2d(
    torch_redistribute: TorchRedistribute, local_tensor: torch.Tensor, current_spec: Any,
    target_spec: Any, tp_dims: tuple[int, ...], **kwargs: Any,
) -> torch.Tensor:
    """A dp x TP mesh ([Note: 2-D parameters] in ``_tp_params.py``): the one dp dimension that
    shards holds uneven rows of the TP-local tensor (``Shard(0)``, or ``_StridedShard(0)`` where
    TP shards dim 0 too: a piece of each TP-local tensor either way), the TP dimensions
    ``torch.chunk`` pieces. Whenever anything changes, the dp dimension is gathered first (the
    TP-local tensor, whatever the TP placements), then torch does the TP part, whose layout is
    its own; a change that leaves the dp dimension and its layout alone (``Partial ->
    Replicate`` over TP) goes to torch as it is, and so does a tensor that cannot hold our
    rows ([Note: deciding by tensor])."""
    mesh = current_spec.mesh
    source, target = tuple(current_spec.placements), tuple(target_spec.placements)
    what = f"redistributing a DTensor {source} -> {target} on {mesh}"
    sharded = dp_sharded_mesh_dims(source, mesh, tp_dims)
    # A plain dp Shard(d) next to a TP Shard(d) is DTensor's nested meaning (dp chunk first,
    # e.g. distribute_tensor on the root mesh), never a unit's (those are _StridedShard): torch's.
    ndim = max(len(current_spec.shape), 1)
    tp_shard_dims = {cast(Any, source[j]).dim % ndim for j in tp_dims if source[j].is_shard()}
    # A dp _StridedShard(d) is a unit's only where TP shards d too; without that (torch's own
    # result, e.g. of a TP-only redistribution to Replicate()) its rows are torch's strided
    # rows, and gathering them as one TP-local piece would reorder them: torch's.
    if not sharded or not mesh._is_current_rank_part_of_mesh() or any(
        cast(Any, source[j]).dim % ndim in tp_shard_dims
        if source[j].is_shard() else cast(Any, source[j]).dim % ndim not in tp_shard_dims
        for j in sharded
    ) or chunk_rows(local_tensor, current_spec, sharded, what):
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)
    # A unit's dp _StridedShard(d) (TP shards d too) redistributed to keep it while TP stops
    # sharding d: the result's rows would be torch's strided rows of the whole tensor, which
    # torch itself gathers wrongly for uneven sizes (2.14: zeros or an error). Refused on every
    # rank alike (the placements are the same everywhere), before any collective.
    target_tp_shard_dims = {
        cast(Any, target[j]).dim % ndim for j in tp_dims if target[j].is_shard()
    }
    if any(
        not target[j].is_shard() and is_shard_like(target[j])
        and cast(Any, target[j]).dim % ndim not in target_tp_shard_dims
        for j in range(len(target)) if j not in tp_dims and mesh.size(j) > 1
    ):
        raise NotImplementedError(
            f"{what}: a strided shard (_StridedShard) over a data-parallel dimension means "
            "fully_shard's rows of a TP-local piece only while TP shards the same tensor "
            "dimension; redistribute the data-parallel dimension too (e.g. to Replicate() on "
            f"every dimension, then to what you need); {ALTERNATIVE}"
        )
    if len(sharded) > 1 and not (sharded == [0, 1] and mesh_kind(mesh)):
        raise NotImplementedError(
            f"{what}: a DTensor sharded over two data-parallel mesh dimensions that are not "
            f"an HSDP outer-optim unit's; {ALTERNATIVE}"
        )
    i = sharded[-1]
    if source[i] == target[i] and all(
        s == t or (s.is_partial() and t.is_replicate()) for s, t in zip(source, target)
    ):
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _refuse_while_tracing(what)
    replicated = tuple(Replicate() if j in sharded else p for j, p in enumerate(source))
    # The gathered tensor is this rank's TP-local tensor: check its size, not the global one.
    tp_local_shape, _ = compute_local_shape_and_global_offset(current_spec.shape, mesh,
                                                              replicated)
    dim = cast(Any, source[i]).dim % local_tensor.dim()
    if len(sharded) > 1:
        # HSDP outer optim: rank (r, s) holds sub-shard s * R + r of the TP-local rows (inner
        # first, see design.md §9), so the outer gather rebuilds inner shard s, the inner one
        # the rest. The only DTensors sharded over both dp dims of a dp x TP mesh are the
        # unit's own (and derived ones); the same spec from distribute_tensor on this 3-D mesh
        # would mean outer first and is read in this order too.
        local_tensor = gather_shard(local_tensor, mesh, 0, dim, None, what)
    gathered = gather_shard(local_tensor, mesh, i, dim, tuple(tp_local_shape), what)
    if replicated == target:
        return gathered
    mid = DTensorSpec(mesh, replicated, tensor_meta=current_spec.tensor_meta)
    return torch_redistribute(gathered, mid, target_spec, **kwargs)


def chunk_rows(local_tensor: torch.Tensor, spec: Any, mesh_dims: list[int], what: str) -> bool:
    """Whether the DTensor (``local_tensor``, ``spec``) on a registered mesh holds DTensor's
    own ``torch.chunk`` rows along its dp-sharded ``mesh_dims``, so torch's path is
    right for it ([Note: deciding by tensor]). Decided from the spec alone
    (the same on every rank); the local sizes are then checked, and a tensor the spec calls
    ``torch.chunk``'s whose rows are not raises on the ranks where they differ."""
    placements = spec.placements
    if any(type(placements[i]) is not Shard for i in mesh_dims):
        return False  # _StridedShard: a unit's dp placement where TP shards dim 0 too
    ndim = max(len(spec.shape), 1)
    dims = {cast(Shard, placements[i]).dim % ndim for i in mesh_dims}
    if any(type(spec.shape[d]) is not int for d in dims):
        return False  # symbolic sizes (tracing): the uneven path, which handles tracing
    counts = row_counts_of(spec.mesh)
    if any(spec.shape[d] in counts for d in dims):
        return False  # may be a unit's parameter, gradient, state or a same-size derivative
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    expected, _ = compute_local_shape_and_global_offset(spec.shape, spec.mesh, placements)
    for d in sorted(dims):
        if local_tensor.shape[d] != expected[d]:
            raise NotImplementedError(
                f"{what}: this rank holds {local_tensor.shape[d]} rows of dim {d}, not the "
                f"{expected[d]} of torch.chunk, though no parameter of fully_shard on this "
                f"mesh has {spec.shape[d]} rows (a view of a parameter that changed the "
                "sharded dimension's size?); redistribute the parameter, or a derived tensor "
                f"of the same size along that dimension, instead, or {ALTERNATIVE}"
            )
    return True


def _anchor_rows(anchors: list[tuple[int, Any]], k: int, local_args: Any,
                 device: torch.device, mesh: Any, what: str) -> list[int]:
    """Every rank's row count along mesh dim ``k`` of the op's sharded arguments (``anchors``:
    (argument index, spec)), from one small all-gather; the anchors must hold the same rows on
    every rank, else their layouts differ and nothing can line up with them."""
    dims = [cast(Any, a.placements[k]).dim % max(a.ndim, 1) for _, a in anchors]
    own = [local_args[j].shape[d] for (j, _), d in zip(anchors, dims)]
    table = gather_sizes(own, device, mesh, k)
    if any(len(set(row)) > 1 for row in table):
        raise ValueError(
            f"{what}: the op's other sharded arguments hold different rows on some rank "
            f"({table}), so their layouts differ (a fully_shard parameter mixed with a "
            "torch.chunk-sharded DTensor?); redistribute one of them to Replicate() first"
        )
    return [row[0] for row in table]


def redistribute_local_args(
    torch_redistribute_args: TorchRedistributeArgs, torch_redistribute: TorchRedistribute,
    op_info: Any, suggested_input_schema: Any, use_val_from_redistribute_schema: bool,
) -> None:
    """The op dispatcher's implicit redistribution of an op's arguments (torch's
    ``torch_redistribute_args``, then a correction). When an argument is turned into ``Shard``
    along a mesh dimension of a registered mesh (e.g. the ``Replicate()`` operand of
    ``param + x``) while another argument stays sharded there (the parameter), torch would cut
    it into ``torch.chunk`` pieces that do not line up with the other argument's rows: cut it at
    that argument's true rows instead (one small all-gather of the sizes)."""
    before = tuple(op_info.local_args)
    torch_redistribute_args(op_info, suggested_input_schema, use_val_from_redistribute_schema)
    if not any_mesh_registered():
        return
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils import _pytree as pytree

    if op_info.args_tree_spec is not None:
        targets = tuple(pytree.tree_leaves(suggested_input_schema.args_schema))
    else:
        targets = tuple(suggested_input_schema.args_schema)
    specs = [
        (i, spec, targets[i]) for i, spec in enumerate(op_info.flat_args_schema)
        if isinstance(spec, DTensorSpec) and isinstance(targets[i], DTensorSpec)
    ]
    todo = [
        (i, src, dst, k) for i, src, dst in specs if src != dst
        for k, (a, b) in enumerate(zip(src.placements, dst.placements))
        if (b.is_shard() or (is_shard_like(b) and k not in tp_dims_of(src.mesh))) and a != b
        and src.mesh.size(k) > 1 and mesh_kind(src.mesh) is not None
    ]
    if not todo:
        return
    local_args = list(op_info.local_args)
    tp_todo = [t for t in todo if tp_dims_of(t[1].mesh)]
    if tp_todo:
        _line_up_2d(torch_redistribute, before, local_args, specs, tp_todo)
    for i, src, dst, k in todo:
        if tp_dims_of(src.mesh):
            continue  # done by _line_up_2d above
        anchors = [
            (j, a_src) for j, a_src, a_dst in specs
            if j != i and a_src.mesh == src.mesh and a_src.placements[k].is_shard()
            and a_dst.placements[k] == a_src.placements[k]
        ]
        if not anchors:
            continue  # nothing to line up with: DTensor's own (torch.chunk) layout is right
        shard = dst.placements[k]
        what = f"implicit redistribution of an argument {src.placements} -> {dst.placements}"
        if all(chunk_rows(before[j], a, [k], what) for j, a in anchors):
            continue  # the anchors hold torch.chunk rows: torch's cut lines up with them
        if sum(1 for n, p in enumerate(dst.placements) if is_shard_like(p)
               and src.mesh.size(n) > 1) > 1:
            raise NotImplementedError(
                f"{what} on a mesh used by fully_shard: sharding over two mesh dimensions "
                f"cannot line up with fully_shard's uneven shards; {ALTERNATIVE}"
            )
        # Every anchor's size along its sharded dim, on every rank (one small all-gather): the
        # anchors must agree with each other on every rank, and tile the target dimension.
        sizes = _anchor_rows(anchors, k, op_info.local_args, before[i].device, src.mesh, what)
        dim = cast(Shard, shard).dim % dst.ndim
        if sum(sizes) != dst.shape[dim]:
            raise ValueError(
                f"{what}: the sharded argument's rows {sizes} do not tile dim {dim} of shape "
                f"{tuple(dst.shape)}; redistribute the arguments to Replicate() first"
            )
        mid = DTensorSpec(
            src.mesh, dst.placements[:k] + (Replicate(),) + dst.placements[k + 1 :],
            tensor_meta=src.tensor_meta,
        )
        full = redistribute_local_tensor(torch_redistribute, before[i], src, mid)
        rank = src.mesh.get_local_rank(k)
        offset = sum(sizes[:rank])
        local_args[i] = full.narrow(dim, offset, sizes[rank]).contiguous()
    op_info.local_args = tuple(local_args)


def _line_up_2d(
    torch_redistribute: TorchRedistribute, before: tuple[Any, ...], local_args: list[Any],
    specs: list[tuple[int, Any, Any]], todo: list[tuple[int, Any, Any, int]],
) -> None:
    """:func:`redistribute_local_args` on a dp x TP mesh ([Note: 2-D parameters] in
    ``_tp_params.py``): an argument turned into a unit's placements (``t.copy_(replicated)``,
    torchtitan's fused-QKV init; ``p + replicated_x``) next to an argument that keeps its dp
    shard. The TP dims are DTensor's own ``torch.chunk`` pieces, so torch's cut is right there;
    the one data-parallel dim that changes is cut at the other argument's true rows of the
    TP-local tensor instead: the argument redistributed to ``Replicate()`` on that dp dim (the
    TP-local tensor; through :func:`redistribute_local_tensor`, so a dp-sharded source is
    gathered right), then narrowed (one small all-gather of the rows)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    by_arg: dict[int, tuple[Any, Any, list[int]]] = {}
    for i, src, dst, k in todo:
        if k not in tp_dims_of(src.mesh):
            by_arg.setdefault(i, (src, dst, []))[2].append(k)
    for i, (src, dst, ks) in by_arg.items():
        mesh, tp_dims = src.mesh, tp_dims_of(src.mesh)
        what = f"implicit redistribution of an argument {src.placements} -> {dst.placements}"
        ndim = max(dst.ndim, 1)
        tp_shard_dims = {cast(Any, dst.placements[j]).dim % ndim for j in tp_dims
                         if dst.placements[j].is_shard()}
        k = ks[0]
        target = dst.placements[k]
        dim = cast(Any, target).dim % ndim
        if target.is_shard() and dim in tp_shard_dims:
            continue  # DTensor's nested meaning (dp chunk first), never a unit's: torch's cut
        anchors = [
            (j, a_src) for j, a_src, a_dst in specs
            if j != i and a_src.mesh == mesh and is_shard_like(a_src.placements[k])
            and a_dst.placements[k] == a_src.placements[k]
        ]
        if not anchors:
            continue  # nothing to line up with: DTensor's own (torch.chunk) layout is right
        if all(chunk_rows(before[j], a, [k], what) for j, a in anchors):
            continue  # the anchors hold torch.chunk rows: torch's cut lines up with them
        if len(ks) > 1:
            raise NotImplementedError(
                f"{what} on a dp x TP mesh used by fully_shard: sharding over two "
                f"data-parallel mesh dimensions cannot line up with fully_shard's uneven "
                f"shards; {ALTERNATIVE}"
            )
        sizes = _anchor_rows(anchors, k, local_args, before[i].device, mesh, what)
        mid = DTensorSpec(
            mesh, dst.placements[:k] + (Replicate(),) + dst.placements[k + 1 :],
            tensor_meta=src.tensor_meta,
        )
        tp_local = redistribute_local_tensor(torch_redistribute, before[i], src, mid)
        if sum(sizes) != tp_local.shape[dim]:
            raise ValueError(
                f"{what}: the sharded argument's rows {sizes} do not tile dim {dim} of its "
                f"tensor-parallel piece {tuple(tp_local.shape)}; redistribute the arguments "
                "to Replicate() first"
            )
        rank = mesh.get_local_rank(k)
        local_args[i] = tp_local.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()
