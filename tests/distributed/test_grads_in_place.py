"""Gradients written by autograd straight into the flat buffers (``BufferPlan.grads_in_place``;
see [Note: gradients in place] in ``megatron_fsdp_v2/_runtime/_grad_staging.py``).

Each case trains three copies of one small model from one seed on the same data: ``fully_shard``
as configured (gradients in place where the plan allows), ``fully_shard`` with the plan's
``grads_in_place`` switched off (every micro-batch staged by ``pack_``, the path the in-place one
replaces), and single-process PyTorch on the concatenated global batch. After every step the
two ``fully_shard`` runs must agree bitwise wherever the arithmetic is the same (one micro-batch,
or a power-of-two world size, where scaling the sum equals summing the scaled values), else to
rounding; both must match the reference (loss, parameters, ``.grad`` including ``None`` for the
unused parameter). The in-place runs also prove that no unit staged gradients (a spy on
``GradStaging``) but the root on the reduce-each path (by design: units are nested below
it) and that ``.grad`` during backward lives in the flat buffer.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# private: records the gradient groups' copies (GradStaging) to prove gradients land in place
import megatron_fsdp_v2._runtime._grad_staging as staging_module
from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: the compute parameter and the groups' records (where gradients are written)
from megatron_fsdp_v2._registry import record_of, state_of

from _models import SharedLayerNet, agree, local_detached, shard_rows
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
# fp32: where gradients go in place (ZeRO-3 stages: see [Note: gradients in place]).
IN_PLACE = ["no_shard", "optim", "optim_grads"]
TIMEOUT_S = 240.0
PER_RANK = 2
STEPS = 2


def _wrap(model: SharedLayerNet, strategy: str, mp: str) -> SharedLayerNet:
    policy = {
        "fp32": None,
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        "bf16_comm": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.bfloat16),
    }[mp]
    kw: dict[str, Any] = {"sharding_strategy": strategy, "timeout": 60.0}
    if policy is not None:
        kw["mp_policy"] = policy
    fully_shard(model.block, **kw)
    fully_shard(model.shared, **kw)
    return fully_shard(model, **kw)


def _groups(model: nn.Module) -> list[Any]:
    return [g for m in model.modules() if (s := state_of(m)) is not None for g in s.groups]


def _stage_instead(model: nn.Module) -> None:
    """The staging path everywhere: the plan without ``grads_in_place``."""
    for group in _groups(model):
        group.plan = dataclasses.replace(group.plan, grads_in_place=False)


@contextlib.contextmanager
def _count_staging() -> Iterator[list[str]]:
    """Records the unit of every group that staged gradients (``GradStaging.stage`` and
    ``stage_over``: a ``pack_`` of ``param.grad`` into a flat buffer) while active."""
    staged: list[str] = []
    cls = staging_module.GradStaging
    real = {name: getattr(cls, name) for name in ("stage", "stage_over")}

    def spy(name: str) -> Callable[..., None]:
        def wrapper(self: Any, grads: Any, *args: Any, **kwargs: Any) -> None:
            if any(g is not None for g in grads):
                staged.append(self.group.name.split("'")[1])  # "unit '<fqn>' group <i>"
            real[name](self, grads, *args, **kwargs)
        return wrapper

    for name in real:
        setattr(cls, name, spy(name))
    try:
        yield staged
    finally:
        for name, fn in real.items():
            setattr(cls, name, fn)


def _batches(world: int, micro: int, seed: int) -> list[list[list[tuple[torch.Tensor, ...]]]]:
    g = torch.Generator().manual_seed(100 + seed)
    return [[[(torch.randn(PER_RANK, 5, generator=g), torch.randn(PER_RANK, 2, generator=g))
              for _ in range(world)] for _ in range(micro)] for _ in range(STEPS)]


def _expected_rows(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        lo, hi = shard_rows(p)
        return full[lo:hi]
    return full


def _check_against(model: nn.Module, other: nn.Module, bitwise: bool, what: str,
                   rtol: float = 1e-5, atol: float = 1e-6, ref: bool = False) -> None:
    """Parameters and ``.grad`` of ``model`` against ``other`` (a fully_shard twin, or with
    ``ref`` the single-process reference, of which this rank's rows are compared)."""
    others = dict(other.named_parameters())
    for name, p in model.named_parameters():
        q = others[name]
        pairs = [("param", local_detached(p), q.detach()), ("grad", p.grad, q.grad)]
        for kind, mine, theirs in pairs:
            if mine is None or theirs is None:
                empty = isinstance(p, DTensor) and shard_rows(p)[0] == shard_rows(p)[1]
                if (mine is None) != (theirs is None) and not (ref and empty and mine is None):
                    raise AssertionError(f"{what}: {name}.{kind}: {mine is None=} but the other "
                                         f"is {'None' if theirs is None else 'set'}")
                continue
            mine = local_detached(mine)
            theirs = _expected_rows(p, local_detached(theirs)) if ref else local_detached(theirs)
            if bitwise:
                assert torch.equal(mine, theirs), (
                    f"{what}: {name}.{kind} differs bitwise, max abs diff "
                    f"{(mine.float() - theirs.float()).abs().max().item():.3g}")
            else:
                torch.testing.assert_close(mine.float(), theirs.float(), rtol=rtol, atol=atol,
                                           msg=lambda m: f"{what}: {name}.{kind}: {m}")


def _case(rank: int, world: int, strategy: str, mp: str, micro: int, variant: str,
          ckpt: str | None = None) -> list[str]:
    """Trains (in place, staged, reference); returns the units that staged gradients in the
    in-place run (one entry per group and backward; the root, a unit with units below it,
    stages on the reduce-each path: see ``FSDPState.prepare_gradients``). ``variant``: ``plain``;
    ``create_graph`` (the last micro-batch's backward with ``create_graph=True``: autograd
    replaces ``.grad``); ``replaced`` (a hook replaces a compute parameter's ``.grad`` by an
    equal tensor); ``retain_graph`` (each micro-batch's backward twice); ``zeros`` (every
    optimizer clears with ``zero_grad(set_to_none=False)``: the next window finds zeroed
    gradients and accumulates on them in place, on the one-collective path)."""
    torch.manual_seed(0)
    base = SharedLayerNet(ckpt)
    ref = copy.deepcopy(base)
    ours = _wrap(copy.deepcopy(base), strategy, mp)
    staged = _wrap(copy.deepcopy(base), strategy, mp)
    _stage_instead(staged)
    in_place = any(g.plan.grads_in_place for g in _groups(ours))
    expected = strategy in IN_PLACE and (mp == "fp32" or mp == "bf16_comm"
                                         and strategy == "optim_grads")
    assert in_place == expected, f"grads_in_place for {strategy}/{mp}"
    if variant == "replaced":
        for model in (ours, staged):
            compute = record_of(model.block.fc1.weight).compute_param

            def replace(param: torch.Tensor) -> None:
                param.grad = param.grad.clone()

            compute.register_post_accumulate_grad_hook(replace)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
            for m in (ours, staged, ref)]
    # Bitwise where the math is the same: N=1, or a power-of-two scale. bf16: rounding of the
    # compute dtype dominates the reference comparison.
    bitwise = micro == 1 or world & (world - 1) == 0
    # A second backward over a retained graph finds installed values: no_shard in place adds
    # onto them before its all-reduce (1/D * sum of (V + local)), staged it sets them aside
    # (V + 1/D * sum of local): the same to rounding, not the same arithmetic.
    bitwise = bitwise and not (variant == "retain_graph" and strategy == "no_shard")
    ref_tol = (1e-5, 1e-6) if mp == "fp32" else (5e-2, 2e-2)
    calls: list[str] = []
    for step, batches in enumerate(_batches(world, micro, seed=world)):
        for m, parts in enumerate(batches):
            last = m == micro - 1
            create_graph = variant == "create_graph" and last
            backwards = 2 if variant == "retain_graph" else 1
            x, y = parts[rank]
            for model in (ours, staged):
                model.set_is_last_backward(last)
                loss = F.mse_loss(model(x).float(), y) / micro
                with _count_staging() if model is ours else contextlib.nullcontext([]) as c:
                    for b in range(backwards):
                        loss.backward(retain_graph=b < backwards - 1, create_graph=create_graph)
                calls += c if model is ours else []
                for group in _groups(model):  # compute .grad is None again after backward
                    assert all(p.grad is None for p in group.params), "compute .grad left set"
            gx = torch.cat([p[0] for p in parts])
            gy = torch.cat([p[1] for p in parts])
            ref_loss = F.mse_loss(ref(gx), gy) / micro
            for b in range(backwards):
                ref_loss.backward(retain_graph=b < backwards - 1, create_graph=create_graph)
        where = f"{strategy}/{mp} world {world} N={micro} {variant} step {step}"
        agree("in place vs staged", lambda: _check_against(
            ours, staged, bitwise, f"{where}, in place vs staged", rtol=1e-6, atol=1e-7))
        agree("vs single-process torch", lambda: _check_against(
            ours, ref, False, f"{where}, vs torch", *ref_tol, ref=True))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=variant != "zeros")
        if create_graph:  # torch's .grad holds a graph: drop it
            for p in ref.parameters():
                p.grad = None
    agree("unused parameter untouched", lambda: _check_against(
        ours, ref, False, "final", *ref_tol, ref=True))
    if not any(p.to_local().numel() for p in _root_params(ours)):
        calls.append(ROOT_HOLDS_NOTHING)
    return calls


# Appended to a rank's staging calls when its shards of the root's parameters are all empty
# (the 16-element alignment makes the root's groups fit in rank 0's shard at 2 ranks).
ROOT_HOLDS_NOTHING = "<root holds nothing on this rank>"


def _root_params(model: nn.Module) -> list[Any]:
    return [r.dist_param for g in state_of(model).groups for r in g.records]  # type: ignore[union-attr]


CASES = [
    # world, strategy, mp, micro, variant
    *[(2, s, "fp32", n, "plain") for s in STRATEGIES for n in (1, 3)],
    *[(2, s, "bf16", 3, "plain") for s in STRATEGIES],
    *[(2, s, "bf16_comm", 2, "plain") for s in STRATEGIES],
    *[(2, s, "fp32", 2, v) for s in STRATEGIES for v in ("create_graph", "replaced",
                                                         "retain_graph")],
    *[(3, s, "fp32", n, "plain") for s in STRATEGIES for n in (1, 3)],
    *[(w, s, "fp32", 2, "zeros") for w in (2, 3) for s in STRATEGIES],
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,strategy,mp,micro,variant", CASES,
                         ids=[f"w{w}-{s}-{mp}-N{n}-{v}" for w, s, mp, n, v in CASES])
def test_matches_staging_and_torch(ranks: RankPools, world: int, strategy: str, mp: str,
                                   micro: int, variant: str) -> None:
    staged = ranks.run(_case, world, strategy, mp, micro, variant, timeout_s=TIMEOUT_S)
    # A second backward of a window's last micro-batch finds reduced gradients on the
    # accumulate path: it sets them aside and goes in place too ([Note: HSDP window carry]).
    accumulates = strategy in ("no_shard", "optim")
    root_in_place = accumulates and mp == "fp32"
    for calls in staged:
        units = [u for u in calls if u != ROOT_HOLDS_NOTHING]
        root = units.count("<root>")
        if not root_in_place:  # the root stages every backward
            assert root >= STEPS * micro, units
        elif variant in ("plain", "replaced", "zeros", "retain_graph"):
            assert root == 0, f"the root staged although in place: {units}"
        else:  # create_graph replaces .grad
            assert root >= STEPS, units
        nested = sorted({u for u in units if u != "<root>"})
        if strategy not in IN_PLACE or mp == "bf16":
            assert nested == ["block", "shared"], f"expected staging in every unit: {units}"
        elif mp == "fp32" and variant in ("plain", "zeros", "retain_graph"):
            assert nested == [], f"gradients were staged although in place: {units}"
        elif variant == "replaced":
            assert nested == ["block"], f"expected the replaced gradient staged: {units}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_activation_checkpointing(ranks: RankPools, strategy: str, ckpt: str) -> None:
    staged = ranks.run(_case, 2, strategy, "fp32", 2, "plain", ckpt=ckpt, timeout_s=TIMEOUT_S)
    expected = {"no_shard": set(), "optim": set(), "optim_grads": {"<root>"},
                "optim_grads_params": {"<root>", "block", "shared"}}[strategy]
    for units in staged:
        assert set(units) - {ROOT_HOLDS_NOTHING} == expected, f"staged: {units}"


def _where_grads_live(rank: int, world: int, strategy: str) -> list[tuple[str, str]]:
    """During backward, where each compute ``.grad`` autograd wrote lives: in the plan's buffer
    (``main_grad`` on the accumulate path, the unit's ``staged_grad`` scratch buffer on the
    reduce-each path) or elsewhere (autograd's own tensor, staged at the post-backward)."""
    torch.manual_seed(0)
    model = _wrap(SharedLayerNet(), strategy, "fp32")
    seen: list[tuple[str, str]] = []

    def hook_for(group: Any) -> Callable[[torch.Tensor], None]:
        def check(param: torch.Tensor) -> None:
            if group.plan.grad_path.value == "accumulate":
                buffer = group.grads.ensure_main_grad()
            else:
                buffer = group.allocator.get(group.temporary_key("staged_grad"))
            ptr = param.grad.untyped_storage().data_ptr()
            same = buffer is not None and ptr == buffer.untyped_storage().data_ptr()
            seen.append((group.name.split("'")[1], "buffer" if same else "elsewhere"))
        return check

    for group in _groups(model):
        for param in group.params:
            param.register_post_accumulate_grad_hook(hook_for(group))
    for _ in range(2):
        x = torch.randn(PER_RANK, 5)
        model(x).square().mean().backward()
        for p in model.parameters():  # as optimizer.zero_grad(): the next window starts EMPTY
            p.grad = None
    return seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grads_written_into_the_buffer(ranks: RankPools, strategy: str) -> None:
    seen = ranks.run(_where_grads_live, 2, strategy, timeout_s=TIMEOUT_S)
    where = "buffer" if strategy in IN_PLACE else "elsewhere"
    # The root, a unit with units below it, arms only on the accumulate path.
    root_where = "buffer" if strategy in ("no_shard", "optim") else "elsewhere"
    for per_rank in seen:
        # Per iteration: block.fc1, block.fc2, shared (2 each) in place; the root's inp and
        # head (2 each); the unused Linear: nothing.
        assert sorted(per_rank) == sorted(
            [("block", where)] * 8 + [("shared", where)] * 4 + [("<root>", root_where)] * 8
        ), per_rank
