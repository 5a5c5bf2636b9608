"""No silently wrong training: regression tests for usage patterns where ``fully_shard`` must
either behave exactly like single-process PyTorch or raise a clear error.

Every case compares a ``fully_shard`` run (2 gloo ranks, fp32) with a single-process PyTorch
reference trained on the concatenation of all ranks' micro-batches (mean losses, so the
reference's gradients equal the rank-averaged ones). The reference is a ``copy.deepcopy`` of the
model built from the same seed on every rank, taken before wrapping. After the steps every
parameter is compared (this rank's rows of the reference, rtol 1e-5 / atol 1e-6), and every
step's forward output too, so a failure says where training first diverged.

Layout: one rank function per case (``_case_*``) returns its named variants; one pytest
function per case, parametrized over the four strategies. All selected cases of a strategy run
in one spawn (``_run_cases``; four spawns for the whole file), and each (case, strategy) is
still a test of its own, rerunnable by id (then only that case runs). A failing test lists every
failing variant and the ranks it failed on, as ``WRONG RESULT`` (a failed check: which
parameter, gradient or output, how many elements differ, max abs diff; or an expected error
that was not raised) or ``EXCEPTION`` (type, message, where it was raised). Checks agree across
ranks (``all_ranks_ok``), so all ranks fail at the same point; and each variant wraps with its
own collective ``timeout`` (hence its own process group), so a variant that leaves a collective
unmatched fails within seconds without breaking the next ones.
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import megatron_fsdp_v2
from megatron_fsdp_v2 import fully_shard
from megatron_fsdp_v2._registry import record_of
from megatron_fsdp_v2.testing import run_distributed

from _models import (
    TinyGPT,
    all_ranks_ok,
    assert_close_to_reference,
    local_detached,
    make_batches,
    shard_rows,
)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
WORLD = 2
STEPS = 3
PER_RANK = 3
RTOL, ATOL = 1e-5, 1e-6
_BASE_TIMEOUT_S = 30.0
_variant_timeout_s = _BASE_TIMEOUT_S  # set per variant by _run_cases

Variant = tuple[str, Callable[[], None]]


# ------------------------------------------------------------------------------------------ models

class MLPBlock(nn.Module):
    """Residual MLP block (odd hidden width, so shards are uneven).

    ``checkpoint="inner"``: reentrant activation checkpoint inside forward (bypasses the unit's
    forward hooks on recompute). ``unused``: a Linear forward never calls. ``extra``: a Linear
    used only while ``self.use_extra`` is true."""

    def __init__(self, dim: int, *, checkpoint: str | None = None, unused: bool = False,
                 extra: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim + 1)
        self.fc2 = nn.Linear(2 * dim + 1, dim)
        self.inner_checkpoint = checkpoint == "inner"
        if unused:
            self.unused = nn.Linear(dim, dim)
        self.use_extra = extra
        if extra:
            self.extra = nn.Linear(dim, dim)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(torch.tanh(self.fc1(x)))
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner_checkpoint and torch.is_grad_enabled():
            return checkpoint(self._body, x, use_reentrant=True)
        return self._body(x)


class Net(nn.Module):
    """inp -> blocks (each a nested unit) -> [frozen] -> head; the root unit owns inp, frozen and
    head. ``checkpoint="outer"``: reentrant checkpoint around each block call (the recompute runs
    the block's forward hooks)."""

    DIN, DIM, DOUT = 5, 6, 3

    def __init__(self, layers: int = 2, checkpoint: str | None = None, unused: bool = False,
                 extra: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(self.DIN, self.DIM)
        self.blocks = nn.ModuleList(
            MLPBlock(self.DIM, checkpoint=checkpoint, unused=unused and i == 0,
                     extra=extra and i == 0)
            for i in range(layers)
        )
        if frozen:
            self.frozen = nn.Linear(self.DIM, self.DIM)
            for p in self.frozen.parameters():
                p.requires_grad_(False)
        self.head = nn.Linear(self.DIM, self.DOUT)
        self.outer_checkpoint = checkpoint == "outer"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            if self.outer_checkpoint and torch.is_grad_enabled():
                h = checkpoint(block, h, use_reentrant=True)
            else:
                h = block(h)
        if hasattr(self, "frozen"):
            h = h + torch.tanh(self.frozen(h))
        return self.head(h)


# ----------------------------------------------------------------------------------------- helpers

Batch = tuple[torch.Tensor, torch.Tensor]


def _batches(steps: int, micro: int = 1, seed: int = 0) -> list[list[list[Batch]]]:
    """batches[step][micro][rank] -> that rank's (x, y); identical on every rank."""
    g = torch.Generator().manual_seed(4321 + seed)
    return [[[(torch.randn(PER_RANK, Net.DIN, generator=g),
               torch.randn(PER_RANK, Net.DOUT, generator=g))
              for _ in range(WORLD)] for _ in range(micro)] for _ in range(steps)]


def _wrap(model: nn.Module, strategy: str, **kw: Any) -> nn.Module:
    """Blocks first, then the root (as test_parity's ``wrap``)."""
    kw.setdefault("timeout", _variant_timeout_s)
    for block in getattr(model, "blocks", []):
        fully_shard(block, sharding_strategy=strategy, **kw)
    return fully_shard(model, sharding_strategy=strategy, **kw)


def _setup(strategy: str, seed: int = 0, **model_kw: Any) -> tuple[nn.Module, nn.Module]:
    """(wrapped model, unwrapped reference), both from ``seed``."""
    torch.manual_seed(seed)
    model = Net(**model_kw)
    ref = copy.deepcopy(model)
    return _wrap(model, strategy), ref


def _adamw(params: Any, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def _rows(p: torch.Tensor) -> tuple[int, int] | None:
    """This rank's global rows of a fully_shard parameter (None: a plain tensor, all rows)."""
    return shard_rows(p) if isinstance(p, DTensor) else None


def _expected(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    rows = _rows(p)
    return full if rows is None else full[rows[0]:rows[1]]


def _rank_rows(rank: int) -> slice:
    return slice(rank * PER_RANK, (rank + 1) * PER_RANK)


# Checks. Each ``_assert_*`` runs a local check and agrees on the verdict across ranks
# (``all_ranks_ok``), so a value that differs on one rank only (e.g. a shard only it holds)
# fails every rank at the same point, and no rank runs ahead into a collective alone.

_PASSED_HERE = "(passed on this rank; another rank failed this check)"


def _agree(check: Callable[..., None], *args: Any) -> None:
    try:
        check(*args)
        err = None
    except Exception as e:  # noqa: BLE001 - agreed first, then re-raised as is
        err = e
    if not all_ranks_ok(err is None):
        raise err if err is not None else AssertionError(_PASSED_HERE)


def _params_close(model: nn.Module, ref: nn.Module, where: str) -> None:
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and record_of(p) is None:
            raise AssertionError(
                f"{where}: {name} is no longer the parameter fully_shard installed (a new "
                f"{type(p).__name__} without its flat-buffer binding: "
                f"the module's parameter was replaced)")
    assert_close_to_reference(model, ref, rtol=RTOL, atol=ATOL, what=f"{where}: param")


def _outputs_close(out: torch.Tensor, expected: torch.Tensor, model: nn.Module, ref: nn.Module,
                   where: str) -> None:
    try:
        torch.testing.assert_close(out.detach(), expected.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{where}: forward output differs from torch: {m}")
    except AssertionError as e:
        try:
            _params_close(model, ref, f"{where} (parameters at that forward)")
            detail = "all parameters match torch, so the compute weights differ from the parameters"
        except AssertionError as p:
            detail = str(p)
        raise AssertionError(f"{e}\n        {detail}") from None


def _grads_close(model: nn.Module, ref: nn.Module, where: str) -> None:
    """``.grad`` of every parameter (this rank's rows) against the reference's; ``None`` must
    match ``None`` (a rank whose shard of a parameter is empty has ``grad=None``)."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        ref_grad, grad = ref_params[name].grad, p.grad
        rows = _rows(p)
        if ref_grad is None:
            if grad is not None:
                raise AssertionError(f"{where}: grad of {name} is set "
                                     f"(max abs {_maxabs(grad)}) but torch's is None")
        elif grad is None:
            if rows is None or rows[0] != rows[1]:
                raise AssertionError(f"{where}: grad of {name} is None but torch's is set")
        else:
            torch.testing.assert_close(local_detached(grad), _expected(p, ref_grad), rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"{where}: grad {name}: {m}")


def _grads_none(model: nn.Module, names: list[str], where: str) -> None:
    for name in names:
        grad = model.get_parameter(name).grad
        if grad is not None:
            raise AssertionError(f"{where}: {name}.grad is a {type(grad).__name__} (max abs "
                                 f"{_maxabs(grad)}); torch leaves it None")


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor], where: str,
               names: list[str] | None = None) -> None:
    """Bitwise equality of this rank's local values with a ``_snapshot``."""
    for name in names if names is not None else list(before):
        now, old = local_detached(model.get_parameter(name)), before[name]
        if not torch.equal(now, old):
            diff = (_maxabs(now.float() - old.float()) if now.shape == old.shape
                    else f"shape {tuple(old.shape)} -> {tuple(now.shape)}")
            raise AssertionError(f"{where}: {name} changed (max abs diff {diff}); torch leaves it "
                                 f"bitwise unchanged")


def _maxabs(t: torch.Tensor) -> str:
    t = local_detached(t)
    return f"{t.abs().max().item():.3g}" if t.numel() else "- (empty)"


def _assert_params(model: nn.Module, ref: nn.Module, where: str) -> None:
    _agree(_params_close, model, ref, where)


def _assert_outputs(out: torch.Tensor, expected: torch.Tensor, model: nn.Module, ref: nn.Module,
                    where: str) -> None:
    _agree(_outputs_close, out, expected, model, ref, where)


def _assert_grads(model: nn.Module, ref: nn.Module, where: str) -> None:
    _agree(_grads_close, model, ref, where)


def _assert_grad_none(model: nn.Module, names: list[str], where: str) -> None:
    _agree(_grads_none, model, names, where)


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor], where: str,
                      names: list[str] | None = None) -> None:
    _agree(_unchanged, model, before, where, names)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: local_detached(p).clone() for name, p in model.named_parameters()}


@contextlib.contextmanager
def _expect_raises(exc_type: type[BaseException], *needles: str, what: str) -> Iterator[None]:
    """pytest.raises for rank functions: ``exc_type`` whose message contains every needle
    (verdict agreed across ranks)."""
    problem = None
    try:
        yield
        problem = "nothing was raised"
    except exc_type as e:
        missing = [n for n in needles if n not in str(e)]
        if missing:
            problem = f"{type(e).__name__} raised but its message lacks {missing}: {str(e)!r}"
    except Exception as e:  # noqa: BLE001 - report the wrong kind
        problem = f"got {type(e).__name__}: {e}"

    def raised_as_expected() -> None:
        if problem is not None:
            raise AssertionError(
                f"{what}: expected {exc_type.__name__} mentioning {list(needles)}; {problem}")
    _agree(raised_as_expected)


def _forward_pair(model: nn.Module, ref: nn.Module, parts: list[Batch], rank: int, where: str,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's loss and the reference's loss on the global batch; asserts that this rank's
    output equals the reference output's rows (reports the first diverging parameter too)."""
    x, y = parts[rank]
    out = model(x)
    ref_out = ref(torch.cat([p[0] for p in parts]))
    _assert_outputs(out, ref_out[_rank_rows(rank)], model, ref, where)
    loss = F.mse_loss(out, y) * scale
    ref_loss = F.mse_loss(ref_out, torch.cat([p[1] for p in parts])) * scale
    return loss, ref_loss


def _step_both(opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer) -> None:
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()


def _train(model: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer,
           ref_opt: torch.optim.Optimizer, batches: list, rank: int, where: str,
           first_step: int = 0) -> None:
    """Plain steps (one micro-batch each): forward (outputs compared), backward, step, zero_grad."""
    for step, micro in enumerate(batches, start=first_step):
        loss, ref_loss = _forward_pair(model, ref, micro[0], rank, f"{where} step {step}")
        loss.backward()
        ref_loss.backward()
        _step_both(opt, ref_opt)


def _compact(text: str) -> str:
    """torch.testing's multi-line mismatch report on one line: elements differing, max abs diff."""
    text = re.sub(r"(Tensor-likes|Scalars) are not close!\s*", "", text)
    text = re.sub(r"\n(Greatest relative|Relative) difference:[^\n]*", "", text)
    text = re.sub(r"Mismatched elements: ([^\n]*)\nGreatest absolute difference: ",
                  r"\1 elements differ, max abs diff ", text)
    return text.replace("\nAbsolute difference: ", ", abs diff ")


def _describe(e: BaseException) -> str:
    if isinstance(e, AssertionError):
        return "WRONG RESULT: " + _compact(str(e))
    frames = traceback.extract_tb(e.__traceback__)
    where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                        for f in reversed(frames[-3:]))
    return f"EXCEPTION {type(e).__name__}: {e}\n        at {where}"


def _run_cases(rank: int, world: int, strategy: str, cases: list[str]) -> dict[str, str | None]:
    """Rank function of one spawn: run every variant of the named cases on every rank and agree
    on the verdicts. Returns (on rank 0) each case's report: None, or every failing variant with
    every rank's message (identical messages merged)."""
    global _variant_timeout_s
    reports: dict[str, str | None] = {}
    index = 0
    for case in cases:
        variants: list[Variant] = globals()[case](rank, strategy)
        failures = []
        for name, fn in variants:
            # Own timeout -> own library process group: a variant that leaves a collective
            # unmatched fails after the timeout without breaking the next ones.
            index += 1
            _variant_timeout_s = _BASE_TIMEOUT_S + 0.25 * index
            if rank == 0:  # progress, shown if the spawn hangs or crashes
                print(f"running {strategy} / {case} / {name}", file=sys.stderr, flush=True)
            try:
                fn()
                msg = None
            except Exception as e:  # noqa: BLE001 - every failure is reported by name
                msg = _describe(e)
            if all_ranks_ok(msg is None):
                continue
            msgs: list[str | None] = [None] * world
            dist.all_gather_object(msgs, msg)
            by_msg: dict[str, list[int]] = {}
            for r, m in enumerate(msgs):
                if m is not None and not m.endswith(_PASSED_HERE):  # report the failing ranks
                    by_msg.setdefault(m, []).append(r)
            lines = [f"    rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}"
                     for m, rs in by_msg.items()]
            failures.append(f"[{strategy} / {name}]\n" + "\n".join(lines))
        reports[case] = (f"{len(failures)} of {len(variants)} variants failed:\n"
                         + "\n".join(failures)
                         if failures else None)
    return reports if rank == 0 else {}


# Reports of the spawns so far: strategy -> case -> report (or the spawn's own error).
_reports: dict[str, dict[str, str | None]] = {}


def _case_test(case: Callable[[int, str], list[Variant]]) -> Callable[[Callable[..., None]], Any]:
    """Decorator of a case's pytest function: parametrized over the strategies; runs ``case``.

    All selected cases of one strategy run in one spawn (the first selected test of that strategy
    starts it; the others read its report), so the file costs four spawns, while each (case,
    strategy) stays a test of its own, rerunnable by id (then only that case runs)."""
    def deco(test: Callable[..., None]) -> Any:
        test.case = case.__name__  # type: ignore[attr-defined]
        return pytest.mark.parametrize("strategy", STRATEGIES)(test)
    return deco


def _check(request: pytest.FixtureRequest) -> None:
    case = request.function.case
    strategy = request.node.callspec.params["strategy"]
    if case not in _reports.get(strategy, {}):
        selected = [
            item.function.case for item in request.session.items
            if getattr(item, "function", None) is not None and hasattr(item.function, "case")
            and item.callspec.params.get("strategy") == strategy
            and item.function.case not in _reports.get(strategy, {})
        ]
        cases = list(dict.fromkeys([case] + selected))
        try:
            report = run_distributed(_run_cases, WORLD, strategy, cases,
                                     timeout_s=60 + 60 * len(cases))[0]
        except Exception as e:  # noqa: BLE001 - a crash or hang of the spawn fails all its cases
            report = {c: f"the spawn running {cases} failed:\n{e}" for c in cases}
        _reports.setdefault(strategy, {}).update(report)
    report = _reports[strategy][case]
    if report is not None:
        pytest.fail(report, pytrace=False)


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
