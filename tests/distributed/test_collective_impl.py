"""``fully_shard(..., collective_impl=...)``: ``"auto"`` trains bitwise like ``"native"``, the
accounting (``FSDPModule.collective_stats``) says what ran, ``"native"`` keeps the count contract,
and the selection table behaves as documented.

The gloo rules substitute only buffers of at least 1 MiB (reduce-scatter) or 4 MiB
(all-gather), far above these tiny models' buffers: the training cases lower the thresholds to 0
(:func:`_substitute_all`), so every reduce-scatter and all-gather really runs as its substitute,
and one case keeps the real table with a group above the thresholds. Each comparison trains the
same model twice in the same ranks (native, then auto) from the same seed on the same batches
and compares every loss, every final parameter shard and a forward after the last step, bit for
bit. ``"native"`` itself is proven against single-process PyTorch by the parity tests; this file
proves ``"auto"`` equal to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from megatron_fsdp_v2 import CollectiveCount, MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from megatron_fsdp_v2._comm import _collective_impl as impl
from megatron_fsdp_v2._registry import state_of

from _models import OddMLP, TinyGPT, lm_loss, make_batches, mlp_loss
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TIMEOUT_S = 300
STEPS = 3

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


# --------------------------------------------------------------------------- selection table


def test_native_never_substitutes() -> None:
    for logical in (impl.ALL_GATHER, impl.REDUCE_SCATTER, impl.ALL_REDUCE):
        for backend in ("gloo", "nccl"):
            assert impl.choose("native", backend, logical, 1 << 30, 4) == logical


def test_gloo_thresholds() -> None:
    rs, ag = impl.GLOO_REDUCE_SCATTER_MIN_BYTES, impl.GLOO_ALL_GATHER_MIN_BYTES
    assert impl.choose("auto", "gloo", impl.REDUCE_SCATTER, rs, 2) == impl.ALL_REDUCE
    assert impl.choose("auto", "gloo", impl.REDUCE_SCATTER, rs, 3) == impl.ALL_REDUCE
    assert impl.choose("auto", "gloo", impl.ALL_GATHER, ag, 4) == impl.BROADCASTS
    assert impl.choose("auto", "gloo", impl.REDUCE_SCATTER, rs - 1, 4) == impl.REDUCE_SCATTER
    assert impl.choose("auto", "gloo", impl.ALL_GATHER, ag - 1, 2) == impl.ALL_GATHER
    # All-reduces are never replaced; a group of one rank has nothing to choose.
    assert impl.choose("auto", "gloo", impl.ALL_REDUCE, 1 << 30, 4) == impl.ALL_REDUCE
    assert impl.choose("auto", "gloo", impl.ALL_GATHER, 1 << 30, 1) == impl.ALL_GATHER


@pytest.mark.parametrize("backend", ["nccl", "fake", "mpi"])
def test_other_backends_stay_native(backend: str) -> None:
    """No GPU measurement says otherwise: NCCL (and unmeasured backends) keep native."""
    for logical in (impl.ALL_GATHER, impl.REDUCE_SCATTER, impl.ALL_REDUCE):
        assert impl.choose("auto", backend, logical, 1 << 30, 4) == logical


def test_rules_are_equivalents() -> None:
    """Every rule replaces a collective by one this module implements as its equivalent."""
    allowed = {(impl.REDUCE_SCATTER, impl.ALL_REDUCE), (impl.ALL_GATHER, impl.BROADCASTS)}
    for backend, rules in impl.RULES.items():
        for rule in rules:
            assert (rule.logical, rule.issued) in allowed, (backend, rule)
    assert "nccl" not in impl.RULES


def test_rule_ranges() -> None:
    rule = impl.Rule(impl.ALL_GATHER, impl.BROADCASTS, min_world=3, max_world=4,
                     min_bytes=10, max_bytes=20)
    assert rule.applies(impl.ALL_GATHER, 10, 3) and rule.applies(impl.ALL_GATHER, 20, 4)
    assert not rule.applies(impl.ALL_GATHER, 9, 3) and not rule.applies(impl.ALL_GATHER, 21, 3)
    assert not rule.applies(impl.ALL_GATHER, 15, 2) and not rule.applies(impl.ALL_GATHER, 15, 5)
    assert not rule.applies(impl.REDUCE_SCATTER, 15, 3)


@pytest.mark.parametrize("value,error", [("fast", ValueError), ("Auto", ValueError),
                                         (None, TypeError), (1, TypeError)])
def test_parse(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="collective_impl must be"):
        impl.parse_collective_impl(value)
    assert impl.parse_collective_impl("auto") == "auto"


def test_accounting_merge() -> None:
    a = impl.GroupCollectives("auto")
    a.record(impl.ALL_GATHER, impl.BROADCASTS, 3, 12)
    b = impl.GroupCollectives("auto")
    b.record(impl.ALL_GATHER, impl.BROADCASTS, 3, 6)
    b.record(impl.ALL_REDUCE, impl.ALL_REDUCE, 1, 4)
    total = impl.merge_counts([a.counts, b.counts])
    assert total == {(impl.ALL_GATHER, impl.BROADCASTS): CollectiveCount(2, 6, 18),
                     (impl.ALL_REDUCE, impl.ALL_REDUCE): CollectiveCount(1, 1, 4)}
    a.reset()
    assert a.counts == {} and total[(impl.ALL_GATHER, impl.BROADCASTS)].calls == 2


# --------------------------------------------------------------------------- helpers (ranks)


@contextlib.contextmanager
def _substitute_all() -> Iterator[None]:
    """Let the gloo rules apply at every size (the pool's ranks are reused: restored after)."""
    saved = impl.RULES["gloo"]
    impl.RULES["gloo"] = tuple(dataclasses.replace(r, min_bytes=0) for r in saved)
    try:
        yield
    finally:
        impl.RULES["gloo"] = saved


def _groups(model: nn.Module) -> list:
    return [g for m in model.modules() if (s := state_of(m)) is not None for g in s.groups]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def _check(ok: bool, message: str) -> None:
    """Fail on every rank when the check fails on any (so no rank waits in a collective)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not ok:
        raise AssertionError(message)
    if not bool(flag.item()):
        raise AssertionError(f"{message} (failed on another rank)")


@dataclasses.dataclass
class Variant:
    micro: int = 1
    mp: str = "fp32"
    model: str = "gpt"  # "gpt", "gpt_ckpt" (activation checkpointing), "odd" (OddMLP)
    zero_to_none: bool = True
    retain_graph: bool = False  # a second backward over the same graph, same window

    def __str__(self) -> str:
        return (f"N={self.micro} {self.mp} {self.model}"
                + ("" if self.zero_to_none else " zero_grad(set_to_none=False)")
                + (" retain_graph" if self.retain_graph else ""))


def _train(rank: int, world: int, collective_impl: str, strategy: str, overlap: bool,
           v: Variant, mesh: Any = None, outer: str = "no_shard") -> dict[str, Any]:
    """Train ``STEPS`` steps; returns losses, final parameter shards, a last forward, the
    accounting per step and the CommDebugMode counts per step."""
    torch.manual_seed(0)
    kind = "mlp" if v.model == "odd" else "lm"
    if v.model == "odd":
        model: nn.Module = OddMLP()
        units: list[nn.Module] = [model.inp]
    else:
        model = TinyGPT(layers=2, checkpoint="outer" if v.model == "gpt_ckpt" else None)
        units = list(model.blocks)
    kw: dict[str, Any] = dict(sharding_strategy=strategy, overlap=overlap,
                              collective_impl=collective_impl)
    if mesh is not None:
        kw.update(mesh=mesh, outer_dp_sharding_strategy=outer)
    if v.mp == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.bfloat16)
    for unit in units:
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    assert model.collective_stats() == {}, "wrapping counts nothing"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = make_batches(kind, STEPS, v.micro, world, per_rank=2)
    loss_fn = mlp_loss if kind == "mlp" else lm_loss
    losses, stats, comm_counts = [], [], []
    for step in range(STEPS):
        with CommDebugMode() as comm:
            for i in range(v.micro):
                model.set_is_last_backward(i == v.micro - 1)
                loss = loss_fn(model, batches[step][i][rank]) / v.micro
                if v.retain_graph:
                    loss.backward(retain_graph=True)
                loss.backward()
                losses.append(loss.detach().clone())
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=v.zero_to_none)
        stats.append(model.collective_stats(reset=True))
        comm_counts.append({str(k).split(".")[-1].rstrip("_"): n
                            for k, n in comm.get_comm_counts().items()})
    with torch.no_grad():  # the refresh / gather after the last step
        out = model(batches[0][0][rank][0] if kind == "mlp" else batches[0][0][rank][:, :-1])
    return dict(
        losses=losses, out=out.detach().clone(), stats=stats, comm=comm_counts,
        params=[p.to_local().detach().clone() for p in model.parameters()],  # type: ignore[operator]
        groups=len(_groups(model)), axis_size=world if mesh is None else 2,
    )


def _compare(native: dict[str, Any], auto: dict[str, Any], what: str) -> None:
    for i, (a, b) in enumerate(zip(native["losses"], auto["losses"])):
        _check(torch.equal(_bits(a), _bits(b)), f"{what}: loss {i} differs: {a} vs {b}")
    for i, (a, b) in enumerate(zip(native["params"], auto["params"])):
        _check(a.shape == b.shape and torch.equal(_bits(a), _bits(b)),
               f"{what}: parameter {i} differs after {STEPS} steps")
    _check(torch.equal(_bits(native["out"]), _bits(auto["out"])), f"{what}: last forward differs")


def _check_accounting(native: dict[str, Any], auto: dict[str, Any], what: str) -> None:
    """Native issues exactly the logical collectives; auto the same logical ones, substituted;
    both agree with what CommDebugMode saw."""
    for step, (n_stats, a_stats) in enumerate(zip(native["stats"], auto["stats"])):
        _check(all(logical == issued for logical, issued in n_stats),
               f"{what} step {step}: native issued a substitute: {n_stats}")
        logical_n = {k[0]: (c.calls, c.bytes) for k, c in n_stats.items()}
        logical_a: dict[str, tuple[int, int]] = {}
        for (logical, _), c in a_stats.items():
            calls, nbytes = logical_a.get(logical, (0, 0))
            logical_a[logical] = (calls + c.calls, nbytes + c.bytes)
        _check(logical_n == logical_a,
               f"{what} step {step}: logical collectives differ: {n_stats} vs {a_stats}")
        for (logical, issued), c in a_stats.items():
            expected = {impl.REDUCE_SCATTER: impl.ALL_REDUCE, impl.ALL_GATHER: impl.BROADCASTS,
                        impl.ALL_REDUCE: impl.ALL_REDUCE}[logical]
            _check(issued == expected, f"{what} step {step}: {logical} ran as {issued}")
            if issued == impl.BROADCASTS:  # one per rank of the axis (2 on the HSDP mesh)
                _check(c.ops == c.calls * auto["axis_size"],
                       f"{what} step {step}: {c.calls} gathers issued {c.ops} broadcasts")
        # CommDebugMode saw what the accounting says (plus clipping's norm all-reduce).
        for run, stats in (("native", n_stats), ("auto", a_stats)):
            seen = (native if run == "native" else auto)["comm"][step]
            ops = {issued: 0 for issued in ("allgather", "reduce_scatter", "allreduce",
                                            "broadcast")}
            for (_, issued), c in stats.items():
                name = {impl.ALL_GATHER: "allgather", impl.REDUCE_SCATTER: "reduce_scatter",
                        impl.ALL_REDUCE: "allreduce", impl.BROADCASTS: "broadcast"}[issued]
                ops[name] += c.ops
            got = {
                "allgather": seen.get("_allgather_base", 0)
                + seen.get("all_gather_into_tensor", 0),
                "reduce_scatter": seen.get("_reduce_scatter_base", 0)
                + seen.get("reduce_scatter_tensor", 0),
                "allreduce": seen.get("allreduce", 0) + seen.get("all_reduce", 0),
                "broadcast": seen.get("broadcast", 0),
            }
            clip = got["allreduce"] - ops["allreduce"]
            _check(clip in (0, 1) and {k: v for k, v in got.items() if k != "allreduce"}
                   == {k: v for k, v in ops.items() if k != "allreduce"},
                   f"{what} {run} step {step}: CommDebugMode saw {seen}, accounting {stats}")


def _expected(strategy: str, micro: int) -> dict[str, int]:
    """Per group and iteration after the first (the count contract of design.md §4)."""
    ag, rs, ar = {
        "no_shard": (0, 0, 1),
        "optim": (1, 1, 0),
        "optim_grads": (1, micro, 0),
        "optim_grads_params": (2 * micro, micro, 0),
    }[strategy]
    return {impl.ALL_GATHER: ag, impl.REDUCE_SCATTER: rs, impl.ALL_REDUCE: ar}


def _check_contract(native: dict[str, Any], strategy: str, v: Variant, what: str) -> None:
    if v.retain_graph or v.model == "odd":  # extra reductions / frozen groups: not the contract
        return
    want = {k: n * native["groups"] for k, n in _expected(strategy, v.micro).items() if n}
    for step, stats in enumerate(native["stats"][1:], start=1):
        got = {logical: c.calls for (logical, _), c in stats.items()}
        _check(got == want, f"{what} step {step}: native counted {got}, contract {want}")


VARIANTS = [
    Variant(),
    Variant(micro=3),
    Variant(mp="bf16"),
    Variant(micro=3, mp="bf16", zero_to_none=False),
    Variant(model="gpt_ckpt"),
    Variant(model="odd", micro=3),
    Variant(retain_graph=True),
]


def _parity_worker(rank: int, world: int, strategy: str, overlap: bool) -> None:
    with _substitute_all():
        for v in VARIANTS:
            what = f"{strategy} world {world} overlap={overlap} {v}"
            native = _train(rank, world, "native", strategy, overlap, v)
            auto = _train(rank, world, "auto", strategy, overlap, v)
            _compare(native, auto, what)
            _check_accounting(native, auto, what)
            _check_contract(native, strategy, v, what)
            substituted = {k for s in auto["stats"] for k in s if k[0] != k[1]}
            if strategy != "no_shard":
                _check(bool(substituted), f"{what}: auto substituted nothing")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [2, 3])
def test_auto_bitwise_equals_native(ranks: RankPools, world: int, strategy: str,
                                    overlap: bool) -> None:
    ranks.run(_parity_worker, world, strategy, overlap, timeout_s=TIMEOUT_S)


def _world4_worker(rank: int, world: int, strategy: str) -> None:
    with _substitute_all():
        for v in (Variant(micro=3), Variant(mp="bf16")):
            what = f"{strategy} world 4 {v}"
            native = _train(rank, world, "native", strategy, True, v)
            auto = _train(rank, world, "auto", strategy, True, v)
            _compare(native, auto, what)
            _check_accounting(native, auto, what)


def _hsdp_worker(rank: int, world: int, outer: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with _substitute_all():
        for v in (Variant(micro=3), Variant(mp="bf16")):
            for overlap in (True, False):
                what = f"HSDP 2x2 outer {outer} overlap={overlap} {v}"
                args = ("optim_grads_params", overlap, v, mesh, outer)
                native = _train(rank, world, "native", *args)
                auto = _train(rank, world, "auto", *args)
                _compare(native, auto, what)
                _check_accounting(native, auto, what)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_auto_bitwise_world4(ranks: RankPools, strategy: str) -> None:
    ranks.run(_world4_worker, 4, strategy, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_auto_bitwise_hsdp(ranks: RankPools, outer: str) -> None:
    ranks.run(_hsdp_worker, 4, outer, timeout_s=TIMEOUT_S)


def _debug_check_worker(rank: int, world: int) -> None:
    """``MFSDP_DEBUG_COLLECTIVES=1`` (an 8-byte all-gather before each collective) with the
    substitutes: still bitwise, and the check itself is neither substituted nor counted."""
    os.environ["MFSDP_DEBUG_COLLECTIVES"] = "1"
    try:
        with _substitute_all():
            v = Variant(micro=3)
            native = _train(rank, world, "native", "optim_grads_params", True, v)
            auto = _train(rank, world, "auto", "optim_grads_params", True, v)
    finally:
        del os.environ["MFSDP_DEBUG_COLLECTIVES"]
    _compare(native, auto, "debug check")
    for stats in auto["stats"]:
        _check(all(c.ops == c.calls * (world if k[1] == impl.BROADCASTS else 1)
                   for k, c in stats.items()), f"debug check counted: {stats}")


def test_with_debug_order_check(ranks: RankPools) -> None:
    ranks.run(_debug_check_worker, 2, timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------- the real table


class _Wide(nn.Module):
    """One group above both gloo thresholds (16 MiB of fp32 weights and bias), one below both."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(2048, 2048)
        self.small = nn.Linear(2048, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.tanh(self.big(x)))


def _real_table_worker(rank: int, world: int, strategy: str) -> None:
    results = {}
    for collective_impl in ("native", "auto"):
        torch.manual_seed(0)
        model = _Wide()
        fully_shard(model.big, sharding_strategy=strategy, collective_impl=collective_impl)
        fully_shard(model, sharding_strategy=strategy, collective_impl=collective_impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(7)
        for _ in range(2):
            x = torch.randn(world, 4, 2048, generator=g)[rank]
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        big = model.big.collective_stats()  # type: ignore[operator]
        whole = model.collective_stats()  # type: ignore[operator]
        results[collective_impl] = ([p.to_local().clone() for p in model.parameters()],
                                    big, whole)
    (n_params, _, n_whole), (a_params, a_big, a_whole) = results["native"], results["auto"]
    for a, b in zip(n_params, a_params):
        _check(torch.equal(_bits(a), _bits(b)), f"{strategy}: parameters differ")
    _check(all(k[0] == k[1] for k in n_whole), f"native substituted: {n_whole}")
    # The big unit's buffers are above the threshold: substituted; the root's small group not.
    _check(all(k[0] != k[1] for k in a_big), f"{strategy} big unit: {a_big}")
    small = {k: c for k, c in a_whole.items() if k not in a_big or c != a_big[k]}
    _check(all(k[0] == k[1] for k in small), f"{strategy} small root group: {a_whole}")


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_real_table(ranks: RankPools, strategy: str) -> None:
    ranks.run(_real_table_worker, 2, strategy, timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------- bitwise claim


def _rs_vs_ar_worker(rank: int, world: int) -> None:
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    """The substitution's premise on gloo: this rank's slot of an all-reduce equals the
    reduce-scatter's output bit for bit (mixed magnitudes, so a different summation order
    would show)."""
    for dtype in (torch.float32, torch.bfloat16):
        for n in (world, 7 * world, 4096 * world, 262144 * world):
            g = torch.Generator().manual_seed(100 + rank)
            x = (torch.randn(n, generator=g, dtype=torch.float64)
                 * 10.0 ** torch.randint(-4, 4, (n,), generator=g)).to(dtype)
            reduced = x.clone()
            dist.all_reduce(reduced)
            shard = torch.empty(n // world, dtype=dtype)
            reduce_scatter(shard, x)
            mine = reduced[rank * (n // world): (rank + 1) * (n // world)]
            _check(torch.equal(_bits(mine), _bits(shard)),
                   f"world {world} {dtype} {n}: all-reduce slot != reduce-scatter output")


@pytest.mark.parametrize("world", [3, 4])
def test_gloo_all_reduce_matches_reduce_scatter(ranks: RankPools, world: int) -> None:
    ranks.run(_rs_vs_ar_worker, world, timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------- misuse


def _invalid_worker(rank: int, world: int) -> None:
    model = TinyGPT()
    before = type(model)
    for value, error in (("fast", ValueError), (None, TypeError)):
        try:
            fully_shard(model, collective_impl=value)
        except error as e:
            assert "collective_impl must be" in str(e) and "native" in str(e), str(e)
        else:
            raise AssertionError(f"collective_impl={value!r} was accepted")
        assert type(model) is before and state_of(model) is None
        assert not any(hasattr(p, "to_local") for p in model.parameters())


def _disagree_worker(rank: int, world: int) -> None:
    try:
        fully_shard(TinyGPT(), collective_impl="auto" if rank == 0 else "native")
    except (ValueError, RuntimeError) as e:
        assert "collective_impl" in str(e), str(e)
    else:
        raise AssertionError("ranks with different collective_impl were not caught")


def test_invalid_value(ranks: RankPools) -> None:
    """Raised before any collective (a rank that raised alone would leave no peer waiting)."""
    ranks.run(_invalid_worker, 2, timeout_s=60)


def test_ranks_disagree(ranks: RankPools) -> None:
    ranks.run(_disagree_worker, 2, timeout_s=120)
