"""FSDP x TP collective counts on a dp=2 x tp=2 mesh, per strategy, recorded with
``CollectiveCounts`` (``CommDebugMode``'s counts, see ``_comm_counts.py``) and attributed to
the ranks each collective ran over.

Over dp: exactly the 1-D table of design.md §4 per flat group and iteration of N micro-batches
(the TP-local tensors are sharded over dp as plain tensors are). Over tp, in forward and
backward: the user's tensor parallelism (activations, and the ``Partial -> Replicate``
all-reduce of each sequence-parallel parameter's gradient), the same count as FSDP2 running the
same script. ``clip_grad_norm_``: one all-reduce per distinct group (dp x tp for parameters TP
shards too, dp for the others; tp only under ``no_shard``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _tp_common import (
    STRATEGIES,
    apply_tp,
    batches,
    build_model,
    clip_ours,
    dp_tp_mesh,
    loss_of,
    wrap_fsdp2,
    wrap_ours,
)
from torch.distributed.distributed_c10d import _resolve_process_group

# private: counts the units' parameter groups (state_of(unit).groups)
from megatron_fsdp_v2._registry import state_of

from _comm_counts import COUNTED_OPS, CollectiveCounts
from _models import check_all_ranks
from _pool import RankPools

TIMEOUT_S = 400
MICRO = 2


class GroupCommMode(CollectiveCounts):
    """``CollectiveCounts`` that also counts each collective by (op, ranks it ran over)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_group: Counter[tuple[str, tuple[int, ...]]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        packet = getattr(func, "_overloadpacket", None)
        if out is not NotImplemented and packet in COUNTED_OPS:
            self.by_group[(_op_name(packet), _ranks_of(args))] += 1
        return out


def _op_name(packet: Any) -> str:
    name = str(packet).split(".")[-1].strip("_")
    for short, words in (("AG", ("allgather", "all_gather")), ("RS", ("reduce_scatter",)),
                         ("AR", ("allreduce", "all_reduce")), ("BC", ("broadcast",))):
        if any(w in name for w in words):
            return short
    return name


def _ranks_of(args: Any) -> tuple[int, ...]:
    for a in args:
        if isinstance(a, str):  # functional collectives name their group
            try:
                return tuple(dist.get_process_group_ranks(_resolve_process_group(a)))
            except (ValueError, RuntimeError, KeyError):
                continue
        if isinstance(a, torch.ScriptObject):
            try:
                group = dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue
            return tuple(dist.get_process_group_ranks(group))
    return ()


def _iteration(model: nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor, step: int,
               dp_rank: int, ours: bool) -> tuple[Counter, Counter]:
    """(forward + backward, clip + step) collectives of one iteration."""
    with GroupCommMode() as fwd_bwd:
        for i in range(MICRO):
            if ours:
                model.set_is_last_backward(i == MICRO - 1)  # type: ignore[operator]
            (loss_of(model, data[step, i, dp_rank]) / MICRO).backward()
    with GroupCommMode() as after:
        if ours:
            clip_ours(model)
        opt.step()
        opt.zero_grad()
    return fwd_bwd.by_group, after.by_group


def _label(counts: Counter, names: dict[tuple[int, ...], str]) -> Counter:
    return Counter({(op, names.get(r, str(r))): n for (op, r), n in counts.items()})


def _per_axis(counts: Counter, axis: str) -> Counter:
    return Counter({op: n for (op, a), n in counts.items() if a == axis})


# design.md §4: (all-gathers, reduce-scatters, all-reduces) per flat group per iteration.
_DP_TABLE = {
    "no_shard": (0, 0, 1), "optim": (1, 1, 0), "optim_grads": (1, MICRO, 0),
    "optim_grads_params": (2 * MICRO, MICRO, 0),
}


def _counts_worker(rank: int, world: int, strategy: str) -> None:
    mesh = dp_tp_mesh()
    dp_rank = mesh.get_local_rank("dp")
    names = {
        tuple(dist.get_process_group_ranks(mesh.get_group("dp"))): "dp",
        tuple(dist.get_process_group_ranks(mesh.get_group("tp"))): "tp",
        tuple(range(world)): "dp x tp",
    }
    data = batches(steps=3, micro=MICRO, dp=2)
    model = wrap_ours(apply_tp(build_model(), mesh["tp"]), mesh["dp"], strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    control = wrap_fsdp2(apply_tp(build_model(), mesh["tp"]), mesh["dp"])
    control_opt = torch.optim.AdamW(control.parameters(), lr=1e-2)
    groups = sum(len(s.groups) for m in model.modules() if (s := state_of(m)) is not None)
    ag, rs, ar = _DP_TABLE[strategy]
    want_dp = Counter({k: v * groups for k, v in (("AG", ag), ("RS", rs), ("AR", ar)) if v})
    # no_shard: TP-sharded gradients over tp; else TP-sharded over dp x tp, the rest over dp.
    want_clip = (Counter({("AR", "tp"): 1}) if strategy == "no_shard"
                 else Counter({("AR", "dp x tp"): 1, ("AR", "dp"): 1}))
    for step in range(3):
        fwd_bwd, after = _iteration(model, opt, data, step, dp_rank, ours=True)
        control_fwd_bwd, _ = _iteration(control, control_opt, data, step, dp_rank, ours=False)
        fwd_bwd, after = _label(fwd_bwd, names), _label(after, names)
        control_tp = _per_axis(_label(control_fwd_bwd, names), "tp")
        # The optim/optim_grads refresh of a step's update runs at the next forward.
        dp = _per_axis(fwd_bwd, "dp")
        if step == 0 and strategy in ("optim", "optim_grads"):
            dp["AG"] += groups  # the first iteration has no update to refresh yet
        check_all_ranks(
            dp == want_dp,
            f"{strategy} iteration {step}: dp collectives {dict(dp)}, want {dict(want_dp)} "
            f"for {groups} groups",
        )
        tp = _per_axis(fwd_bwd, "tp")
        check_all_ranks(
            tp == control_tp and tp["AR"] > 0,
            f"{strategy} iteration {step}: tp collectives in forward/backward {dict(tp)}, "
            f"FSDP2 issues {dict(control_tp)}",
        )
        other = {k: v for k, v in fwd_bwd.items() if k[1] not in ("dp", "tp")}
        check_all_ranks(not other, f"{strategy}: collectives over other groups {other}")
        check_all_ranks(
            after == want_clip,
            f"{strategy} iteration {step}: clip + step collectives {dict(after)}, want "
            f"{dict(want_clip)}",
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collective_counts(ranks: RankPools, strategy: str) -> None:
    ranks.run(_counts_worker, 4, strategy, timeout_s=TIMEOUT_S)
