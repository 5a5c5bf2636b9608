"""``nn.init.*`` on the DTensor parameters after ``fully_shard`` (torchtitan's init after
``to_empty``) draws what single-process code draws: the full tensor from the same generator,
each rank keeping its rows (see [Note: random init of uneven shards] in ``_random_init.py``).

Each case wraps a model, re-initializes every parameter in ``parameters()`` order with a mix of
``nn.init`` functions after one seed, does the same on an unwrapped copy, and compares every
parameter of the full state dict bitwise; the generators must end in the same state (every
rank consumed the stream as a single process does). World 3 (uneven and empty shards) for every
strategy, and a 2x2 HSDP mesh with outer ``no_shard`` and ``optim``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import fully_shard

from _models import TinyGPT, agree, reference_copy
from _pool import RankPools

TIMEOUT_S = 240
# Before torch 2.14, ``bool(dtensor.any())`` of a sharded DTensor is this rank's local answer
# (``any`` returns ``Partial(sum)`` and the scalar is read from the local tensor), so
# ``trunc_normal_``'s rejection loop runs a different number of times on different ranks on any
# sharded DTensor, ours and FSDP2's alike; with bounds it cannot reject at (torchtitan's: the
# default +-2 at std 0.02) the loop never runs. The README's "Random init" says so.
TIGHT_TRUNC_BOUNDS = tuple(
    int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


def init_all(model: nn.Module, generator: torch.Generator | None, simple: bool) -> None:
    """A torchtitan-like init: a different ``nn.init`` per parameter, in ``parameters()``
    order. ``simple``: ``normal_``/``uniform_`` only (``trunc_normal_``'s rejection loop and
    ``kaiming_*``'s fan computation redistribute the tensor, which HSDP outer ``optim``
    DTensors refuse with a NotImplementedError)."""
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            kind = i % 2 * 3 if simple else i % 4
            if kind == 0:
                nn.init.normal_(param, std=0.02, generator=generator)
            elif kind == 1:
                bound = 0.04 if TIGHT_TRUNC_BOUNDS else 2.0  # see TIGHT_TRUNC_BOUNDS
                nn.init.trunc_normal_(param, std=0.02, a=-bound, b=bound, generator=generator)
            elif kind == 2 and param.dim() >= 2:
                nn.init.kaiming_uniform_(param, a=math.sqrt(5), generator=generator)
            else:
                nn.init.uniform_(param, -0.1, 0.1, generator=generator)


def _case(rank: int, world: int, strategy: str, outer: str | None, use_generator: bool) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=37, dim=12)
    ref = reference_copy(model)
    kw: dict = {}
    if outer is not None:
        kw = dict(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                  outer_dp_sharding_strategy=outer)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy, **kw)
    fully_shard(model, sharding_strategy=strategy, **kw)

    def draw(m: nn.Module) -> torch.Tensor:
        gen = torch.Generator().manual_seed(11) if use_generator else None
        torch.manual_seed(7)
        init_all(m, gen, simple=outer == "optim")
        # What is left of the streams: every rank must have consumed them like one process.
        rest = torch.rand(3, generator=gen) if gen is not None else torch.zeros(3)
        return torch.cat([torch.rand(3), rest])

    tail = draw(model)
    ref_tail = draw(ref)
    full = mckpt.get_full_state_dict(model, rank0_only=False)

    def compare() -> None:
        for key, value in ref.state_dict().items():
            assert torch.equal(full[key], value), (
                f"{key}: {int((full[key] != value).sum())} of {value.numel()} values differ")
        assert torch.equal(tail, ref_tail), "the generators ended in another state"
    agree(f"{strategy}/{outer}: nn.init on the wrapped model vs unwrapped", compare)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("use_generator", [False, True], ids=["default_gen", "generator"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_random_init_matches_single_process(ranks: RankPools, strategy: str,
                                            use_generator: bool) -> None:
    ranks.run(_case, 3, strategy, None, use_generator, timeout_s=TIMEOUT_S)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_random_init_hsdp(ranks: RankPools, outer: str) -> None:
    ranks.run(_case, 4, "optim_grads_params", outer, False, timeout_s=TIMEOUT_S)
