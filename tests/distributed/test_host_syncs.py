"""Host syncs in a steady-state training step (issue 23, item 5): no library code reads a
tensor's value on the host (``.item()``, ``bool()``, ``float()``, ``int()``, ``.tolist()``,
``torch.equal``...) during forward, backward and the optimizer step, for every strategy, with
``zero_grad()`` and ``zero_grad(set_to_none=False)``. On CUDA each such read blocks the CPU until
the GPU catches up (the CPU can no longer run ahead); on CPU it is the same call, which is what
this test counts: a dispatch mode sees every op that turns a tensor value into a Python scalar,
a patch sees ``tolist``/``numpy``, and only calls with a frame inside ``megatron_fsdp_v2/`` count.
"""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_fsdp_v2
from megatron_fsdp_v2 import fully_shard

# private: whether a group holds a window_carry scratch buffer
from megatron_fsdp_v2._registry import state_of

from _models import UnusedRootNet
from _pool import RankPools
from _training import train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TIMEOUT_S = 240.0
LIBRARY = os.path.dirname(os.path.abspath(megatron_fsdp_v2.__file__)) + os.sep
# The rank pool that runs this test's workers lives in the package too; it is not the library.
HARNESS = os.path.join(LIBRARY, "testing") + os.sep
aten = torch.ops.aten
# Ops whose result is a Python value computed from tensor data (metadata queries are not).
_VALUE_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
              aten.allclose.default}


def _library_frame() -> str | None:
    """The innermost frame of the calling stack inside the library (None: none)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(LIBRARY) and not frame.filename.startswith(HARNESS):
            return f"{os.path.relpath(frame.filename, LIBRARY)}:{frame.lineno} {frame.name}"
    return None


class _CountValueReads(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _VALUE_OPS:
            where = _library_frame()
            if where is not None:
                self.seen.append(f"{func} at {where}")
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_value_reads() -> Iterator[list[str]]:
    """Every host read of a tensor value from library code inside the block."""
    seen: list[str] = []
    patched = {}
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)
        patched[name] = original

        def spy(self: torch.Tensor, *a: Any, __original: Any = original, __name: str = name,
                **k: Any) -> Any:
            where = _library_frame()
            if where is not None:
                seen.append(f"Tensor.{__name} at {where}")
            return __original(self, *a, **k)

        setattr(torch.Tensor, name, spy)
    try:
        with _CountValueReads(seen):
            yield seen
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)


STEPS = 4
SETUP_STEPS = 2  # lazy init, the first install, the first zero_grad of what was installed
MICRO = 2
PER_RANK = 4


def _batches(world: int) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """batches[step][micro][rank], the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [[[(torch.randn(PER_RANK, 16, generator=g), torch.randn(PER_RANK, 3, generator=g))
              for _ in range(world)] for _ in range(MICRO)] for _ in range(STEPS)]


def _reductions(model: nn.Module) -> int:
    """Gradient reduction collectives issued since the last call (and resets the count)."""
    stats = model.collective_stats(reset=True)  # type: ignore[operator]
    return sum(c.calls for (logical, _), c in stats.items() if logical != "all_gather")


def _rank_run(rank: int, world: int, strategy: str, variant: str, unused: bool
              ) -> tuple[list[list[str]], list[int], list[str], bool]:
    """Trains ``fully_shard``, then single-process torch on the global batch, and compares
    their parameters after every step. ``variant``
    says how gradients are cleared after each step:

    * ``none``: ``opt.zero_grad()``; ``zeros``: ``opt.zero_grad(set_to_none=False)``;
    * ``two_optimizers``: two optimizers over halves of the parameters, both
      ``zero_grad(set_to_none=False)``;
    * ``manual``: ``p.grad.zero_()`` in a loop;
    * ``to_local_write`` / ``dtensor_write``: ``zero_grad(set_to_none=False)``, then 0.5 added
      to ``inp.weight``'s gradient through ``to_local()`` / a DTensor op, as torch adds it.

    Returns, per steady-state step, the host reads of library code and the reduction
    collectives issued, the mismatches against torch, and whether a group set installed
    gradients aside (a ``window_carry`` scratch buffer)."""
    torch.manual_seed(0)
    model = UnusedRootNet(unused)
    ref = copy.deepcopy(model)
    fully_shard(model.block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)

    def optimizers(m: nn.Module) -> list[torch.optim.Optimizer]:
        params = list(m.parameters())
        if variant == "two_optimizers":
            return [torch.optim.AdamW(params[::2], lr=1e-2, weight_decay=0.1),
                    torch.optim.AdamW(params[1::2], lr=1e-2, weight_decay=0.1)]
        return [torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)]

    opts, ref_opts = optimizers(model), optimizers(ref)
    reads: list[list[str]] = []
    reductions: list[int] = []
    seen: list[str] = []
    trained: list[dict[str, torch.Tensor]] = []  # the wrapped model's full parameters per step

    @contextmanager
    def counted(step: int) -> Iterator[None]:
        _reductions(model)
        with counting_value_reads() as found:
            yield
        seen[:] = found

    def after_step(step: int) -> None:
        if step >= SETUP_STEPS:
            reads.append(list(seen))
            reductions.append(_reductions(model))
        trained.append({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()})

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(m(batch[0]), batch[1])

    train_steps(model, opts, _batches(world), loss, rank=rank,
                clear=lambda step: _clear(model, opts, variant), around_step=counted,
                after_step=after_step)
    want: list[dict[str, torch.Tensor]] = []
    train_steps(ref, ref_opts, _batches(world), loss, rank=None,
                clear=lambda step: _clear(ref, ref_opts, variant),
                after_step=lambda step: want.append(
                    {n: p.detach().clone() for n, p in ref.named_parameters()}))
    mismatches = [f"step {step}: {name}"
                  for step, (got, ref_params) in enumerate(zip(trained, want))
                  for name, full in got.items()
                  if not torch.allclose(full, ref_params[name], rtol=1e-5, atol=1e-6)]
    carried = any(g.allocator.get(g.temporary_key("window_carry")) is not None
                  for unit in (model, model.block)
                  for g in state_of(unit).groups)  # type: ignore[union-attr]
    return reads, reductions, mismatches, carried


def _clear(model: nn.Module, opts: list[torch.optim.Optimizer], variant: str) -> None:
    if variant == "manual":
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        return
    for opt in opts:
        opt.zero_grad(set_to_none=variant == "none")
    grad = model.inp.weight.grad  # type: ignore[union-attr]
    if variant == "to_local_write":
        (grad.to_local() if isinstance(grad, DTensor) else grad).add_(0.5)
    elif variant == "dtensor_write":
        grad.add_(0.5)


CASES = [(s, v, u) for s in STRATEGIES for v in ("none", "zeros") for u in (False, True)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,variant,unused", CASES,
                         ids=[f"{s}-{v}-{'unused' if u else 'all_used'}" for s, v, u in CASES])
def test_no_host_reads_in_steady_state(ranks: RankPools, strategy: str, variant: str,
                                       unused: bool) -> None:
    """Zero host reads per steady-state step; with a parameter no rank uses, only the one read
    per group and window that decides its ``.grad=None`` (see [Note: gradients known without a
    host read]): the root's group holds it, so one read per step, not one per parameter."""
    results = ranks.run(_rank_run, 2, strategy, variant, unused, timeout_s=TIMEOUT_S)
    for rank, (reads, _, mismatches, _) in enumerate(results):
        assert not mismatches, f"rank {rank}: differs from torch: {mismatches}"
        for step, seen in enumerate(reads):
            where = f"rank {rank}, steady step {step}"
            if not unused:
                assert not seen, f"{where}: {len(seen)} host reads, first: {seen[:4]}"
            else:
                assert len(seen) <= 1 and all("reduced_nonzero" in r for r in seen), (
                    f"{where}: expected at most the unused parameters' one read: {seen}")


ACCUMULATING = ["no_shard", "optim"]  # one collective per group and window (the other two
# reduce each micro-batch, onto whatever the gradients hold, whatever they hold)
# Ways to leave values in the installed gradients after a step; the library is told none of
# them (torch's own zero_grad, no wrapper) and reads none: the next window sets them aside and
# adds them back after its one collective ([Note: HSDP window carry] in _grads.py).
IN_PLACE_WRITES = ["zeros", "two_optimizers", "manual", "to_local_write", "dtensor_write"]
REDUCTIONS_PER_STEP = 2  # the block's group and the root's, one collective each


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ACCUMULATING)
@pytest.mark.parametrize("variant", IN_PLACE_WRITES)
def test_in_place_writes_need_no_read(ranks: RankPools, strategy: str, variant: str) -> None:
    """Gradients zeroed or written in place after the step, by any means (an optimizer's
    ``zero_grad(set_to_none=False)``, two of them, ``p.grad.zero_()`` in a loop, an add
    through ``to_local()`` or a DTensor op after the zeroing): torch's numbers, no host read,
    and still one collective per group and window (no per-micro-batch fallback, no agreement
    all-reduce)."""
    results = ranks.run(_rank_run, 2, strategy, variant, False, timeout_s=TIMEOUT_S)
    for rank, (seen, issued, mismatches, carried) in enumerate(results):
        assert not mismatches, f"rank {rank}: differs from torch: {mismatches}"
        assert not any(seen), f"rank {rank}: host reads {seen}"
        assert issued == [REDUCTIONS_PER_STEP] * len(issued), f"rank {rank}: reductions {issued}"
        # no_shard adds onto the installed values (the all-reduce's 1/D keeps them, DDP's
        # arithmetic); sharded gradients are set aside, this rank's shard only.
        assert carried == (strategy == "optim"), f"rank {rank}: window_carry used: {carried}"


def _backward_to_inputs(rank: int, world: int, strategy: str) -> list[str]:
    """One step, gradients zeroed in place and 0.5 added to one; then a backward with respect
    to the input only (every unit's pre-backward runs, no parameter receives a gradient), then
    a normal step. Returns the gradients and parameters that differ from torch's."""
    torch.manual_seed(0)
    model = UnusedRootNet(False)
    ref = copy.deepcopy(model)
    fully_shard(model.block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = _batches(world)
    mismatches: list[str] = []

    def compare(where: str) -> None:
        refs = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            grad, ref_grad = param.grad, refs[name].grad
            if (grad is None) != (ref_grad is None) or grad is not None and not torch.allclose(
                    grad.full_tensor(), ref_grad, rtol=1e-5, atol=1e-6):
                mismatches.append(f"{where}: {name}.grad")
            if not torch.allclose(param.full_tensor(), refs[name], rtol=1e-5, atol=1e-6):
                mismatches.append(f"{where}: {name}")

    for step in (0, 2):
        for m, parts in enumerate(batches[step]):
            model.set_is_last_backward(m == MICRO - 1)
            (F.mse_loss(model(parts[rank][0]), parts[rank][1]) / MICRO).backward()
            gx, gy = (torch.cat([p[i] for p in parts]) for i in (0, 1))
            (F.mse_loss(ref(gx), gy) / MICRO).backward()
        compare(f"step {step}, after backward")
        opt.step()
        ref_opt.step()
        _clear(model, [opt], "to_local_write")
        _clear(ref, [ref_opt], "to_local_write")
        if step == 0:
            parts = batches[1][0]
            x = parts[rank][0].clone().requires_grad_()
            model.set_is_last_backward(True)
            F.mse_loss(model(x), parts[rank][1]).backward(inputs=[x])
            compare("after a backward to the input only")
    return mismatches


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ACCUMULATING)
def test_backward_bringing_no_gradient_keeps_written_values(ranks: RankPools,
                                                            strategy: str) -> None:
    """A window that set the written gradients aside at a pre-backward and then received
    nothing puts them back: ``.grad`` still shows what was written, as torch's does."""
    results = ranks.run(_backward_to_inputs, 2, strategy, timeout_s=TIMEOUT_S)
    for rank, mismatches in enumerate(results):
        assert not mismatches, f"rank {rank}: differs from torch: {mismatches}"
