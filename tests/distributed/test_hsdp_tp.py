"""HSDP x TP: a 3-D mesh ``("replicate", "shard", "tp")`` of 2 x 2 x 2 (8 ranks), TP on
``mesh["tp"]``, ``fully_shard`` on ``mesh["replicate", "shard"]`` with outer ``no_shard`` (FSDP2's
HSDP, run as the control) and outer ``optim``: parity with single-process training (losses,
gradient norms, ``full_tensor()`` of every parameter, torch's full state dict)."""

from __future__ import annotations

import pytest
from _tp_common import (
    apply_tp,
    batches,
    build_model,
    clip_ours,
    clip_torch,
    compare,
    compare_losses,
    full_values,
    torch_full_state_dict,
    train,
    wrap_fsdp2,
    wrap_ours,
)
from torch.distributed.device_mesh import init_device_mesh

from _pool import RankPools

TIMEOUT_S = 500


def _parity_worker(rank: int, world: int, strategy: str, outer: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh = mesh["replicate", "shard"]
    dp_rank = mesh.get_local_rank("replicate") * 2 + mesh.get_local_rank("shard")
    data = batches(steps=2, micro=2, dp=4, per_rank=1)
    ref = build_model()
    ref_losses = train(ref, data, None, clip=clip_torch)
    want = full_values(ref)
    case = f"HSDP ({outer} x {strategy}) x TP"
    ours = wrap_ours(apply_tp(build_model(), mesh["tp"]), dp_mesh, strategy,
                     outer_dp_sharding_strategy=outer)
    losses = train(ours, data, dp_rank, mark=True, clip=clip_ours)
    compare_losses(f"{case}: losses and gradient norms", losses, ref_losses)
    compare(f"{case}: full_tensor()", full_values(ours), want)
    compare(f"{case}: torch full state dict", torch_full_state_dict(ours), want)
    if outer == "no_shard":  # FSDP2's HSDP x TP, the same script
        control = wrap_fsdp2(apply_tp(build_model(), mesh["tp"]), dp_mesh)
        control_losses = train(control, data, dp_rank, clip=clip_torch)
        compare_losses(f"{case}: FSDP2 (control)", control_losses, ref_losses)
        compare(f"{case}: FSDP2 full_tensor() (control)", full_values(control), want)


@pytest.mark.parametrize("strategy,outer", [
    ("optim_grads_params", "no_shard"),
    ("optim", "no_shard"),
    ("optim_grads_params", "optim"),
])
def test_parity_2x2x2(ranks: RankPools, strategy: str, outer: str) -> None:
    ranks.run(_parity_worker, 8, strategy, outer, timeout_s=TIMEOUT_S)
