"""No silently wrong training (see ``_silent_wrong.py``): training patterns torch allows, where
``fully_shard`` must match single-process PyTorch or raise clearly: an optimizer over a subset,
reentrant checkpointing, ``retain_graph``, unused parameters, replicas that start different,
every backward marked not-last, ``inference_mode`` before training.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _silent_wrong import (
    ATOL,
    RTOL,
    STEPS,
    Net,
    Variant,
    _adamw,
    _agree,
    _assert_grad_none,
    _assert_grads,
    _assert_outputs,
    _assert_params,
    _assert_unchanged,
    _batches,
    _forward_pair,
    _rank_rows,
    _setup,
    _snapshot,
    _step_both,
    _train,
    _wrap,
)
from _silent_wrong_runner import (
    _case_test,
    _check,
)

import megatron_fsdp_v2

# ---------------------------------------------------------------------- 1. optimizer over a subset

def _subset_optimizer(rank: int, strategy: str, mode: str) -> None:
    """torch: only the head is optimized. The other parameters still get gradients (accumulated
    over the steps, since this optimizer never clears them) and stay unchanged. ``mode``:
    ``none`` zero_grad() before forward, ``zeros`` zero_grad(set_to_none=False), ``between``
    zero_grad() between forward and backward."""
    model, ref = _setup(strategy)
    opt, ref_opt = _adamw(model.head.parameters()), _adamw(ref.head.parameters())
    for step, micro in enumerate(_batches(STEPS)):
        if mode != "between":
            opt.zero_grad(set_to_none=mode == "none")
            ref_opt.zero_grad(set_to_none=mode == "none")
        loss, ref_loss = _forward_pair(model, ref, micro[0], rank, f"step {step}")
        if mode == "between":
            opt.zero_grad()
            ref_opt.zero_grad()
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
    _assert_params(model, ref, "after 3 steps")
    _assert_grads(model, ref, "after 3 steps (head: last step's grad; others: sum of 3 steps)")


def _case_subset_optimizer(rank: int, strategy: str) -> list[Variant]:
    return [
        (f"zero_grad_{mode}", lambda mode=mode: _subset_optimizer(rank, strategy, mode))
        for mode in ("none", "zeros", "between")
    ]


@_case_test(_case_subset_optimizer)
def test_optimizer_over_subset_of_unit(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)


# ---------------------------------------------------------------------- 2. reentrant checkpointing

def _reentrant_checkpoint(rank: int, strategy: str, mode: str) -> None:
    """torch: ``checkpoint(..., use_reentrant=True)`` gives the same numbers as no checkpoint;
    the reference checkpoints the same way."""
    model, ref = _setup(strategy, checkpoint=mode)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    _train(model, ref, opt, ref_opt, _batches(STEPS), rank, f"checkpoint={mode}")
    _assert_params(model, ref, f"checkpoint={mode} after 3 steps")


def _case_reentrant_checkpoint(rank: int, strategy: str) -> list[Variant]:
    return [
        (mode, lambda mode=mode: _reentrant_checkpoint(rank, strategy, mode))
        for mode in ("outer", "inner")
    ]


@_case_test(_case_reentrant_checkpoint)
def test_reentrant_activation_checkpointing(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)


# --------------------------------------------------------------------------------- 3. retain_graph

def _retain_graph(rank: int, strategy: str) -> None:
    """torch: ``loss.backward(retain_graph=True); loss.backward()`` accumulates twice the
    gradient."""
    model, ref = _setup(strategy)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(STEPS)):
        loss, ref_loss = _forward_pair(model, ref, micro[0], rank, f"step {step}")
        loss.backward(retain_graph=True)
        loss.backward()
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        _assert_grads(model, ref, f"step {step} after both backwards")
        _step_both(opt, ref_opt)
    _assert_params(model, ref, "after 3 steps")


def _case_retain_graph(rank: int, strategy: str) -> list[Variant]:
    return [("backward_twice", lambda: _retain_graph(rank, strategy))]


@_case_test(_case_retain_graph)
def test_retain_graph_second_backward(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)


# ---------------------------------------------------------------------------- 4. unused parameters

_UNUSED = ["blocks.0.unused.weight", "blocks.0.unused.bias"]
_EXTRA = ["blocks.0.extra.weight", "blocks.0.extra.bias"]


def _never_used(rank: int, strategy: str) -> None:
    """torch: a parameter forward never uses has ``grad is None`` after backward, and AdamW
    skips it (no weight decay): bitwise unchanged."""
    model, ref = _setup(strategy, unused=True)
    before = _snapshot(model)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(STEPS)):
        loss, ref_loss = _forward_pair(model, ref, micro[0], rank, f"step {step}")
        loss.backward()
        ref_loss.backward()
        _assert_grad_none(ref, _UNUSED, "reference (test self-check)")
        _assert_grad_none(model, _UNUSED, f"step {step} after backward")
        _step_both(opt, ref_opt)
    _assert_unchanged(model, before, "after 3 AdamW steps", _UNUSED)
    _assert_params(model, ref, "after 3 steps")


def _used_first_step_only(rank: int, strategy: str) -> None:
    """torch, with ``zero_grad()`` (set_to_none) every step: a parameter used in step 1 only is
    updated in step 1; in steps 2-3 its grad is None and AdamW leaves it alone (no decay, no
    momentum)."""
    model, ref = _setup(strategy, extra=True)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(STEPS)):
        use = step == 0
        model.blocks[0].use_extra = ref.blocks[0].use_extra = use
        loss, ref_loss = _forward_pair(model, ref, micro[0], rank, f"step {step}")
        loss.backward()
        ref_loss.backward()
        if not use:
            _assert_grad_none(model, _EXTRA, f"step {step} (extra unused) after backward")
            before = _snapshot(model)
        opt.step()
        ref_opt.step()
        if not use:
            _assert_unchanged(model, before, f"step {step} (extra unused) after AdamW", _EXTRA)
        opt.zero_grad()
        ref_opt.zero_grad()
    _assert_params(model, ref, "after 3 steps")


def _case_unused_params(rank: int, strategy: str) -> list[Variant]:
    return [
        ("never_used", lambda: _never_used(rank, strategy)),
        ("used_in_step_1_only", lambda: _used_first_step_only(rank, strategy)),
    ]


@_case_test(_case_unused_params)
def test_unused_parameters_get_no_grad(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)


# --------------------------------------------------------------------- 5. replicas start different

def _ranks_start_different(rank: int, strategy: str) -> None:
    """Like DDP, wrapping makes every replica start from rank 0's parameters: the model is
    built with ``torch.manual_seed(rank)``, the reference with rank 0's seed."""
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(rank)
    model = _wrap(Net(), strategy)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    _assert_params(model, ref, "right after wrapping")
    # The first forward (step 0 of _train) compares outputs with rank 0's model.
    _train(model, ref, opt, ref_opt, _batches(STEPS), rank, "per-rank seeds")
    _assert_params(model, ref, "after 3 steps")


def _case_ranks_start_different(rank: int, strategy: str) -> list[Variant]:
    return [("seed_rank", lambda: _ranks_start_different(rank, strategy))]


@_case_test(_case_ranks_start_different)
def test_replicas_start_from_rank0(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)


# --------------------------------------------------------------- 9. every backward marked not-last

def _never_marked_last(rank: int, strategy: str, clip: bool) -> None:
    """``set_is_last_backward(False)`` before every backward, then ``opt.step()``: gradients
    must still be reduced by the step (or by ``clip_grad_norm_`` before it), matching torch,
    and a UserWarning naming ``set_is_last_backward`` tells the user (checked on every rank;
    each variant builds a new model, so a once-per-model warning is enough)."""
    micro = 2
    model, ref = _setup(strategy)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    warned = []
    for step, parts in enumerate(_batches(STEPS, micro=micro)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(micro):
                model.set_is_last_backward(False)
                loss, ref_loss = _forward_pair(model, ref, parts[i], rank, f"step {step} micro {i}",
                                               scale=1.0 / micro)
                loss.backward()
                ref_loss.backward()
            if clip:
                norm = megatron_fsdp_v2.clip_grad_norm_(model.parameters(), 0.02)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.02)
                assert ref_norm.item() > 0.02, "test self-check: clipping must be active"
                _agree(lambda: torch.testing.assert_close(
                    norm, ref_norm, rtol=RTOL, atol=ATOL,
                    msg=lambda m: f"step {step}: clip_grad_norm_ total norm vs torch's: {m}"))
            opt.step()
            ref_opt.step()
        warned += [str(w.message) for w in caught
                   if issubclass(w.category, UserWarning)
                   and "set_is_last_backward" in str(w.message)]
        opt.zero_grad()
        ref_opt.zero_grad()
    _assert_params(model, ref, "after 3 steps")

    def warned_on_this_rank() -> None:
        assert warned, "no UserWarning mentioning set_is_last_backward was emitted (on this rank)"
    _agree(warned_on_this_rank)


def _case_never_marked_last(rank: int, strategy: str) -> list[Variant]:
    return [
        ("step", lambda: _never_marked_last(rank, strategy, clip=False)),
        ("clip_then_step", lambda: _never_marked_last(rank, strategy, clip=True)),
    ]


@_case_test(_case_never_marked_last)
def test_every_backward_marked_not_last(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)


# ------------------------------------------------------------------------------ 10. inference_mode

def _inference_then_train(rank: int, strategy: str, when: str) -> None:
    """torch: a forward under ``torch.inference_mode()`` changes nothing; training afterwards is
    unaffected."""
    model, ref = _setup(strategy)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    batches = _batches(STEPS)
    first = 0
    if when == "after_step":
        _train(model, ref, opt, ref_opt, batches[:1], rank, "before inference")
        first = 1
    parts = _batches(1, seed=7)[0][0]
    with torch.inference_mode():
        out = model(parts[rank][0])
        ref_out = ref(torch.cat([p[0] for p in parts]))[_rank_rows(rank)]
    _assert_outputs(out, ref_out, model, ref, f"inference_mode forward ({when})")
    _train(model, ref, opt, ref_opt, batches[first:], rank, f"after inference ({when})",
           first_step=first)
    _assert_params(model, ref, "after 3 steps")


def _case_inference_mode(rank: int, strategy: str) -> list[Variant]:
    return [
        (when, lambda when=when: _inference_then_train(rank, strategy, when))
        for when in ("before_first_step", "after_step")
    ]


@_case_test(_case_inference_mode)
def test_inference_mode_then_training(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)
