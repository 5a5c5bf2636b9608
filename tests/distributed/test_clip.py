"""clip_grad_norm_: gradients of several dtypes, ranks whose parameter lists hold no gradient,
and the collectives it issues, against torch.nn.utils.clip_grad_norm_ on a single-process
reference that sees the same gradients.

Every rank feeds the whole batch, so the averaged gradients equal the reference's (and plain,
ignored parameters get the same local gradient on every rank). fully_shard runs with a short
collective timeout: a rank left alone in an all-reduce raises within seconds instead of hanging.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import clip_grad_norm_, fully_shard

from _comm_counts import CollectiveCounts
from _models import TinyGPT, all_ranks_ok, check_all_ranks, lm_loss, shard_rows
from _pool import RankPools

TIMEOUT_S = 20  # fully_shard's collective timeout (one library group for the whole process)
RUN_TIMEOUT_S = 120
NORMS = {"l2": 2.0, "inf": math.inf}


# ---------------------------------------------------------------------- models

class TwoDtypeMLP(nn.Module):
    """An fp32 layer and a bf16 layer: fully_shard keeps one bucket (and main grads) per dtype."""

    def __init__(self) -> None:
        super().__init__()
        # b's rows are 16 wide, so at world 2 both ranks hold rows of it (shard boundaries
        # fall on multiples of lcm(row, 16) elements): every rank sees both dtypes.
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).to(torch.bfloat16)).float()


class IgnoredBf16MLP(nn.Module):
    """fp32 layers plus a bf16 gain that fully_shard ignores (a plain parameter, bf16 grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.gain.float()


class Tiny(nn.Module):
    """So small that at world 3-4 some ranks' shards are all empty (every grad has zero rows)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1) if world == 3 else nn.Sequential(
            nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _batch(in_features: int, out_features: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, in_features, generator=g), torch.randn(n, out_features, generator=g)


def _backward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = batch
    # Scaled up so the gradients are well above max_norm and clipping really scales them.
    (10.0 * F.mse_loss(model(x).float(), y)).backward()


# ---------------------------------------------------------------------- checks

def _grad_errors(model: nn.Module, expected: dict[str, torch.Tensor],
                 tol: dict[torch.dtype, tuple[float, float]]) -> list[str]:
    """This rank's clipped gradients against full ``expected`` ones (its rows of each), with
    (rtol, atol) per gradient dtype."""
    errors = []
    for name, p in model.named_parameters():
        full = expected[name]
        if isinstance(p, DTensor):
            lo, hi = shard_rows(p)
            want = full[lo:hi]
            if p.grad is None:
                if hi > lo:
                    errors.append(f"{name}: no gradient for a non-empty shard")
                continue
            local = p.grad.to_local()
        else:
            want, local = full, p.grad
        if local.dtype != p.dtype:
            errors.append(f"{name}: grad dtype {local.dtype}, parameter {p.dtype}")
            continue
        rtol, atol = tol[local.dtype]
        try:
            torch.testing.assert_close(local.double(), want.double(), rtol=rtol, atol=atol)
        except AssertionError as e:
            errors.append(f"{name} ({local.dtype}): {e}")
    return errors


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


FP32_TOL = {torch.float32: (1e-5, 1e-7)}


def _norm_errors(norm: torch.Tensor, ref_norm: torch.Tensor, rtol: float) -> list[str]:
    """The returned norm against the reference, and bitwise equal on every rank."""
    errors = []
    if not torch.allclose(norm.float().cpu(), ref_norm.float().cpu(), rtol=rtol, atol=0.0):
        errors.append(f"norm {norm.item()!r} vs reference {ref_norm.item()!r}")
    gathered = [torch.zeros((), dtype=torch.float32) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, norm.detach().float().cpu())
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        errors.append(f"norm differs across ranks: {[g.item() for g in gathered]}")
    return errors


def _raise_together(errors: list[str], what: str) -> None:
    """Every rank raises (or none does), so no rank is left in a later collective."""
    if not all_ranks_ok(not errors):
        raise AssertionError(
            f"{what}: " + ("; ".join(errors) if errors else "failed on another rank")
        )


def _all_reduces(comm: CollectiveCounts) -> int:
    return sum(v for k, v in comm.get_comm_counts().items()
               if str(k).split(".")[-1].rstrip("_") in ("allreduce", "all_reduce"))


# ---------------------------------------------------------------------- 1: several dtypes

def _build_two_dtype(case: str, strategy: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    if case == "fp32_and_bf16_params":
        model = TwoDtypeMLP()
        ref = copy.deepcopy(model)
        fully_shard(model, sharding_strategy=strategy, timeout=TIMEOUT_S)
    else:  # "fp32_main_grads_and_ignored_bf16"
        model = IgnoredBf16MLP()
        ref = copy.deepcopy(model)
        fully_shard(model, sharding_strategy=strategy, timeout=TIMEOUT_S,
                    ignored_params=[model.gain])
    return model, ref


def _two_dtype_worker(rank: int, world: int, case: str, strategy: str) -> None:
    for norm_type in NORMS.values():
        _two_dtype_check(rank, case, strategy, norm_type)


def _two_dtype_check(rank: int, case: str, strategy: str, norm_type: float) -> None:
    model, ref = _build_two_dtype(case, strategy)
    batch = _batch(6, 3)
    _backward(model, batch)
    _backward(ref, batch)
    dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    max_norm = 0.05
    # The exact result from the reference's unclipped gradients: norm in fp64, each gradient
    # scaled by the fp64 coefficient.
    unclipped = _grads(ref)
    flat = torch.cat([g.double().flatten() for g in unclipped.values()])
    exact_norm = flat.norm() if norm_type == 2.0 else flat.abs().max()
    coef = min(1.0, max_norm / (exact_norm.item() + 1e-6))
    exact = {n: g.double() * coef for n, g in unclipped.items()}

    norm = clip_grad_norm_(model.parameters(), max_norm, norm_type)
    torch_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    errors = []
    if exact_norm.item() <= 2 * max_norm:
        errors.append(f"reference norm {exact_norm.item()} too small for clipping to matter")
    # Against the exact result: fp32 accumulation of the norm, fp32 gradients scaled by an fp32
    # coefficient, bf16 ones by the coefficient rounded to bf16 (and the product rounded).
    errors += _norm_errors(norm, exact_norm, rtol=1e-5)
    errors += _grad_errors(model, exact, {torch.float32: (1e-5, 1e-7),
                                          torch.bfloat16: (1.6e-2, 1e-5)})
    # Against torch.nn.utils.clip_grad_norm_, which takes bf16 per-tensor norms: looser.
    errors += [f"vs torch: {e}" for e in _norm_errors(norm, torch_norm, rtol=2e-2)]
    errors += [f"vs torch: {e}" for e in _grad_errors(
        model, _grads(ref), {torch.float32: (2e-2, 1e-5), torch.bfloat16: (3e-2, 1e-5)})]
    # Every rank holds both dtypes here (world 2), so the test exercises the mixed-dtype paths.
    if dtypes != {torch.float32, torch.bfloat16}:
        errors.append(f"expected fp32 and bf16 gradients on this rank, got {dtypes}")
    _raise_together(errors, f"{case} {strategy} norm={norm_type} rank {rank}")


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.parametrize("case", ["fp32_and_bf16_params", "fp32_main_grads_and_ignored_bf16"])
def test_clip_two_dtypes_matches_torch(ranks: RankPools, case: str, strategy: str) -> None:
    """Both norm types per run (named in the failure message)."""
    ranks.run(_two_dtype_worker, 2, case, strategy, timeout_s=RUN_TIMEOUT_S)


def _fp32_worker(rank: int, world: int) -> None:
    for norm_type in NORMS.values():
        _fp32_check(rank, norm_type)


def _fp32_check(rank: int, norm_type: float) -> None:
    """All-fp32 sharded model: the tight tolerance of the common case."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    ref = copy.deepcopy(model)
    fully_shard(model, sharding_strategy="optim_grads", timeout=TIMEOUT_S)
    batch = _batch(6, 3)
    _backward(model, batch)
    _backward(ref, batch)
    norm = clip_grad_norm_(model.parameters(), 0.05, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
    errors = _norm_errors(norm, ref_norm, rtol=1e-5) + _grad_errors(model, _grads(ref), FP32_TOL)
    _raise_together(errors, f"fp32 norm={norm_type} rank {rank}")


def test_clip_fp32_matches_torch(ranks: RankPools) -> None:
    ranks.run(_fp32_worker, 2, timeout_s=RUN_TIMEOUT_S)


# ---------------------------------------------------------------------- 2: empty lists

def _filtered(model: nn.Module, rank: int, how: str) -> list[nn.Parameter]:
    params = list(model.parameters())
    if how == "grad_not_none":  # every rank holds a gradient of every parameter: all of them
        return [p for p in params if p.grad is not None]
    if how == "local_rows" or (how == "per_rank" and rank != 0):
        # Filtered by what this rank holds: empty on a rank whose shards are all empty.
        return [p for p in params if p.to_local().numel() > 0]
    return params  # "per_rank", rank 0: unfiltered


def _empty_list_worker(rank: int, world: int, how: str) -> None:
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        for norm_type in NORMS.values():
            _empty_list_check(rank, world, how, strategy, norm_type)


def _empty_list_check(rank: int, world: int, how: str, strategy: str, norm_type: float) -> None:
    torch.manual_seed(0)
    model = Tiny(world)
    ref = copy.deepcopy(model)
    fully_shard(model, sharding_strategy=strategy, timeout=TIMEOUT_S)
    batch = _batch(2 if world == 3 else 3, 1)
    _backward(model, batch)
    _backward(ref, batch)
    params = _filtered(model, rank, how)
    max_norm = 0.05
    with CollectiveCounts() as comm:
        norm = clip_grad_norm_(params, max_norm, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    errors = _norm_errors(norm, ref_norm, rtol=1e-5)
    errors += _grad_errors(model, _grads(ref), FP32_TOL)
    # One all-reduce on every rank, the one with an empty list included.
    if _all_reduces(comm) != 1 or sum(comm.get_comm_counts().values()) != 1:
        errors.append(f"collectives {dict(comm.get_comm_counts())}, expected one all-reduce")
    sizes: list = [None] * world
    dist.all_gather_object(sizes, len(params))
    if how == "grad_not_none":
        # A rank whose shard of a parameter is empty holds a zero-row gradient of it, as FSDP2.
        if sizes != [len(list(model.parameters()))] * world:
            errors.append(f"list sizes per rank {sizes}: some rank lacks a gradient")
    elif min(sizes) != 0 or max(sizes) == 0:
        # The case under test must occur: some rank passes an empty list, some a non-empty one.
        errors.append(f"list sizes per rank {sizes}: no rank with an empty list")
    _raise_together(errors, f"{how} {strategy} norm={norm_type} world {world} rank {rank} "
                            f"(list of {len(params)})")


@pytest.mark.parametrize("how", ["grad_not_none", "local_rows", "per_rank"])
@pytest.mark.parametrize("world_size", [3, 4])
def test_clip_rank_with_empty_list_joins(ranks: RankPools, world_size: int, how: str) -> None:
    """Strategies and norm types per run (named in the failure message). A rank that skipped
    the all-reduce would leave its peers in it until fully_shard's short timeout."""
    ranks.run(_empty_list_worker, world_size, how, timeout_s=RUN_TIMEOUT_S)


# ---------------------------------------------------------------------- 3: collectives

def _count_worker(rank: int, world: int, case: str) -> None:
    """The collectives of one call on a TinyGPT whose blocks and root are wrapped (or on
    TwoDtypeMLP), and the norm against the reference."""
    torch.manual_seed(0)
    norm_type = math.inf if case.endswith("_inf") else 2.0
    if case == "two_dtypes":
        model = TwoDtypeMLP()
        ref = copy.deepcopy(model)
        fully_shard(model, sharding_strategy="optim_grads", timeout=TIMEOUT_S)
        _backward(model, _batch(6, 3))
        _backward(ref, _batch(6, 3))
    else:
        model = TinyGPT(layers=2)
        ref = copy.deepcopy(model)
        strategy = {"no_shard": "no_shard", "optim_grads_params_inf": "optim_grads_params"}.get(
            case, "optim_grads")
        block_strategy = "no_shard" if case == "no_shard_blocks" else strategy
        for block in model.blocks:
            fully_shard(block, sharding_strategy=block_strategy, timeout=TIMEOUT_S)
        # two_groups: a second timeout makes a second library group, with its own all-reduce.
        fully_shard(model, sharding_strategy=strategy,
                    timeout=TIMEOUT_S + 5 if case == "two_groups" else TIMEOUT_S)
        tokens = torch.randint(0, 37, (4, 9), generator=torch.Generator().manual_seed(3))
        lm_loss(model, tokens).backward()
        lm_loss(ref, tokens).backward()
    expected = {"no_shard": 0, "two_groups": 2}.get(case, 1)
    with CollectiveCounts() as comm:
        norm = clip_grad_norm_(model.parameters(), 0.05, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
    errors = []
    if _all_reduces(comm) != expected or sum(comm.get_comm_counts().values()) != expected:
        errors.append(
            f"collectives {dict(comm.get_comm_counts())}, expected {expected} all-reduce(s)"
        )
    errors += _norm_errors(norm, ref_norm, rtol=2e-2 if case == "two_dtypes" else 1e-5)
    _raise_together(errors, f"{case} rank {rank}")


@pytest.mark.parametrize("case", [
    "optim_grads",  # the common case: one all-reduce
    "optim_grads_params_inf",  # inf-norm: one MAX all-reduce
    "two_dtypes",  # fp32 and bf16 buckets: still one all-reduce (summed locally first)
    "no_shard_blocks",  # no_shard blocks under a sharded root: one
    "no_shard",  # replicated gradients only: none
    "two_groups",  # two timeouts, so two library groups: one each
])
def test_clip_collective_count(ranks: RankPools, case: str) -> None:
    ranks.run(_count_worker, 2, case, timeout_s=RUN_TIMEOUT_S)


# ---------------------------------------------------------------- 4: lists that are not ours

def _unrelated_norm_worker(rank: int, world: int) -> None:
    """After ``fully_shard``, ``torch.nn.utils.get_total_norm`` of a list holding none of the
    library's tensors, called on one rank only (code that has nothing to do with the model), is
    torch's: the same value, no collective over the library's groups (which would leave the
    caller waiting for peers that never join)."""
    torch.manual_seed(0)
    model = TinyGPT(layers=1)
    fully_shard(model, timeout=TIMEOUT_S)
    errors: list[str] = []
    if rank == 0:
        plain = [torch.ones(3), torch.full((2,), 2.0)]
        with CollectiveCounts() as comm:
            empty_norm = torch.nn.utils.get_total_norm([])
            plain_norm = torch.nn.utils.get_total_norm(plain)
        if sum(comm.get_comm_counts().values()) != 0:
            errors.append(f"collectives {dict(comm.get_comm_counts())}, expected none")
        if empty_norm.item() != 0.0:
            errors.append(f"get_total_norm([]) = {empty_norm.item()}, torch's is 0")
        if not math.isclose(plain_norm.item(), math.sqrt(11.0), rel_tol=1e-6):
            errors.append(f"get_total_norm(plain) = {plain_norm.item()}, torch's is sqrt(11)")
    check_all_ranks(not errors, f"rank {rank}: {errors}")


def test_get_total_norm_of_lists_that_are_not_ours_is_torchs(ranks: RankPools) -> None:
    ranks.run(_unrelated_norm_worker, 2, timeout_s=RUN_TIMEOUT_S)
