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
checks the values under 1F1B.

Zero-bubble schedules (a backward split into input and weight passes) are refused with a
``NotImplementedError`` naming the schedule, on every rank, before the step's pipeline
communication (see [Note: pipeline schedules over fully_shard units]).
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
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import fully_shard

# private: counts the units' parameter groups (state_of(unit).groups)
from megatron_fsdp_v2._registry import state_of

from _models import Block, agree
from _pool import RankPools

TIMEOUT_S = 120
DIM, HEADS, SEQ, MICRO_ROWS = 16, 2, 4, 2
BLOCKS, MICRO, STEPS = 4, 4, 2
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# (name, schedule class, stages per rank, V layout: rank r holds stages r and 2*pp-1-r)
SCHEDULES: dict[str, tuple[type, int]] = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "looped_bfs": (ScheduleLoopedBFS, 2),
}


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


def _expected(variant: str, groups: int) -> Counter:
    """Collectives over the dp group per step (after the first), for ``groups`` flat groups."""
    n = MICRO
    per_group = {
        "no_shard": {"AR": 1},
        "optim": {"AG": 1, "RS": 1},
        "optim_grads": {"AG": 1, "RS": n},
        "optim_grads_params": {"AG": n + 1, "RS": n},
        "optim_grads_params/raf=False": {"AG": 1, "RS": n},
        # Stage root not wrapped: the schedule marks nothing, every backward ends a window.
        "no_shard/blocks": {"AR": n},
        "fsdp2": {"AG": 1, "RS": 1},  # the control: one reduce-scatter per step
    }[variant]
    return Counter({op: k * groups for op, k in per_group.items()})


def _train(mesh: DeviceMesh, schedule: str, variant: str, ref: nn.Sequential,
           data: list[tuple[torch.Tensor, torch.Tensor]], v_layout: bool = False,
           dp_mesh: DeviceMesh | None = None, dp_rank: int | None = None,
           ) -> tuple[list[list[float]], list[nn.Sequential], list[int], list[Counter]]:
    """Train ``STEPS`` steps on a fresh split of ``ref``'s (untrained) blocks: per step the last
    stage's micro-batch losses (empty elsewhere), the stage modules, their stage ids, and the
    collectives each step issued over the ``"dp"`` group. ``dp_mesh``/``dp_rank``: the mesh the
    stages are wrapped on and this rank's data slice (default ``mesh["dp"]``, its rank)."""
    cls, per_rank = SCHEDULES[schedule] if schedule in SCHEDULES else (ScheduleZBVZeroBubble, 2)
    if schedule == "interleaved_zero_bubble":
        cls, per_rank = ScheduleInterleavedZeroBubble, 2
    pp_rank = mesh.get_local_rank("pp")
    dp_rank = mesh.get_local_rank("dp") if dp_rank is None else dp_rank
    num_stages = 2 * per_rank
    per_stage = BLOCKS // num_stages
    ids = _stage_ids(pp_rank, per_rank, v_layout)
    subs, stages = [], []
    for s in ids:
        sub = nn.Sequential(*copy.deepcopy(list(ref[s * per_stage:(s + 1) * per_stage])))
        _wrap(sub, mesh["dp"] if dp_mesh is None else dp_mesh, variant)
        subs.append(sub)
        stages.append(PipelineStage(sub, s, num_stages, torch.device("cpu"),
                                    group=mesh.get_group("pp")))
    sched = (cls(stages, n_microbatches=MICRO, loss_fn=_loss) if per_rank > 1
             else cls(stages[0], n_microbatches=MICRO, loss_fn=_loss))
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
    return all_losses, subs, ids, counts


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


def _parity_worker(rank: int, world: int, schedule: str, hsdp: bool = False) -> None:
    if hsdp:  # pp 2 x (replicate 2 x shard 2): 8 ranks, 4 data-parallel slices
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "replicate", "dp"))
        dp_mesh: DeviceMesh | None = mesh["replicate", "dp"]
        dp_rank = mesh.get_local_rank("replicate") * 2 + mesh.get_local_rank("dp")
        variants: tuple[str, ...] = ("fsdp2", "hsdp")
    else:
        mesh, dp_mesh = _mesh(), None
        dp_rank = mesh.get_local_rank("dp")
        variants = ("fsdp2", *STRATEGIES, "optim_grads_params/raf=False", "no_shard/blocks")
    data = _data(dp=4 if hsdp else 2)
    want_losses = _reference_run(_reference(), data)
    want = _reference()
    _reference_run(want, data)  # ``want`` holds the trained reference parameters
    for variant in variants:
        losses, subs, ids, counts = _train(mesh, schedule, variant, _reference(), data,
                                           dp_mesh=dp_mesh, dp_rank=dp_rank)
        per_stage = BLOCKS // (len(ids) * 2)

        def check(losses: Any = losses, subs: Any = subs, ids: Any = ids,
                  counts: Any = counts, per_stage: int = per_stage, variant: str = variant,
                  ) -> None:
            last = 2 * len(ids) - 1
            if last in ids:
                for step in range(STEPS):
                    torch.testing.assert_close(
                        torch.tensor(losses[step]), torch.tensor(want_losses[step][dp_rank]),
                        rtol=1e-5, atol=1e-6, msg=lambda m: f"{variant} step {step} losses: {m}")
            for s, sub in zip(ids, subs):
                for name, p in sub.named_parameters():
                    i, rest = name.split(".", 1)
                    full = p.full_tensor() if isinstance(p, DTensor) else p
                    expected = want[s * per_stage + int(i)].get_parameter(rest)
                    torch.testing.assert_close(
                        full.detach(), expected.detach(), rtol=1e-5, atol=1e-6,
                        msg=lambda m: f"{variant} stage {s} {name} after {STEPS} steps: {m}")
            if hsdp:
                return  # counts: the 1-D cases; here the values
            expected_counts = _expected(variant, _groups(subs, variant))
            for step in range(1, STEPS):  # step 0 adds torch's metadata-inference pass
                assert counts[step] == expected_counts, (
                    f"{variant} step {step}: collectives over dp {dict(counts[step])}, want "
                    f"{dict(expected_counts)} (N = {MICRO} micro-batches)")

        agree(f"{schedule} {variant}", check)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_matches_one_process_and_fsdp2(ranks: RankPools, schedule: str) -> None:
    """Losses and parameters equal one process on the global batch (FSDP2 in the same run as
    the control), every strategy, and the dp collectives of each step are the contract's."""
    ranks.run(_parity_worker, 4, schedule, timeout_s=TIMEOUT_S)


def test_hsdp_stages_match_one_process_and_fsdp2(ranks: RankPools) -> None:
    """HSDP inside each stage (inner ``optim_grads_params``, outer ``no_shard``) under 1F1B on
    pp 2 x replicate 2 x shard 2, FSDP2's HSDP as the control: the window's end at the step's
    end runs the outer reduction too."""
    ranks.run(_parity_worker, 8, "1f1b", True, timeout_s=TIMEOUT_S)


def _zero_bubble_worker(rank: int, world: int, schedule: str) -> None:
    mesh = _mesh()
    name = {"interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
            "zbv_zero_bubble": "ScheduleZBVZeroBubble"}[schedule]
    with pytest.raises(NotImplementedError, match=f"{name} splits each backward.*Use "
                       "ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B"):
        _train(mesh, schedule, "optim_grads_params", _reference(), _data()[:1],
               v_layout=schedule == "zbv_zero_bubble")


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble"])
def test_zero_bubble_schedules_are_refused_on_every_rank(ranks: RankPools, schedule: str) -> None:
    """A schedule with split (I/W) backwards raises on every rank, naming itself and the
    schedules that work, before the step's pipeline communication (no rank hangs)."""
    ranks.run(_zero_bubble_worker, 4, schedule, timeout_s=TIMEOUT_S)
