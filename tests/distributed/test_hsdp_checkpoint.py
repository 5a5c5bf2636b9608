"""Checkpoints of HSDP models (2-D mesh, outer ``no_shard`` and outer ``optim``): DCP save/load
across a 2x2 HSDP mesh and 1-D meshes of other sizes and strategies (2x2 -> 1-D world 3, 1-D
world 4 -> 2x2, 2x2 -> 2x2), the chunk metadata (each replica's true rows, every chunk written
once; outer optim: each rank's own sub-shard rows, partitioning each tensor), and full
state-dict export/import (rank 0 = the mesh's first rank; the broadcast reaches every rank).

Tolerances as in ``test_checkpoint.py``: bitwise for a resume on the same mesh and strategy,
``rtol=1e-6`` (``atol=1e-7``) across layouts, against the uninterrupted run.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _checkpoint import local_batch, new_optimizer
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import fully_shard

# private: a parameter's shard rows and its group's outer process group
from megatron_fsdp_v2._registry import record_of
from megatron_fsdp_v2.checkpoint._process_group import dcp_process_group, model_process_group
from megatron_fsdp_v2.testing import RankPools

from _models import OddMLP, TinyGPT, agree, lm_loss, mlp_loss, step_mean_loss

RTOL, ATOL = 1e-6, 1e-7


# ---------------------------------------------------------------------- helpers

def hsdp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def make_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyGPT() if kind == "lm" else OddMLP()


def wrap(model: torch.nn.Module, strategy: str, hsdp: bool, outer: str = "no_shard"
         ) -> torch.nn.Module:
    kw: dict = {"mesh": hsdp_mesh()} if hsdp else {}
    if outer != "no_shard":
        kw["outer_dp_sharding_strategy"] = outer
    for block in getattr(model, "blocks", []):
        fully_shard(block, sharding_strategy=strategy, **kw)
    return fully_shard(model, sharding_strategy=strategy, **kw)


def train(model, opt, kind: str, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    loss_fn = lm_loss if kind == "lm" else mlp_loss
    for step in steps:
        losses.append(step_mean_loss(loss_fn(model, local_batch(kind, step, rank, world)), opt))
    return losses


def assert_same(actual: dict, expected: dict, *, exact: bool) -> None:
    assert list(actual) == list(expected), f"keys {list(actual)} != {list(expected)}"
    for key, value in expected.items():
        got = actual[key]
        if exact:
            assert torch.equal(got, value), f"{key}: max diff {(got - value).abs().max()}"
        else:
            torch.testing.assert_close(got, value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{key}: {m}")


def assert_losses(actual: list[float], expected: list[float], *, exact: bool) -> None:
    if exact:
        assert actual == expected, f"losses {actual} != {expected}"
    else:
        torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64), rtol=RTOL, atol=0.0)


def _path(root: str, tag: str) -> str:
    return os.path.join(root, tag)


# ---------------------------------------------------------------------- resharding
# Produced at world 4: "H_*" on the 2x2 HSDP mesh, "D_*" on the 1-D mesh. Consumed: D_* on 2x2
# (same spawn), H_* on a 1-D world-3 mesh (second spawn).

SOURCES = {
    "H_lm": dict(kind="lm", strategy="optim_grads_params", hsdp=True, save_at=2, end=4),
    "H_mlp": dict(kind="mlp", strategy="optim", hsdp=True, save_at=2, end=4),
    "D_lm": dict(kind="lm", strategy="optim_grads", hsdp=False, save_at=2, end=4),
    "D_mlp": dict(kind="mlp", strategy="no_shard", hsdp=False, save_at=2, end=4),
    # Outer optim: each rank holds its own sub-shard rows.
    "O_lm": dict(kind="lm", strategy="optim_grads_params", hsdp=True, save_at=2, end=4,
                 outer="optim"),
}


def _check_chunks_written_once(path: str) -> None:
    """Every saved tensor's chunks tile it exactly: replicas' identical chunks were written
    once (DCP de-duplicates them), and no rows are missing."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, meta in md.items():
        if not hasattr(meta, "chunks"):
            continue
        covered = sum(torch.Size(c.sizes).numel() for c in meta.chunks)
        assert covered == meta.size.numel(), (
            f"{key}: chunks cover {covered} elements of {meta.size.numel()} ({meta.chunks})")


def _check_saved_steps(path: str, expected: int) -> None:
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    steps = {k: torch.zeros((), dtype=m.properties.dtype) for k, m in md.items()
             if k.startswith("optim.state.") and k.endswith(".step")}
    assert steps, "no optimizer steps in the checkpoint"
    dcp.load(steps, checkpoint_id=path)
    for key, value in steps.items():
        assert value.item() == expected, f"{key} = {value.item()}, expected {expected}"


def _produce(rank: int, world: int, root: str, tag: str) -> None:
    spec = SOURCES[tag]
    kind, strategy, hsdp = spec["kind"], spec["strategy"], spec["hsdp"]
    save_at, end = spec["save_at"], spec["end"]
    outer = spec.get("outer", "no_shard")
    model = wrap(make_model(kind, 0), strategy, hsdp, outer)
    opt = new_optimizer(model)
    train(model, opt, kind, range(save_at), rank, world)
    mckpt.save(model, opt, checkpoint_id=_path(root, tag), extra={"train_step": save_at})
    agree(f"{tag}: chunks", lambda: _check_chunks_written_once(_path(root, tag)))
    agree(f"{tag}: saved Adam steps", lambda: _check_saved_steps(_path(root, tag), save_at))
    losses = train(model, opt, kind, range(save_at, end), rank, world)
    full = mckpt.get_full_state_dict(model, rank0_only=False)
    if rank == 0:
        torch.save({"losses": losses, "full": full, "kind": kind, "save_at": save_at, "end": end},
                   _path(root, tag) + ".ref.pt")
    # Same mesh and strategy: bitwise.
    model2 = wrap(make_model(kind, 1), strategy, hsdp, outer)
    opt2 = new_optimizer(model2)
    mckpt.load(model2, opt2, checkpoint_id=_path(root, tag))
    losses2 = train(model2, opt2, kind, range(save_at, end), rank, world)
    full2 = mckpt.get_full_state_dict(model2, rank0_only=False)
    agree(f"{tag} resumed on the same mesh ({strategy})", lambda: (
        assert_losses(losses2, losses, exact=True), assert_same(full2, full, exact=True)))


def _consume(rank: int, world: int, root: str, tag: str, strategy: str, hsdp: bool,
             outer: str = "no_shard") -> None:
    dist.barrier()  # the producer's reference file is complete
    ref = torch.load(_path(root, tag) + ".ref.pt")
    kind = ref["kind"]
    model = wrap(make_model(kind, 1), strategy, hsdp, outer)
    opt = new_optimizer(model)
    if kind == "lm":  # the manual flow: get_state_dict, dcp.load, set_state_dict
        msd, osd = mckpt.get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "train_step": -1}
        dcp.load(state, checkpoint_id=_path(root, tag))
        mckpt.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        extra = {"train_step": state["train_step"]}
    else:
        extra = mckpt.load(model, opt, checkpoint_id=_path(root, tag), extra={"train_step": -1})
    agree(f"{tag}: extra", lambda: _check_equal(extra, {"train_step": ref["save_at"]}))
    losses = train(model, opt, kind, range(ref["save_at"], ref["end"]), rank, world)
    full = mckpt.get_full_state_dict(model, rank0_only=False)
    where = f"{f'2x2 HSDP outer {outer}' if hsdp else f'1-D world {world}'} {strategy}"
    agree(f"{tag} -> {where}", lambda: (
        assert_losses(losses, ref["losses"], exact=False),
        assert_same(full, ref["full"], exact=False)))


def _check_equal(actual, expected) -> None:
    assert actual == expected, f"{actual} != {expected}"


# ---------------------------------------------------------------------- state dicts on 2x2

def _check_forward(what: str, model, kind: str, weights: dict) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 37, (2, 8), generator=g) if kind == "lm" else torch.randn(4, 15,
                                                                                    generator=g)
    ref = make_model(kind, 5)
    ref.load_state_dict(weights)
    with torch.no_grad():
        out, expected = model(x), ref(x)
    agree(what, lambda: torch.testing.assert_close(out, expected, rtol=0.0, atol=0.0))


def _check_rows(what: str, model, weights: dict, strategy: str, outer: str = "no_shard"
                ) -> None:
    """``model.state_dict()`` on 2x2: DTensors on the 2-D mesh with (Replicate(), Shard(0))
    ((Replicate(), Replicate()) for no_shard, (Shard(0), Shard(0)) for outer optim), each
    rank's true rows, chunk metadata at that offset, and the same rows on both replicas (outer
    optim: the chunks of the four ranks partition each tensor)."""
    sd = model.state_dict()
    rows = []
    problems = []
    for key, value in sd.items():
        if not isinstance(value, DTensor):
            problems.append(f"{key} is not a DTensor")
            continue
        param = dict(model.named_parameters(remove_duplicate=False))[key]
        record = record_of(param)
        group, index = record.group, record.index
        expected = (Replicate(), Replicate() if strategy == "no_shard" else Shard(0))
        if outer == "optim":
            expected = (Shard(0), Shard(0))
        if tuple(value.placements) != expected or value.device_mesh.ndim != 2:
            problems.append(f"{key}: placements {value.placements}, expected {expected}")
        if strategy == "no_shard":
            lo, hi = 0, value.shape[0]
        else:
            lo, hi = group.local_row_range(index)
            chunks = value.__create_chunk_list__()
            if hi == lo:
                if chunks != []:
                    problems.append(f"{key}: empty shard has chunks {chunks}")
            elif (list(chunks[0].offsets) != [lo] + [0] * (value.dim() - 1)
                  or tuple(chunks[0].sizes) != tuple(value.to_local().shape)):
                problems.append(f"{key}: chunk {chunks[0]} for rows {lo}..{hi}")
        if not torch.equal(value.to_local(), weights[key][lo:hi]):
            problems.append(f"{key}: rows {lo}..{hi} differ")
        rows.append((lo, hi))
    if outer == "optim":
        # The four ranks' chunks (empty sub-shards: none) partition each tensor.
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        for i, key in enumerate(sd):
            spans = sorted(r[i] for r in everyone if r[i][1] > r[i][0])
            covered = 0
            for lo, hi in spans:
                if lo != covered:
                    problems.append(f"{key}: sub-shard rows {spans} do not partition it")
                covered = hi
            if covered != sd[key].shape[0]:
                problems.append(f"{key}: sub-shard rows {spans} do not cover it")
    else:
        # Replicas (same inner index, other outer index) hold the same rows.
        outer_group = record_of(next(iter(model.parameters()))).group.outer_process_group
        gathered: list = [None] * 2
        dist.all_gather_object(gathered, rows, group=outer_group)
        if gathered[0] != gathered[1]:
            problems.append(f"replicas hold different rows: {gathered}")
    agree(what, lambda: _check_equal(problems, []))


def _state_dict_worker_2x2(rank: int, world: int, root: str) -> None:
    cases = (("mlp", ("optim", "no_shard"), "no_shard"),
             ("lm", ("optim_grads_params",), "no_shard"),
             ("lm", ("optim_grads_params",), "optim"),
             ("mlp", ("optim_grads_params",), "optim"))
    for kind, strategies, outer in cases:
        w0 = make_model(kind, 0).state_dict()
        w1 = make_model(kind, 1).state_dict()
        for strategy in strategies:
            name = f"{kind} {strategy} outer {outer} 2x2"
            model = wrap(make_model(kind, 0), strategy, hsdp=True, outer=outer)
            group = model_process_group(model)
            agree(f"{name}: checkpoint group covers the mesh", lambda: (
                _check_equal(dist.get_process_group_ranks(group), [0, 1, 2, 3]),
                _check_equal(dcp_process_group(model, None), group)))
            _check_forward(f"{name}: before load", model, kind, w0)
            model.load_state_dict(w1)
            _check_forward(f"{name}: after load_state_dict(full)", model, kind, w1)
            _check_rows(f"{name}: state_dict rows", model, w1, strategy, outer)
            # Full export: only the mesh's first rank gets it.
            full = mckpt.get_full_state_dict(model)
            agree(f"{name}: full export", lambda: (
                assert_same(full, w1, exact=True) if rank == 0 else _check_equal(full, {})))
            everywhere = mckpt.get_full_state_dict(model, rank0_only=False, cpu_offload=False)
            agree(f"{name}: full export on every rank",
                  lambda: assert_same(everywhere, w1, exact=True))
            # Import with every rank passing it, then by broadcast from rank 0 (reaches the
            # other inner rank and both ranks of the other replica).
            victim = wrap(make_model(kind, 3), strategy, hsdp=True, outer=outer)
            mckpt.load_full_state_dict(victim, w0)
            _check_forward(f"{name}: after load_full_state_dict", victim, kind, w0)
            mckpt.load_full_state_dict(victim, full if rank == 0 else None,
                                       broadcast_from_rank0=True)
            _check_forward(f"{name}: after broadcast import", victim, kind, w1)
            _check_rows(f"{name}: rows after broadcast import", victim, w1, strategy, outer)
            # Sharded state dict of another 2x2 model, loaded in place.
            mckpt.load_full_state_dict(victim, w0)
            victim.load_state_dict(model.state_dict())
            _check_forward(f"{name}: after load_state_dict(sharded)", victim, kind, w1)


def _world4_worker(rank: int, world: int, root: str) -> None:
    _state_dict_worker_2x2(rank, world, root)
    for tag in SOURCES:
        _produce(rank, world, root, tag)
    # 1-D world 4 -> 2x2 HSDP, other inner strategies.
    _consume(rank, world, root, "D_lm", "optim", hsdp=True)
    _consume(rank, world, root, "D_mlp", "optim_grads_params", hsdp=True)
    # 1-D world 4 -> 2x2 HSDP with outer optim.
    _consume(rank, world, root, "D_lm", "optim_grads_params", hsdp=True, outer="optim")


def _world3_worker(rank: int, world: int, root: str) -> None:
    # 2x2 HSDP -> 1-D world 3, other strategies.
    _consume(rank, world, root, "H_lm", "no_shard", hsdp=False)
    _consume(rank, world, root, "H_mlp", "optim_grads", hsdp=False)
    # 2x2 HSDP outer optim -> 1-D world 3, another strategy.
    _consume(rank, world, root, "O_lm", "optim", hsdp=False)


def test_hsdp_checkpoints_reshard_and_full_state_dicts(ranks: RankPools) -> None:
    """World 4: state dicts, chunk offsets and full export/import on 2x2 HSDP; checkpoints
    saved on 2x2 and on a 1-D mesh; the 1-D ones resumed on 2x2 and each 2x2 one on 2x2.
    World 3: the 2x2 checkpoints resumed on a 1-D mesh of 3 ranks. Resumed runs reproduce the
    uninterrupted losses and final parameters."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_world4_worker, 4, root, timeout_s=240)
        ranks.run(_world3_worker, 3, root, timeout_s=120)
