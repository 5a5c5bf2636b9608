"""FSDP x TP with plain parameters in the same model (mixed meshes): a tensor-parallel model
whose root also holds a plain ``nn.Parameter`` (a bias on the replicated logits, replicated over
tp) trains like the single-process model, and ``megatron_fsdp_v2.clip_grad_norm_`` computes the
norm over the whole model -- TP-sharded parameters on the dp x tp group, TP-replicated and plain
ones on dp, each counted once -- with one all-reduce per distinct process group.

No FSDP2 control here: torch's ``clip_grad_norm_`` cannot stack norms of DTensors on different
meshes ("All operands in aten.stack must have the same mesh"), which is exactly the case."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _tp_common import (
    STRATEGIES,
    TPModel,
    apply_tp,
    batches,
    build_model,
    clip_ours,
    clip_torch,
    compare,
    compare_losses,
    dp_tp_mesh,
    full_values,
    train,
    wrap_ours,
)

from _comm_counts import CollectiveCounts
from _models import check_all_ranks
from _pool import RankPools

TIMEOUT_S = 400


class MixedModel(TPModel):
    """TPModel plus a plain parameter that no TP plan touches."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_bias = nn.Parameter(torch.linspace(-0.5, 0.5, self.head.out_features))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # The head's output is replicated over tp and handed back as a plain tensor.
        return super().forward(tokens) + self.logit_bias


def build_mixed(seed: int = 0) -> MixedModel:
    plain = build_model(seed)
    model = MixedModel()
    model.load_state_dict(plain.state_dict(), strict=False)
    return model


def _mixed_worker(rank: int, world: int, strategy: str) -> None:
    mesh = dp_tp_mesh()
    dp_rank = mesh.get_local_rank("dp")
    data = batches(steps=3, micro=2, dp=2)
    ref = build_mixed()
    ref_losses = train(ref, data, None, clip=clip_torch)
    want = full_values(ref)

    ours = wrap_ours(apply_tp(build_mixed(), mesh["tp"]), mesh["dp"], strategy)
    all_reduces: list[int] = []

    def clip_counting(model: nn.Module) -> torch.Tensor:
        with CollectiveCounts() as counts:
            norm = clip_ours(model)
        all_reduces.append(counts.get_comm_counts().get(torch.ops.c10d.allreduce_, 0))
        return norm

    losses = train(ours, data, dp_rank, mark=True, clip=clip_counting)
    compare_losses(f"{strategy}: mixed meshes", losses, ref_losses)
    compare(f"{strategy}: full_tensor()", full_values(ours), want)
    # One per distinct group: dp x tp for the TP-sharded parameters and dp for the plain and
    # TP-replicated ones; under no_shard only the TP shards need summing (over tp).
    expected = 1 if strategy == "no_shard" else 2
    check_all_ranks(all_reduces == [expected] * len(all_reduces),
                    f"{strategy}: all-reduces per clip {all_reduces}, expected {expected}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mixed_plain_and_tp_parameters(ranks: RankPools, strategy: str) -> None:
    ranks.run(_mixed_worker, 4, strategy, timeout_s=TIMEOUT_S)
