"""DTensor redistribution of the library's uneven shards: ``full_tensor()``, ``redistribute()``,
torch's full state dicts and the implicit redistributions of DTensor's op dispatch give the right
values for DTensors on a mesh that ``fully_shard`` shards over, or raise. Installed once, at the
first ``fully_shard``; DTensors on other meshes take torch's path untouched.

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
:func:`_gather_shard` does, over the mesh dimension's own process group.

Every redistribution goes through
``torch.distributed.tensor._redistribute.redistribute_local_tensor`` (explicit ones from
``Redistribute``, backward ones from ``NestedRedistribute``, implicit ones from the op
dispatcher in ``_dispatch.py``, ``from_local``'s backward in ``_api.py``; modules that imported
it by name hold their own reference, so each is patched). The replacement
(:func:`_redistribute_local_tensor`) calls the original for everything that is not on a mesh
registered by ``fully_shard`` (:func:`register_mesh`). On a registered mesh, when the source is
sharded (``Shard``) along exactly one mesh dimension of size > 1 and that dimension's placement
changes, it first gathers along that dimension with the true sizes, then hands the result (now
``Replicate()`` there) to the original for the rest, which is then layout-independent: a
``Replicate -> Shard`` produces ``torch.chunk`` pieces, DTensor's own meaning of ``Shard``, and
partial reductions along other dimensions run over equal shapes. A transform that leaves the
sharded dimension as it is (e.g. ``(Partial(), Shard(0)) -> (Replicate(), Shard(0))``) goes to
the original unchanged: it never reads the row layout.

The decision depends only on the specs (mesh, placements), which every rank shares, so every
rank takes the same branch and issues the same collectives: no deadlock.

Refused with ``NotImplementedError`` (before any collective; every rank raises):

* ``(Shard(0), Shard(0))`` on a 2-D mesh used with ``outer_dp_sharding_strategy="optim"``:
  rank (r, s) holds sub-shard ``s * R + r`` (inner first), while DTensor's nested ``Shard``
  means outer first; a ``distribute_tensor`` result on the same mesh is outer first, and the
  spec cannot tell the two apart, so neither can be gathered safely. The library's
  ``checkpoint.get_full_state_dict`` / ``get_state_dict`` handle these units.
* ``_StridedShard`` sources on a registered mesh (a view of an uneven shard has no strided
  equivalent);
* any of the above while tracing (``torch.compile``/export of DTensor code): the size exchange
  is data dependent. The library's own forward/backward runs on plain compute parameters and
  never reaches DTensor redistribution.

Three more places read the rows through the spec alone, and are handled here too: the op
dispatcher's implicit redistribution of an argument *into* ``Shard`` next to one of ours
(``p + replicated_x``: :func:`_redistribute_local_args` cuts it at our rows), ``copy_`` between
two DTensors of the same placements but different rows (``p.copy_(distribute_tensor(...))``:
:func:`_copy_handler`), and torch's full optimizer state dict, which pairs each rank's states in
its own order while a rank with an empty shard of a parameter has no state for it
(:func:`_get_optim_state_dict` refuses that case on every rank before any gather).

Not covered: gradients flowing back *into* a parameter through ``full_tensor()``/
``redistribute()`` (``Replicate -> Shard`` in backward produces ``torch.chunk`` rows, not the
parameter's), and ops other than ``copy_`` that combine one of our DTensors with a
``torch.chunk``-sharded one of the same placements (see design.md, "DTensor paths").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from .. import _registry

__all__ = ["install", "mesh_is_registered", "register_mesh"]

# Modules that hold ``redistribute_local_tensor`` under that name (imported by name, or the
# defining module itself). A module missing from a torch version is skipped.
_PATCHED_MODULES = (
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._api",
    "torch.distributed.tensor._dispatch",
    "torch.distributed.tensor.experimental._tp_transform",
)
_NAME = "redistribute_local_tensor"
_original: list[Callable[..., torch.Tensor]] = []  # the torch function, once installed
_original_args: list[Callable[..., None]] = []  # OpDispatcher.redistribute_local_args
_original_optim_sd: list[Callable[..., Any]] = []  # state_dict._get_optim_state_dict

_ALTERNATIVE = (
    "use megatron_fsdp_v2.checkpoint.get_full_state_dict(model) for full weights, or "
    "megatron_fsdp_v2.checkpoint.get_state_dict / save for weights with optimizer state"
)


def register_mesh(mesh: DeviceMesh, *, outer_optim: bool) -> None:
    """Mark ``mesh`` as one whose ``Shard`` DTensors may hold uneven row ranges (see
    [Note: uneven redistribution]); ``outer_optim``: a 2-D mesh whose units shard over both
    dimensions in inner-first order. Installs the interception (once)."""
    install()
    for entry in _registry.uneven_meshes:
        if entry[0] is mesh:
            entry[1] = entry[1] or outer_optim
            return
    _registry.uneven_meshes.append([mesh, outer_optim])


def mesh_is_registered(mesh: DeviceMesh) -> bool:
    """Whether ``fully_shard`` shards over ``mesh`` (its ``Shard`` DTensors may be uneven)."""
    return _mesh_kind(mesh) is not None


def _mesh_kind(mesh: DeviceMesh) -> bool | None:
    """``None``: not registered; else whether it is an outer-optim mesh."""
    found: bool | None = None
    for registered, outer_optim in _registry.uneven_meshes:
        if registered is mesh or registered == mesh:
            found = bool(found) or outer_optim
    return found


def install() -> None:
    """Replace ``redistribute_local_tensor`` in every module that holds it, wrapping the
    original. Idempotent."""
    if _original:
        return
    from torch.distributed.tensor import _redistribute

    original = _redistribute.redistribute_local_tensor
    _original.append(original)
    for name in _PATCHED_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, _NAME, None) is original:
            setattr(module, _NAME, _redistribute_local_tensor)
    from torch.distributed.tensor._dispatch import OpDispatcher

    _original_args.append(OpDispatcher.redistribute_local_args)
    OpDispatcher.redistribute_local_args = staticmethod(  # type: ignore[method-assign]
        _redistribute_local_args
    )
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    if torch.ops.aten.copy_.default not in handlers:  # torch has none of its own (2.14)
        handlers[torch.ops.aten.copy_.default] = _copy_handler
    from . import _random_init  # nn.init.* on our shards: see [Note: random init of ...]

    _random_init.install()
    from torch.distributed.checkpoint import state_dict as dsd

    _original_optim_sd.append(dsd._get_optim_state_dict)
    dsd._get_optim_state_dict = _get_optim_state_dict
    from . import _torch_full_state_dict  # full-state-dict loads: see [Note: torch's full-...]

    _torch_full_state_dict.install()


def _is_shard_like(placement: Placement) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def _redistribute_local_tensor(
    local_tensor: torch.Tensor, current_spec: Any, target_spec: Any, **kwargs: Any
) -> torch.Tensor:
    """``redistribute_local_tensor`` with uneven shards on registered meshes gathered right."""
    original = _original[0]
    mesh = current_spec.mesh
    outer_optim = _mesh_kind(mesh) if _registry.uneven_meshes else None
    if outer_optim is None or mesh != target_spec.mesh:
        return original(local_tensor, current_spec, target_spec, **kwargs)
    source, target = tuple(current_spec.placements), tuple(target_spec.placements)
    sharded = [i for i, p in enumerate(source) if _is_shard_like(p) and mesh.size(i) > 1]
    if not sharded or not mesh._is_current_rank_part_of_mesh():
        return original(local_tensor, current_spec, target_spec, **kwargs)
    what = f"redistributing a DTensor {source} -> {target} on {mesh}"
    if any(not source[i].is_shard() for i in sharded):
        raise NotImplementedError(
            f"{what}: a strided shard (_StridedShard) on a mesh used by fully_shard may be "
            f"derived from an uneven shard and cannot be gathered correctly; {_ALTERNATIVE}"
        )
    if len(sharded) > 1:
        if outer_optim:
            raise NotImplementedError(
                f"{what}: on a mesh used with outer_dp_sharding_strategy='optim', fully_shard "
                "holds sub-shards in inner-first order while DTensor's (Shard, Shard) means "
                "outer first, and the two cannot be told apart, so neither is gathered; "
                f"{_ALTERNATIVE}"
            )
        # Never ours: on other registered meshes a unit shards over one mesh dimension.
        return original(local_tensor, current_spec, target_spec, **kwargs)
    i = sharded[0]
    others_keep_layout = all(
        t == s or (s.is_partial() and t.is_replicate())
        for j, (s, t) in enumerate(zip(source, target)) if j != i
    )
    if source[i] == target[i] and others_keep_layout:
        return original(local_tensor, current_spec, target_spec, **kwargs)
    from torch.distributed.tensor._redistribute import _are_we_tracing

    if _are_we_tracing():
        raise NotImplementedError(
            f"{what} while tracing (torch.compile / export): fully_shard's shards are uneven "
            "and their gather needs the sizes of every rank at run time; redistribute "
            f"outside the compiled region, or {_ALTERNATIVE}"
        )
    shard = source[i]
    assert isinstance(shard, Shard)
    dim = shard.dim if shard.dim >= 0 else shard.dim + local_tensor.dim()
    shape = tuple(current_spec.shape) if current_spec.tensor_meta is not None else None
    gathered = _gather_shard(local_tensor, mesh, i, dim, shape, what)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    replicated = DTensorSpec(
        mesh, source[:i] + (Replicate(),) + source[i + 1 :], tensor_meta=current_spec.tensor_meta
    )
    if replicated.placements == target:
        return gathered
    return original(gathered, replicated, target_spec, **kwargs)


def _signature(local: torch.Tensor, dim: int, shape: tuple[int, ...] | None) -> list[int]:
    """What every rank of one gather must agree on, after this rank's size along ``dim``: the
    global shape (``-2`` when unknown), the rank and the element type."""
    global_shape = list(shape) if shape is not None else [-2] * local.dim()
    dtype = local.dtype
    return [
        local.shape[dim], local.dim(), dtype.itemsize, int(dtype.is_floating_point),
        int(dtype.is_complex), *(global_shape + [-1] * (_MAX_DIMS - len(global_shape))),
    ]


_MAX_DIMS = 8


def _gather_shard(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int,
    shape: tuple[int, ...] | None, what: str,
) -> torch.Tensor:
    """Concatenate along ``dim`` the local tensors of the ranks along ``mesh_dim``, in mesh
    order, whatever their sizes: two all-gathers (the sizes with a signature of the tensor,
    then the padded shards)."""
    group = mesh.get_group(mesh_dim)
    n = mesh.size(mesh_dim)
    if local.dim() > _MAX_DIMS:
        raise NotImplementedError(f"{what}: more than {_MAX_DIMS} dimensions; {_ALTERNATIVE}")
    own = torch.tensor(_signature(local, dim, shape), dtype=torch.int64, device=local.device)
    everyone = torch.empty(n * own.numel(), dtype=torch.int64, device=local.device)
    dist.all_gather_into_tensor(everyone, own, group=group)
    rows = everyone.view(n, -1).tolist()
    sizes = [int(r[0]) for r in rows]
    # Every rank sees the same rows, so every rank raises together below.
    if any(r[1:] != rows[0][1:] for r in rows):
        raise RuntimeError(
            f"{what}: the ranks along mesh dimension {mesh_dim} are gathering different "
            "tensors (global shape or dtype differ), so nothing was gathered. A fully_shard "
            "rank whose shard of a parameter is empty has grad None and no optimizer state for "
            "it, so code that walks gradients or optimizer states rank by rank (e.g. torch's "
            "get_optimizer_state_dict(full_state_dict=True)) pairs different tensors; "
            f"{_ALTERNATIVE}"
        )
    if shape is not None and sum(sizes) != shape[dim]:
        raise RuntimeError(
            f"{what}: the local tensors along mesh dimension {mesh_dim} hold {sizes} entries "
            f"of dim {dim}, which do not add up to the global size {shape[dim]}: they are not "
            f"a partition of the tensor; {_ALTERNATIVE}"
        )
    rows_first = local.movedim(dim, 0)
    most = max(sizes)
    padded = rows_first.new_zeros((most, *rows_first.shape[1:]))
    padded[: rows_first.shape[0]].copy_(rows_first)
    out = rows_first.new_empty((n * most, *rows_first.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    pieces = [out[k * most : k * most + size] for k, size in enumerate(sizes)]
    return torch.cat(pieces).movedim(0, dim).contiguous()


def _gather_sizes(
    own: list[int], device: torch.device, mesh: DeviceMesh, mesh_dim: int
) -> list[list[int]]:
    """``own`` of every rank along ``mesh_dim``, in mesh order (one all-gather)."""
    n = mesh.size(mesh_dim)
    mine = torch.tensor(own, dtype=torch.int64, device=device)
    out = torch.empty(n * len(own), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=mesh.get_group(mesh_dim))
    return [[int(v) for v in row] for row in out.view(n, -1).tolist()]


def _redistribute_local_args(
    op_info: Any, suggested_input_schema: Any, use_val_from_redistribute_schema: bool
) -> None:
    """The op dispatcher's implicit redistribution of an op's arguments. When an argument is
    turned into ``Shard`` along a mesh dimension of a registered mesh (e.g. the ``Replicate()``
    operand of ``param + x``) while another argument stays sharded there (the parameter),
    torch would cut it into ``torch.chunk`` pieces that do not line up with the other
    argument's rows: cut it at that argument's true rows instead (one small all-gather of the
    sizes). Everything else is torch's."""
    original = _original_args[0]
    before = tuple(op_info.local_args)
    original(op_info, suggested_input_schema, use_val_from_redistribute_schema)
    if not _registry.uneven_meshes:
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
        if b.is_shard() and a != b and src.mesh.size(k) > 1 and _mesh_kind(src.mesh) is not None
    ]
    if not todo:
        return
    local_args = list(op_info.local_args)
    for i, src, dst, k in todo:
        anchors = [
            (j, a_src) for j, a_src, a_dst in specs
            if j != i and a_src.mesh == src.mesh and a_src.placements[k].is_shard()
            and a_dst.placements[k] == a_src.placements[k]
        ]
        if not anchors:
            continue  # nothing to line up with: DTensor's own (torch.chunk) layout is right
        shard = dst.placements[k]
        what = f"implicit redistribution of an argument {src.placements} -> {dst.placements}"
        if sum(1 for n, p in enumerate(dst.placements) if _is_shard_like(p)
               and src.mesh.size(n) > 1) > 1:
            raise NotImplementedError(
                f"{what} on a mesh used by fully_shard: sharding over two mesh dimensions "
                f"cannot line up with fully_shard's uneven shards; {_ALTERNATIVE}"
            )
        # Every anchor's size along its sharded dim, on every rank (one small all-gather): the
        # anchors must agree with each other on every rank, and tile the target dimension.
        dims = [cast(Shard, a.placements[k]).dim % a.ndim for _, a in anchors]
        own = [op_info.local_args[j].shape[d] for (j, _), d in zip(anchors, dims)]
        table = _gather_sizes(own, before[i].device, src.mesh, k)
        dim = cast(Shard, shard).dim % dst.ndim
        sizes = [row[0] for row in table]
        if any(len(set(row)) > 1 for row in table):
            raise ValueError(
                f"{what}: the op's other sharded arguments hold different rows on some rank "
                f"({table}), so their layouts differ (a fully_shard parameter mixed with a "
                "torch.chunk-sharded DTensor?); redistribute one of them to Replicate() first"
            )
        if sum(sizes) != dst.shape[dim]:
            raise ValueError(
                f"{what}: the sharded argument's rows {sizes} do not tile dim {dim} of shape "
                f"{tuple(dst.shape)}; redistribute the arguments to Replicate() first"
            )
        mid = DTensorSpec(
            src.mesh, dst.placements[:k] + (Replicate(),) + dst.placements[k + 1 :],
            tensor_meta=src.tensor_meta,
        )
        full = _redistribute_local_tensor(before[i], src, mid)
        rank = src.mesh.get_local_rank(k)
        offset = sum(sizes[:rank])
        local_args[i] = full.narrow(dim, offset, sizes[rank]).contiguous()
    op_info.local_args = tuple(local_args)


def _get_optim_state_dict(model: Any, optimizers: Any, info: Any) -> Any:
    """torch's full optimizer state dict gathers each state tensor rank by rank, in the order of
    each rank's own ``optimizer.state``. A rank whose shard of a parameter is empty has no
    gradient, hence no state, for it, so the ranks would pair different tensors: refuse, on every
    rank, before any gather (one small all-reduce per library process group)."""
    original = _original_optim_sd[0]
    if getattr(info, "full_state_dict", False) and getattr(info, "handle_optim", True):
        for optimizer in optimizers:
            _check_states_everywhere(optimizer)
    return original(model, optimizers, info)


def _check_states_everywhere(optimizer: torch.optim.Optimizer) -> None:
    """Raise on every rank when some rank lacks state for a sharded parameter others have."""
    from .._buffers._plan import Extent

    # Per process group over which the parameters' shards differ: (name, has state), device.
    by_group: dict[Any, tuple[list[tuple[str, bool]], torch.device]] = {}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            record = _registry.record_of(param)
            if record is None or record.group.plan.optimizer_placement is Extent.FULL:
                continue
            entries, _ = by_group.setdefault(
                record.group.norm_process_group, ([], record.group.device)
            )
            entries.append((record.fqn, bool(optimizer.state.get(param))))
    for group, (entries, device) in by_group.items():
        flags = torch.tensor([int(has) for _, has in entries], dtype=torch.int64, device=device)
        lowest, highest = flags.clone(), flags.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
        uneven = [name for (name, _), lo, hi in zip(entries, lowest.tolist(), highest.tolist())
                  if lo != hi]
        if uneven:
            raise NotImplementedError(
                f"get_optimizer_state_dict(full_state_dict=True): optimizer state of "
                f"{uneven[:3]}{' ...' if len(uneven) > 3 else ''} exists on some ranks only "
                "(a fully_shard rank whose shard of a parameter is empty has no gradient and "
                "no optimizer state for it), so torch would gather different tensors together; "
                f"nothing was gathered. {_ALTERNATIVE}"
            )


def _copy_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dst.copy_(src)`` for DTensors. Same placements do not mean same rows: one of ours and a
    ``torch.chunk`` one (``distribute_tensor``) differ, and DTensor would copy local tensor to
    local tensor, silently (a 0- or 1-row local tensor broadcasts). On a registered mesh, when
    ``src`` is sharded like ``dst`` along one mesh dimension and does not carry the rows marker
    of the library's own state-dict conversions, compare both tensors' sizes on every rank (one
    small all-gather); if they differ, gather ``src`` and keep ``dst``'s rows."""
    from torch.distributed.tensor import DTensor

    from ._state_dict import ROWS_ATTR

    handlers = DTensor._op_dispatcher._custom_op_handlers
    dst, src = args[0], args[1]
    dims = _copy_needs_check(dst, src)
    if dims is None or hasattr(src._local_tensor, ROWS_ATTR):
        # torch's own path: take the handler out for the nested dispatch.
        del handlers[op_call]
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[op_call] = _copy_handler
    k, dim = dims
    mesh = dst.device_mesh
    what = f"DTensor copy_ of {src.placements} into {dst.placements}"
    if _mesh_kind(mesh) and sum(1 for n, p in enumerate(dst.placements)
                                if _is_shard_like(p) and mesh.size(n) > 1) > 1:
        raise NotImplementedError(
            f"{what} on a mesh used with outer_dp_sharding_strategy='optim': the two may hold "
            f"their sub-shards in different orders; {_ALTERNATIVE}, and "
            "megatron_fsdp_v2.checkpoint.load_full_state_dict to load full weights"
        )
    table = _gather_sizes(
        [dst._local_tensor.shape[dim], src._local_tensor.shape[dim]], dst._local_tensor.device,
        mesh, k,
    )
    if all(a == b for a, b in table):
        del handlers[op_call]
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[op_call] = _copy_handler
    if sum(row[1] for row in table) != dst.shape[dim]:
        raise ValueError(f"{what}: source rows {[r[1] for r in table]} do not tile dim {dim}")
    replicated = src._spec.placements[:k] + (Replicate(),) + src._spec.placements[k + 1 :]
    full = src.redistribute(mesh, replicated).to_local()  # the right gather (see above)
    rank = mesh.get_local_rank(k)
    offset = sum(row[0] for row in table[:rank])
    rows = full.narrow(dim, offset, table[rank][0])
    dst._local_tensor.copy_(rows, *args[2:], **kwargs)
    return dst


def _copy_needs_check(dst: Any, src: Any) -> tuple[int, int] | None:
    """(mesh dim, tensor dim) of the one sharded mesh dimension of two DTensors on a registered
    mesh with the same placements; None when there is nothing to check."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(dst, DTensor) and isinstance(src, DTensor)) or not _registry.uneven_meshes:
        return None
    mesh = dst.device_mesh
    if src.device_mesh != mesh or src.placements != dst.placements or dst.shape != src.shape:
        return None
    if _mesh_kind(mesh) is None:
        return None
    sharded = [
        (k, cast(Shard, p).dim % dst.ndim) for k, p in enumerate(dst.placements)
        if p.is_shard() and mesh.size(k) > 1
    ]
    return sharded[-1] if sharded else None
