"""What the ``test_checkpoint*`` files share: models, wrapping, batches, a training loop, and the
comparisons with their tolerances.

Tolerances. Resuming at the *same* world size and strategy is checked **bitwise** (losses and
every final fp32 parameter). Resuming at another world size or strategy changes how gradients
are reduced (other per-rank batch splits and collectives), so losses and final fp32 parameters
are checked with ``rtol=1e-6`` (``atol=1e-7`` for entries near zero) against the uninterrupted
run; a wrong row offset, a stale compute weight or a wrong Adam ``step`` moves them by orders of
magnitude more (measured margins: losses ~1e-7 relative, parameters within a quarter of the
envelope). Loads of given weights are checked bitwise on the main weights and by a forward
compared with an unwrapped model holding those weights: bitwise in fp32, ``1e-2`` with bf16
compute weights.
"""

from __future__ import annotations

import torch

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: the units' parameter groups (flat buffers) a checkpoint must round-trip
from megatron_fsdp_v2._registry import state_of

from _models import OddMLP, TinyGPT, all_ranks_ok, lm_loss, mlp_loss, step_mean_loss

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
GLOBAL_BATCH = 12  # divisible by every world size used here
RTOL, ATOL = 1e-6, 1e-7


# ---------------------------------------------------------------------- helpers

def make_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyGPT() if kind == "lm" else OddMLP()


def wrap(model: torch.nn.Module, strategy: str, mp: MixedPrecisionPolicy | None = None):
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in getattr(model, "blocks", []):  # TinyGPT: nested units, tied embedding
        fully_shard(block, sharding_strategy=strategy, **kw)
    return fully_shard(model, sharding_strategy=strategy, **kw)


def new_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def local_batch(kind: str, step: int, rank: int, world: int):
    """This rank's slice of the global batch of ``step``; the same global batch at any world."""
    g = torch.Generator().manual_seed(1000 + step)
    n = GLOBAL_BATCH // world
    rows = slice(rank * n, (rank + 1) * n)
    if kind == "lm":
        return torch.randint(0, 37, (GLOBAL_BATCH, 9), generator=g)[rows]
    x, y = torch.randn(GLOBAL_BATCH, 15, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    return x[rows], y[rows]


def sample_input(kind: str):
    g = torch.Generator().manual_seed(7)
    if kind == "lm":
        return torch.randint(0, 37, (2, 8), generator=g)
    return torch.randn(4, 15, generator=g)


def train(model, opt, kind: str, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    loss_fn = lm_loss if kind == "lm" else mlp_loss
    for step in steps:
        losses.append(step_mean_loss(loss_fn(model, local_batch(kind, step, rank, world)), opt))
    return losses


def expect_value_error(what: str, fn, *fragments: str) -> None:
    """``fn`` (run on every rank) must raise ValueError whose message contains ``fragments``."""
    try:
        fn()
        err = "no ValueError raised"
    except ValueError as e:
        missing = [f for f in fragments if f not in str(e)]
        err = f"message {str(e)!r} lacks {missing}" if missing else None
    if not all_ranks_ok(err is None):
        raise AssertionError(f"{what}: {err or 'failed on another rank'}")


def assert_same(actual: dict, expected: dict, *, exact: bool) -> None:
    assert list(actual) == list(expected), f"keys {list(actual)} != {list(expected)}"
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype, f"{key}: dtype {got.dtype} != {value.dtype}"
        if exact:
            assert torch.equal(got, value), f"{key}: max diff {(got - value).abs().max()}"
        else:
            torch.testing.assert_close(got, value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{key}: {m}")


def assert_losses(actual: list[float], expected: list[float], *, exact: bool) -> None:
    if exact:
        assert actual == expected, f"losses {actual} != {expected}"
    else:
        torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64), rtol=RTOL, atol=0.0)


def units_groups(model: torch.nn.Module) -> list:
    return [g for m in model.modules() if (s := state_of(m)) is not None for g in s.groups]


def main_weights_snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [g.main_weight.detach().clone() for g in units_groups(model)]
