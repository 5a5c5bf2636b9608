"""Pipeline parallel x FSDP: ``torch.distributed.pipelining`` schedules over stages whose blocks
(and the stage root) are wrapped with our ``fully_shard`` on the dp sub-mesh of a 2-D
``("pp", "dp")`` mesh, 4 gloo ranks as pp 2 x dp 2.

Each case trains the same split with every strategy and with FSDP2 (torch's ``fully_shard``,
``reshard_after_forward=False`` as torchtitan wraps under PP) as the control, and checks against
one process on the global batch: every micro-batch's loss on the last stage, and every
parameter after the steps. It also counts the collectives each step issues over the stage's dp
group (``GroupCommMode``, a ``CommDebugMode``-equivalent dispatch observer) and asserts the
strategy contract with N = the schedule's micro-batches: torch's schedule marks every backward
not-last and ends the window once per step (``perform_reduce_grad``), so per flat group and
step ``no_shard`` 1 all-reduce, ``optim`` 1 all-gather + 1 reduce-scatter, ``optim_grads`` 1
all-gather + N reduce-scatters, ``optim_grads_params`` N + 1 all-gathers + N reduce-scatters
(weights kept from one backward to the next: torch sets ``reshard_after_backward=False``) or,
with ``reshard_after_forward=False``, 1 all-gather + N reduce-scatters. With the blocks wrapped
but not the stage root, torch's schedule sees no ``FSDPModule`` and marks nothing: every
backward ends a window (``no_shard``: N all-reduces), still exact. FSDP2 reduce-scatters
once per step (it keeps unsharded gradients across the micro-batches; ours keep them sharded).

HSDP inside the stages (pp 2 x replicate 2 x shard 2, 8 ranks, FSDP2's HSDP as the control)
checks the values under 1F1B and ZBV.

Zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: backwards split into
input passes ``I`` and weight passes ``W``) train the same way; the post-backward of an ``I``
is deferred to the step's end (see [Note: pipeline schedules over fully_shard units]), so the
reduce-scatters per group are one per full backward plus one at the end for ``I`` passes after
the last (:func:`_reductions`, read off the schedule's actions). HSDP is checked under ZBV too.
The blocks-only wrapping (stage root not a unit) is refused under them on every rank, at the
first step (every stage but the first would otherwise get no gradient; see the Note).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from test_fsdp_tp_counts import GroupCommMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining import schedules as pp_schedules
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import fully_shard

# private: counts the units' parameter groups (state_of(unit).groups)
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import DistributedTestError

from _models import Block, agree
from _pool import RankPools

TIMEOUT_S = 120
DIM, HEADS, SEQ, MICRO_ROWS = 16, 2, 4, 2
BLOCKS, MICRO, STEPS = 4, 4, 2
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# name: (schedule class, stages per rank, V layout: rank r holds stages r and 2*pp-1-r)
SCHEDULES: dict[str, tuple[type, int, bool]] = {
    "gpipe": (ScheduleGPipe, 1, False),
    "1f1b": (Schedule1F1B, 1, False),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2, False),
    "looped_bfs": (ScheduleLoopedBFS, 2, False),
    # Zero-bubble: backwards split into input (I) and weight (W) passes.
    "interleaved_zero_bubble": (ScheduleInterleavedZeroBubble, 2, False),
    "zbv_zero_bubble": (ScheduleZBVZeroBubble, 2, True),
    "dualpipev": (ScheduleDualPipeV, 2, True),
}
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
TORCH_RELEASE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
# torch 2.11's V-layout schedules fail in their first gloo exchange with no FSDP at all
# ("Pair is not connected"; FSDP2 and plain stages alike): nothing of ours to test there.
V_SCHEDULES_RUN = TORCH_RELEASE >= (2, 12)
# torch 2.12 added the cleanup after metadata inference where a split-backward schedule over
# blocks-only stages is refused on every rank; before it, the first stage's ranks refuse at
# their first forward and the others fail in their exchange with them.
METADATA_CLEANUP = TORCH_RELEASE >= (2, 12)
# torch 2.15: a runtime schedule may leave each stage's gradient reduction in flight until
# the next one starts (FSDPModule.finalize_backward(async_op=True)).
DEFERS_REDUCE_GRAD_WAIT = TORCH_RELEASE >= (2, 15)


def _runs_here(schedule: str) -> Any:
    """``schedule`` as a pytest parameter, skipped where torch's own schedule cannot run."""
    v_layout = SCHEDULES[schedule][2]
    return pytest.param(schedule, marks=pytest.mark.skipif(
        v_layout and not V_SCHEDULES_RUN,
        reason=f"torch {torch.__version__}'s {schedule} fails in its first gloo exchange "
               "without FSDP too"))


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))


def _reference() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(DIM, HEADS) for _ in range(BLOCKS)])


def _data(dp: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: inputs and targets ``[dp, MICRO * MICRO_ROWS, SEQ, DIM]`` (same on all ranks)."""
    g = torch.Generator().manual_seed(1)
    shape = (dp, MICRO * MICRO_ROWS, SEQ, DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
            for _ in range(STEPS)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _stage_ids(pp_rank: int, per_rank: int, v_layout: bool) -> list[int]:
    if v_layout:
        return [pp_rank, 2 * 2 - 1 - pp_rank]
    return [pp_rank + 2 * v for v in range(per_rank)]


def _wrap(sub: nn.Sequential, mesh: DeviceMesh, variant: str) -> None:
    """``variant``: a strategy, ``optim_grads_params/raf=False``, ``no_shard/blocks`` (the
    blocks only, not the stage root: torch's schedule then treats the stage as plain),
    ``hsdp`` (``mesh`` 2-D: inner ``optim_grads_params``, outer ``no_shard``) or ``fsdp2``."""
    if variant == "no_shard/blocks":
        for block in sub:
            fully_shard(block, mesh=mesh, sharding_strategy="no_shard")
        return
    for module in [*sub, sub]:
        if variant == "fsdp2":
            torch_fully_shard(module, mesh=mesh, reshard_after_forward=False)
        elif variant == "hsdp":
            fully_shard(module, mesh=mesh, sharding_strategy="optim_grads_params",
                        outer_dp_sharding_strategy="no_shard")
        elif variant.endswith("/raf=False"):
            fully_shard(module, mesh=mesh, sharding_strategy="optim_grads_params",
                        reshard_after_forward=False)
        else:
            fully_shard(module, mesh=mesh, sharding_strategy=variant)


def _expected(variant: str, stages: list[tuple[int, int]]) -> Counter:
    """Collectives over the dp group per step (after the first), for ``stages``: per stage on
    this rank, (its flat groups, its reductions per step: N, or :func:`_reductions`)."""
    total: Counter = Counter()
    for groups, r in stages:
        per_group = {
            "no_shard": {"AR": 1},
            "optim": {"AG": 1, "RS": 1},
            "optim_grads": {"AG": 1, "RS": r},
            "optim_grads_params": {"AG": MICRO + 1, "RS": r},
            "optim_grads_params/raf=False": {"AG": 1, "RS": r},
            # Stage root not wrapped: the schedule marks nothing, every backward ends a window.
            "no_shard/blocks": {"AR": r},
            "fsdp2": {"AG": 1, "RS": 1},  # the control: one reduce-scatter per step
        }[variant]
        total.update({op: k * groups for op, k in per_group.items()})
    return total


def _reductions(sched: Any, pp_rank: int, stage: int) -> int:
    """Post-backwards of ``stage`` per step that reduce gradients: N, except under a schedule
    that splits backwards (see [Note: pipeline schedules over fully_shard units]): one per full
    backward (``B``, and the first stage's ``W``, which torch runs as a full backward), plus
    one at the step's end for input passes (``I``) after the stage's last full backward, whose
    weight passes (``W``) wrote gradients no post-backward reduced yet."""
    if not isinstance(sched, tuple(SCHEDULES[name][0] for name in SPLIT_BACKWARD)):
        return MICRO
    pending = [*reversed(sched.pipeline_order[pp_rank])]
    count, deferred = 0, False
    while pending:
        action = pending.pop()
        if action is None:
            continue
        pending.extend(reversed(getattr(action, "sub_actions", None) or ()))
        if action.stage_index != stage:
            continue
        kind = action.computation_type
        if kind is pp_schedules.FULL_BACKWARD or (
            kind is pp_schedules.BACKWARD_WEIGHT and stage == 0
        ):
            count, deferred = count + 1, False
        elif kind is pp_schedules.BACKWARD_INPUT and stage != 0:
            deferred = True
    return count + deferred


def _split(mesh: DeviceMesh, schedule: str, variant: str, ref: nn.Sequential,
           dp_mesh: DeviceMesh | None = None, schedule_kwargs: dict[str, Any] | None = None,
           ) -> tuple[list[nn.Sequential], list[int], Any]:
    """This rank's stages of a fresh split of ``ref``'s blocks, wrapped as ``variant`` on
    ``dp_mesh`` (default ``mesh["dp"]``): the stage modules, their stage ids and the schedule
    (``schedule_kwargs`` passed to its class)."""
    cls, per_rank, v_layout = SCHEDULES[schedule]
    num_stages = 2 * per_rank
    per_stage = BLOCKS // num_stages
    ids = _stage_ids(mesh.get_local_rank("pp"), per_rank, v_layout)
    subs, stages = [], []
    for s in ids:
        sub = nn.Sequential(*copy.deepcopy(list(ref[s * per_stage:(s + 1) * per_stage])))
        _wrap(sub, mesh["dp"] if dp_mesh is None else dp_mesh, variant)
        subs.append(sub)
        stages.append(PipelineStage(sub, s, num_stages, torch.device("cpu"),
                                    group=mesh.get_group("pp")))
    sched = (cls(stages, n_microbatches=MICRO, loss_fn=_loss, **(schedule_kwargs or {}))
             if per_rank > 1 else cls(stages[0], n_microbatches=MICRO, loss_fn=_loss))
    return subs, ids, sched


def _check_params(subs: list[nn.Sequential], ids: list[int], want: nn.Sequential,
                  what: str) -> None:
    """Every stage parameter (gathered) against the trained one-process ``want``."""
    per_stage = BLOCKS // (len(ids) * 2)
    for s, sub in zip(ids, subs):
        for name, p in sub.named_parameters():
            i, rest = name.split(".", 1)
            full = p.full_tensor() if isinstance(p, DTensor) else p
            expected = want[s * per_stage + int(i)].get_parameter(rest)
            torch.testing.assert_close(
                full.detach(), expected.detach(), rtol=1e-5, atol=1e-6,
                msg=lambda m: f"{what} stage {s} {name}: {m}")


def _train(mesh: DeviceMesh, schedule: str, variant: str, ref: nn.Sequential,
           data: list[tuple[torch.Tensor, torch.Tensor]],
           dp_mesh: DeviceMesh | None = None, dp_rank: int | None = None,
           schedule_kwargs: dict[str, Any] | None = None,
           ) -> tuple[list[list[float]], list[nn.Sequential], list[int], list[Counter],
                      list[int]]:
    """Train ``STEPS`` steps on a fresh split of ``ref``'s (untrained) blocks: per step the last
    stage's micro-batch losses (empty elsewhere), the stage modules, their stage ids, the
    collectives each step issued over the ``"dp"`` group, and each stage's reductions per step
    (:func:`_reductions`). ``dp_mesh``/``dp_rank``: the mesh the
    stages are wrapped on and this rank's data slice (default ``mesh["dp"]``, its rank);
    ``schedule_kwargs``: passed to the schedule class."""
    pp_rank = mesh.get_local_rank("pp")
    dp_rank = mesh.get_local_rank("dp") if dp_rank is None else dp_rank
    subs, ids, sched = _split(mesh, schedule, variant, ref, dp_mesh, schedule_kwargs)
    opt = torch.optim.AdamW([p for sub in subs for p in sub.parameters()], lr=1e-2)
    dp_ranks = tuple(dist.get_process_group_ranks(mesh.get_group("dp")))
    all_losses, counts = [], []
    for x, y in data:
        losses: list[torch.Tensor] = []
        with GroupCommMode() as comm:
            if 0 in ids:
                sched.step(x[dp_rank], target=y[dp_rank], losses=losses)
            else:
                sched.step(target=y[dp_rank], losses=losses)
        opt.step()
        opt.zero_grad()
        all_losses.append([loss.item() for loss in losses])
        counts.append(Counter({op: k for (op, ranks), k in comm.by_group.items()
                               if ranks == dp_ranks}))
    return all_losses, subs, ids, counts, [_reductions(sched, pp_rank, s) for s in ids]


def _reference_run(ref: nn.Sequential, data: list[tuple[torch.Tensor, torch.Tensor]],
                   ) -> list[list[list[float]]]:
    """One process, global batch: per step, per dp rank, each micro-batch's loss."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    per_step = []
    for x, y in data:
        out = ref(x.flatten(0, 1))
        _loss(out, y.flatten(0, 1)).backward()
        opt.step()
        opt.zero_grad()
        rows = out.detach().view(x.shape).split(MICRO_ROWS, dim=1)
        targets = y.split(MICRO_ROWS, dim=1)
        per_step.append([[_loss(rows[m][d], targets[m][d]).item() for m in range(MICRO)]
                         for d in range(x.shape[0])])
    return per_step


def _groups(subs: list[nn.Sequential], variant: str) -> int:
    if variant == "fsdp2":  # one param group per unit holding parameters
        return sum(1 for sub in subs for m in sub if any(True for _ in m.parameters()))
    return sum(len(s.groups) for sub in subs for m in sub.modules()
               if (s := state_of(m)) is not None)


def _parity_worker(rank: int, world: int, schedule: str, hsdp: bool = False,
                   schedule_kwargs: dict[str, Any] | None = None) -> None:
    if hsdp:  # pp 2 x (replicate 2 x shard 2): 8 ranks, 4 data-parallel slices
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "replicate", "dp"))
        dp_mesh: DeviceMesh | None = mesh["replicate", "dp"]
        dp_rank = mesh.get_local_rank("replicate") * 2 + mesh.get_local_rank("dp")
        variants: tuple[str, ...] = ("fsdp2", "hsdp")
    else:
        mesh, dp_mesh = _mesh(), None
        dp_rank = mesh.get_local_rank("dp")
        variants = ("fsdp2", *STRATEGIES, "optim_grads_params/raf=False")
        if schedule not in SPLIT_BACKWARD:  # refused there: see the last test
            variants += ("no_shard/blocks",)
    data = _data(dp=4 if hsdp else 2)
    want_losses = _reference_run(_reference(), data)
    want = _reference()
    _reference_run(want, data)  # ``want`` holds the trained reference parameters
    for variant in variants:
        losses, subs, ids, counts, reductions = _train(
            mesh, schedule, variant, _reference(), data, dp_mesh=dp_mesh, dp_rank=dp_rank,
            schedule_kwargs=schedule_kwargs)

        def check(losses: Any = losses, subs: Any = subs, ids: Any = ids,
                  counts: Any = counts, variant: str = variant,
                  reductions: Any = reductions) -> None:
            last = 2 * len(ids) - 1
            if last in ids:
                for step in range(STEPS):
                    torch.testing.assert_close(
                        torch.tensor(losses[step]), torch.tensor(want_losses[step][dp_rank]),
                        rtol=1e-5, atol=1e-6, msg=lambda m: f"{variant} step {step} losses: {m}")
            _check_params(subs, ids, want, f"{variant} after {STEPS} steps")
            if hsdp:
                return  # counts: the 1-D cases; here the values
            expected_counts = _expected(
                variant, [(_groups([sub], variant), r) for sub, r in zip(subs, reductions)])
            for step in range(1, STEPS):  # step 0 adds torch's metadata-inference pass
                assert counts[step] == expected_counts, (
                    f"{variant} step {step}: collectives over dp {dict(counts[step])}, want "
                    f"{dict(expected_counts)} (N = {MICRO} micro-batches, reductions per "
                    f"stage {dict(zip(ids, reductions))})")

        agree(f"{schedule} {variant}", check)


@pytest.mark.parametrize("schedule", [_runs_here(name) for name in SCHEDULES])
def test_schedule_matches_one_process_and_fsdp2(ranks: RankPools, schedule: str) -> None:
    """Losses and parameters equal one process on the global batch (FSDP2 in the same run as
    the control), every strategy, and the dp collectives of each step are the contract's."""
    ranks.run(_parity_worker, 4, schedule, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("schedule", [_runs_here(name) for name in ("1f1b", "zbv_zero_bubble")])
def test_hsdp_stages_match_one_process_and_fsdp2(ranks: RankPools, schedule: str) -> None:
    """HSDP inside each stage (inner ``optim_grads_params``, outer ``no_shard``) on pp 2 x
    replicate 2 x shard 2, FSDP2's HSDP as the control: the window's end at the step's end runs
    the outer reduction too (under ZBV also after the deferred post-backwards)."""
    ranks.run(_parity_worker, 8, schedule, True, timeout_s=TIMEOUT_S)


def _blocks_only_worker(rank: int, world: int, schedule: str) -> None:
    name = SCHEDULES[schedule][0].__name__
    with pytest.raises(NotImplementedError, match=f"{name} splits each backward.*is not a "
                       "fully_shard unit.*Wrap the stage module with fully_shard too"):
        _train(_mesh(), schedule, "no_shard/blocks", _reference(), _data()[:1])


def _blocks_only_first_stage_worker(rank: int, world: int, schedule: str) -> None:
    """Before torch 2.12: the first stage's ranks raise at their first forward (the error
    propagates); the others wait for them in an exchange that never comes."""
    _train(_mesh(), schedule, "no_shard/blocks", _reference(), _data()[:1])


@pytest.mark.parametrize("schedule", [_runs_here(name) for name in SPLIT_BACKWARD])
def test_zero_bubble_over_blocks_only_is_refused_on_every_rank(
        ranks: RankPools, schedule: str) -> None:
    """A split-backward schedule over stages whose root is not a unit raises on every rank,
    at torch's cleanup after the first step's metadata inference (before the step's first
    action), instead of training every stage but the first without gradients. torch 2.11 has
    no such cleanup: the ranks of the first stage raise at its first forward, and the other
    ranks (waiting for it) fail as their peers' processes end."""
    if METADATA_CLEANUP:
        ranks.run(_blocks_only_worker, 4, schedule, timeout_s=TIMEOUT_S)
        return
    name = SCHEDULES[schedule][0].__name__
    with pytest.raises(DistributedTestError) as failed:
        ranks.run(_blocks_only_first_stage_worker, 4, schedule, timeout_s=TIMEOUT_S)
    report = str(failed.value)
    for pp0_rank in (0, 1):  # mesh ("pp", "dp") = (2, 2): pp rank 0 holds ranks 0 and 1
        section = report.split(f"--- rank {pp0_rank} ---", 1)[-1].split("--- rank", 1)[0]
        assert f"NotImplementedError: {name} splits each backward" in section, report


@pytest.mark.skipif(not DEFERS_REDUCE_GRAD_WAIT,
                    reason="defer_reduce_grad_wait is torch 2.15's schedule option")
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv_zero_bubble"])
def test_deferred_reduce_grad_wait_matches_one_process_and_fsdp2(
        ranks: RankPools, schedule: str) -> None:
    """``defer_reduce_grad_wait=True``: each stage's gradient reduction is started with
    ``finalize_backward(async_op=True)`` and waited on when the next starts or at the step's
    end; the same losses, parameters and collectives as without it, FSDP2 as the control."""
    ranks.run(_parity_worker, 4, schedule, False, {"defer_reduce_grad_wait": True},
              timeout_s=TIMEOUT_S)


def _accumulating_worker(rank: int, world: int, schedule: str) -> None:
    """Two ``step(finalize_gradients=False)`` calls and a final ``step()``, then one optimizer
    step: the parameters equal one process that backpropagates the three global batches' mean
    losses summed (each call's gradients divided by N once, at the last call, as documented)."""
    mesh = _mesh()
    dp_rank = mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(3)
    shape = (2, MICRO * MICRO_ROWS, SEQ, DIM)
    calls = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(3)]
    want = _reference()
    opt = torch.optim.SGD(want.parameters(), lr=0.1)
    sum(_loss(want(x.flatten(0, 1)), y.flatten(0, 1)) for x, y in calls).backward()
    opt.step()
    for variant in ("fsdp2", *STRATEGIES, "optim_grads_params/raf=False"):
        subs, ids, sched = _split(mesh, schedule, variant, _reference())
        sub_opt = torch.optim.SGD([p for sub in subs for p in sub.parameters()], lr=0.1)
        for i, (x, y) in enumerate(calls):
            last = i == len(calls) - 1
            if 0 in ids:
                sched.step(x[dp_rank], target=y[dp_rank], finalize_gradients=last)
            else:
                sched.step(target=y[dp_rank], finalize_gradients=last)
        sub_opt.step()

        what = f"{schedule} {variant} finalize_gradients=False"
        agree(what, lambda subs=subs, ids=ids, what=what: _check_params(subs, ids, want, what))


@pytest.mark.skipif(not DEFERS_REDUCE_GRAD_WAIT,
                    reason="step(finalize_gradients=False) is torch 2.15's schedule option")
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_gradients_accumulated_across_steps(ranks: RankPools, schedule: str) -> None:
    """``schedule.step(finalize_gradients=False)`` keeps the stages' windows open across calls
    (torch 2.15); the call with ``True`` finalizes them: one process's parameters after the
    optimizer step, every strategy, FSDP2 as the control."""
    ranks.run(_accumulating_worker, 4, schedule, timeout_s=TIMEOUT_S)
