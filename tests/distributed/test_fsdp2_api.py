"""FSDP2's arguments and methods on fully_shard: ``reshard_after_forward``, FSDP2's
``MixedPrecisionPolicy`` (``output_dtype`` included), ``offload_policy``, a list of modules,
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``,
``set_reshard_after_backward`` with ``set_requires_gradient_sync``, and
``torch.nn.utils.clip_grad_norm_`` on ranks whose shards are empty.

Distributed cases train on gloo ranks against a single-process reference that sees the same
global batch (every rank feeds the whole batch, so averaged gradients equal the reference's), and
where useful against FSDP2 itself (``torch.distributed.fsdp.fully_shard``) on the same input.
Workers collect their findings and return them; the assertions run here, after every rank
finished. Argument errors are raised before any collective, so they are checked in this process
without a process group.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from megatron_fsdp_v2 import FSDPModule, MixedPrecisionPolicy, fully_shard
from megatron_fsdp_v2._registry import record_of, state_of

from _models import shard_rows
from _pool import RankPools

TIMEOUT_S = 240  # per case, generous: the CPUs are shared
pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------------- model and helpers

class Net(nn.Module):
    """An input layer, ``layers`` blocks (each wrapped as a unit) and an output layer (root)."""

    def __init__(self, dim: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)
        )
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _net(seed: int = 0) -> tuple[Net, Net]:
    torch.manual_seed(seed)
    model = Net()
    return model, copy.deepcopy(model)


def _wrap(model: nn.Module, wrap: Any = fully_shard, **kw: Any) -> None:
    for block in model.blocks:  # type: ignore[attr-defined]
        wrap(block, **kw)
    wrap(model, **kw)


def _batches(steps: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g))
             for _ in range(micro)] for _ in range(steps)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _param_errors(model: nn.Module, ref: nn.Module, rtol: float = 1e-5,
                  atol: float = 1e-6) -> list[str]:
    """This rank's shard of each parameter against the reference's rows."""
    errors = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = ref_params[name].detach()
        if isinstance(p, DTensor) and record_of(p) is None:  # FSDP2's: a collective
            local, want = p.full_tensor().detach(), full
        elif isinstance(p, DTensor):
            lo, hi = shard_rows(p)
            local, want = p.to_local().detach(), full[lo:hi]
        else:
            local, want = p.detach(), full
        try:
            torch.testing.assert_close(local.float(), want.float(), rtol=rtol, atol=atol)
        except AssertionError as e:
            errors.append(f"{name}: {e}")
    return errors


def _count(comm: CommDebugMode, *names: str) -> int:
    counts = comm.get_comm_counts()
    return sum(v for k, v in counts.items() if str(k).split(".")[-1].rstrip("_") in names)


def _gathers(comm: CommDebugMode) -> int:
    return _count(comm, "_allgather_base", "all_gather_into_tensor",
                  "allgather_into_tensor_coalesced")


def _reduce_scatters(comm: CommDebugMode) -> int:
    return _count(comm, "_reduce_scatter_base", "reduce_scatter_tensor",
                  "reduce_scatter_tensor_coalesced")


def _n_groups(model: nn.Module) -> int:
    return sum(len(s.groups) for m in model.modules() if (s := state_of(m)) is not None)


def _train(model: nn.Module, ref: nn.Module, steps: int, micro: int, *, count_step: int = -1,
           between: Any = None) -> dict[str, Any]:
    """AdamW on both; ``micro`` micro-batches per step, the non-last ones marked with
    ``set_requires_gradient_sync(False)``. ``between(model, ref)`` runs after each non-last
    micro-batch. Returns both loss curves, the collectives of step ``count_step`` and
    parameter mismatches after each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, ref_losses, errors = [], [], []
    counts = None
    for step, parts in enumerate(_batches(steps, micro)):
        comm = CommDebugMode()
        with comm if step == count_step else _null():
            for i, batch in enumerate(parts):
                model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
                loss = _loss(model, batch) / micro
                loss.backward()
                ref_loss = _loss(ref, batch) / micro
                ref_loss.backward()
                losses.append(loss.item())
                ref_losses.append(ref_loss.item())
                if between is not None and i < micro - 1:
                    between(model, ref)
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == count_step:
            counts = (_gathers(comm), _reduce_scatters(comm))
        errors += [f"step {step}: {e}" for e in _param_errors(model, ref)]
    return {"losses": losses, "ref_losses": ref_losses, "counts": counts, "errors": errors,
            "groups": _n_groups(model)}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def _check_training(results: list[dict[str, Any]], rtol: float = 1e-5) -> None:
    for rank, r in enumerate(results):
        assert not r["errors"], f"rank {rank}: " + "\n".join(r["errors"][:5])
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=rtol, atol=1e-7,
                                   msg=lambda m: f"rank {rank} losses: {m}")


# ---------------------------------------------------------------------- reshard_after_forward

def _reshard_after_forward_worker(rank: int, world: int, how: str, micro: int) -> dict[str, Any]:
    model, ref = _net()
    if how == "argument":
        _wrap(model, reshard_after_forward=False)
    else:
        _wrap(model)
        model.set_reshard_after_forward(False)  # type: ignore[attr-defined]
    # Between forward and backward a unit keeps its gathered weights (the root included).
    out = _loss(model, _batches(1, 1)[0][0])
    gathered_after_forward = all(
        g.is_gathered for m in model.modules() if (s := state_of(m)) for g in s.groups
    )
    out.backward()
    gathered_after_backward = any(
        g.is_gathered for m in model.modules() if (s := state_of(m)) for g in s.groups
    )
    model.zero_grad()  # type: ignore[operator]
    # The same step on the reference keeps both in sync for the training below.
    _loss(ref, _batches(1, 1)[0][0]).backward()
    ref.zero_grad()
    result = _train(model, ref, steps=3, micro=micro, count_step=1)
    # A forward no backward follows keeps the weights too; an edit of the main weights before
    # the next forward must not be missed.
    _loss(model, _batches(1, 1)[0][0])
    with torch.no_grad():
        for p in (*model.parameters(), *ref.parameters()):
            p.mul_(0.5)
    after_edit = _train(model, ref, steps=1, micro=1)
    result["errors"] += [f"after edit: {e}" for e in after_edit["errors"]]
    result["losses"] += after_edit["losses"]
    result["ref_losses"] += after_edit["ref_losses"]
    result["gathered_after_forward"] = gathered_after_forward
    result["gathered_after_backward"] = gathered_after_backward
    # FSDP2 itself on the same input: the same losses.
    fsdp2, _ = _net()
    _wrap(fsdp2, torch_fully_shard, reshard_after_forward=False)
    _, ref2 = _net()
    _loss(ref2, _batches(1, 1)[0][0]).backward()
    ref2.zero_grad()
    _loss(fsdp2, _batches(1, 1)[0][0]).backward()
    fsdp2.zero_grad()
    result["fsdp2_losses"] = _train(fsdp2, ref2, steps=3, micro=micro)["losses"]
    _loss(fsdp2, _batches(1, 1)[0][0])
    with torch.no_grad():
        for p in (*fsdp2.parameters(), *ref2.parameters()):
            p.mul_(0.5)
    result["fsdp2_losses"] += _train(fsdp2, ref2, steps=1, micro=1)["losses"]
    return result


@pytest.mark.parametrize("how", ["argument", "method"])
@pytest.mark.parametrize("micro", [1, 2])
def test_reshard_after_forward_false(ranks: RankPools, how: str, micro: int) -> None:
    """ZeRO-3 with ``reshard_after_forward=False``: the reference's numbers, FSDP2's losses,
    and N all-gathers + N reduce-scatters per group per window of N micro-batches."""
    results = ranks.run(_reshard_after_forward_worker, 2, how, micro, timeout_s=TIMEOUT_S)
    _check_training(results)
    for rank, r in enumerate(results):
        assert r["gathered_after_forward"], f"rank {rank}: weights freed after forward"
        assert not r["gathered_after_backward"], f"rank {rank}: weights kept after backward"
        assert r["counts"] == (micro * r["groups"], micro * r["groups"]), (
            f"rank {rank}: (all-gathers, reduce-scatters) {r['counts']}, expected "
            f"{micro} each per group ({r['groups']} groups)"
        )
        torch.testing.assert_close(r["losses"], r["fsdp2_losses"], rtol=1e-5, atol=1e-7)


def _default_counts_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model)
    return _train(model, ref, steps=2, micro=2, count_step=1)


def test_reshard_after_forward_default_keeps_zero3_counts(ranks: RankPools) -> None:
    """Without the argument the ZeRO-3 schedule is unchanged: 2N all-gathers."""
    results = ranks.run(_default_counts_worker, 2, timeout_s=TIMEOUT_S)
    _check_training(results)
    for r in results:
        assert r["counts"] == (4 * r["groups"], 2 * r["groups"]), r["counts"]


# ---------------------------------------------------------------------- reshard_after_backward

def _reshard_after_backward_worker(rank: int, world: int, edit: bool) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model)
    model.set_reshard_after_backward(False)  # type: ignore[attr-defined]
    kept: list[bool] = []

    def between(m: nn.Module, r: nn.Module) -> None:
        kept.append(all(g.is_gathered for mod in m.modules() if (s := state_of(mod))
                        for g in s.groups))
        if edit:  # the main weights change inside the window: kept weights are stale
            with torch.no_grad():
                for p in (*m.parameters(), *r.parameters()):
                    p.mul_(0.9)

    result = _train(model, ref, steps=3, micro=2, count_step=1, between=between)
    result["kept"] = kept
    result["gathered_after_step"] = any(
        g.is_gathered for m in model.modules() if (s := state_of(m)) for g in s.groups
    )
    return result


@pytest.mark.parametrize("edit", [False, True], ids=["accumulate", "edit-inside-window"])
def test_reshard_after_backward_false(ranks: RankPools, edit: bool) -> None:
    """Kept from a non-last backward to the next forward (one all-gather fewer per group and
    window of 2); freed by the last backward; gathered again when the weights changed."""
    results = ranks.run(_reshard_after_backward_worker, 2, edit, timeout_s=TIMEOUT_S)
    _check_training(results)
    for rank, r in enumerate(results):
        assert all(r["kept"]) and r["kept"], f"rank {rank}: kept {r['kept']}"
        assert not r["gathered_after_step"], f"rank {rank}: weights kept past the last backward"
        gathers = (4 if edit else 3) * r["groups"]
        assert r["counts"] == (gathers, 2 * r["groups"]), (rank, r["counts"], gathers)


# ---------------------------------------------------------------------- FSDP2 MixedPrecisionPolicy

def _mp_worker(rank: int, world: int) -> dict[str, Any]:
    bf16 = torch.bfloat16
    # Blocks compute in bf16 and hand bf16 activations on; the root returns fp32.
    fsdp2_policies = (TorchMixedPrecisionPolicy(param_dtype=bf16),
                      TorchMixedPrecisionPolicy(param_dtype=bf16, output_dtype=torch.float32))
    ours_policies = (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16),
                     MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16,
                                          output_dtype=torch.float32))
    out: dict[str, Any] = {}
    for name, wrap, (block_policy, root_policy) in [
        ("converted", fully_shard, fsdp2_policies), ("ours", fully_shard, ours_policies),
        ("fsdp2", torch_fully_shard, fsdp2_policies),
    ]:
        model, ref = _net()
        for block in model.blocks:
            wrap(block, mp_policy=block_policy)
        wrap(model, mp_policy=root_policy)
        seen: dict[str, torch.dtype] = {}

        def recorder(key: str) -> Any:
            def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
                seen.setdefault(key, output.dtype)
            return hook

        hooks = [model.register_forward_hook(recorder("root")),
                 model.blocks[0].register_forward_hook(recorder("block"))]
        result = _train(model, ref, steps=3, micro=1)
        for hook in hooks:
            hook.remove()
        out[name] = {
            "losses": result["losses"], "dtypes": seen,
            "params": {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                       for n, p in model.named_parameters()},
            "param_dtype": next(model.parameters()).dtype,
        }
    return out


def test_fsdp2_mixed_precision_policy(ranks: RankPools) -> None:
    """FSDP2's policy is converted: bitwise the same training as our equivalent policy, bf16
    compute, ``output_dtype`` applied to the unit's outputs, fp32 sharded parameters, and
    FSDP2's losses."""
    results = ranks.run(_mp_worker, 2, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["converted"]["losses"] == r["ours"]["losses"], rank
        for n, p in r["converted"]["params"].items():
            assert torch.equal(p, r["ours"]["params"][n]), (rank, n)
        for name in ("converted", "fsdp2"):
            assert r[name]["dtypes"] == {"block": torch.bfloat16, "root": torch.float32}, (
                rank, name, r[name]["dtypes"])
            assert r[name]["param_dtype"] == torch.float32, (rank, name)
        torch.testing.assert_close(r["converted"]["losses"], r["fsdp2"]["losses"], rtol=2e-2,
                                   atol=1e-3)


# ---------------------------------------------------------------------- explicit prefetch

def _prefetch_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model)
    blocks = model.blocks
    blocks[0].set_modules_to_forward_prefetch([blocks[1], blocks[2]])  # type: ignore[operator]
    blocks[1].set_modules_to_forward_prefetch([])  # type: ignore[operator]
    blocks[2].set_modules_to_backward_prefetch([blocks[0]])  # type: ignore[operator]
    errors = []
    try:
        blocks[0].set_modules_to_forward_prefetch([model.inp])  # type: ignore[operator]
        errors.append("a module that is not a unit was accepted")
    except TypeError as e:
        if "not a fully_shard module" not in str(e):
            errors.append(f"unclear error: {e}")
    result = _train(model, ref, steps=1, micro=1)
    ctx = state_of(model).ctx  # type: ignore[union-attr]
    ctx.events = []
    second = _train(model, ref, steps=2, micro=1)
    result["losses"] += second["losses"]
    result["ref_losses"] += second["ref_losses"]
    result["errors"] += second["errors"] + errors
    result["events"] = [e for e in ctx.events if e[0] in ("unshard", "prefetch")]
    return result


def test_explicit_prefetch(ranks: RankPools) -> None:
    """Explicit lists replace the recorded-order neighbor; the numbers are unchanged."""
    results = ranks.run(_prefetch_worker, 2, timeout_s=TIMEOUT_S)
    _check_training(results)
    events = results[0]["events"]
    # One training step: forward then backward.
    one_step = events[: len(events) // 2]
    assert one_step == [
        # forward: the root prefetches blocks.0 (its recorded neighbor); blocks.0 prefetches
        # blocks.1 and blocks.2 (explicit), blocks.1 nothing (explicit empty list).
        ("unshard", "<root>"), ("prefetch", "blocks.0"),
        ("prefetch", "blocks.1"), ("prefetch", "blocks.2"),
        # backward: the root (first in forward order) has no unit before it to prefetch;
        # blocks.2 prefetches blocks.0 (explicit) instead of blocks.1, which gathers on its
        # own; blocks.1's default prefetch (blocks.0) finds it gathered already.
        ("unshard", "<root>"), ("unshard", "blocks.2"), ("prefetch", "blocks.0"),
        ("unshard", "blocks.1"),
    ], events


def _foreign_prefetch_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model)
    other, _ = _net(seed=1)
    _wrap(other)
    model.blocks[1].set_modules_to_forward_prefetch([other.blocks[0]])  # type: ignore[operator]
    raised = None
    try:
        _loss(model, _batches(1, 1)[0][0]).backward()
    except ValueError as e:
        raised = str(e)
    # Every rank raised at the same point: the next step recovers and trains correctly.
    model.blocks[1].set_modules_to_forward_prefetch([])  # type: ignore[operator]
    result = _train(model, ref, steps=2, micro=1)
    result["raised"] = raised
    return result


def test_prefetch_of_a_unit_of_another_tree_raises(ranks: RankPools) -> None:
    results = ranks.run(_foreign_prefetch_worker, 2, timeout_s=TIMEOUT_S)
    _check_training(results)
    for r in results:
        assert r["raised"] is not None and "not a unit of the same fully_shard tree" in r[
            "raised"], r["raised"]


# ---------------------------------------------------------------------- torch clip_grad_norm_

class Tiny(nn.Module):
    """At world 3 rank 2's shards are all empty: every one of its grads is None."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _clip_worker(rank: int, world: int, norm_type: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Tiny()
    ref = copy.deepcopy(model)
    fully_shard(model, timeout=30)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)
    (10 * F.mse_loss(model(x), y)).backward()
    (10 * F.mse_loss(ref(x), y)).backward()
    grads_none = [n for n, p in model.named_parameters() if p.grad is None]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    errors = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        lo, hi = shard_rows(p)
        if hi > lo:
            torch.testing.assert_close(p.grad.to_local(), ref_params[name].grad[lo:hi])
    # The route decides from the parameters: every rank raises, before any collective.
    raised = []
    for kwargs in ({"norm_type": 0.0}, {"error_if_nonfinite": True}):
        if "error_if_nonfinite" in kwargs:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.to_local().fill_(math.inf)
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, **kwargs)
            raised.append(None)
        except (ValueError, RuntimeError) as e:
            raised.append(f"{type(e).__name__}: {e}")
    # A list without fully_shard parameters is torch's own function's business.
    plain = [nn.Parameter(torch.ones(3))]
    plain[0].grad = torch.full((3,), 2.0)
    plain_norm = torch.nn.utils.clip_grad.clip_grad_norm_(plain, 1.0, 2.0)
    return {"norm": float(norm), "ref_norm": float(ref_norm), "grads_none": grads_none,
            "errors": errors, "raised": raised, "plain_norm": float(plain_norm),
            "plain_grad": plain[0].grad.tolist()}


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_torch_clip_grad_norm_with_empty_shards(ranks: RankPools, norm_type: float) -> None:
    results = ranks.run(_clip_worker, 3, norm_type, timeout_s=TIMEOUT_S)
    assert results[2]["grads_none"] == ["net.weight", "net.bias"], results[2]["grads_none"]
    for rank, r in enumerate(results):
        assert not r["errors"], (rank, r["errors"])
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), (rank, r)
        assert r["raised"][0] is not None and "norm_type=0.0" in r["raised"][0], r["raised"]
        assert r["raised"][1] is not None and "error_if_nonfinite" in r["raised"][1], r["raised"]
        assert r["plain_norm"] == pytest.approx(math.sqrt(12.0))
        assert r["plain_grad"] == pytest.approx([2.0 / math.sqrt(12.0)] * 3, rel=1e-5)


# ---------------------------------------------------------------------- offload_policy accepted

def _offload_default_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model, offload_policy=OffloadPolicy())
    return _train(model, ref, steps=1, micro=1)


def test_default_offload_policy_is_accepted(ranks: RankPools) -> None:
    _check_training(ranks.run(_offload_default_worker, 2, timeout_s=TIMEOUT_S))


# ---------------------------------------------------------------------- argument errors

def _untouched(model: nn.Module) -> bool:
    return not isinstance(model, FSDPModule) and not any(
        isinstance(p, DTensor) for p in model.parameters()
    )


@pytest.mark.parametrize("kwargs, error, needles", [
    ({"reshard_after_forward": 2}, NotImplementedError, ["reshard_after_forward=2", "HSDP"]),
    ({"reshard_after_forward": "yes"}, TypeError, ["reshard_after_forward must be a bool"]),
    ({"reshard_after_forward": True, "sharding_strategy": "optim_grads"}, ValueError,
     ["only sharding_strategy='optim_grads_params'", "'optim_grads'"]),
    ({"offload_policy": CPUOffloadPolicy()}, NotImplementedError, ["CPU offload"]),
    ({"offload_policy": "cpu"}, TypeError, ["offload_policy must be"]),
    ({"mp_policy": torch.distributed.fsdp.MixedPrecision(param_dtype=torch.bfloat16)},
     TypeError, ["megatron_fsdp_v2.MixedPrecisionPolicy", "FSDP1"]),
    ({"mp_policy": {"param_dtype": torch.bfloat16}}, TypeError,
     ["torch.distributed.fsdp.MixedPrecisionPolicy", "dict"]),
], ids=["int", "not-bool", "true-without-zero3", "cpu-offload", "offload-type", "fsdp1-mp",
        "mp-dict"])
def test_argument_errors(kwargs: dict[str, Any], error: type[Exception],
                         needles: list[str]) -> None:
    """Raised before any collective (no process group exists here), module untouched."""
    model = Net()
    with pytest.raises(error) as info:
        fully_shard(model, **kwargs)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert _untouched(model)


def test_list_of_modules_names_the_alternative() -> None:
    model = Net()
    with pytest.raises(NotImplementedError, match="common parent"):
        fully_shard([model.blocks[0], model.blocks[1]])  # type: ignore[arg-type]
    assert _untouched(model)


def _method_errors_worker(rank: int, world: int) -> list[str]:
    model = Net()
    _wrap(model)
    found = []
    for call, error, needle in [
        (lambda: model.set_reshard_after_backward(1), TypeError,
         "reshard_after_backward must be a bool"),
        (lambda: model.set_reshard_after_forward(2), NotImplementedError,
         "reshard_after_forward=2"),
        (lambda: model.set_modules_to_forward_prefetch(model.blocks[0]), TypeError,
         "expects a list"),
        (lambda: model.set_modules_to_backward_prefetch([model.out]), TypeError,
         "not a fully_shard module"),
    ]:
        try:
            call()
            found.append(f"no error (expected {error.__name__}: {needle})")
        except error as e:
            found.append("ok" if needle in str(e) else f"unclear: {e}")
    return found


def test_methods_reject_bad_arguments(ranks: RankPools) -> None:
    for rank, found in enumerate(ranks.run(_method_errors_worker, 2, timeout_s=TIMEOUT_S)):
        assert found == ["ok"] * 4, (rank, found)


def test_clip_route_is_installed_by_wrapping_and_removed_by_reset() -> None:
    """Importing the package leaves torch alone; the first wrap replaces
    ``torch.nn.utils.clip_grad_norm_`` (both attributes); ``_registry.reset`` restores it."""
    import subprocess
    import sys

    code = (
        "import torch.nn.utils as u, torch.nn.utils.clip_grad as c\n"
        "before = (u.clip_grad_norm_, c.clip_grad_norm_)\n"
        "import megatron_fsdp_v2\n"
        "from megatron_fsdp_v2 import _registry\n"
        "from megatron_fsdp_v2._torch_patches import _clip_grad\n"
        "assert (u.clip_grad_norm_, c.clip_grad_norm_) == before\n"
        "_clip_grad.install()\n"
        "routed = u.clip_grad_norm_\n"
        "_clip_grad.install()\n"
        "assert u.clip_grad_norm_ is c.clip_grad_norm_ is routed is not before[0]\n"
        "_registry.reset()\n"
        "assert (u.clip_grad_norm_, c.clip_grad_norm_) == before\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
