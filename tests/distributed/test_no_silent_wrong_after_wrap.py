"""No silently wrong training (see ``_silent_wrong.py``): edits of a model after it was wrapped:
``requires_grad`` toggled, parameters replaced, ``nn.init`` on the parameters, ``deepcopy`` and
dtype/device moves.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _silent_wrong import (
    STEPS,
    WORLD,
    Net,
    Variant,
    _adamw,
    _assert_grads,
    _assert_outputs,
    _assert_params,
    _assert_unchanged,
    _batches,
    _expect_raises,
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

from _models import (
    TinyGPT,
    make_batches,
)

# ----------------------------------------------------------------- 6. requires_grad after wrapping

def _toggle_requires_grad(rank: int, strategy: str, name: str, value: bool) -> None:
    """torch: ``requires_grad_`` takes effect at the next forward. Unfrozen: trains like any
    parameter. Frozen: no grad, AdamW leaves it bitwise unchanged."""
    model, ref = _setup(strategy, frozen=True)
    model.get_parameter(name).requires_grad_(value)
    ref.get_parameter(name).requires_grad_(value)
    before = _snapshot(model)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    for step, micro in enumerate(_batches(STEPS)):
        loss, ref_loss = _forward_pair(model, ref, micro[0], rank, f"step {step}")
        loss.backward()
        ref_loss.backward()
        _assert_grads(model, ref, f"step {step} after backward")
        _step_both(opt, ref_opt)
    if not value:
        _assert_unchanged(model, before, "after 3 AdamW steps", [name])
    _assert_params(model, ref, "after 3 steps")


def _case_requires_grad(rank: int, strategy: str) -> list[Variant]:
    return [
        ("unfreeze_frozen.weight",
         lambda: _toggle_requires_grad(rank, strategy, "frozen.weight", True)),
        ("freeze_blocks.1.fc1.weight",
         lambda: _toggle_requires_grad(rank, strategy, "blocks.1.fc1.weight", False)),
        ("freeze_head.bias", lambda: _toggle_requires_grad(rank, strategy, "head.bias", False)),
    ]


@_case_test(_case_requires_grad)
def test_requires_grad_changed_after_wrap(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)


# ----------------------------------------------------------- 7. parameters replaced after wrapping

def _replaced_param_raises(rank: int, strategy: str, how: str) -> None:
    """The module's parameters are views into flat buffers; replacing, tying or adding one after
    wrapping cannot be honoured, so the next forward raises RuntimeError naming the parameter
    and saying "after fully_shard", before anything changes."""
    if how == "tie":
        torch.manual_seed(0)
        model = _wrap(TinyGPT(tie=False), strategy)
        inp = make_batches("lm", 1, 1, WORLD, per_rank=2)[0][0][rank][:, :-1]
    else:
        model, _ = _setup(strategy)
        inp = _batches(1)[0][0][rank][0]
    if how == "replace_after_step":
        opt = _adamw(model.parameters())
        x, y = _batches(1, seed=1)[0][0][rank]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if how in ("replace_root", "replace_after_step"):
        name = "head.weight"
        model.head.weight = nn.Parameter(torch.randn(Net.DOUT, Net.DIM))
    elif how == "replace_nested":
        name = "fc1.weight"  # blocks.0.fc1.weight; the unit is blocks.0
        model.blocks[0].fc1.weight = nn.Parameter(torch.randn(2 * Net.DIM + 1, Net.DIM))
    elif how == "tie":
        name = "head.weight"
        model.head.weight = model.tok.weight
    elif how == "add":
        name = "added_scale"
        model.blocks[0].added_scale = nn.Parameter(torch.ones(Net.DIM))
    else:
        raise ValueError(how)
    before = _snapshot(model)
    with _expect_raises(RuntimeError, name, "after fully_shard",
                        what=f"forward after {how} of {name}"):
        model(inp)
    _assert_unchanged(model, before, f"after the rejected forward ({how})")


def _case_replaced_params(rank: int, strategy: str) -> list[Variant]:
    return [
        (how, lambda how=how: _replaced_param_raises(rank, strategy, how))
        for how in ("replace_root", "replace_nested", "replace_after_step", "tie", "add")
    ]


@_case_test(_case_replaced_params)
def test_parameter_replaced_after_wrap_raises(
    strategy: str, request: pytest.FixtureRequest
) -> None:
    _check(request)


# ----------------------------------------------------------------------- 8. nn.init after wrapping

def _init_edits(model: nn.Module) -> None:
    """Deterministic ``torch.nn.init`` edits (sharded DTensor random init cannot match a
    full-tensor reference, so no ``normal_`` here): one per unit, nested and root."""
    nn.init.zeros_(model.get_parameter("blocks.0.fc2.weight"))
    nn.init.constant_(model.get_parameter("blocks.1.fc1.weight"), 0.05)
    nn.init.constant_(model.get_parameter("head.bias"), 0.25)
    nn.init.ones_(model.get_parameter("inp.bias"))


def _init_after_wrap(rank: int, strategy: str, when: str) -> None:
    """torch: an in-place init is what the next forward uses and what training continues from.
    ``when``: before the first forward; after a training step; after a step and a forward."""
    model, ref = _setup(strategy)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    batches = _batches(STEPS)
    first = 0
    if when.startswith("after_step"):
        _train(model, ref, opt, ref_opt, batches[:1], rank, "before the init")
        first = 1
    if when == "after_step_and_eval":
        # A forward after the step consumes the refresh the step scheduled.
        with torch.no_grad():
            parts = _batches(1, seed=3)[0][0]
            _assert_outputs(model(parts[rank][0]),
                            ref(torch.cat([p[0] for p in parts]))[_rank_rows(rank)],
                            model, ref, "eval forward after step 0")
    _init_edits(model)
    _init_edits(ref)
    _assert_params(model, ref, f"right after the init ({when})")
    _train(model, ref, opt, ref_opt, batches[first:], rank, f"init {when}", first_step=first)
    _assert_params(model, ref, "after 3 steps")


def _case_init_after_wrap(rank: int, strategy: str) -> list[Variant]:
    return [
        (when, lambda when=when: _init_after_wrap(rank, strategy, when))
        for when in ("before_first_forward", "after_step", "after_step_and_eval")
    ]


@_case_test(_case_init_after_wrap)
def test_nn_init_after_wrap(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)


# ------------------------------------------------------------- 11. deepcopy and dtype/device moves

def _copy_or_convert(rank: int, strategy: str, how: str) -> None:
    """``copy.deepcopy`` of a wrapped model raises TypeError; a dtype change raises
    NotImplementedError and leaves the model usable; a no-op ``to("cpu")``/``float()`` on an
    fp32 CPU model changes nothing (torch: returns the same model)."""
    model, ref = _setup(strategy)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    batches = _batches(STEPS)
    first = 0
    if how.endswith("_after_step"):
        _train(model, ref, opt, ref_opt, batches[:1], rank, f"before {how}")
        first = 1
    op = how.removesuffix("_after_step")
    if op == "deepcopy":
        with _expect_raises(TypeError, "fully_shard", what="copy.deepcopy(wrapped model)"):
            copy.deepcopy(model)
    elif op in ("bfloat16", "double"):
        with _expect_raises(NotImplementedError, "fully_shard", what=f"model.{op}()"):
            getattr(model, op)()
    elif op == "to_cpu":
        assert model.to("cpu") is model
    elif op == "float":
        assert model.float() is model
    else:
        raise ValueError(how)
    _assert_params(model, ref, f"right after {how}")
    _train(model, ref, opt, ref_opt, batches[first:], rank, f"after {how}", first_step=first)
    _assert_params(model, ref, "after 3 steps")


def _case_copy_and_convert(rank: int, strategy: str) -> list[Variant]:
    return [
        (how, lambda how=how: _copy_or_convert(rank, strategy, how))
        for how in ("deepcopy", "bfloat16", "double", "to_cpu", "float",
                    "bfloat16_after_step", "to_cpu_after_step", "float_after_step")
    ]


@_case_test(_case_copy_and_convert)
def test_deepcopy_and_dtype_conversion(strategy: str, request: pytest.FixtureRequest) -> None:
    _check(request)
