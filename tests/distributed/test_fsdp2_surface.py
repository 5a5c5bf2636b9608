"""Our units are ``torch.distributed.fsdp.FSDPModule`` instances, and every method torch's class
defines means what FSDP2 means on them or refuses with a ``NotImplementedError`` naming the
alternative (see [Note: FSDP2's methods on flat buffers] in ``_frontend/_fsdp2_surface.py``).

The classification test enumerates torch's ``FSDPModule``: a method a newer torch adds fails it
until it is implemented or refused here. ``set_requires_all_reduce`` on HSDP and
``reset_iter_state`` after a failed forward train like the reference and FSDP2.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from _fsdp2_api import TIMEOUT_S, _loss, _net, _param_errors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import FSDPModule, fully_shard

# private: the table of FSDP2 arguments refused with a reason
from megatron_fsdp_v2._frontend._fsdp2_surface import REFUSED

from _pool import RankPools

pytestmark = pytest.mark.timeout(600)

# Methods of torch's FSDPModule with FSDP2's meaning here (some accept only part of FSDP2's
# values; see README "Coming from FSDP2").
SUPPORTED = {
    "__new__", "_apply", "reshard", "unshard", "reset_iter_state", "set_is_last_backward",
    "set_requires_gradient_sync", "set_requires_all_reduce", "set_reshard_after_forward",
    "set_reshard_after_backward", "set_modules_to_forward_prefetch",
    "set_modules_to_backward_prefetch", "set_gradient_divide_factor",
    "set_reduce_scatter_divide_factor", "set_force_sum_reduction_for_comms",
    "set_reduce_scatter_unused_params", "set_all_reduce_hook",
    # torch 2.15's, ours on every release (test_manual_finalization.py).
    "set_manual_backward_finalization", "finalize_backward",
    # Only ``_comm_ctx``, which torch 2.15's pipelining reads; the rest refused (below).
    "_get_fsdp_state",
}
NOT_METHODS = {"__annotations__", "__dict__", "__doc__", "__module__", "__weakref__",
               "_orig_cls_mro_index"}
# Arguments for calling each refused method.
REFUSED_CALLS: dict[str, tuple[Any, ...]] = {
    "set_custom_all_gather": (object(),), "set_custom_reduce_scatter": (object(),),
    "set_post_optim_event": (object(),),
    "set_symm_mem_for_comm": ("NCCL",), "set_allocate_memory_from_process_group_for_comm": (True,),
    "set_reduce_scatter_max_input_buffers": (2,), "set_separate_reduce_scatter_group": (True,),
    "set_unshard_in_backward": (False,), "_set_unshard_async_op": (True,),
    "set_keep_unsharded_storage": (True,),
}


def test_every_torch_fsdp_module_method_is_classified_and_overridden() -> None:
    names = set(vars(TorchFSDPModule)) - NOT_METHODS
    # Methods a newer torch adds are classified ahead of it; those of the running torch must be.
    unclassified = names - SUPPORTED - set(REFUSED)
    assert not unclassified, (
        f"torch's FSDPModule has methods fully_shard has not classified: {sorted(unclassified)}"
        "; implement them with FSDP2's meaning or add them to REFUSED in _fsdp2_surface.py"
    )
    assert not (SUPPORTED & set(REFUSED)), SUPPORTED & set(REFUSED)
    assert set(REFUSED_CALLS) == set(REFUSED)
    for name in sorted(names):
        owner = next(c for c in FSDPModule.__mro__ if name in vars(c))
        assert owner is not TorchFSDPModule, f"{name} is inherited from torch's FSDPModule"
    assert issubclass(FSDPModule, TorchFSDPModule)


# ---------------------------------------------------------------------- on wrapped modules

def _surface_worker(rank: int, world: int) -> list[str]:
    found: list[str] = []
    mesh = init_device_mesh("cpu", (world,))
    model, _ = _net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = [m for m in model.modules() if isinstance(m, TorchFSDPModule)]
    if len(units) != 4:
        found.append(f"isinstance finds {len(units)} units, want 4")
    for name, args in REFUSED_CALLS.items():
        try:
            getattr(model, name)(*args)
            found.append(f"{name}: no error")
        except NotImplementedError as e:
            if REFUSED[name] not in str(e) or name not in str(e):
                found.append(f"{name}: message {e}")
    model.set_unshard_in_backward(True)  # FSDP2's default: accepted
    model.set_keep_unsharded_storage(False)  # FSDP2's default: accepted
    replicated = nn.Linear(3, 3)
    fully_shard(replicated, mesh=mesh, sharding_strategy="optim_grads")
    replicated.set_unshard_in_backward(False)  # type: ignore[operator]  # nothing to gather
    replicated.set_keep_unsharded_storage(True)  # type: ignore[operator]  # never freed
    # _get_fsdp_state(): the communication context torch 2.15's pipelining compares, one per
    # unit; anything else of FSDP2's state is refused.
    contexts = {id(m._get_fsdp_state()._comm_ctx) for m in units}
    if len(contexts) != len(units):
        found.append(f"_get_fsdp_state()._comm_ctx: {len(contexts)} for {len(units)} units")
    try:
        _ = model._get_fsdp_state()._fsdp_param_groups
        found.append("_get_fsdp_state()._fsdp_param_groups: no error")
    except NotImplementedError as e:
        if "_fsdp_param_groups" not in str(e) or "has no FSDP2 state" not in str(e):
            found.append(f"_get_fsdp_state()._fsdp_param_groups: message {e}")
    model.set_reduce_scatter_unused_params(True)
    model.set_reduce_scatter_unused_params(False, recurse=False)
    model.set_force_sum_reduction_for_comms(True)
    # private: the unit's force_sum_reduction_for_comms flag
    from megatron_fsdp_v2._registry import state_of
    if not state_of(model).force_sum_reduction_for_comms:  # type: ignore[union-attr]
        found.append("force_sum_reduction_for_comms not kept")
    # FSDP2's __new__: building FSDP<Sequential> (what slicing does) gives a plain module.
    block = model.blocks[0]
    part = block[0:1]
    if type(part) is not nn.Sequential or isinstance(part, TorchFSDPModule):
        found.append(f"slicing a unit gave {type(part).__name__}")
    # reset_iter_state: a no-op before the first forward; then refused on a non-root unit; on
    # the root after a failed forward, training goes on.
    model.blocks[1].reset_iter_state()
    model(torch.randn(3, 5)).sum().backward()
    try:
        model.blocks[1].reset_iter_state()
        found.append("reset_iter_state on a non-root unit: no error")
    except RuntimeError:
        pass
    model.reset_iter_state()  # between steps: nothing to undo
    handle = model.blocks[2].register_forward_hook(lambda *a: (_ for _ in ()).throw(KeyError()))
    try:
        model(torch.randn(3, 5))
    except KeyError:
        pass
    handle.remove()
    model.reset_iter_state()
    model(torch.randn(3, 5)).sum().backward()
    return found


def test_surface_on_wrapped_modules(ranks: RankPools) -> None:
    for rank, found in enumerate(ranks.run(_surface_worker, 2, timeout_s=TIMEOUT_S)):
        assert not found, f"rank {rank}: {found}"


def _unshard_worker(rank: int, world: int) -> list[str]:
    """``unshard()`` registers the unsharded parameters until ``reshard()`` (or the end of the
    next forward), as FSDP2 does: ``module.weight`` is a plain tensor of the full value and a
    submodule can be called directly; FSDP2 runs the same script as the control."""
    found: list[str] = []
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(3, 8)
    for who, wrap in (("ours", fully_shard), ("FSDP2", torch_fully_shard)):
        model, ref = _net()
        for block in model.blocks:
            wrap(block, mesh=mesh)
        wrap(model, mesh=mesh)
        block, want = model.blocks[1], ref.blocks[1]
        for async_op in (False, True):
            handle = block.unshard(async_op=async_op)
            if handle is not None:
                handle.wait()
            weight = block[0].weight
            if isinstance(weight, DTensor) or not torch.equal(weight.detach(), want[0].weight):
                found.append(f"{who} async_op={async_op}: after unshard() block[0].weight is "
                             f"{type(weight).__name__} {tuple(weight.shape)}")
            if not torch.allclose(block[0](x), want[0](x)):  # called directly
                found.append(f"{who}: calling the unsharded submodule gave other values")
            block.reshard()
            if not isinstance(block[0].weight, DTensor):
                found.append(f"{who}: after reshard() block[0].weight is not the DTensor")
        model(torch.randn(3, 5)).sum().backward()  # and the model runs on afterwards
    # Built on the meta device: unshard() gives the values first, as a forward would.
    _, ref = _net()
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = type(ref)()
    for block in meta.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(meta, mesh=mesh)
    meta.unshard()
    if not torch.equal(meta.out.weight.detach(), ref.out.weight):
        found.append("unshard() of a meta-built model: not the values built on the CPU")
    meta.reshard()
    return found


def test_unshard_registers_unsharded_params(ranks: RankPools) -> None:
    for rank, found in enumerate(ranks.run(_unshard_worker, 2, timeout_s=TIMEOUT_S)):
        assert not found, f"rank {rank}: {found}"


def _requires_all_reduce_worker(rank: int, world: int, outer: str,
                                reenable: str) -> dict[str, Any]:
    """HSDP 2x2, 3 micro-batches: the first two with ``set_requires_all_reduce(False)``, the
    last with ``set_requires_all_reduce(True)`` or ``set_requires_gradient_sync(True)`` (which
    turns the all-reduce back on too, in FSDP2); every rank its own data, the reference
    averages over all of them."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(3)
    batches = [[[(torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g))
                 for _ in range(world)] for _ in range(3)] for _ in range(2)]
    out: dict[str, Any] = {}
    calls: dict[str, int] = {}
    unclosed: list[str] = []
    ref = None
    for name in ("ours", "fsdp2", "ours_unmarked"):
        model, ref = _net()
        wrap = [fully_shard, torch_fully_shard][name == "fsdp2"]
        kw = {"outer_dp_sharding_strategy": outer} if name != "fsdp2" else {}
        for block in model.blocks:
            wrap(block, mesh=mesh, **kw)
        wrap(model, mesh=mesh, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for parts in batches:
            for i, per_rank in enumerate(parts):
                last = i == len(parts) - 1
                if name != "ours_unmarked":
                    if last and reenable == "gradient_sync":
                        model.set_requires_gradient_sync(True)
                    else:
                        model.set_requires_all_reduce(last)
                _loss(model, per_rank[rank]).backward()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                opt.step()  # warns if no backward closed the window
            unclosed += [f"{name}: {w.message}" for w in seen if "never" in str(w.message)]
            opt.zero_grad()
        out[name] = model
        if name != "fsdp2":
            calls[name] = sum(c.calls for c in model.collective_stats().values())
    # Held open, the outer reduction runs once per window instead of once per micro-batch.
    fewer = [] if calls["ours"] < calls["ours_unmarked"] else [f"collective calls {calls}"]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)  # type: ignore[union-attr]
    for parts in batches:
        for per_rank in parts:
            for batch in per_rank:
                (_loss(ref, batch) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    errors = {name: _param_errors(m, ref) for name, m in out.items()}
    return {"calls": fewer, "unclosed": unclosed, **errors}


@pytest.mark.parametrize("reenable", ["requires_all_reduce", "gradient_sync"])
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_requires_all_reduce_hsdp(ranks: RankPools, outer: str, reenable: str) -> None:
    results = ranks.run(_requires_all_reduce_worker, 4, outer, reenable, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        for name, errors in r.items():
            assert not errors, f"rank {rank} {name}: " + "\n".join(errors[:4])


class _Branches(nn.Module):
    """Rank ``r`` runs branch ``r`` only (conditional control flow inside one unit: multi-modal,
    MoE), so each rank leaves the other's parameters without a gradient. (Branches wrapped as
    units of their own would make the ranks run different units: a misuse, see README.)"""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        return self.out(torch.tanh(self.branches[branch](x)))


def _unused_params_worker(rank: int, world: int) -> dict[str, float]:
    """FSDP2 needs ``set_reduce_scatter_unused_params(True)`` for this model (its collectives
    would not match); ours reduces every parameter of a unit always, zeros for unused ones: the
        setting is accepted and the gradients equal FSDP2's with it, and one process's."""
    import copy

    torch.manual_seed(0)
    base = _Branches()
    ref, ours, theirs = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    # FSDP2 has the setting from torch 2.13; without it the control cannot train this model.
    runs = [("ours", ours, fully_shard)]
    if hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params"):
        runs.append(("fsdp2", theirs, torch_fully_shard))
    for _, model, shard in runs:
        shard(model)
        model.set_reduce_scatter_unused_params(True)
    xs = torch.randn(world, 3, 4, generator=torch.Generator().manual_seed(1))
    for _, model, _ in runs:
        model(xs[rank], rank).square().mean().backward()
    sum(ref(xs[r], r).square().mean() for r in range(world)).div(world).backward()
    # private: a parameter's shard rows (record_of(p).local_rows)
    from megatron_fsdp_v2._registry import record_of

    def rows(model: nn.Module, p: Any) -> tuple[int, int]:
        if model is ours:
            return record_of(p).local_rows
        chunk = -(-p.shape[0] // world)  # FSDP2: torch.chunk rows
        return min(rank * chunk, p.shape[0]), min((rank + 1) * chunk, p.shape[0])

    distance = {}
    for name, model, _ in runs:
        worst = 0.0
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            # Both leave a parameter this rank did not use and holds no rows of without a
            # gradient here (see [Note: gradients the optimizer sees]).
            local = None if p.grad is None else p.grad.to_local()
            assert local is not None or p.to_local().numel() == 0, \
                f"{name}: a parameter with rows here got no gradient"
            pieces: list[Any] = [None] * world
            torch.distributed.all_gather_object(pieces, (rows(model, p), local))
            full = torch.zeros_like(q.grad)
            for (lo, hi), held in pieces:
                if held is not None:
                    full[lo:hi] = held
            worst = max(worst, (full - q.grad).abs().max().item())
        distance[name] = worst
    return distance


def test_reduce_scatter_unused_params_matches_fsdp2(ranks: RankPools) -> None:
    for distance in ranks.run(_unused_params_worker, 2, timeout_s=TIMEOUT_S):
        # The control ran as FSDP2 documents it, where torch has the setting.
        assert distance.get("fsdp2", 0.0) < 1e-6, distance
        assert distance["ours"] < 1e-6, distance
