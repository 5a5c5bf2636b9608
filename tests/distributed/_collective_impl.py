"""What the ``test_collective_impl*`` files share: thresholds lowered to 0
(:func:`_substitute_all`), so every reduce-scatter and all-gather really runs as its
substitute; a training loop that records losses, shards and accounting; the bitwise comparison
of two runs and the count contract of ``"native"``.

Each comparison trains the same model twice in the same ranks (native, then auto) from the same
seed on the same batches and compares every loss, every final parameter shard and a forward
after the last step, bit for bit. ``"native"`` itself is proven against single-process PyTorch
by the parity tests; these files prove ``"auto"`` equal to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: lowers the gloo rule table's size floors (impl.RULES) so every collective takes the
#   substitute path
from megatron_fsdp_v2._comm import _collective_impl as impl

# private: counts the units' parameter groups (state_of(unit).groups)
from megatron_fsdp_v2._registry import state_of

from _comm_counts import CollectiveCounts
from _models import OddMLP, TinyGPT, lm_loss, make_batches, mlp_loss
from _training import train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TIMEOUT_S = 300
# The first step (lazy initialization, the first window and refresh) and one steady step, which
# the count contract is checked on; the forward after the last step refreshes / gathers the
# updated weights once more. A third step repeated the steady step's collectives (suite time).
STEPS = 2


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


def _run_variant(rank: int, world: int, collective_impl: str, strategy: str, overlap: bool,
                 v: Variant, mesh: Any = None, outer: str = "no_shard",
                 counter: type[TorchDispatchMode] = CollectiveCounts) -> dict[str, Any]:
    """Train ``STEPS`` steps; returns losses, final parameter shards, a last forward, the
    accounting per step and the dispatched collectives per step (``counter``: CommDebugMode's
    counts, see [Note: counting collectives cheaply] in ``_comm_counts.py``)."""
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
    counters: list[Any] = []
    stats, comm_counts = [], []

    @contextlib.contextmanager
    def counted(step: int) -> Iterator[None]:
        with counter() as comm:
            counters.append(comm)
            yield

    def record(step: int) -> None:
        stats.append(model.collective_stats(reset=True))
        comm_counts.append({str(k).split(".")[-1].rstrip("_"): n
                            for k, n in counters[step].get_comm_counts().items()})

    losses = [loss for step_losses in train_steps(
        model, opt, batches, loss_fn, rank=rank, backward_twice=v.retain_graph, clip_norm=1.0,
        set_to_none=v.zero_to_none, around_step=counted, after_step=record)
        for loss in step_losses]
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
    both agree with the collectives dispatched (CommDebugMode's counts)."""
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
        # The dispatcher saw what the accounting says (plus clipping's norm all-reduce).
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
                   f"{what} {run} step {step}: dispatched {seen}, accounting {stats}")


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
