"""torchtitan's FSDP patterns, written in plain torch, give single-process numbers (issue 24, item
0's done-when): an SPMD mesh ``("dp_shard", "tp")`` passed with ``dp_mesh_dims``, ``fully_shard(
[model.norm, model.output], reshard_after_forward=False)`` with the head called outside the
model's forward by a chunked loss, FSDP2's gradient sum (``set_gradient_divide_factor(1.0)`` on
every module that passes ``isinstance(m, torch.distributed.fsdp.FSDPModule)``, with the loss
divided by the global token count), torchtitan's clipping over ``p.grad is not None`` (torch's
``get_total_norm`` + ``clip_grads_with_norm_``), at world 3 where some ranks hold no rows of
some parameters. Losses, gradient norms and full parameters after each run must equal
single-process training on the global batch; FSDP2 on the same script is the control (on
``mesh["dp_shard"]``: FSDP2's ``dp_mesh_dims`` takes only DTensor parameters on the SPMD mesh,
which a plain-torch model does not have).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from _titan import apply_fsdp, batches, compare, empty_shards, make_model, reference, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from megatron_fsdp_v2 import fully_shard

from _models import all_ranks_ok
from _pool import RankPools

TIMEOUT_S = 300
WORLD = 3
STEPS, MICRO = 3, 2
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]

def _disable_division(model: torch.nn.Module) -> int:
    """torchtitan's ``disable_fsdp_gradient_division``: how many modules it reached."""
    fsdp_module = torch_fsdp.FSDPModule
    reached = 0
    for module in model.modules():
        if isinstance(module, fsdp_module):
            module.set_gradient_divide_factor(1.0)
            # gloo has no PREMUL_SUM: FSDP2 needs a plain SUM here (ours always sums).
            module.set_force_sum_reduction_for_comms(True)
            reached += 1
    return reached


def _worker(rank: int, world: int, strategy: str, summed: bool) -> list[str]:
    data = batches(STEPS, MICRO, world)
    want = reference(STEPS, MICRO, world)
    spmd = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    errors: list[str] = []
    # torchtitan's SPMD mesh with dp_mesh_dims where torch has DataParallelMeshDims (not 2.11);
    # on 2.11 its data-parallel sub-mesh, which the former resolves to.
    dims = getattr(torch_fsdp, "DataParallelMeshDims", None)
    ours = (dict(mesh=spmd, dp_mesh_dims=dims(shard="dp_shard")) if dims is not None
            else dict(mesh=spmd["dp_shard"]))
    runs: list[tuple[str, Any, dict[str, Any]]] = [
        ("megatron_fsdp_v2", fully_shard, dict(ours, sharding_strategy=strategy, timeout=60)),
        ("FSDP2", torch_fully_shard, dict(mesh=spmd["dp_shard"])),
    ]
    for what, wrap, kw in runs:
        model = make_model()
        apply_fsdp(model, wrap, **kw)
        if summed:
            reached = _disable_division(model)
            if reached != 6:  # embedding, 2 blocks, norm and output (one unit), root
                errors.append(f"{what}: {reached} modules pass isinstance(m, FSDPModule), "
                              "want 6")
        got = train(model, data, rank, world, summed)
        errors += compare(got, want, f"{what} {strategy} rank {rank}")
        counts: list[Any] = [None] * world
        dist.all_gather_object(counts, got["counts"])
        if any(c != counts[0] for c in counts):
            errors.append(f"{what}: ranks clipped different numbers of gradients: {counts}")
        if what == "megatron_fsdp_v2":
            empty: list[Any] = [None] * world
            dist.all_gather_object(empty, empty_shards(model))
            if strategy != "no_shard" and not any(empty):
                errors.append("no rank holds an empty shard: the case under test did not occur")
    if not all_ranks_ok(not errors):
        errors = errors or [f"rank {rank}: failed on another rank"]
    return errors


@pytest.mark.parametrize("summed", [pytest.param(True, id="sum"), pytest.param(False, id="mean")])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torchtitan_patterns_match_single_process(ranks: RankPools, strategy: str,
                                                  summed: bool) -> None:
    results = ranks.run(_worker, WORLD, strategy, summed, timeout_s=TIMEOUT_S)
    failures = [e for r in results for e in r]
    assert not failures, "\n".join(failures[:20])
