"""``fully_shard(..., enable_trace_pool=True)`` against the storage-freeing default, on gloo ranks.

Each case trains the same model twice in the same ranks, once per allocator, on the same
per-rank batches (AdamW, several steps), and requires *bitwise* equal losses and parameters:
the pool only changes where temporary buckets live, never what is computed. With the pool, every
temporary bucket handed out in the steady steps (after the warm-up steps that record and plan
every pattern of the case) must keep its ``data_ptr()``, come from the arena, and no replan may
happen any more. Cases: the four strategies at world 2 and 3 (empty shards), one and three
micro-batches, bf16 compute with bf16 reduction (so ``optim``/``no_shard`` have a
communication workspace), activation checkpointing, a block skipped on odd steps (control flow
that changes the trace), a retained graph backwarded twice, ``release_memory_pool()`` in the
middle of training, gathered weights kept after forward or after backward, evaluation
forwards on odd steps, a block called twice or with its output unused on odd steps, and HSDP
2x2 with outer ``no_shard`` and outer ``optim``. Plus the errors: a non-bool argument, units
that disagree, ``release_memory_pool()`` between forward and backward, and a retained graph
backwarded after the pool moved its buckets (or after a release).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard, memory_report

# private: counts the library's collectives by name (wraps _collectives' functions)
from megatron_fsdp_v2._comm import _collectives

# private: the tree's allocator (trace-pool arena, buckets handed out)
from megatron_fsdp_v2._registry import state_of

from _models import MLPStack
from _pool import RankPools
from _training import train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
STEPS = 6
WARMUP = 3  # steps that may record and plan (an alternating trace needs two of them)
TIMEOUT_S = 240.0


def _stack(ckpt: bool = False) -> MLPStack:
    """inp -> 4 residual MLP blocks (odd widths: uneven, sometimes empty shards; each a unit) ->
    head (the root unit owns inp and head); ``ckpt``: non-reentrant checkpoint around each block
    call. A step sets ``skip`` / ``twice`` / ``discard`` (see :class:`MLPStack`)."""
    return MLPStack(layers=4, inp_tanh=False, checkpoint="outer" if ckpt else None,
                    reentrant=False)


def _wrap(world: int, pool: bool, strategy: str, mp: str, outer: str | None,
          ckpt: bool, **extra: Any) -> MLPStack:
    torch.manual_seed(0)
    model = _stack(ckpt=ckpt)
    kwargs: dict[str, Any] = dict(sharding_strategy=strategy, timeout=60.0,
                                  enable_trace_pool=pool, **extra)
    if mp == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.bfloat16)
    if outer is not None:
        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2),
                                          mesh_dim_names=("replicate", "shard"))
        kwargs["outer_dp_sharding_strategy"] = outer
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(3, 5, generator=g), torch.randn(3, 3, generator=g)


def _rank_run(rank: int, world: int, *, pool: bool, strategy: str, micro: int = 1,
              mp: str = "fp32", outer: str | None = None, ckpt: bool = False,
              skip: bool = False, retain: bool = False, release_at: int | None = None,
              keep_after_backward: bool = False, evaluate: bool = False, twice: bool = False,
              discard: bool = False, **extra: Any) -> dict[str, Any]:
    model = _wrap(world, pool, strategy, mp, outer, ckpt, **extra)
    if keep_after_backward:
        model.set_reshard_after_backward(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    root = state_of(model)
    assert root is not None
    handed: list[dict[Any, set[int]]] = []  # per step: key -> data_ptr()s handed out
    stats: list[tuple[int, int]] = []  # per step: (replans, allocations outside the arena)
    patched: list[Any] = []
    evaluated: dict[int, float] = {}  # step -> the evaluation forward's loss

    def before_step(step: int) -> None:
        model.skip = {2} if skip and step % 2 else set()
        model.twice = {1} if twice and step % 2 else set()
        model.discard = {2} if discard and step % 2 else set()
        handed.append({})
        if evaluate and step % 2 and patched:  # an evaluation forward on odd steps
            ex, ey = _batch(rank, step, 9)
            with torch.no_grad():
                evaluated[step] = F.mse_loss(model(ex), ey).item()

    def loss_fn(m: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(m(x).float(), y)
        if not patched:  # the tree's allocator exists from the first forward on
            alloc = root.ctx.allocator  # type: ignore[union-attr]
            allocate = alloc.allocate

            def recording(key: Any, *args: Any, _a: Any = allocate, **kw: Any) -> Any:
                bucket = _a(key, *args, **kw)
                handed[-1].setdefault(key, set()).add(bucket.data_ptr())
                return bucket

            alloc.allocate = recording  # type: ignore[method-assign]
            patched.append(alloc)
        return loss

    def after_step(step: int) -> None:
        if release_at == step:
            model.release_memory_pool()  # type: ignore[attr-defined]
        alloc = patched[0]
        stats.append((getattr(alloc, "replans", 0), getattr(alloc, "outside_arena", 0)))

    # This rank's micro-batches (each rank draws its own).
    batches = [[_batch(rank, step, i) for i in range(micro)] for step in range(STEPS)]
    per_step = train_steps(model, opt, batches, loss_fn, rank=rank,
                           select=lambda parts, r: parts, divide_by_micro=False,
                           backward_twice=retain, before_step=before_step,
                           after_step=after_step)
    losses: list[float] = []
    for step, step_losses in enumerate(per_step):
        losses += [evaluated[step]] if step in evaluated else []
        losses += [loss.item() for loss in step_losses]
    report = memory_report(model)
    return {
        "losses": losses,
        "params": [p.to_local().detach().clone() for p in model.parameters()],
        "handed": handed,
        "stats": stats,
        "arena": report.trace_pool_arena,
        "peak": report.temporary_peak,
        "report": str(report),
    }


_COLLECTIVES = ("all_gather_into", "reduce_scatter_into", "all_reduce_inplace")


def _counting(case: dict[str, Any], rank: int, world: int, pool: bool) -> dict[str, Any]:
    """``_rank_run``, counting the library's collectives by kind (they must not change)."""
    counts = dict.fromkeys(_COLLECTIVES, 0)
    originals = {name: getattr(_collectives, name) for name in _COLLECTIVES}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in _COLLECTIVES:
        setattr(_collectives, name, counted(name))
    try:
        result = _rank_run(rank, world, pool=pool, **case)
    finally:
        for name, fn in originals.items():
            setattr(_collectives, name, fn)
    result["counts"] = counts
    return result


def _compare(rank: int, world: int, **case: Any) -> dict[str, Any]:
    off = _counting(case, rank, world, pool=False)
    on = _counting(case, rank, world, pool=True)
    problems = []
    if on["counts"] != off["counts"] or not any(off["counts"].values()):
        problems.append(f"collectives differ: {on['counts']} vs {off['counts']}")
    if on["losses"] != off["losses"]:
        problems.append(f"losses differ: {on['losses']} vs {off['losses']}")
    for i, (a, b) in enumerate(zip(on["params"], off["params"])):
        if not torch.equal(a, b):
            problems.append(f"parameter {i} differs: max {(a.float() - b.float()).abs().max()}")
    steady = on["handed"][WARMUP:]
    if case.get("release_at") is None:  # (after a release, buckets get new addresses)
        for key in {k for step in steady for k in step}:
            ptrs = set().union(*(step.get(key, set()) for step in steady))
            if len(ptrs) != 1:
                problems.append(f"bucket {key} moved in steady steps: {len(ptrs)} addresses")
        # (replans, allocations outside the arena since the last plan) stop changing.
        if on["stats"][-1] != on["stats"][WARMUP - 1]:
            problems.append(f"replanned or served outside the arena after the warm-up: "
                            f"{on['stats']}")
    if on["peak"] != off["peak"]:
        problems.append(f"storage-freeing peak differs: {on['peak']} vs {off['peak']}")
    return {"problems": problems, "arena": on["arena"], "report": on["report"],
            "keys": len({k for step in steady for k in step}), "stats": on["stats"]}


CASES: list[tuple[str, int, dict[str, Any]]] = []
for _world in (2, 3):
    for _micro in (1, 3):
        for _s in STRATEGIES:
            CASES.append((f"{_s}-w{_world}-n{_micro}", _world,
                          dict(strategy=_s, micro=_micro)))
for _s in STRATEGIES:
    CASES.append((f"{_s}-bf16-n3", 2, dict(strategy=_s, micro=3, mp="bf16")))
    CASES.append((f"{_s}-ckpt", 2, dict(strategy=_s, ckpt=True)))
    CASES.append((f"{_s}-skip-odd-steps", 2, dict(strategy=_s, skip=True)))
    CASES.append((f"{_s}-skip-ckpt-n2", 3, dict(strategy=_s, skip=True, ckpt=True, micro=2)))
CASES.append(("optim_grads_params-no-reshard-after-forward", 2,
              dict(strategy="optim_grads_params", reshard_after_forward=False, micro=2)))
CASES.append(("optim_grads_params-keep-after-backward-n3", 2,
              dict(strategy="optim_grads_params", keep_after_backward=True, micro=3)))
for _s in ("optim_grads", "optim_grads_params"):
    CASES.append((f"{_s}-eval-on-odd-steps", 3, dict(strategy=_s, evaluate=True, micro=2)))
    CASES.append((f"{_s}-block-twice-on-odd-steps", 2, dict(strategy=_s, twice=True)))
    CASES.append((f"{_s}-output-unused-on-odd-steps", 2, dict(strategy=_s, discard=True)))
    CASES.append((f"{_s}-block-twice-ckpt-skip", 3,
                  dict(strategy=_s, twice=True, ckpt=True, skip=True, micro=2)))
for _s in ("optim", "optim_grads_params"):
    CASES.append((f"{_s}-retain-graph", 2, dict(strategy=_s, retain=True)))
    CASES.append((f"{_s}-release", 2, dict(strategy=_s, release_at=3, micro=2)))
for _s in STRATEGIES:
    CASES.append((f"hsdp-{_s}-outer-no_shard-n2", 4,
                  dict(strategy=_s, outer="no_shard", micro=2)))
CASES.append(("hsdp-outer-optim-n1", 4, dict(strategy="optim_grads_params", outer="optim")))
CASES.append(("hsdp-outer-optim-n3-bf16", 4,
              dict(strategy="optim_grads_params", outer="optim", micro=3, mp="bf16")))
CASES.sort(key=lambda c: c[1])  # one pool per world size


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("name", "world", "case"), CASES, ids=[c[0] for c in CASES])
def test_trace_pool_matches_storage_freeing(ranks: RankPools, name: str, world: int,
                                            case: dict[str, Any]) -> None:
    results = ranks.run(_compare, world, timeout_s=TIMEOUT_S - 20, **case)
    for rank, result in enumerate(results):
        assert not result["problems"], f"rank {rank}: " + "; ".join(result["problems"])
        if result["keys"]:
            assert result["arena"] > 0 and "trace_pool_arena=" in result["report"]
        else:  # an empty trace: no arena, nothing said about it
            assert result["arena"] == 0 and "trace_pool_arena" not in result["report"]
    if case["strategy"] == "optim_grads_params" or case.get("mp") == "bf16":
        assert results[0]["keys"] > 0  # the comparison covered buckets at all
    if case == dict(strategy="no_shard", micro=1):
        assert results[0]["keys"] == 0 and results[0]["stats"][-1] == (0, 0)


# ------------------------------------------------------------------------------------ errors

def _errors(rank: int, world: int) -> list[str]:
    seen = []
    try:
        fully_shard(_stack(), enable_trace_pool=1)  # type: ignore[arg-type]
    except TypeError as e:
        seen.append(f"TypeError: {e}")
    mixed = _stack()
    for block in mixed.blocks:
        fully_shard(block, enable_trace_pool=True, timeout=60.0)
    fully_shard(mixed, timeout=60.0)
    try:
        mixed(torch.randn(2, 5))
    except ValueError as e:
        seen.append(f"ValueError: {e}")

    model = _wrap(world, True, "optim_grads_params", "fp32", None, False)
    x, y = _batch(rank, 0, 0)
    F.mse_loss(model(x), y).backward()  # the first iteration: recording
    loss = F.mse_loss(model(x), y)
    try:
        model.release_memory_pool()  # type: ignore[attr-defined]
    except RuntimeError as e:
        seen.append(f"RuntimeError: {e}")
    loss.backward(retain_graph=True)  # the step still completes
    kept = F.mse_loss(model(x), y)
    kept.backward(retain_graph=True)
    model.release_memory_pool()  # type: ignore[attr-defined]
    try:
        kept.backward(retain_graph=True)  # the weights it saved are no longer the pool's
    except RuntimeError as e:
        seen.append(f"RuntimeError: {e}")
    F.mse_loss(model(x), y).backward()  # records again
    F.mse_loss(model(x), y).backward()  # plans: the gathered weights move to the arena
    try:
        kept.backward()  # over the graph built before they moved
    except RuntimeError as e:
        seen.append(f"RuntimeError: {e}")
    return seen


@pytest.mark.timeout(TIMEOUT_S)
def test_trace_pool_errors(ranks: RankPools) -> None:
    for seen in ranks.run(_errors, 2, timeout_s=TIMEOUT_S - 20):
        assert len(seen) == 5, seen
        assert "enable_trace_pool must be a bool" in seen[0]
        assert "must be the same for every unit" in seen[1] and "'blocks.0'" in seen[1]
        assert "middle of a step" in seen[2]
        assert "built before the trace pool" in seen[3]
        assert "built before the trace pool" in seen[4]


def _arena_freed(rank: int, world: int, strategy: str) -> bool:
    """Whether the arena's storage is free after ``release_memory_pool()``, before the next
    forward: compute views and the gradient aliases cached over a bucket in it must let go
    (``optim_grads``: autograd writes gradients into the ``staged_grad`` scratch buffer through
    cached aliases)."""
    model = _wrap(world, True, strategy, "fp32", None, False)
    for step in range(3):  # record, plan, run on the plan
        x, y = _batch(rank, step, 0)
        F.mse_loss(model(x), y).backward()
        model.zero_grad()  # type: ignore[operator]
    allocator = state_of(model).ctx.allocator  # type: ignore[union-attr]
    (arena,) = allocator._arenas.values()
    old = StorageWeakRef(arena.untyped_storage())
    del arena
    model.release_memory_pool()  # type: ignore[attr-defined]
    gc.collect()
    return old.expired()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_release_frees_the_arena_before_the_next_forward(ranks: RankPools,
                                                         strategy: str) -> None:
    assert ranks.run(_arena_freed, 2, strategy, timeout_s=TIMEOUT_S - 20) == [True, True]
