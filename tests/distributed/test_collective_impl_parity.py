"""``collective_impl="auto"`` trains bitwise like ``"native"`` with every reduce-scatter and
all-gather substituted (thresholds lowered to 0), over the strategies, world sizes 2 to 4, HSDP
and the debug order check; the accounting (``FSDPModule.collective_stats``) says what ran and
``"native"`` keeps the count contract (see ``_collective_impl.py``).
"""

from __future__ import annotations

import os

import pytest
from _collective_impl import (
    STRATEGIES,
    TIMEOUT_S,
    VARIANTS,
    Variant,
    _check,
    _check_accounting,
    _check_contract,
    _compare,
    _run_variant,
    _substitute_all,
)
from torch.distributed.device_mesh import init_device_mesh

# private: the collective-kind names of collective_stats (impl.BROADCASTS)
from megatron_fsdp_v2._comm import _collective_impl as impl

from _pool import RankPools

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


# Without overlap the collectives are the same calls, issued one at a time: the variants that
# change what is reduced or gathered (accumulation with bf16 and zero-filled gradients, odd
# shapes, a second backward in one window) run that way too; the rest (one micro-batch, plain
# bf16, checkpointing) differ from them only in what the overlapping path already covers.
SYNC_VARIANTS = [v for v in VARIANTS
                 if not v.zero_to_none or v.model == "odd" or v.retain_graph]


def _parity_worker(rank: int, world: int, strategy: str, overlap: bool) -> None:
    with _substitute_all():
        for v in VARIANTS if overlap else SYNC_VARIANTS:
            what = f"{strategy} world {world} overlap={overlap} {v}"
            native = _run_variant(rank, world, "native", strategy, overlap, v)
            auto = _run_variant(rank, world, "auto", strategy, overlap, v)
            _compare(native, auto, what)
            _check_accounting(native, auto, what)
            _check_contract(native, strategy, v, what)
            substituted = {k for s in auto["stats"] for k in s if k[0] != k[1]}
            if strategy != "no_shard":
                _check(bool(substituted), f"{what}: auto substituted nothing")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [2, 3])
def test_auto_bitwise_equals_native(ranks: RankPools, world: int, strategy: str,
                                    overlap: bool) -> None:
    ranks.run(_parity_worker, world, strategy, overlap, timeout_s=TIMEOUT_S)


def _world4_worker(rank: int, world: int, strategy: str) -> None:
    with _substitute_all():
        for v in (Variant(micro=3), Variant(mp="bf16")):
            what = f"{strategy} world 4 {v}"
            native = _run_variant(rank, world, "native", strategy, True, v)
            auto = _run_variant(rank, world, "auto", strategy, True, v)
            _compare(native, auto, what)
            _check_accounting(native, auto, what)


def _hsdp_worker(rank: int, world: int, outer: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with _substitute_all():
        for v in (Variant(micro=3), Variant(mp="bf16")):
            for overlap in (True, False):
                what = f"HSDP 2x2 outer {outer} overlap={overlap} {v}"
                args = ("optim_grads_params", overlap, v, mesh, outer)
                native = _run_variant(rank, world, "native", *args)
                auto = _run_variant(rank, world, "auto", *args)
                _compare(native, auto, what)
                _check_accounting(native, auto, what)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_auto_bitwise_world4(ranks: RankPools, strategy: str) -> None:
    ranks.run(_world4_worker, 4, strategy, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_auto_bitwise_hsdp(ranks: RankPools, outer: str) -> None:
    ranks.run(_hsdp_worker, 4, outer, timeout_s=TIMEOUT_S)


def _debug_check_worker(rank: int, world: int) -> None:
    """``MFSDP_DEBUG_COLLECTIVES=1`` (an 8-byte all-gather before each collective) with the
    substitutes: still bitwise, and the check itself is neither substituted nor counted."""
    os.environ["MFSDP_DEBUG_COLLECTIVES"] = "1"
    try:
        with _substitute_all():
            v = Variant(micro=3)
            native = _run_variant(rank, world, "native", "optim_grads_params", True, v)
            auto = _run_variant(rank, world, "auto", "optim_grads_params", True, v)
    finally:
        del os.environ["MFSDP_DEBUG_COLLECTIVES"]
    _compare(native, auto, "debug check")
    for stats in auto["stats"]:
        _check(all(c.ops == c.calls * (world if k[1] == impl.BROADCASTS else 1)
                   for k, c in stats.items()), f"debug check counted: {stats}")


def test_with_debug_order_check(ranks: RankPools) -> None:
    ranks.run(_debug_check_worker, 2, timeout_s=TIMEOUT_S)
