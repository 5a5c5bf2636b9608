"""``nn.init.*`` on FSDP x TP parameters after ``fully_shard`` (torchtitan's random
``init_weights`` on the wrapped model, its default TP run) draws what single-process code
draws: the full tensor from the same generator, each rank keeping its TP piece and, inside it,
its flat-buffer rows (see [Note: random init of uneven shards] in ``_dtensor/_random_init.py``).

Both FSDP x TP faces on dp 2 x tp 2: DTensor TP parameters (``parallelize_module`` on
``mesh["tp"]``, ``fully_shard`` on ``mesh["dp"]``; ``_tp_common``'s model: a row-wise
embedding and col-wise head ``Shard(0)``, row-wise ``Shard(1)``, sequence-parallel norms
``Replicate()``, uneven dp rows) and ``spmd_types``-annotated plain TP parameters
(``test_spmd_types_tp``'s model, ``fully_shard`` with the SPMD mesh and ``dp_mesh_dims``).
Three rounds re-initialize every parameter, each with ``normal_``, ``trunc_normal_`` (bounds
tight enough that its rejection loop runs) and ``uniform_`` in turn, the last round with an
explicit generator; after each round every ``full_tensor()`` equals the unwrapped copy's
parameter (the same round from the same seeds) bitwise, and the generator ends in the same
state. One training step later the full values still match single-process training. And
torchtitan's fused-weight init, ``p.copy_(replicated)`` (DTensor's implicit redistribution of
the source into the parameter's placements), keeps each rank's piece of the source. The user's
``distribute_tensor`` DTensors on the same mesh draw DTensor's own values (torch alone, the
patches suspended, is the control) unless they share a parameter's size.

No FSDP2 control: FSDP2's sharded draws on CPU are not the single-process values (DTensor's
offset-based generator is CUDA-only; each rank draws its local tensor from its own
generator), so there is nothing of FSDP2's to compare ours with here (checked when this test
was written: FSDP2's ``full_tensor()`` differs from the single-process draw).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from _tp_common import (
    apply_tp,
    batches,
    build_model,
    clip_ours,
    clip_torch,
    compare,
    dp_tp_mesh,
    full_values,
    train,
    wrap_ours,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# private: _torch_patches.suspended(), torch alone on the same tensor, is the control for
# the DTensors the patches must leave to torch
from megatron_fsdp_v2 import _torch_patches, fully_shard

from _comm_counts import CollectiveCounts
from _models import all_ranks_ok
from _pool import RankPools

TIMEOUT_S = 400


def init_round(model: nn.Module, r: int) -> torch.Tensor:
    """Round ``r`` of ``nn.init`` over ``model.parameters()`` from fixed seeds (the default
    generator; in round 2 an explicit one); returns what is left of the generator's stream."""
    torch.manual_seed(7 + r)
    g = torch.Generator().manual_seed(11) if r == 2 else None
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            kind = (i + r) % 3
            if kind == 0:
                nn.init.normal_(param, std=0.02, generator=g)
            elif kind == 1:  # +-2 std: about 1 in 20 values rejected and redrawn
                nn.init.trunc_normal_(param, std=0.02, a=-0.04, b=0.04, generator=g)
            else:
                nn.init.uniform_(param, -0.1, 0.1, generator=g)
    return torch.rand(3, generator=g)


def init_and_compare(what: str, model: nn.Module, ref: nn.Module) -> None:
    """Each round on ``model`` and on ``ref``, then every full value compared bitwise, and the
    rest of the generator's stream (every rank consumed it as one process does)."""
    for r in range(3):
        tail, ref_tail = init_round(model, r), init_round(ref, r)
        _bitwise(f"{what}: round {r}", model, ref)
        if not all_ranks_ok(torch.equal(tail, ref_tail)):
            raise AssertionError(f"{what}: round {r}: the generator ended in another state")


def _bitwise(what: str, model: nn.Module, ref: nn.Module) -> None:
    want = dict(ref.named_parameters())
    err = ""
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            err = f"{name}: not a DTensor"
        elif not torch.equal(p.full_tensor(), want[name]):
            diff = int((p.full_tensor() != want[name]).sum())
            err = err or f"{name} {tuple(p.placements)}: {diff} of {p.numel()} values differ"
    if not all_ranks_ok(not err):
        raise AssertionError(f"{what}: {err or 'differs on another rank'}")


def _build(face: str, strategy: str) -> tuple[nn.Module, nn.Module, Any]:
    """(wrapped model, its unwrapped copy, mesh) of one face: ``"dtensor"``, ``_tp_common``'s
    model under ``parallelize_module``; ``"spmd_types"``, ``test_spmd_types_tp``'s annotated
    one under the SPMD mesh and ``dp_mesh_dims``."""
    if face == "dtensor":
        mesh = dp_tp_mesh()
        model = wrap_ours(apply_tp(build_model(), mesh["tp"]), mesh["dp"], strategy)
        return model, build_model(), mesh
    from test_spmd_types_tp import SpMlp, _annotate, _mesh

    mesh, dims = _mesh("fsdp_tp")
    torch.manual_seed(0)
    ref = SpMlp()
    model = _annotate(copy.deepcopy(ref), mesh)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims, sharding_strategy=strategy)
    return model, ref, mesh


def _draw(x: DTensor) -> DTensor:
    torch.manual_seed(5)
    nn.init.normal_(x)
    return x


def _distributed_tensors(model: nn.Module, mesh: Any) -> None:
    """DTensors of ``distribute_tensor`` on the registered dp x tp mesh (``torch.chunk`` pieces)
    are decided by tensor ([Note: random init of uneven shards]): one whose dp-sharded (or, not
    sharded over dp, dim-0) size no parameter has, and DTensor's nested ``(Shard(0), Shard(0))``,
    draw what DTensor draws without the library (torch alone is the control: per rank on CPU)
    with no collective; one with a parameter's dim-0 size takes the library's path, right for
    ``torch.chunk`` rows too: the single-process values."""
    counts = {p.shape[0] for p in model.parameters()}
    user_rows = next(r for r in range(10, 64) if r not in counts)
    ours_rows = max(counts)
    err = ""
    for placements in ((Shard(0), Shard(0)), (Shard(0), Shard(1)), (Replicate(), Shard(1))):
        x = distribute_tensor(torch.zeros(user_rows, 6), mesh, placements)
        with CollectiveCounts() as comm:
            got = _draw(x).to_local().clone()
        with _torch_patches.suspended():
            want = _draw(x).to_local()
        if comm.get_total_counts() or not torch.equal(got, want):
            err = err or (f"distribute_tensor {placements}, {user_rows} rows: not DTensor's own "
                          f"draw ({comm.get_total_counts()} collectives)")
        if placements[0] == placements[1]:
            continue  # nested: DTensor's whatever the size
        full = _draw(distribute_tensor(torch.zeros(ours_rows, 6), mesh, placements)).full_tensor()
        torch.manual_seed(5)
        if not torch.equal(full, torch.empty(ours_rows, 6).normal_()):
            err = err or f"distribute_tensor {placements}, {ours_rows} rows: not one process's draw"
    if not all_ranks_ok(not err):
        raise AssertionError(err or "differs on another rank")


def _init_case(rank: int, world: int, face: str, strategy: str) -> None:
    model, ref, mesh = _build(face, strategy)
    init_and_compare(f"{face} {strategy}", model, ref)
    if face == "dtensor":
        _distributed_tensors(model, mesh)
        data = batches(steps=1, micro=1, dp=2)
        train(ref, data, None, clip=clip_torch)
        train(model, data, mesh.get_local_rank("dp"), mark=True, clip=clip_ours)
        compare(f"{strategy}: after a step", full_values(model), full_values(ref))
        return
    from test_spmd_types_tp import _batches, _close, _dp_rank, _full
    from test_spmd_types_tp import _rank_run as train_spmd

    dp_rank, dp = _dp_rank(mesh)
    data = _batches(1, dp)
    want = train_spmd(ref, data, None)
    got = train_spmd(model, data, dp_rank)
    errors = [] if torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5) else [
        f"losses and norms {got} vs single process {want}"]
    errors += _close("after a step", _full(model), _full(ref))
    if not all_ranks_ok(not errors):
        raise AssertionError(f"spmd_types {strategy}: {errors or 'failed on another rank'}")


def _need_spmd_types() -> None:
    """The spmd_types face needs the package and FSDP2's ``DataParallelMeshDims`` (torch 2.14
    and later; test_spmd_types_tp.py skips alike)."""
    pytest.importorskip("spmd_types", reason="a test dependency (scripts/install.sh)")
    import torch.distributed.fsdp as torch_fsdp

    if getattr(torch_fsdp, "DataParallelMeshDims", None) is None:
        pytest.skip("torch.distributed.fsdp has no DataParallelMeshDims")


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("face,strategy", [
    ("dtensor", "optim_grads_params"),
    ("dtensor", "optim"),
    ("dtensor", "no_shard"),
    ("spmd_types", "optim_grads_params"),
])
def test_random_init_matches_single_process(ranks: RankPools, face: str, strategy: str) -> None:
    if face == "spmd_types":
        _need_spmd_types()
    ranks.run(_init_case, 4, face, strategy, timeout_s=TIMEOUT_S)


def _copy_case(rank: int, world: int, face: str) -> None:
    """torchtitan's fused-weight init (``models/common/config_utils.py``, its fused QKV):
    ``p.new_empty`` of other shapes (``Replicate()`` DTensors), ``nn.init`` on each, ``torch.cat``
    of them, ``p.copy_(fused)``: each rank keeps its piece of ``fused``; also ``p + fused`` (the
    same implicit redistribution of ``fused``)."""
    model, _, _ = _build(face, "optim_grads_params")
    torch.manual_seed(3)
    err = ""
    for name, p in model.named_parameters():
        head = p.shape[0] // 3 + 1
        parts = [p.new_empty(head, *p.shape[1:]), p.new_empty(p.shape[0] - head, *p.shape[1:])]
        if not all(x.is_replicate() for q in parts for x in q.placements):
            err = err or f"{name}: new_empty gave {[q.placements for q in parts]}"
        with torch.no_grad():
            for q in parts:  # distinct values (no random op: this checks copy_ alone)
                q.copy_(DTensor.from_local(torch.randn(q.shape), q.device_mesh, q.placements))
            fused = torch.cat(parts)
            before = p.full_tensor()
            total = p + fused
            p.copy_(fused)
        if not torch.equal(p.full_tensor(), fused.full_tensor()):
            err = err or f"{name} {tuple(p.placements)}: copy_ of a Replicate() DTensor"
        if not torch.equal(total.full_tensor(), before + fused.full_tensor()):
            err = err or f"{name} {tuple(p.placements)}: p + fused"
    if not all_ranks_ok(not err):
        raise AssertionError(f"{face}: {err or 'differs on another rank'}")


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("face", ["dtensor", "spmd_types"])
def test_copy_replicated_into_tp_params(ranks: RankPools, face: str) -> None:
    if face == "spmd_types":
        _need_spmd_types()
    ranks.run(_copy_case, 4, face, timeout_s=TIMEOUT_S)
