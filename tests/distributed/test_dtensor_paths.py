"""What a user reaches through the DTensor parameters gives the right values, or a clear error
(see [Note: uneven redistribution] in ``megatron_fsdp_v2/_redistribute.py``).

A model with uneven row counts (Linear weights of 5, 12, 7, 3 and 1 rows and their biases, so
some ranks hold no rows of a parameter) is trained for a few AdamW steps on 2 and 3 gloo ranks in
every strategy, and on a 2x2 HSDP mesh, next to a single-process reference trained on the
concatenated global batch. Then, on every rank, compared with the reference:

* ``p.grad.full_tensor()`` (before the last step) and ``p.full_tensor()``;
* ``p.redistribute(mesh, [Replicate()] * ndim)``, ``p.redistribute(mesh, [Shard(1)]...)`` of a
  2-D weight (a gather then ``torch.chunk``), and derived tensors (``(p * 2).full_tensor()``,
  ``p.t()``);
* an op mixing a parameter with a ``Replicate()`` DTensor (DTensor's implicit redistribution);
* ``exp_avg.full_tensor()``/``exp_avg_sq.full_tensor()`` of the optimizer;
* torch's ``get_model_state_dict``/``get_optimizer_state_dict`` with ``full_state_dict=True``;
* a ``distribute_tensor`` (``torch.chunk``) DTensor on the same mesh still gathers right, and
  ``copy_`` between it and one of ours (same placements, different rows) is right both ways.

HSDP with outer ``optim`` (``(Shard(0), Shard(0))``) must raise ``NotImplementedError`` naming
``get_full_state_dict`` instead. The training steps themselves must never go through DTensor
redistribution (counted). Every check agrees across ranks, so all ranks fail together.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from megatron_fsdp_v2 import fully_shard

from _models import all_ranks_ok, reference_copy
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
STEPS = 3
PER_RANK = 2
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT_S = 240


class Uneven(nn.Module):
    """Weights of 40, 24, 48, 16 and 1 rows (biases of the same lengths), one unit each: uneven
    shards of every weight but the last at 2 and 3 ranks (and on 4 sub-shards), biases and the
    last weight held by one rank (empty shards elsewhere), and at 3 ranks a rank holding only
    padding of the last unit. Widths are multiples of 16 or 8 because shard boundaries fall on
    multiples of lcm(row, 16) elements ([Note: row-aligned flat buffers]): narrower rows would put
    every small unit on rank 0 alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(16, 40), nn.Linear(40, 24), nn.Linear(24, 48), nn.Linear(48, 16),
             nn.Linear(16, 1)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return x


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(world * PER_RANK, 16, generator=g), torch.randn(world * PER_RANK, 1,
                                                                     generator=g))
        for _ in range(STEPS)
    ]


def _mesh(world: int, hsdp: bool) -> DeviceMesh:
    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


class _Checks:
    """Named checks whose failures are collected (a failed check raises nowhere), so every
    rank runs the same collectives in the same order whatever fails."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def close(self, name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        got, expected = got.detach().float().cpu(), expected.detach().float().cpu()
        if got.shape != expected.shape:
            self.failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}")
        elif not torch.allclose(got, expected, rtol=RTOL, atol=ATOL):
            diff = (got - expected).abs().max().item()
            self.failures.append(f"WRONG VALUES {name}: max abs diff {diff:.3g}")

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported as the check's failure
            self.failures.append(f"EXCEPTION in {name}:\n{traceback.format_exc(limit=4)}")

    def raises(self, name: str, fn: Callable[[], Any]) -> None:
        """``fn`` must raise NotImplementedError naming the library's alternative."""
        try:
            fn()
        except NotImplementedError as e:
            if "get_full_state_dict" not in str(e):
                self.failures.append(f"{name}: the error does not name the alternative: {e}")
            return
        except Exception:  # noqa: BLE001
            self.failures.append(f"{name}: wrong exception:\n{traceback.format_exc(limit=4)}")
            return
        self.failures.append(f"{name}: returned instead of raising NotImplementedError")


class _CountRedistributions:
    """Counts calls of DTensor's ``redistribute_local_tensor`` (whatever is installed) from
    its explicit and implicit call sites."""

    def __init__(self) -> None:
        import torch.distributed.tensor._dispatch as dispatch
        import torch.distributed.tensor._redistribute as redistribute

        self.modules = [redistribute, dispatch]
        self.calls = 0

    def __enter__(self) -> _CountRedistributions:
        self.saved = [m.redistribute_local_tensor for m in self.modules]  # type: ignore[attr-defined]
        for module, fn in zip(self.modules, self.saved):
            def counting(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
                self.calls += 1
                return _fn(*args, **kwargs)
            module.redistribute_local_tensor = counting  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, fn in zip(self.modules, self.saved):
            module.redistribute_local_tensor = fn  # type: ignore[attr-defined]


def _held_everywhere(params: dict[str, nn.Parameter]) -> set[str]:
    """Names of the parameters that have a gradient on every rank."""
    mine = [p.grad is not None for p in params.values()]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name for i, name in enumerate(params) if all(flags[i] for flags in every)}


def _case(rank: int, world: int, strategy: str, hsdp: str | None) -> list[str]:
    """Train, then run every check; returns this rank's failures."""
    torch.manual_seed(0)
    ref = Uneven()
    model = reference_copy(ref)
    mesh = _mesh(world, hsdp is not None)
    kw: dict[str, Any] = {"mesh": mesh, "sharding_strategy": strategy}
    if hsdp is not None:
        kw["outer_dp_sharding_strategy"] = hsdp
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    outer_optim = hsdp == "optim"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    checks = _Checks()
    names = dict(model.named_parameters())
    ref_params = dict(ref.named_parameters())
    # Rank r's micro-batch is rows [r * PER_RANK, (r + 1) * PER_RANK) of the global batch.
    with _CountRedistributions() as counted:
        for step, (x, y) in enumerate(_batches(world)):
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            F.mse_loss(model(x[mine]), y[mine]).backward()
            F.mse_loss(ref(x), y).backward()
            if step == STEPS - 1:
                break
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    if counted.calls:
        checks.failures.append(f"training went through DTensor redistribution {counted.calls}x")

    # A rank whose shard of a parameter is empty has grad None, hence no optimizer state, for
    # it (design.md §3): the gradient and state checks cover parameters every rank holds.
    everyone = _held_everywhere(names)
    if not everyone:
        checks.failures.append(f"only {everyone} held by every rank: the test checks too little")
    for name, p in names.items():
        assert isinstance(p, DTensor)
        if name not in everyone:
            continue
        full_grad = lambda p=p: p.grad.full_tensor()  # noqa: E731
        if outer_optim:
            checks.raises(f"{name}.grad.full_tensor()", full_grad)
        else:
            checks.run(f"{name}.grad.full_tensor()", lambda n=name, f=full_grad: checks.close(
                f"{n}.grad.full_tensor()", f(), ref_params[n].grad))
    opt.step()
    ref_opt.step()

    replicate = [Replicate()] * mesh.ndim
    for name, p in names.items():
        expected = ref_params[name]
        if outer_optim:
            checks.raises(f"{name}.full_tensor()", p.full_tensor)
            checks.raises(f"{name}.redistribute", lambda p=p: p.redistribute(mesh, replicate))
            checks.raises(f"({name} * 2).full_tensor()", lambda p=p: (p * 2).full_tensor())
            if name in everyone:
                state = opt.state[p]
                checks.raises(f"{name} exp_avg", lambda s=state: s["exp_avg"].full_tensor())
            continue
        checks.run(f"{name}.full_tensor()", lambda n=name, p=p, e=expected: checks.close(
            f"{n}.full_tensor()", p.full_tensor(), e))
        checks.run(f"{name}.redistribute", lambda n=name, p=p, e=expected: checks.close(
            f"{n}.redistribute(Replicate)", p.redistribute(mesh, replicate).to_local(), e))
        checks.run(f"({name} * 2)", lambda n=name, p=p, e=expected: checks.close(
            f"({n} * 2).full_tensor()", (p * 2).full_tensor(), e * 2))
        state, ref_state = opt.state[p], ref_opt.state[expected]
        for key in ("exp_avg", "exp_avg_sq") if name in everyone else ():
            checks.run(f"{name} {key}", lambda n=name, k=key, s=state, r=ref_state: checks.close(
                f"{n} {k}.full_tensor()", s[k].full_tensor(), r[k]))
        if p.dim() == 2:
            # Uneven Shard(0) -> Shard(1): a right gather, then DTensor's torch.chunk columns.
            shard1 = [Replicate()] * (mesh.ndim - 1) + [Shard(1)]
            checks.run(f"{name} -> Shard(1)", lambda n=name, p=p, e=expected: checks.close(
                f"{n}.redistribute(Shard(1)).full_tensor()",
                p.redistribute(mesh, shard1).full_tensor(), e))
            checks.run(f"{name}.t()", lambda n=name, p=p, e=expected: checks.close(
                f"{n}.t().full_tensor()", p.t().full_tensor(), e.t()))
            # Implicit redistribution: the Replicate operand is cut at the parameter's rows.
            ones = distribute_tensor(torch.ones(p.shape), mesh, replicate)
            checks.run(f"{name} + Replicate", lambda n=name, p=p, o=ones, e=expected:
                       checks.close(f"({n} + Replicate ones).full_tensor()",
                                    (p + o).full_tensor(), e + 1))

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    if outer_optim:
        checks.raises("get_model_state_dict", lambda: get_model_state_dict(model, options=options))
    else:
        def model_sd() -> None:
            sd = get_model_state_dict(model, options=options)
            expected_sd = ref.state_dict()
            if sorted(sd) != sorted(expected_sd):
                checks.failures.append(f"state dict keys {sorted(sd)} != {sorted(expected_sd)}")
            for key, value in expected_sd.items():
                if key in sd:
                    checks.close(f"get_model_state_dict()[{key!r}]", sd[key], value)

        def optim_sd() -> None:
            osd = get_optimizer_state_dict(model, opt, options=options)
            for name, ref_param in ref_params.items():
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    got = osd["state"][name][key]
                    checks.close(f"get_optimizer_state_dict {name}.{key}", got,
                                 ref_opt.state[ref_param][key])

        checks.run("get_model_state_dict", model_sd)
        if everyone == set(names):
            checks.run("get_optimizer_state_dict", optim_sd)
        else:
            # Some rank has no state for a parameter it holds no rows of: torch would pair
            # different tensors across ranks. A clear error, on every rank, before any gather.
            checks.raises("get_optimizer_state_dict (states missing on some ranks)",
                          lambda: get_optimizer_state_dict(model, opt, options=options))

    # A torch-made (torch.chunk) DTensor on the same mesh keeps DTensor's meaning.
    full = torch.arange(35.0).view(7, 5)
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    theirs = distribute_tensor(full, mesh, placements)
    checks.run("distribute_tensor round trip", lambda: checks.close(
        "distribute_tensor(...).full_tensor()", theirs.full_tensor(), full))
    if outer_optim:
        # Decided by tensor ([Note: deciding by tensor]): no parameter has 7 rows, so this is
        # torch's outer-first layout; one with a parameter's row count may be a unit's
        # inner-first sub-shards, which the spec cannot tell apart: refused.
        both = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
        checks.run("torch (Shard(0), Shard(0)) of an unregistered size", lambda: checks.close(
            "distribute_tensor(..., [Shard(0), Shard(0)]).full_tensor()", both.full_tensor(),
            full))
        like = next(iter(model.parameters()))
        same_rows = distribute_tensor(torch.zeros(like.shape), mesh, [Shard(0), Shard(0)])
        checks.raises("torch (Shard(0), Shard(0)) of a parameter's size on an outer-optim mesh",
                      same_rows.full_tensor)
    # copy_ between one of ours and a torch.chunk DTensor of the same placements: the local
    # tensors hold different rows, so a local copy would be wrong (or broadcast silently).
    for name, p in names.items():
        expected = ref_params[name].detach()
        if outer_optim:
            ours = torch.zeros_like(p)
            chunked = distribute_tensor(expected, mesh, list(p.placements))
            checks.raises(f"copy_ into zeros_like({name})", lambda o=ours, c=chunked: o.copy_(c))
            continue
        if not any(isinstance(pl, Shard) for pl in p.placements):
            continue

        def copies(n: str = name, p: torch.Tensor = p, e: torch.Tensor = expected) -> None:
            ours = torch.zeros_like(p)
            ours.copy_(distribute_tensor(e, mesh, list(p.placements)))
            checks.close(f"zeros_like({n}).copy_(distribute_tensor(...))", ours.full_tensor(), e)
            chunked = distribute_tensor(torch.zeros_like(e), mesh, list(p.placements))
            chunked.copy_(p)
            checks.close(f"distribute_tensor(...).copy_({n})", chunked.full_tensor(), e)

        checks.run(f"copy_ {name}", copies)
    if not all_ranks_ok(not checks.failures):
        return checks.failures or ["(failed on another rank)"]
    return []


def _run(ranks: RankPools, world: int, strategy: str, hsdp: str | None) -> None:
    results = ranks.run(_case, world, strategy, hsdp, timeout_s=TIMEOUT_S)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


def _compiled(rank: int, world: int, backend: str) -> list[str]:
    """``full_tensor`` inside ``torch.compile``: the gather is excluded from tracing (the sizes
    are known at run time only), so the compiled function falls back to eager there and must
    still give the right values."""
    torch.manual_seed(0)
    ref = Uneven()
    model = reference_copy(ref)
    mesh = _mesh(world, False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    checks = _Checks()
    fn = torch.compile(lambda t: t.full_tensor() * 2, backend=backend)
    for name, p in model.named_parameters():
        expected = dict(ref.named_parameters())[name]
        checks.run(f"compiled {name}", lambda n=name, p=p, e=expected: checks.close(
            f"torch.compile(full_tensor)({n})", fn(p), e * 2))
    if not all_ranks_ok(not checks.failures):
        return checks.failures or ["(failed on another rank)"]
    return []


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_full_tensor(ranks: RankPools, backend: str) -> None:
    results = ranks.run(_compiled, 2, backend, timeout_s=TIMEOUT_S)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [2, 3])  # cases of one world size in a row (one pool each)
def test_dtensor_paths(ranks: RankPools, world: int, strategy: str) -> None:
    _run(ranks, world, strategy, None)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_hsdp_outer_no_shard(ranks: RankPools, strategy: str) -> None:
    _run(ranks, 4, strategy, "no_shard")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_hsdp_outer_optim_raises(ranks: RankPools) -> None:
    """(Shard(0), Shard(0)) DTensors on an outer-optim mesh: NotImplementedError, not wrong
    values (ours are inner-first, torch's outer-first, and the spec cannot tell them apart)."""
    _run(ranks, 4, "optim_grads_params", "optim")

