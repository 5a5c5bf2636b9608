"""FSDP x TP on a dp=2 x tp=2 mesh (4 ranks): ``parallelize_module`` on ``mesh["tp"]``, then
``fully_shard`` on ``mesh["dp"]`` (see [Note: 2-D parameters] in ``_dtensor/_tp_params.py``).

Parity with single-process training (losses, ``full_tensor()`` of every parameter, torch's full
state dict; gradient norms of clip_grad_norm_ over the whole model) for every strategy, 2
micro-batches, uneven rows over dp, with FSDP2
(``torch.distributed.fsdp.fully_shard``) trained on the same script as a control; the placements
of the optimizer-facing parameters; torch's full-state-dict loads; and the errors for meshes
that cannot be composed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn as nn
from _tp_common import (
    STRATEGIES,
    apply_tp,
    batches,
    build_model,
    clip_ours,
    clip_torch,
    compare,
    compare_losses,
    dp_tp_mesh,
    full_values,
    torch_full_state_dict,
    train,
    wrap_fsdp2,
    wrap_ours,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from megatron_fsdp_v2 import fully_shard

# private: a TP parameter's flat-buffer record (its rows and layout)
from megatron_fsdp_v2._registry import record_of

from _models import check_all_ranks
from _pool import RankPools

TIMEOUT_S = 400


def _parity_worker(rank: int, world: int, strategy: str) -> None:
    mesh = dp_tp_mesh()
    dp_rank = mesh.get_local_rank("dp")
    data = batches(steps=3, micro=2, dp=2)
    ref = build_model()
    ref_losses = train(ref, data, None, clip=clip_torch)
    want = full_values(ref)

    ours = wrap_ours(apply_tp(build_model(), mesh["tp"]), mesh["dp"], strategy)
    losses = train(ours, data, dp_rank, mark=True, clip=clip_ours)
    compare_losses(f"{strategy}: fully_shard x TP", losses, ref_losses)
    compare(f"{strategy}: full_tensor()", full_values(ours), want)
    compare(f"{strategy}: torch full state dict", torch_full_state_dict(ours), want)

    control = wrap_fsdp2(apply_tp(build_model(), mesh["tp"]), mesh["dp"])
    control_losses = train(control, data, dp_rank, clip=clip_torch)
    compare_losses(f"{strategy}: FSDP2 x TP (control)", control_losses, ref_losses)
    compare(f"{strategy}: FSDP2 full_tensor() (control)", full_values(control), want)
    compare_losses(f"{strategy}: fully_shard vs FSDP2", losses, control_losses)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_dp2_tp2(ranks: RankPools, strategy: str) -> None:
    ranks.run(_parity_worker, 4, strategy, timeout_s=TIMEOUT_S)


def _placements_worker(rank: int, world: int, strategy: str) -> None:
    mesh = dp_tp_mesh()
    model = wrap_ours(apply_tp(build_model(), mesh["tp"]), mesh["dp"], strategy)
    dp = Replicate() if strategy == "no_shard" else Shard(0)
    strided = Replicate() if strategy == "no_shard" else _StridedShard(0, split_factor=2)
    want = {
        "embed.weight": (strided, Shard(0)), "head.weight": (strided, Shard(0)),
        "head.bias": (strided, Shard(0)), "norm.weight": (dp, Replicate()),
        "blocks.0.up.weight": (strided, Shard(0)), "blocks.0.down.weight": (dp, Shard(1)),
        "blocks.0.down.bias": (dp, Replicate()), "blocks.1.norm.bias": (dp, Replicate()),
    }
    got = {n: tuple(p.placements) for n, p in model.named_parameters() if n in want}
    ok = got == want and all(
        isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "tp")
        for p in model.parameters()
    )
    check_all_ranks(ok, f"{strategy}: placements {got}, want {want}")
    # Forward sees the TP DTensors parallelize_module made, locals viewing the flat buffers.
    seen: list[object] = []

    def look(module: nn.Module, args: object) -> None:
        w = module.weight
        record = record_of(w)
        bound = record.group.weights._bound_to if record is not None else None
        seen.append((type(w).__name__, tuple(getattr(w, "placements", ())),
                     getattr(getattr(w, "device_mesh", None), "mesh_dim_names", None),
                     tuple(w.to_local().shape) if isinstance(w, DTensor) else None,
                     # zero-copy: the local tensor views the unsharded model-weight buffer
                     bound is not None and isinstance(w, DTensor) and (
                         w.to_local().untyped_storage().data_ptr()
                         == bound.untyped_storage().data_ptr())))

    hook = model.blocks[0].up.register_forward_pre_hook(look)
    model(torch.zeros(2, 4, dtype=torch.long))
    hook.remove()
    want_seen = [("DTensor", (Shard(0),), ("tp",), (11, 16), True)]
    check_all_ranks(seen == want_seen, f"{strategy}: compute parameter {seen}, want {want_seen}")
    # A user's DTensor on the same (registered) dp x tp mesh keeps DTensor's meaning.
    x = torch.arange(48.0).view(12, 4)
    nested = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    check_all_ranks(torch.equal(nested.full_tensor(), x), f"{strategy}: (Shard(0), Shard(0))")
    # A col-wise embedding (TP shards dim 1), and random init on dp x tp: the values one
    # process draws ([Note: random init of uneven shards]; test_random_init_tp has the rest).
    torch.manual_seed(3)
    emb = nn.Embedding(7, 4)
    full = emb.weight.detach().clone()
    parallelize_module(emb, mesh["tp"], ColwiseParallel())
    fully_shard(emb, mesh=mesh["dp"], sharding_strategy=strategy)
    w = emb.weight
    ok = tuple(w.placements) == (dp, Shard(1)) and torch.equal(w.full_tensor(), full)
    check_all_ranks(ok, f"{strategy}: col-wise embedding {w.placements}")
    up = model.blocks[0].up.weight
    torch.manual_seed(4)
    torch.nn.init.normal_(up)
    torch.manual_seed(4)
    check_all_ranks(torch.equal(up.full_tensor(), torch.empty(up.shape).normal_()),
                    f"{strategy}: random init on dp x tp: not the single-process draw")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_placements(ranks: RankPools, strategy: str) -> None:
    ranks.run(_placements_worker, 4, strategy, timeout_s=TIMEOUT_S)


def _load_full_worker(rank: int, world: int, strategy: str, broadcast: bool) -> None:
    """torch's set_model_state_dict(full_state_dict=True) cuts each full tensor at the TP
    offsets, then at this rank's dp rows."""
    mesh = dp_tp_mesh()
    model = wrap_ours(apply_tp(build_model(seed=5), mesh["tp"]), mesh["dp"], strategy)
    want = full_values(build_model())
    sd = {k: v.clone() for k, v in build_model().state_dict().items()}
    if broadcast and rank != 0:
        sd = {}
    dsd.set_model_state_dict(model, sd, options=dsd.StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast))
    compare(f"{strategy} broadcast={broadcast}: loaded full state dict", full_values(model),
            want, rtol=0, atol=0)


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_load_full_state_dict(ranks: RankPools, strategy: str, broadcast: bool) -> None:
    ranks.run(_load_full_worker, 4, strategy, broadcast, timeout_s=TIMEOUT_S)


def _errors_worker(rank: int, world: int) -> None:
    mesh = dp_tp_mesh()
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    cases: list[tuple[str, nn.Module, object, str]] = []
    # A TP mesh from another root mesh than the dp mesh.
    m = parallelize_module(nn.Linear(4, 4), other["b"], ColwiseParallel())
    cases.append(("other root", m, mesh["dp"], "not a sub-mesh of the same root mesh"))
    # The dp mesh and the TP mesh overlap (the same axis twice), or are the same mesh.
    m = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
    cases.append(("same axis", m, mesh, "shares mesh dimension(s) ['tp']"))
    m = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
    cases.append(("same mesh", m, mesh["tp"], "the data-parallel mesh itself"))
    # A DTensor that is not Shard/Replicate (Partial).
    from torch.distributed.tensor import Partial

    m = nn.Linear(4, 4)
    m.weight = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh["tp"], [Partial()]))
    cases.append(("partial", m, mesh["dp"], "placed Shard(d) or Replicate()"))
    for what, module, dp_mesh, message in cases:
        try:
            fully_shard(module, mesh=dp_mesh)
            err = "no error"
        except ValueError as e:
            err = "" if message in str(e) else f"wrong message: {e}"
        check_all_ranks(not err, f"{what}: {err}")


def _fp8_tp_worker(rank: int, world: int) -> None:
    # torchao float8 weights with FP8 all-gathers, then torchao's float8 TP plan: the TP
    # DTensor's local tensor carries FSDP2's all-gather extensions, which the flat buffers only
    # honour on a data-parallel mesh -- refused before any collective, not trained on stale
    # weights.
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    mesh = dp_tp_mesh()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    m = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32, bias=False)), config=config)
    parallelize_module(m, mesh["tp"], {"0": Float8ColwiseParallel()})
    try:
        fully_shard(m, mesh=mesh["dp"])
        err = "no error"
    except NotImplementedError as e:
        err = "" if "supported on a data-parallel mesh only" in str(e) else f"wrong message: {e}"
    check_all_ranks(not err, f"fp8 x tp: {err}")


def test_fp8_all_gather_with_tp_refused(ranks: RankPools) -> None:
    pytest.importorskip("torchao")
    ranks.run(_fp8_tp_worker, 4, timeout_s=TIMEOUT_S)


def test_errors(ranks: RankPools) -> None:
    ranks.run(_errors_worker, 4, timeout_s=TIMEOUT_S)
