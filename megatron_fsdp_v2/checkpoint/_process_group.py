"""Which process group the checkpoint code communicates on, and its cross-rank agreement: every
collective the ``checkpoint`` package issues for a model goes through here.

[Note: checkpoint collectives]
Every collective of the training step runs on the units' communication group
(``FlatParamGroup.process_group``), which carries ``fully_shard``'s collective timeout (see
``[Note: collective timeout]``). The checkpoint code uses the same group, so a rank that never
reaches a checkpoint call (it raised, or is stuck in user code) makes the others fail after that
timeout, not the default group's:

* :func:`model_process_group`: the group of the model's first unit, in
  ``model.modules()`` order, that
  owns parameters (the root unit when it does) and whose mesh covers all of the model's ranks.
  All units of a model on one 1-D mesh cover the same ranks, whatever their timeouts. Expert
  parallelism puts units on a part of the ranks (each EP rank's experts on its ``edp``
  sub-mesh, dense units on the world): accepted when every parameter of such a unit is an
  expert declared with ``register_experts`` (the checkpoint stores it under its global name,
  see [Note: expert names in checkpoints] in ``_runtime/_expert_names.py``), and the model's
  group is then the dense units' (the world's). Any other unit on a part of the ranks, or units
  none of which covers the others' ranks, is rejected with a ``ValueError`` before any
  collective (:func:`widest_unit`, which ``save`` and ``load`` also run with a caller's
  ``process_group``). Only callers that store experts under global names accept expert units
  (``model_process_group(model, experts=True)``); others (``iter_full_weights``) keep the
  ``ValueError`` for units over different ranks. A model with no unit (nothing wrapped) has
  no group: ``None``, the default group. ``set_state_dict``'s agreement, ``load_full_state_dict``'s
  agreement and broadcast, and ``get_full_state_dict``'s choice of the receiving rank use it;
  "rank 0" there is the group's first rank (global rank 0 when the mesh spans the job).
  ``get_full_state_dict``'s all-gathers run on each flat group's own group (the same one).
* :func:`dcp_process_group`: ``save`` and ``load`` hand a group to ``dcp.save``/``dcp.load``, which
  issue their own collectives on it, and run their agreement, commit and checksum collectives
  on the same group (the two must involve the same ranks, or a failure agreed on one group
  would leave ranks of the other inside DCP). A caller's ``process_group`` keeps DCP's meaning
  and is used as given. Without one, DCP would use the default group over the whole job; the
  model's group is used instead when it covers the whole job (same ranks, plus the timeout).
  A model on a sub-mesh (``mesh["dp"]`` of a larger mesh) keeps DCP's default group: a
  checkpoint then spans every rank of the job (e.g. every pipeline stage), and the sub-mesh's
  group does not include them all. The timeout then bounds each wait inside a save or load,
  including the wait for the slowest rank's writes and checksum reads: a checkpoint whose
  per-rank I/O takes longer than ``fully_shard``'s ``timeout`` needs a larger ``timeout`` or an
  explicit ``process_group``.

HSDP (a 2-D mesh, outer ``no_shard``): the units' inner group covers one replica's S ranks
only, not the job, so it cannot carry agreements that every rank of the mesh must join, nor
DCP's coordination. :func:`model_process_group` then returns
:func:`hsdp_mesh_process_group`: a group over every rank
of the 2-D mesh with the units' timeout (created on the first checkpoint call that needs it, by
every rank of the mesh, like every checkpoint collective; cached with the units' groups under
the axis ``"mesh"``). Everything above then applies unchanged with "the units' group" read as
that whole-mesh group: the agreements, ``load_full_state_dict``'s broadcast (so it reaches every
rank, inner and outer), "rank 0" (the mesh's lowest global rank, global rank 0 when the mesh
spans the job), and :func:`dcp_process_group` (the whole-mesh group when it covers the job,
else DCP's
default group). Only ``get_full_state_dict``'s all-gathers stay on each flat group's own
(inner) group: every replica holds the same inner shards, so each replica gathers its own copy
and no outer collective is needed.

Collectives that are not ours keep their own groups: ``DTensor.full_tensor()`` of a DTensor
``fully_shard`` does not manage (e.g. an ignored tensor-parallel weight) runs on that DTensor's
mesh.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from .. import _registry
from .._comm._process_groups import whole_mesh_process_group
from .._runtime._expert_names import unit_ranks
from ._experts import ExpertNames, check_claims, global_rank, narrow_unit_error

__all__ = [
    "Failure",
    "all_gather",
    "broadcast_from_coordinator",
    "check_same_path",
    "coordinator",
    "dcp_process_group",
    "describe",
    "gather_to_coordinator",
    "hsdp_mesh_process_group",
    "model_process_group",
    "widest_unit",
    "no_checkpoint_exception",
    "raise_first",
    "raise_if_any_rank",
    "rank_and_size",
]

# A rank-local failure, agreed across ranks: the exception type to raise and its message.
Failure = tuple[type[Exception], str]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def hsdp_mesh_process_group(group: Any) -> dist.ProcessGroup:
    """A process group over every rank of ``group``'s 2-D (HSDP) mesh, with the collective
    timeout of its inner communication group (see the note at the top). Collective over the
    mesh's ranks on its first call for a (ranks, timeout, backend); cached afterwards."""
    inner = group.process_group
    timeout_s: float | None = None
    for key, cached in _registry.process_groups.items():
        # The inner group's own key (a reused mesh group may be cached under other axes too).
        if cached is inner and key[3] == "shard" and key[1] >= 0:
            timeout_s = key[1]
            break
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    return whole_mesh_process_group(group.mesh, timeout)


def model_process_group(model: nn.Module, *, experts: bool = False) -> dist.ProcessGroup | None:
    """The communication group of ``model``'s units (see the note at the top), ``None`` when
    it has none or ``torch.distributed`` is not initialized. For units on a 2-D (HSDP) mesh:
    the group over the whole mesh (:func:`hsdp_mesh_process_group`), not the inner group.
    With expert
    parallelism (units whose meshes cover a part of the model's ranks, each holding registered
    experts only): the group of the first unit over all of the model's ranks, for callers that
    store experts under their global names (``experts=True``); other callers (e.g.
    ``iter_full_weights``, which would stream one EP rank's experts under local names) get the
    ``ValueError`` for units over different ranks."""
    if not _distributed():
        return None
    chosen = widest_unit(model, experts=experts)
    if chosen is None:
        return None
    if chosen.mesh.ndim > 1:
        return hsdp_mesh_process_group(chosen)
    return chosen.process_group


def widest_unit(model: nn.Module, *, experts: bool = True) -> Any:
    """The first flat group (in module order) whose mesh covers all of the model's ranks
    (``None`` without units), after checking the layout a checkpoint accepts: every unit on
    meshes of one dimension, every unit's ranks a part of the chosen one's, and units on a
    strict part holding registered experts only (else a ``ValueError`` naming the first
    parameter that is not). Local: no collective, the same answer on every rank."""
    units = [(name or "<root>", group) for name, state in _registry.unit_states(model)
             for group in state.groups]
    if not units:
        return None
    first_name, first = units[0]
    for name, group in units:
        if group.mesh.ndim != first.mesh.ndim:
            raise ValueError(
                f"the units of this model live on meshes of different dimensions "
                f"({name}: {group.mesh.ndim}-D, {first_name}: {first.mesh.ndim}-D); "
                "megatron_fsdp_v2's checkpoint functions need every unit of a model on the "
                "same mesh, or expert units on a part of its ranks"
            )
    ranks = {id(group): unit_ranks(group) for _, group in units}
    wider = frozenset().union(*ranks.values())
    chosen = next((group for _, group in units if ranks[id(group)] == wider), None)
    if chosen is None:
        shown = {tuple(sorted(ranks[id(g)])): name for name, g in units}
        listed = ", ".join(f"{name}: {list(r)}" for r, name in list(shown.items())[:3])
        raise ValueError(
            f"the units of this model communicate over different ranks ({listed}) and none "
            "covers all of them; megatron_fsdp_v2's checkpoint functions need every unit of a "
            "model on the same mesh, or expert units on a part of the ranks of the others"
        )
    narrow = {id(g): (ranks[id(g)], name) for name, g in units if ranks[id(g)] < wider}
    if narrow and not experts:
        unit_ranks_, unit = next(iter(narrow.values()))
        raise ValueError(
            f"the units of this model communicate over different ranks (unit '{unit}': "
            f"{sorted(unit_ranks_)}, the model: {sorted(wider)}); this function needs every "
            "unit of a model on the same mesh. Expert-parallel models go through "
            "megatron_fsdp_v2.checkpoint's save/load, get_state_dict/set_state_dict and the "
            "full-state-dict functions, after checkpoint.register_experts"
        )
    error = narrow_unit_error(model, narrow, wider)
    if error is not None:
        raise ValueError(error)
    return chosen


def dcp_process_group(
    model: nn.Module, process_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The group ``save``/``load`` pass to DCP and coordinate on (see the note at the top):
    ``process_group`` when given, else the model's group when it covers the whole job, else
    ``None`` (DCP's default group)."""
    if process_group is not None:
        return process_group
    group = model_process_group(model, experts=True)
    if group is not None and dist.get_world_size(group) == dist.get_world_size():
        return group
    return None


def rank_and_size(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank and the size, within ``process_group`` (``None``: the default group)."""
    if _distributed():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def coordinator(process_group: dist.ProcessGroup | None) -> int:
    """Global rank of the group's rank 0: DCP's coordinator (which writes ``.metadata``), the
    source of broadcasts and the receiver of full state dicts."""
    if process_group is None or not _distributed():
        return 0
    return dist.get_global_rank(process_group, 0)


def all_gather(obj: Any, process_group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in rank order (one ``all_gather_object``; none on a single rank)."""
    _, size = rank_and_size(process_group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=process_group)
    return out


def gather_to_coordinator(obj: Any, process_group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on the group's rank 0, ``None`` elsewhere."""
    rank, size = rank_and_size(process_group)
    if size == 1:
        return [obj]
    out: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(obj, out, dst=coordinator(process_group), group=process_group)
    return out


def broadcast_from_coordinator(obj: Any, process_group: dist.ProcessGroup | None) -> Any:
    """The group's rank-0 ``obj`` on every rank."""
    if rank_and_size(process_group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=coordinator(process_group), group=process_group)
    return box[0]


def raise_if_any_rank(error: str | None, process_group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every rank of ``process_group`` when any rank found ``error`` (the
    lowest such rank's message), so a check that fails on some ranks cannot leave the others in a
    collective."""
    error = next((e for e in all_gather(error, process_group) if e is not None), None)
    if error is not None:
        raise ValueError(error)


def check_same_path(path: str | os.PathLike | None, process_group: dist.ProcessGroup | None,
                    what: str, experts: ExpertNames | None = None) -> set[tuple[str, str]]:
    """Raise ``ValueError`` on every rank of ``process_group`` unless every rank names the same
    checkpoint location (one ``all_gather_object``). A distributed checkpoint is one directory
    that every rank writes its shard files into, beside the one ``.metadata`` the coordinator
    writes; a rank-dependent path (``f"ckpt_rank{rank}"``) would let the coordinator commit a
    checkpoint whose other shards are elsewhere, which no load can read.

    The same gather carries each rank's registered experts (``experts``), whose global names
    must fit together (``_experts.check_claims``); returns every rank's ``(container, global
    name)`` pairs (empty without registered experts)."""
    key = None if path is None else (
        str(path) if "://" in str(path) else os.path.abspath(os.fspath(path)))
    claims = experts.claims() if experts else []
    found = all_gather((key, global_rank(), claims), process_group)
    paths = [p for p, _, _ in found]
    if any(p != paths[0] for p in paths):
        shown = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths[:4]))
        more = f", ... ({len(paths)} ranks)" if len(paths) > 4 else ""
        raise ValueError(
            f"{what}: the ranks passed different checkpoint paths ({shown}{more}). A "
            "distributed checkpoint is one directory holding every rank's shard files and one "
            ".metadata: pass the same path on every rank (leave the rank out of it); each "
            "rank's part is kept apart inside it. Nothing was read or written"
        )
    error = check_claims([(rank, c) for _, rank, c in found])
    if error is not None:
        raise ValueError(f"{what}: {error}. Nothing was read or written")
    return {(container, name) for _, _, c in found for container, name, _ in c}


def raise_first(failures: Iterable[Failure | None], cause: BaseException | None = None) -> None:
    """Raise the lowest rank's failure, if any, chained to this rank's own exception."""
    first = next((f for f in failures if f is not None), None)
    if first is not None:
        kind, message = first
        raise kind(message) from cause


def describe(exc: BaseException, rank: int) -> str:
    """One line per failing rank. A ``CheckpointException`` already carries every failing rank
    (DCP raises the same one on all ranks), so it is listed as such, not as this rank's."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items())
        )
    return f"rank {rank}: {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def no_checkpoint_exception(what: str) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` into a chained ``RuntimeError``: it derives from
    ``BaseException``, so it would escape callers' ``except Exception`` (and retry loops)."""
    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(f"{what} failed: {describe(exc, -1)}") from exc
