"""``CollectiveCounts`` (``_comm_counts.py``) counts what torch's ``CommDebugMode`` counts, step by
step, on the training runs the tests use it for: every strategy with native and substituted
collectives (broadcast all-gathers, all-reduce reduce-scatters), micro-batches, activation
checkpointing, a second backward over the same graph, the DTensor all-reduce of gradient
clipping, and HSDP on a (2, 2) mesh. See [Note: counting collectives cheaply]."""

from __future__ import annotations

import pytest
from _collective_impl import STRATEGIES, TIMEOUT_S, Variant, _check, _run_variant, _substitute_all
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from _comm_counts import CollectiveCounts
from _pool import RankPools

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def _same_counts(rank: int, world: int, runs: list[tuple[str, str, Variant, bool]]) -> None:
    mesh = None
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with _substitute_all():
        for impl, strategy, v, overlap in runs:
            args = (rank, world, impl, strategy, overlap, v)
            kw = {} if mesh is None else dict(mesh=mesh, outer="optim")
            light = _run_variant(*args, **kw, counter=CollectiveCounts)["comm"]
            torch_counts = _run_variant(*args, **kw, counter=CommDebugMode)["comm"]
            what = f"world {world} {impl} {strategy} overlap={overlap} {v}"
            _check(light == torch_counts,
                   f"{what}: CollectiveCounts {light} != CommDebugMode {torch_counts}")
            _check(all(sum(step.values()) > 0 for step in light), f"{what}: counted nothing")


@pytest.mark.parametrize("impl", ["native", "auto"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_counts_equal_comm_debug_mode(ranks: RankPools, strategy: str, impl: str) -> None:
    runs = [(impl, strategy, Variant(micro=3), True)]
    if strategy == "optim_grads_params":
        runs += [(impl, strategy, Variant(model="gpt_ckpt", retain_graph=True), False)]
    ranks.run(_same_counts, 2, runs, timeout_s=TIMEOUT_S)


def test_counts_equal_comm_debug_mode_hsdp(ranks: RankPools) -> None:
    ranks.run(_same_counts, 4, [("auto", "optim_grads_params", Variant(mp="bf16"), True)],
              timeout_s=TIMEOUT_S)
