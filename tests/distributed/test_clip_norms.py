"""Every p-norm and ``foreach`` setting of gradient clipping at world 3 (uneven shards, and a model
so small that one rank holds no rows at all), in the three ways a user calls it:

* ``megatron_fsdp_v2.clip_grad_norm_(model.parameters(), ...)``;
* ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` (routed to ours);
* torchtitan's ``torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])``
  then ``torch.nn.utils.clip_grads_with_norm_`` (every rank holds a gradient of every
  parameter, zero rows where its shard is empty, so every rank's list is the same).

Each must return the norm single-process ``torch.nn.utils.clip_grad_norm_`` returns on the same
model and batch, leave the same clipped gradients (each rank's rows), and issue the same
collectives on every rank. FSDP2 (``torch.distributed.fsdp.fully_shard``) runs in the same case
as a control, except for the inf-norm, which FSDP2 cannot compute on a rank whose shard of a
parameter is empty (torch raises there). Every rank feeds the whole batch, so averaged
gradients equal the reference's.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import clip_grad_norm_, fully_shard

from _comm_counts import CollectiveCounts
from _models import ThinMLP, all_ranks_ok, shard_rows
from _pool import RankPools

TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(900)
NORM_TYPES = (1.0, 2.0, 3.0, math.inf)
FOREACH = (None, True, False)
FORMS = ("ours", "torch_route", "titan")
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _tiny() -> nn.Module:
    """Three values: at world 3 one rank holds no rows (every grad None there)."""
    return nn.Sequential(nn.Linear(2, 1))


def _batch(model_kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(8, 5 if model_kind == "mlp" else 2, generator=g), torch.randn(
        8, 1, generator=g)


def _backward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    for p in model.parameters():
        p.grad = None
    x, y = batch
    # Scaled so the norms are well above max_norm for every p and clipping really scales.
    (10.0 * F.mse_loss(model(x), y)).backward()


def _clip(form: str, model: nn.Module, max_norm: float, p: float,
          foreach: bool | None) -> torch.Tensor:
    if form == "ours":
        return clip_grad_norm_(model.parameters(), max_norm, p, foreach=foreach)
    if form == "torch_route":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=p,
                                              foreach=foreach)
    # torchtitan's clip_grad_norm_ (torchtitan/distributed/utils.py), as written there.
    params = list(model.parameters())
    grads = [q.grad for q in params if q.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, p, False, foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _grad_errors(model: nn.Module, ref: nn.Module, what: str) -> list[str]:
    """This rank's clipped gradients against the reference's (its rows of each)."""
    errors = []
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}
    for name, q in model.named_parameters():
        want = ref_grads[name]
        if isinstance(q, DTensor) and q.placements[0].is_shard():
            lo, hi = shard_rows(q)
            want = want[lo:hi]
            if q.grad is None:  # even an empty shard holds a (zero-row) gradient, as FSDP2
                errors.append(f"{what} {name}: no gradient for rows {lo}..{hi}")
                continue
        got = q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-7):
            errors.append(f"{what} {name}: max error {(got - want).abs().max().item():.3g}")
    return errors


def _fsdp2_errors(fsdp2: nn.Module, ref: nn.Module, batch: Any, p: float,
                  foreach: bool | None, ref_norm: torch.Tensor) -> list[str]:
    """FSDP2 on the same model and batch, through torch's own clip_grad_norm_."""
    _backward(fsdp2, batch)
    norm = torch.nn.utils.clip_grad_norm_(fsdp2.parameters(), 0.5, norm_type=p, foreach=foreach)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    errors = []
    if not torch.allclose(norm.float(), ref_norm, rtol=1e-5):
        errors.append(f"FSDP2 norm {norm.item()} vs {ref_norm.item()}")
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}
    for name, q in fsdp2.named_parameters():
        if not torch.allclose(q.grad.full_tensor(), ref_grads[name], rtol=1e-5, atol=1e-7):
            errors.append(f"FSDP2 {name}: clipped gradient differs")
    return errors


def _norms_worker(rank: int, world: int, strategy: str, model_kind: str) -> list[str]:
    torch.manual_seed(0)
    base = ThinMLP() if model_kind == "mlp" else _tiny()
    model, ref, fsdp2 = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    fully_shard(model, sharding_strategy=strategy, timeout=30)
    torch_fully_shard(fsdp2, mesh=init_device_mesh("cpu", (world,)))
    batch = _batch(model_kind)
    failures: list[str] = []
    has_rows = []
    for p in NORM_TYPES:
        for foreach in FOREACH:
            _backward(ref, batch)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, p, foreach=foreach)
            for form in FORMS:
                what = f"{strategy} {model_kind} p={p} foreach={foreach} {form} rank {rank}"
                _backward(model, batch)
                has_rows.append(any(q.grad is not None and q.grad.to_local().numel() > 0
                                    for q in model.parameters()))
                with CollectiveCounts() as comm:
                    norm = _clip(form, model, 0.5, p, foreach)
                counts = {str(k): v for k, v in comm.get_comm_counts().items()}
                errors = []
                if not torch.allclose(norm.float(), ref_norm.float(), rtol=1e-5, atol=0.0):
                    errors.append(f"norm {norm.item()!r} vs torch {ref_norm.item()!r}")
                errors += _grad_errors(model, ref, "")
                seen: list[Any] = [None] * world
                dist.all_gather_object(seen, (counts, float(norm)))
                if any(s != seen[0] for s in seen):
                    errors.append(f"collectives or norms differ across ranks: {seen}")
                if not all_ranks_ok(not errors):
                    failures.append(f"{what}: {'; '.join(errors) or 'failed on another rank'}")
            if math.isinf(p):
                # FSDP2 cannot: torch's inf-norm of an empty local shard raises ("does not have
                # an identity") on the ranks holding one, so there is no control to run.
                continue
            failures += [f"{strategy} {model_kind} p={p} foreach={foreach} rank {rank}: {e}"
                         for e in _fsdp2_errors(fsdp2, ref, batch, p, foreach, ref_norm)]
    # The cases under test occur: uneven shards (mlp) and a rank with no gradient rows (tiny).
    rows_everywhere: list[Any] = [None] * world
    dist.all_gather_object(rows_everywhere, all(has_rows))
    if model_kind == "tiny" and strategy != "no_shard" and all(rows_everywhere):
        failures.append("tiny: every rank held gradient rows; the empty-shard case did not occur")
    return failures


@pytest.mark.parametrize("model_kind", ["mlp", "tiny"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_norm_type_and_foreach_matches_torch(ranks: RankPools, strategy: str,
                                                   model_kind: str) -> None:
    """Norm types, foreach settings and call forms per run (named in each failure)."""
    results = ranks.run(_norms_worker, 3, strategy, model_kind, timeout_s=TIMEOUT_S)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:20])


def _bad_norm_worker(rank: int, world: int, strategy: str) -> list[str]:
    torch.manual_seed(0)
    model = ThinMLP()
    fully_shard(model, sharding_strategy=strategy, timeout=30)
    _backward(model, _batch("mlp"))
    before = [q.grad.to_local().clone() if q.grad is not None else None
              for q in model.parameters()]
    raised = []
    for form in ("ours", "torch_route", "titan"):
        for norm_type in (0.0, -1.0, float("nan"), "two"):
            with CollectiveCounts() as comm:
                try:
                    _clip(form, model, 0.5, norm_type, None)  # type: ignore[arg-type]
                    raised.append(f"{form} {norm_type}: nothing raised")
                except (ValueError, TypeError) as e:
                    if "norm_type" not in str(e):
                        raised.append(f"{form} {norm_type}: unclear message {e}")
            if sum(comm.get_comm_counts().values()):
                raised.append(f"{form} {norm_type}: collectives before the error")
    after = [q.grad.to_local() if q.grad is not None else None for q in model.parameters()]
    if any((a is None) != (b is None) or (a is not None and not torch.equal(a, b))
           for a, b in zip(after, before)):
        raised.append("gradients changed")
    # 'inf' as a string is accepted, as torch does.
    norm = clip_grad_norm_(model.parameters(), 1e9, "inf")
    if not math.isfinite(float(norm)):
        raised.append(f"'inf' gave {norm}")
    return raised


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_unsupported_norm_types_raise_before_any_collective(ranks: RankPools,
                                                            strategy: str) -> None:
    results = ranks.run(_bad_norm_worker, 3, strategy, timeout_s=TIMEOUT_S)
    problems = [f"rank {r}: {m}" for r, ms in enumerate(results) for m in ms]
    assert not problems, problems
