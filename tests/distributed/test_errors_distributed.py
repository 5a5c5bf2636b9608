"""Bad input on spawned ranks: a clear TypeError/ValueError (RuntimeError for runtime misuse)
that names the problem and the fix, raised before any collective, with the module left
untouched; also when the ranks disagree, or one rank alone is wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _bad_input import (
    TwoLinear,
    WithParam,
    expect_rejected,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: forgets the cached process groups; the default collective timeout
from megatron_fsdp_v2._comm import _process_groups

# private: the process group each unit's parameter group uses
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import run_distributed

from _models import TinyGPT, lm_loss, make_batches

# ---------------------------------------------------------------------- distributed sweep

def _local_cases(rank: int, world: int) -> list[tuple[str, Callable[[], None]]]:
    """Errors every rank raises identically, without a collective."""
    mesh = init_device_mesh("cpu", (world,))
    cases: list[tuple[str, Callable[[], None]]] = []

    def case(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
        def register(fn: Callable[[], None]) -> Callable[[], None]:
            cases.append((name, fn))
            return fn
        return register

    @case("wrap twice")
    def _() -> None:
        expect_rejected(lambda: fully_shard(nn.Linear(4, 4)), fully_shard, ValueError,
                        r"FSDPLinear is already wrapped by fully_shard; wrap each module once")

    @case("tied weights wrapped separately")
    def _() -> None:
        def make() -> nn.Module:
            model = TinyGPT(tie=True)
            fully_shard(model.head)  # manages the tied weight
            return model
        expect_rejected(make, lambda m: fully_shard(m.tok), ValueError,
                        r"parameter 'weight' is already managed by another fully_shard unit "
                        r"\('weight' of Linear at 0x[0-9a-f]+\).*tied.*wrap a common ancestor",
                        collectives="check")
        expect_rejected(make, fully_shard, ValueError,
                        r"parameter 'tok.weight' is already managed by another fully_shard unit",
                        collectives="check")
        # The fix: wrap the common ancestor only; it manages the tied weight once.
        model = fully_shard(TinyGPT(tie=True))
        assert model.tok.weight is model.head.weight

    @case("child wrapped after its parent")
    def _() -> None:
        expect_rejected(lambda: fully_shard(TinyGPT()), lambda m: fully_shard(m.blocks[0]),
                        ValueError, r"parameter 'ln1.weight' is already managed by another "
                                    r"fully_shard unit.*wrap children before their parents",
                        collectives="check")

    @case("parameters on two devices")
    def _() -> None:
        expect_rejected(lambda: TwoLinear(b=nn.Linear(4, 4, device="meta")), fully_shard,
                        ValueError, r"must be on one device, found 'a.weight' on cpu, 'b.weight' "
                                    r"on meta; move the module with module.to\(device\)",
                        collectives="check")

    @case("parameters not on the mesh's device type")
    def _() -> None:
        # The mesh was never initialized (no group to check on): raised locally.
        cuda_mesh = DeviceMesh("cuda", torch.arange(world), _init_backend=False)
        expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, mesh=cuda_mesh),
                        ValueError, r"parameter 'weight' is on cpu but the mesh is on 'cuda'; "
                                    r"move the module to cuda before fully_shard")

    @case("not a mesh")
    def _() -> None:
        expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, mesh=[0, 1]),
                        TypeError, r"mesh must be a torch.distributed.DeviceMesh .* got list")

    mesh_3d = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("pp", "rep", "dp"))
    mesh_2d = init_device_mesh("cpu", (1, world))  # collective; no dimension names

    @case("3-D mesh, unnamed 2-D mesh")
    def _() -> None:
        expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, mesh=mesh_3d),
                        ValueError, rf"mesh must be 1-D \(data parallel\) or 2-D \(HSDP: "
                                    rf"replicate x shard\), got a 3-D mesh of shape "
                                    rf"\(1, 1, {world}\); pass a 1-D sub-mesh \(e.g. "
                                    rf"mesh\['dp'\]\)")
        expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, mesh=mesh_2d),
                        ValueError, r"a 2-D mesh \(HSDP\) needs dimension names")

    @case("main_grads_dtype differs from the parameters' dtype")
    def _() -> None:
        mp = MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
        expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, mp_policy=mp),
                        ValueError, r"main_grads_dtype=torch.bfloat16 differs from the main "
                                    r"weight dtype torch.float32.*set main_params_dtype",
                        collectives="check")

    @case("ignored_params")
    def _() -> None:
        stranger = nn.Parameter(torch.zeros(3, 5))
        expect_rejected(lambda: nn.Linear(4, 4),
                        lambda m: fully_shard(m, ignored_params=[stranger]),
                        ValueError, r"ignored_params contains a parameter of shape \(3, 5\) that "
                                    r"is not in Linear; pass only parameters of the module",
                        collectives="check")
        expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, ignored_params=m.bias),
                        TypeError, r"ignored_params must be an iterable of parameters .* got a "
                                   r"single tensor",
                        collectives="check")
        expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, ignored_params=["bias"]),
                        TypeError, r"ignored_params must contain parameters \(tensors\), got str; "
                                   r"pass module.get_parameter\(name\)",
                        collectives="check")

    @case("unsupported parameter dtypes and shapes")
    def _() -> None:
        expect_rejected(lambda: WithParam(torch.zeros(3, dtype=torch.int64)), fully_shard,
                        TypeError, r"parameter 'extra' has dtype torch.int64; fully_shard supports "
                                   r"torch.float32, .*Cast it .* or pass it in ignored_params",
                        collectives="check")
        expect_rejected(lambda: WithParam(torch.zeros(3, dtype=torch.complex64), True), fully_shard,
                        TypeError, r"parameter 'extra' has dtype torch.complex64",
                        collectives="check")
        expect_rejected(lambda: WithParam(torch.zeros((), dtype=torch.float32), True), fully_shard,
                        ValueError, r"parameter 'extra' is 0-dimensional.*shape \(1,\)",
                        collectives="check")
        expect_rejected(lambda: WithParam(torch.eye(3).to_sparse(), True), fully_shard,
                        TypeError, r"parameter 'extra' has layout torch.sparse_coo; .*dense",
                        collectives="check")
        # The documented way out works: ignore it.
        m = WithParam(torch.zeros(3, dtype=torch.int64))
        fully_shard(m, ignored_params=[m.extra])
        assert m.extra.dtype == torch.int64

    dtensor = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])  # collective

    @case("parameter that is already a DTensor")
    def _() -> None:
        def make() -> nn.Module:
            m = nn.Linear(4, 4)
            m.weight = nn.Parameter(dtensor.detach().clone())
            return m
        expect_rejected(make, fully_shard, ValueError,
                        r"parameter 'weight' is a DTensor on .*: the data-parallel mesh itself",
                        collectives="check")

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))  # collective
    torch_fsdp = nn.Linear(4, 4)
    torch.distributed.fsdp.fully_shard(torch_fsdp, mesh=mesh)  # collective-free

    @case("module wrapped by DDP or torch FSDP")
    def _() -> None:
        expect_rejected(lambda: ddp, fully_shard, ValueError,
                        r"fully_shard got a module already wrapped by DistributedDataParallel "
                        r"\(DistributedDataParallel\); use one data-parallel wrapper per module: "
                        r"pass its .module instead")
        expect_rejected(lambda: torch_fsdp, fully_shard, ValueError,
                        r"already wrapped by torch.distributed.fsdp.fully_shard \(FSDPLinear\); "
                        r"use one data-parallel wrapper per module: pass a fresh, unwrapped module")

    return cases


def _optimizer_before_wrap(rank: int, world: int) -> None:
    """A runtime misuse: caught at the first step (before the optimizer changes anything)."""
    torch.manual_seed(0)
    batch = make_batches("lm", 1, 1, world, per_rank=2)[0][0][rank]
    for nested, warm in ((True, False), (False, True)):
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if warm:  # stepped (and cached by the step hook) before wrapping
            lm_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
        if nested:
            for block in model.blocks:
                fully_shard(block)
        fully_shard(model)
        lm_loss(model, batch).backward()
        # The stale parameters are ZeRO-3 compute views whose storage is freed: compare ids.
        state_before = [id(p) for g in opt.param_groups for p in g["params"]]
        steps_before = [float(s["step"]) for s in opt.state.values()]
        with pytest.raises(RuntimeError, match=r"AdamW holds parameters that fully_shard replaced "
                           r"\(\d+, first: '[\w.]+' of (FSDP)?\w+ at 0x[0-9a-f]+, shape .*built "
                           r"before wrapping.*Build the optimizer after fully_shard"):
            opt.step()
        assert state_before == [id(p) for g in opt.param_groups for p in g["params"]]
        assert steps_before == [float(s["step"]) for s in opt.state.values()], "it stepped"
        # The fix works.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        lm_loss(model, batch).backward()
        opt.step()


def _rank_disagreement_cases(rank: int, world: int) -> None:
    """Ranks that wrap differently: every rank fails at wrap time, naming the first difference;
    the module stays untouched (one small all-gather is the only collective)."""
    cases = [
        ("strategy", lambda: nn.Linear(4, 4),
         {"sharding_strategy": "optim" if rank == 0 else "no_shard"},
         r"rank 0 has 'sharding_strategy: optim' but rank 1 has 'sharding_strategy: no_shard'"),
        ("model", lambda: nn.Linear(4, 4 + (rank > 0)), {},
         r"rank 0 has 'parameter weight: shape=\(4, 4\).*' but rank 1 has 'parameter weight: "
         r"shape=\(5, 4\)"),
        ("class", lambda: nn.Linear(4, 4) if rank == 0 else nn.Bilinear(2, 2, 4), {},
         r"rank 0 has 'module class: Linear' but rank 1 has 'module class: Bilinear'"),
        ("mp_policy", lambda: nn.Linear(4, 4),
         {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16 if rank else None)},
         r"rank 0 has 'mp_policy: .*param_dtype=None.*' but rank 1 has 'mp_policy: "
         r".*param_dtype=torch.bfloat16"),
        ("ignored", lambda: nn.Linear(4, 4), {"ignored": rank > 0},
         r"rank 0 has 'number of managed parameters: 2' but rank 1 has 'number of managed "
         r"parameters: 1'"),
        ("padding", lambda: nn.Linear(4, 4), {"max_padding_ratio": 0.01 * (rank + 1)},
         r"rank 0 has 'max_padding_ratio: 0.01' but rank 1 has 'max_padding_ratio: 0.02'"),
        # Last: ranks now cache different groups for "the same" timeout; cleared below.
        ("timeout", lambda: nn.Linear(4, 4), {"timeout": 30 + rank},
         r"rank 0 has 'timeout: 30.0' but rank 1 has 'timeout: 31.0'"),
    ]
    for name, make, kwargs, pattern in cases:
        kwargs = dict(kwargs)

        def call(m: nn.Module, kwargs: dict = kwargs) -> None:
            if kwargs.pop("ignored", False):
                kwargs["ignored_params"] = [m.bias]
            fully_shard(m, **kwargs)
        msg = expect_rejected(make, call, ValueError,
                              r"ranks disagree on what fully_shard wraps: "
                              + pattern + r".*every rank must wrap the same model",
                              collectives=True)
        assert msg, name
    _process_groups.clear_process_groups()
    # The same wrap on every rank still works afterwards.
    fully_shard(nn.Linear(4, 4), timeout=30)


def _invalid_on_one_rank(rank: int, world: int) -> None:
    """A parameter that is invalid on rank 1 only (each rank checks its own parameters): every
    rank raises the same error at once, through the cross-rank check, instead of ranks 0 and 2
    waiting in it for the collective timeout (5 minutes here)."""
    start = time.monotonic()
    make = lambda: WithParam(torch.zeros(3, dtype=torch.int64 if rank == 1 else torch.float32))  # noqa: E731
    expect_rejected(make, fully_shard, TypeError,
                    r"parameter 'extra' has dtype torch.int64; fully_shard supports .*"
                    r"\[fully_shard: raised on rank 1; every rank raises this error\]",
                    collectives="check")
    assert time.monotonic() - start < 30, "the other ranks waited for the timeout"
    # Afterwards the ranks are in step: a valid wrap works.
    fully_shard(nn.Linear(4, 4))


def _timeout_groups(rank: int, world: int) -> None:
    """The ``timeout`` argument: one group per distinct value over the mesh's ranks, the mesh's
    own group for ``None``; collectives run on it."""
    a, b, c, d = (nn.Linear(4, 4) for _ in range(4))
    fully_shard(a, timeout=timedelta(seconds=7))
    fully_shard(b, timeout=7.0)
    fully_shard(c)  # DEFAULT_TIMEOUT
    fully_shard(d, timeout=None)
    ga, gb, gc, gd = (state_of(m).groups[0].process_group for m in (a, b, c, d))
    assert ga is gb, "one group per distinct timeout"
    assert ga is not gc and gc is not gd
    assert gd is state_of(d).groups[0].mesh.get_group()
    assert dist.get_process_group_ranks(ga) == list(range(world))
    assert _process_groups.DEFAULT_TIMEOUT == timedelta(minutes=5)
    for m in (a, b, c, d):
        m(torch.ones(2, 4)).sum().backward()


def _errors_worker(rank: int, world: int) -> list[str]:
    failures = []
    for name, fn in _local_cases(rank, world):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - collect them all, report together
            failures.append(f"{name}: {type(e).__name__}: {e}")
    for fn in (_invalid_on_one_rank, _timeout_groups, _optimizer_before_wrap,
               _rank_disagreement_cases):
        try:
            fn(rank, world)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{fn.__name__}: {type(e).__name__}: {e}")
            break  # collectives may be out of step now
    return failures


def test_bad_input_distributed() -> None:
    results = run_distributed(_errors_worker, 3, timeout_s=120)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
