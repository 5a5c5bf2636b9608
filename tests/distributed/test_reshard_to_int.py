"""``fully_shard(..., reshard_after_forward=<int>)`` (FSDP2's int, ZeRO++'s hpZ; see [Note:
resharding to a smaller group] in ``_runtime/_compute_weights.py``): at world 4 with ``2``,
training equals one process and FSDP2 with the same setting (run in the same worker), each
micro-batch's forward all-gather runs over the 4 ranks and its backward all-gather over 2 (counted
per process-group size by a dispatch mode, FSDP2's counted the same way), the estimator equals
the run, and the values FSDP2 refuses are refused before any collective.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _fsdp2_api import TIMEOUT_S, _batches, _check_training, _loss, _net, _train, _wrap
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fsdp_v2 import MixedPrecisionPolicy, estimate, fully_shard, memory_report

# private: each parameter group's post-forward slice and gathered state
from megatron_fsdp_v2._registry import state_of
from megatron_fsdp_v2.testing import RankPools

from _comm_counts import COLLECTIVE_KINDS
from _models import (
    TinyGPT,
    assert_close_to_reference,
    cat_batch,
    lm_loss,
    make_batches,
    reference_copy,
    wrap_blocks,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from comm_counter import CommCounter  # noqa: E402

pytestmark = pytest.mark.timeout(600)

WORLD = 4
GROUP = 2  # reshard_after_forward
_KIND_OF = {name: kind for kind, names in COLLECTIVE_KINDS.items() for name in names}


class CountsByGroupSize(TorchDispatchMode):
    """(kind, process-group size) -> how many such collectives reached the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, int]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = _KIND_OF.get(func._overloadpacket.__name__.rstrip("_"))
        if kind is not None and func.namespace == "c10d":
            group = next(a for a in args if isinstance(a, torch.ScriptObject))
            self.counts[(kind, dist.ProcessGroup.unbox(group).size())] += 1
        return out


def _step_counts(model: torch.nn.Module, micro: int) -> dict[tuple[str, int], int]:
    """The collectives of one training step of ``micro`` micro-batches (SGD, lr 0)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with CountsByGroupSize() as mode:
        for i, batch in enumerate(_batches(1, micro)[0]):
            model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
            _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return dict(mode.counts)


def _training_worker(rank: int, world: int, micro: int) -> dict[str, Any]:
    model, ref = _net()
    _wrap(model, reshard_after_forward=GROUP)
    # Between forward and backward every group holds its 1/2 slice, not the gathered weights.
    out = _loss(model, _batches(1, 1)[0][0])
    groups = [g for m in model.modules() if (s := state_of(m)) for g in s.groups]
    slices = [(g.is_gathered, g.allocator.get(g.temporary_key("post_forward_model_weight")))
              for g in groups]
    after_forward = [(gathered, None if t is None else t.numel(), g.layout.total_numel)
                     for (gathered, t), g in zip(slices, groups)]
    out.backward()
    held_after_backward = [g.allocator.is_allocated(g.temporary_key("post_forward_model_weight"))
                           for g in groups]
    model.zero_grad()  # type: ignore[operator]
    _loss(ref, _batches(1, 1)[0][0]).backward()  # the same step on the reference
    ref.zero_grad()
    result = _train(model, ref, steps=3, micro=micro)
    result["after_forward"] = after_forward
    result["held_after_backward"] = held_after_backward
    result["by_size"] = _step_counts(model, micro)
    # A forward no backward follows keeps the slices; an edit of the main weights (the DTensor
    # parameters, as an optimizer holds them) frees them, so the next forward gathers the
    # edited weights over the world, not the stale slices within the group.
    batch = _batches(1, 1)[0][0]
    _loss(model, batch)
    with torch.no_grad():
        for p in (*model.parameters(), *ref.parameters()):
            p.mul_(0.5)
    with CountsByGroupSize() as mode:
        edited = _loss(model, batch)
    ref_edited = _loss(ref, batch)
    result["edited"] = (edited.item(), ref_edited.item(), dict(mode.counts))
    edited.backward()
    ref_edited.backward()
    model.zero_grad()  # type: ignore[operator]
    # set_reshard_after_forward(True) replaces the int: the default schedule, as in FSDP2.
    model.set_reshard_after_forward(True)  # type: ignore[operator]
    result["after_set_true"] = _step_counts(model, 1)
    # FSDP2 on the same input and setting, in the same worker.
    fsdp2, ref2 = _net()
    _wrap(fsdp2, torch_fully_shard, reshard_after_forward=GROUP)
    _loss(ref2, _batches(1, 1)[0][0]).backward()
    ref2.zero_grad()
    _loss(fsdp2, _batches(1, 1)[0][0]).backward()
    fsdp2.zero_grad()
    fsdp2_result = _train(fsdp2, ref2, steps=3, micro=micro)
    result["fsdp2_losses"] = fsdp2_result["losses"]
    result["fsdp2_errors"] = fsdp2_result["errors"]
    result["fsdp2_by_size"] = _step_counts(fsdp2, micro)
    fsdp2.set_reshard_after_forward(True)  # type: ignore[operator]
    result["fsdp2_after_set_true"] = _step_counts(fsdp2, 1)
    return result


@pytest.mark.parametrize("micro", [1, 2])
def test_reshard_to_2_equals_one_process_and_fsdp2(ranks: RankPools, micro: int) -> None:
    """World 4, ``reshard_after_forward=2``: the reference's losses and parameters, FSDP2's
    losses; per unit and micro-batch one all-gather over 4 ranks (forward) and one over 2
    (backward), as FSDP2 issues them, and ZeRO-3's reduce-scatter over 4. An edit of the
    main weights after a forward frees the slices it kept: the next forward sees the edit.
    ``set_reshard_after_forward(True)`` then replaces the int (the default schedule), as in
    FSDP2."""
    results = ranks.run(_training_worker, WORLD, micro, timeout_s=TIMEOUT_S)
    _check_training(results)
    for rank, r in enumerate(results):
        groups = r["groups"]
        for gathered, kept, total in r["after_forward"]:
            assert not gathered and kept == total // GROUP, (rank, r["after_forward"])
        assert not any(r["held_after_backward"]), (rank, r["held_after_backward"])
        gathers = {("all_gather", WORLD): micro * groups, ("all_gather", GROUP): micro * groups}
        # ZeRO-3 reduces every micro-batch (the strategy's contract); FSDP2 without
        # gradient sync accumulates unsharded gradients and reduces once.
        want = {**gathers, ("reduce_scatter", WORLD): micro * groups}
        assert r["by_size"] == want, (rank, r["by_size"], want)
        assert not r["fsdp2_errors"], (rank, r["fsdp2_errors"][:3])
        want_fsdp2 = {**gathers, ("reduce_scatter", WORLD): groups}
        assert r["fsdp2_by_size"] == want_fsdp2, (rank, "FSDP2", r["fsdp2_by_size"])
        torch.testing.assert_close(r["losses"], r["fsdp2_losses"], rtol=1e-5, atol=1e-7)
        edited, ref_edited, counts = r["edited"]
        assert edited == pytest.approx(ref_edited, rel=1e-5), (rank, "edit missed")
        assert counts == {("all_gather", WORLD): groups}, (rank, counts)
        default = {("all_gather", WORLD): 2 * groups, ("reduce_scatter", WORLD): groups}
        assert r["after_set_true"] == default, (rank, r["after_set_true"])
        assert r["fsdp2_after_set_true"] == default, (rank, "FSDP2", r["fsdp2_after_set_true"])


def _checkpointed_worker(rank: int, world: int, where: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=37, dim=16, layers=2, heads=2, checkpoint=where)
    ref = reference_copy(model)
    wrap_blocks(model, "optim_grads_params", reshard_after_forward=GROUP)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses, counts = [], [], {}
    for parts in make_batches("lm", 2, 1, world, per_rank=2):
        tokens = cat_batch("lm", parts[0])  # every rank the global batch: the reference's grads
        with CountsByGroupSize() as mode:
            loss = lm_loss(model, tokens)
            loss.backward()
        counts = dict(mode.counts)
        ref_loss = lm_loss(ref, tokens)
        ref_loss.backward()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    errors = []
    try:
        assert_close_to_reference(model, ref, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        errors.append(str(e))
    groups = sum(len(s.groups) for m in model.modules() if (s := state_of(m)) is not None)
    return {"losses": losses, "ref_losses": ref_losses, "counts": counts, "errors": errors,
            "groups": groups}


@pytest.mark.parametrize("where", ["inner", "outer"])
def test_activation_checkpointing_gathers_within_the_group(ranks: RankPools, where: str) -> None:
    """Activation checkpointing inside and around each block: the recompute finds the weights
    its pre-backward gathered within the group of 2 (no world gather in backward), and training
    equals one process."""
    for rank, r in enumerate(ranks.run(_checkpointed_worker, WORLD, where, timeout_s=TIMEOUT_S)):
        assert not r["errors"], (rank, r["errors"][:1])
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-7)
        groups = r["groups"]
        assert r["counts"] == {("all_gather", WORLD): groups, ("all_gather", GROUP): groups,
                               ("reduce_scatter", WORLD): groups}, (rank, r["counts"])


# ---------------------------------------------------------------------- the estimator

def _gpt() -> TinyGPT:
    return TinyGPT(vocab=37, dim=16, layers=3, heads=2)


def _mp(precision: str) -> MixedPrecisionPolicy | None:
    if precision == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)


def _measured_worker(rank: int, world: int, micro: int, precision: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _gpt()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=GROUP, mp_policy=_mp(precision))
    fully_shard(model, reshard_after_forward=GROUP, mp_policy=_mp(precision))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches("lm", 2, micro, world, per_rank=2)
    report = None
    for step in range(2):  # the second iteration is recorded
        with CommCounter() as counter:
            for i in range(micro):
                model.set_is_last_backward(i == micro - 1)  # type: ignore[operator]
                (lm_loss(model, batches[step][i][rank]) / micro).backward()
            report = memory_report(model, optimizer=opt)
            opt.step()
            opt.zero_grad()
    assert report is not None
    return {"memory": dataclasses.asdict(report),
            "calls": {k: counter.stats.calls.get(k, 0) for k in COLLECTIVE_KINDS},
            "bytes": {k: counter.stats.payload_bytes.get(k, 0) for k in COLLECTIVE_KINDS},
            "wire": {k: counter.stats.wire_bytes.get(k, 0.0) for k in COLLECTIVE_KINDS}}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_equals_the_run(ranks: RankPools, precision: str) -> None:
    """``estimate(..., reshard_after_forward=2)`` for each rank equals what that rank measured:
    the memory report (the slices in the temporary peak), the collectives' counts, payload and
    wire bytes (the backward gathers' over 2 ranks)."""
    micro = 2
    real = ranks.run(_measured_worker, WORLD, micro, precision, timeout_s=TIMEOUT_S)
    for rank, got in enumerate(real):
        est = estimate(_gpt, world_size=WORLD, rank=rank, wrap=lambda m: type(m).__name__ ==
                       "Block", micro_batches=micro, mp_policy=_mp(precision),
                       reshard_after_forward=GROUP)
        assert dataclasses.asdict(est.memory) == got["memory"], (rank, est.memory, got["memory"])
        counts = {k: c for k, (c, _) in est.collectives.items() if k in COLLECTIVE_KINDS}
        payload = {k: b for k, (_, b) in est.collectives.items() if k in COLLECTIVE_KINDS}
        wire = {k: w for k, w in est.wire_bytes.items() if k in COLLECTIVE_KINDS}
        assert counts == got["calls"], (rank, counts, got["calls"])
        assert payload == got["bytes"], (rank, payload, got["bytes"])
        for kind in COLLECTIVE_KINDS:
            assert wire[kind] == pytest.approx(got["wire"][kind], rel=1e-12), (rank, kind)
    # Against the default schedule: the same payload, less on the wire (half of each backward
    # gather's (n-1)/n bytes: 1/2 instead of 3/4).
    default = estimate(_gpt, world_size=WORLD, wrap=lambda m: type(m).__name__ == "Block",
                       micro_batches=micro, mp_policy=_mp(precision))
    hpz = estimate(_gpt, world_size=WORLD, wrap=lambda m: type(m).__name__ == "Block",
                   micro_batches=micro, mp_policy=_mp(precision), reshard_after_forward=GROUP)
    assert hpz.collectives["all_gather"] == default.collectives["all_gather"]
    assert hpz.wire_bytes["all_gather"] == pytest.approx(
        default.wire_bytes["all_gather"] * (3 / 4 + 1 / 2) / (2 * 3 / 4))
    assert hpz.memory.temporary_peak > default.memory.temporary_peak


# ---------------------------------------------------------------------- refusals

def _refusals_worker(rank: int, world: int) -> list[str]:
    found = []
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"reshard_after_forward": 3}, ValueError, "must be a factor of the shard axis' size 4"),
        ({"reshard_after_forward": 0}, ValueError, "must be a factor"),
        ({"reshard_after_forward": 8}, ValueError, "must be a factor"),
        ({"reshard_after_forward": -2}, ValueError, "must be a factor"),
        ({"reshard_after_forward": 2, "sharding_strategy": "optim"}, ValueError,
         "only sharding_strategy='optim_grads_params'"),
        ({"reshard_after_forward": 2, "enable_trace_pool": True}, NotImplementedError,
         "enable_trace_pool"),
        ({"reshard_after_forward": 2,
          "mesh": init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))},
         NotImplementedError, "2-D (HSDP) mesh"),
        ({"reshard_after_forward": 2.0}, TypeError, "must be a bool, an int"),
    ]
    for kwargs, error, needle in cases:
        model, _ = _net()
        try:
            fully_shard(model, **kwargs)
            found.append(f"{kwargs}: no error")
        except error as e:
            untouched = state_of(model) is None
            found.append("ok" if needle in str(e) and untouched else f"{kwargs}: unclear: {e}")
    # FSDP2's meanings of 1 (False, warned) and of the shard axis' size (True).
    model, _ = _net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(model, reshard_after_forward=1)
    state = state_of(model)
    ok = (state is not None and state.reshard_after_forward is False
          and any("reshard_after_forward=1" in str(w.message) for w in caught))
    found.append("ok" if ok else "1 is not False with a warning")
    for size, mesh in [(WORLD, None), (2, init_device_mesh(  # HSDP: the shard axis' size
            "cpu", (2, 2), mesh_dim_names=("replicate", "shard")))]:
        model, _ = _net()
        fully_shard(model, reshard_after_forward=size, mesh=mesh)
        state = state_of(model)
        ok = state is not None and state.reshard_after_forward is True and not any(
            g.weights.post_forward_size for g in state.groups)
        found.append("ok" if ok else f"{size} on {mesh} is not True")
    return found


def test_refusals_and_fsdp2_meanings(ranks: RankPools) -> None:
    """Ints FSDP2 refuses (not a factor of the shard size) raise ``ValueError`` naming the
    valid sizes, as do other strategies; HSDP and the trace pool are refused with
    ``NotImplementedError``; 1 means ``False`` (warned) and the shard axis' size (4; 2 on a (2, 2)
    mesh) means ``True``, as in FSDP2."""
    for rank, found in enumerate(ranks.run(_refusals_worker, WORLD, timeout_s=TIMEOUT_S)):
        assert found == ["ok"] * len(found), (rank, found)
