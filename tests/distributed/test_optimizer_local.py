"""The optimizer step on local tensors (see [Note: local optimizer step] in
``megatron_fsdp_v2/_optimizer_local.py``).

Each case trains three copies of one small model (uneven shards, a rank with an empty shard at
world 3, a frozen layer, a layer used twice) plus one plain parameter the library does not
manage: ``fully_shard`` with the default optimizer step (on local tensors where allowed),
``fully_shard`` with the DTensor step forced (a no-op per-optimizer step hook, which the local
path must respect), and single-process PyTorch on the concatenated global batch. After every
step the two ``fully_shard`` runs must agree bitwise (losses, parameters, every optimizer state
tensor), the state must be DTensors placed as their parameters, and both must match the
reference. A dispatch-mode spy proves which path ran: no op of the default step sees a DTensor,
every step of the forced one does.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_fsdp_v2 import fully_shard

from _models import OddMLP, agree, cat_batch, local_detached, make_batches, shard_rows
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TIMEOUT_S = 240.0
STEPS = 3
MICRO = 2
OPTIMIZERS: dict[str, Any] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                      weight_decay=0.01),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}


class _DTensorOps(TorchDispatchMode):
    """Counts the ops that receive a DTensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
            self.count += 1
        return func(*args, **kwargs)


def _wrap(model: OddMLP, strategy: str) -> OddMLP:
    kw: dict[str, Any] = {"sharding_strategy": strategy, "timeout": 60.0}
    fully_shard(model.mid, **kw)
    fully_shard(model.shared, **kw)
    return fully_shard(model, **kw)


def _check_twins(ours: nn.Module, ours_opt: Any, forced: nn.Module, forced_opt: Any,
                 where: str) -> None:
    forced_params = list(forced.parameters())
    for i, p in enumerate(ours.parameters()):
        q = forced_params[i]
        assert torch.equal(local_detached(p), local_detached(q)), \
            f"{where}: parameter {i} differs bitwise"
        mine, theirs = ours_opt.state.get(p, {}), forced_opt.state.get(q, {})
        assert sorted(mine) == sorted(theirs), f"{where}: state keys {sorted(mine)} vs " \
            f"{sorted(theirs)}"
        for key, value in mine.items():
            other = theirs[key]
            assert type(value) is type(other), f"{where}: state {i}.{key}: {type(value)} vs " \
                f"{type(other)}"
            if isinstance(value, DTensor):
                assert (value.placements, value.shape, value.device_mesh) == (
                    p.placements, p.shape, p.device_mesh), f"{where}: state {i}.{key} placed " \
                    f"{value.placements} {tuple(value.shape)}, parameter {p.placements}"
            if isinstance(value, torch.Tensor):
                assert torch.equal(local_detached(value), local_detached(other)), (
                    f"{where}: state {i}.{key} differs bitwise")


def _check_reference(ours: nn.Module, ref: nn.Module, where: str) -> None:
    refs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        full = refs[name].detach()
        if isinstance(p, DTensor):
            lo, hi = shard_rows(p)
            full = full[lo:hi]
        torch.testing.assert_close(local_detached(p), full, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{where}: {name}: {m}")


def _case(rank: int, world: int, strategy: str, optimizer: str) -> list[int]:
    """Trains the three copies; returns the DTensor-op counts of each default-path step."""
    torch.manual_seed(0)
    base = OddMLP()
    ref = copy.deepcopy(base)
    ours = _wrap(copy.deepcopy(base), strategy)
    forced = _wrap(copy.deepcopy(base), strategy)
    scales = [nn.Parameter(torch.tensor([1.5, -0.5, 2.0])) for _ in range(3)]  # not managed
    make = OPTIMIZERS[optimizer]
    # The plain parameter in a group of its own: torch's foreach and fused steps refuse a list
    # that mixes DTensors with plain tensors.
    opts = [make([{"params": m.parameters()}, {"params": [s]}])
            for m, s in zip((ours, forced, ref), scales)]
    opts[1].register_step_pre_hook(lambda *args: None)  # forces the DTensor step
    counts = []
    for step, batches in enumerate(make_batches("mlp", STEPS, MICRO, world, 2, seed=world)):
        for m, parts in enumerate(batches):
            last = m == MICRO - 1
            for model, scale in zip((ours, forced), scales):
                model.set_is_last_backward(last)
                x, y = parts[rank]
                (F.mse_loss(model(x) * scale, y) / MICRO).backward()
            x, y = cat_batch("mlp", parts)
            (F.mse_loss(ref(x) * scales[2], y) / MICRO).backward()
        for scale in scales[:2]:  # not managed: averaged by hand, as a user would
            dist.all_reduce(scale.grad)
            scale.grad /= world
        spies = [_DTensorOps(), _DTensorOps()]
        for opt, spy in zip(opts, [*spies, None]):
            if spy is None:
                opt.step()
            else:
                with spy:
                    opt.step()
            opt.zero_grad()
        counts.append(spies[0].count)
        assert spies[1].count > 0, "the forced step did not run on DTensors"
        where = f"{strategy}/{optimizer} world {world} step {step}"
        agree("local vs DTensor step", lambda: _check_twins(ours, opts[0], forced, opts[1], where))
        agree("vs single-process torch", lambda: _check_reference(ours, ref, where))
        assert torch.equal(scales[0].detach(), scales[1].detach()), f"{where}: plain parameter"
        # The optimizer-facing objects are back in the optimizer's lists.
        held = [p for group in opts[0].param_groups for p in group["params"]]
        expected = [*ours.parameters(), scales[0]]
        assert all(a is b for a, b in zip(held, expected, strict=True)), where
    return counts


CASES = [
    *[(2, s, o) for s in STRATEGIES for o in OPTIMIZERS],
    *[(3, s, o) for s in STRATEGIES for o in ("sgd", "adamw")],
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,strategy,optimizer", CASES,
                         ids=[f"w{w}-{s}-{o}" for w, s, o in CASES])
def test_same_bits_as_the_dtensor_step(ranks: RankPools, world: int, strategy: str,
                                       optimizer: str) -> None:
    for counts in ranks.run(_case, world, strategy, optimizer, timeout_s=TIMEOUT_S):
        assert counts == [0] * STEPS, f"ops on DTensors in the local step: {counts}"


def _hooks_and_failures(rank: int, world: int, strategy: str) -> list[str]:
    """A user's step hook sees DTensors; a step that raises half-way is undone before
    ``state_dict`` and the next step, and training then matches the DTensor path."""
    torch.manual_seed(0)
    base = OddMLP()
    ours = _wrap(copy.deepcopy(base), strategy)
    forced = _wrap(copy.deepcopy(base), strategy)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, forced)]
    opts[1].register_step_pre_hook(lambda *args: None)
    seen: list[str] = []
    batches = make_batches("mlp", 3, 1, world, 2, seed=1)

    def train(step: int) -> None:
        for model in (ours, forced):
            x, y = batches[step][0][rank]
            F.mse_loss(model(x), y).backward()

    train(0)
    handle = opts[0].register_step_pre_hook(
        lambda opt, *a: seen.extend(type(p).__name__ for p in opt.param_groups[0]["params"]))
    for opt in opts:
        opt.step()
        opt.zero_grad()
    handle.remove()
    train(1)
    for opt in opts:
        opt.param_groups[0]["lr"] = "not a number"
        try:
            opt.step()
        except TypeError:
            seen.append("raised")
        opt.param_groups[0]["lr"] = 1e-2
    state = opts[0].state_dict()  # undoes the swap the failed step left
    params = list(ours.parameters())
    assert all(a is b for a, b in zip(opts[0].param_groups[0]["params"], params))
    assert all(isinstance(v, DTensor) for s in state["state"].values()
               for k, v in s.items() if k != "step")
    for opt in opts:
        opt.step()
        opt.zero_grad()
    train(2)
    for opt in opts:
        opt.step()
    _check_twins(ours, opts[0], forced, opts[1], f"{strategy} after a failed step")
    return seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_user_hooks_and_a_failed_step(ranks: RankPools, strategy: str) -> None:
    for seen in ranks.run(_hooks_and_failures, 2, strategy, timeout_s=TIMEOUT_S):
        assert set(seen[:-2]) == {"DTensor"} and seen[-2:] == ["raised", "raised"], seen


def _state_placed_otherwise(rank: int, world: int) -> list[int]:
    """A state tensor re-placed by hand (``Replicate`` beside a ``Shard`` parameter) sends the
    whole step down the DTensor path, which redistributes it: the local tensors would not even
    have the same shape. Returns the DTensor-op counts of the two steps after the change."""
    torch.manual_seed(0)
    base = OddMLP()
    models = [_wrap(copy.deepcopy(base), "optim") for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    opts[1].register_step_pre_hook(lambda *args: None)
    counts = []
    for step, batches in enumerate(make_batches("mlp", 3, 1, world, 2, seed=2)):
        x, y = batches[0][rank]
        for model, opt in zip(models, opts):
            F.mse_loss(model(x), y).backward()
            spy = _DTensorOps()
            with spy:
                opt.step()
            opt.zero_grad()
            if model is models[0] and step:
                counts.append(spy.count)
            if step == 0:
                p = model.inp.weight
                opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].redistribute(
                    placements=[Replicate()])
        agree("local vs DTensor step", lambda: _check_state_equal(models, opts, step))
    return counts


def _check_state_equal(models: list[nn.Module], opts: list[Any], step: int) -> None:
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(local_detached(p), local_detached(q)), f"step {step}: parameters differ"
        for key, value in opts[0].state[p].items():
            assert torch.equal(local_detached(value),
                               local_detached(opts[1].state[q][key])), f"{key} differs"


@pytest.mark.timeout(300)
def test_state_placed_otherwise_takes_the_dtensor_step(ranks: RankPools) -> None:
    for counts in ranks.run(_state_placed_otherwise, 2, timeout_s=TIMEOUT_S):
        assert len(counts) == 2 and all(c > 0 for c in counts), counts


def _training_loop_extras(rank: int, world: int, strategy: str) -> list[str]:
    """What a training loop adds around the step: an LR scheduler, a ``GradScaler`` (its
    ``unscale_`` and skipped-step check run on the DTensor gradients before the step), a param
    group added after two steps, a parameter frozen after two steps. The local step must match
    the DTensor step bitwise through all of it. Returns the failures."""
    torch.manual_seed(0)
    base = OddMLP()
    models = [_wrap(copy.deepcopy(base), strategy) for _ in range(2)]
    opts = [torch.optim.AdamW([p for n, p in m.named_parameters() if not n.startswith("out.")],
                              lr=1e-2) for m in models]
    opts[1].register_step_pre_hook(lambda *args: None)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts]
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in opts]
    failures = []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 15, generator=g), torch.randn(4, 3, generator=g)
        for model, opt, scheduler, scaler in zip(models, opts, schedulers, scalers):
            if step == 2:
                opt.add_param_group({"params": list(model.out.parameters()), "lr": 5e-3})
                model.inp.weight.requires_grad_(False)
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            scheduler.step()
            opt.zero_grad()
        try:
            _check_twins(models[0], opts[0], models[1], opts[1], f"{strategy} step {step}")
        except AssertionError as e:
            failures.append(str(e))
    return failures


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scheduler_scaler_and_changing_groups(ranks: RankPools, strategy: str) -> None:
    for failures in ranks.run(_training_loop_extras, 2, strategy, timeout_s=TIMEOUT_S):
        assert failures == []
