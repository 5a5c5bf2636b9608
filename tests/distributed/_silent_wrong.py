"""No silently wrong training: the models and checks the ``test_no_silent_wrong_*`` files share.

Every case compares a ``fully_shard`` run (2 gloo ranks, fp32) with a single-process PyTorch
reference trained on the concatenation of all ranks' micro-batches (mean losses, so the
reference's gradients equal the rank-averaged ones). The reference is a ``copy.deepcopy`` of the
model built from the same seed on every rank, taken before wrapping. After the steps every
parameter is compared (this rank's rows of the reference, rtol 1e-5 / atol 1e-6), and every
step's forward output too, so a failure says where training first diverged. Checks agree across
ranks (``all_ranks_ok``), so all ranks fail at the same point. How the cases run:
``_silent_wrong_runner.py``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import fully_shard

# private: tells our parameters from FSDP2's (record_of is None for FSDP2's)
from megatron_fsdp_v2._registry import record_of

# The cases' model (inp -> residual MLP blocks -> head), imported from here as ``Net``.
from _models import MLPStack as Net
from _models import (
    all_ranks_ok,
    assert_close_to_reference,
    local_detached,
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
