"""HSDP's outer reductions overlap backward (see [Note: outer reductions in backward] in
``megatron_fsdp_v2/_context.py``): on a 2x2 mesh, each unit's outer all-reduce (outer
``no_shard``) or reduce-scatter (outer ``optim``) is launched as soon as the unit's last inner
reduction has finished, when the next unit's post-backward drains it, so it is launched before
the inner reduction of the unit after it in backward order; before, every outer reduction was
launched by the final callback. The launches are recorded from ``GroupIssuer.launch``; the
numbers, collective counts and bitwise agreement of replicas are what ``test_hsdp.py`` and
``test_hsdp_outer_optim.py`` check, unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: the tree's runtime context (forward order, events)
from megatron_fsdp_v2._registry import state_of

# private: records the launches of GroupIssuer.launch (when outer collectives start)
from megatron_fsdp_v2._runtime._issuer import CollectiveLaunch, GroupIssuer

from _models import TinyGPT, lm_loss, make_batches
from _pool import RankPools

TIMEOUT_S = 280
MICRO = 2


def _launch_order(rank: int, world: int, inner: str, outer: str, reduce_bf16: bool
                  ) -> tuple[list[str], list[tuple[str, str]]]:
    """Backward order of the units and the (unit, inner|outer) gradient reductions launched in
    the last backward of a steady-state window."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if reduce_bf16 else None)
    kw: dict[str, Any] = dict(mesh=mesh, sharding_strategy=inner, mp_policy=policy,
                              outer_dp_sharding_strategy=outer)
    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    launches: list[tuple[str, str]] = []
    launch = GroupIssuer.launch

    def recording(self: GroupIssuer, collective: CollectiveLaunch, async_op: bool) -> Any:
        if collective.is_reduction:
            ctx = state_of(model).ctx  # type: ignore[union-attr]
            unit = next(s.fqn for s in ctx.states if any(g.issuer is self for g in s.groups))
            kind = "inner" if collective.axis == "shard" else "outer"
            launches.append((unit, kind))
        return launch(self, collective, async_op)

    batches = make_batches("lm", 2, MICRO, world, per_rank=2)
    for step in range(2):
        for i in range(MICRO):
            last = i == MICRO - 1
            model.set_is_last_backward(last)
            loss = lm_loss(model, batches[step][i][rank]) / MICRO
            if step == 1 and last:
                GroupIssuer.launch = recording  # type: ignore[method-assign]
            try:
                loss.backward()
            finally:
                GroupIssuer.launch = launch  # type: ignore[method-assign]
        opt.step()
        opt.zero_grad()
    order = [s.fqn for s in reversed(state_of(model).ctx.forward_order)]  # type: ignore[union-attr]
    return order, launches


CASES = [
    ("no_shard", "no_shard", False),  # inner all-reduce in place on main_grad (no temporary)
    ("optim", "no_shard", False),  # inner reduce-scatter in place
    ("optim_grads", "no_shard", False),  # inner reduce-scatter of a temporary bucket
    ("optim_grads_params", "no_shard", True),  # bf16 reduction: outer workspaces
    ("optim_grads_params", "optim", False),  # outer reduce-scatter of the window bucket
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inner,outer,reduce_bf16", CASES,
                         ids=[f"{i}-outer_{o}{'-bf16_reduce' if b else ''}" for i, o, b in CASES])
def test_outer_reduction_launched_in_backward(ranks: RankPools, inner: str, outer: str,
                                              reduce_bf16: bool) -> None:
    for rank, (order, launches) in enumerate(ranks.run(_launch_order, 4, inner, outer,
                                                        reduce_bf16, timeout_s=TIMEOUT_S)):
        units = [u for u in order if any(unit == u for unit, _ in launches)]
        assert len(units) >= 3, (order, launches)
        where = {event: i for i, event in reversed(list(enumerate(launches)))}
        for earlier, later in zip(units, units[1:]):
            outer_launch = where.get((earlier, "outer"))
            inner_launch = where.get((later, "inner"))
            assert outer_launch is not None and inner_launch is not None, launches
            assert outer_launch < inner_launch, (
                f"rank {rank}: the outer reduction of {earlier!r} was launched after the inner "
                f"reduction of {later!r}, the next unit in backward order: {launches}")
