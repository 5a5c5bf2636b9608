"""Tensor-subclass parameters ([Note: tensor-subclass parameters] in ``_param_classes.py``).

A wrapper subclass without FSDP2's all-gather extensions (MX, torch's ``TwoTensor``) or with
extensions the flat buffers cannot honour (NF4: several inner tensors), a subclass that
overrides ``__torch_function__``, and a lazy module's uninitialized parameter are refused by
``fully_shard`` with a ``TypeError`` that names the parameter, its class and what to do; the
module is left untouched and the only collective is the cross-rank check that shares the error.
The supported ones train, each equal to single-process PyTorch on the same model and data: a
Python subclass of ``nn.Parameter`` that only carries attributes, torchao float8 linears whose
weights are gathered in full precision, and torchao float8 with FP8 all-gathers (its parity
with FSDP2 is ``test_fp8_params.py``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing._internal.two_tensor import TwoTensor

from megatron_fsdp_v2 import fully_shard

from _models import agree, assert_close_to_reference, step_mean_loss
from _pool import RankPools
from test_errors import expect_rejected

WORLD = 2
TIMEOUT_S = 180


class ScaledTensor(torch.Tensor):
    """A (non-wrapper) subclass whose ``__torch_function__`` changes what ops do."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


class TaggedParameter(nn.Parameter):
    """A Python subclass of ``nn.Parameter`` that only carries an attribute (Megatron-style
    tagging): plain tensor behaviour, so it is supported."""

    tag = "tagged"


def _with_weight(make_weight: Callable[[torch.Tensor], nn.Parameter]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        model[2].weight = make_weight(model[2].weight.detach())
        return model
    return make


def _float8(fp8_all_gather: bool) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather)
    return convert_to_float8_training(model, config=config)


def _nf4(weight: torch.Tensor) -> nn.Parameter:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return nn.Parameter(to_nf4(weight, block_size=64, scaler_block_size=32), requires_grad=False)


def _mx(weight: torch.Tensor) -> nn.Parameter:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return nn.Parameter(MXTensor.to_mx(weight, torch.float8_e4m3fn, 32), requires_grad=False)


def _lazy() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.LazyLinear(32))


# case -> (module factory, pattern the message must match, needs torchao)
REFUSED: dict[str, tuple[Callable[[], nn.Module], str, bool]] = {
    "torchao_nf4": (
        _with_weight(_nf4),
        r"parameter '2\.weight' is a tensor subclass \(torchao\..*NF4Tensor\) with FSDP2 "
        r"all-gather extensions that fully_shard cannot honour: its values are held by 5 inner "
        r"tensors.*frozen.*ignored_params", True),
    "torchao_mx": (
        _with_weight(_mx),
        r"parameter '2\.weight' is a tensor subclass \(torchao\..*MXTensor\).*ignored_params",
        True),
    "two_tensor": (
        _with_weight(lambda w: nn.Parameter(TwoTensor(w, w.clone()))),
        r"parameter '2\.weight' is a tensor subclass "
        r"\(torch\.testing\._internal\.two_tensor\.TwoTensor\).*plain nn\.Parameter", False),
    "torch_function_subclass": (
        _with_weight(lambda w: nn.Parameter(w.as_subclass(ScaledTensor))),
        r"parameter '2\.weight' is a tensor subclass \(.*ScaledTensor\)", False),
    "lazy_module": (
        _lazy,
        r"parameter '1\.weight' is a torch\.nn\.parameter\.UninitializedParameter of a lazy "
        r"module.*run one forward pass", False),
}


def _refused(rank: int, world: int, case: str) -> None:
    make, pattern, _ = REFUSED[case]
    fully_shard(nn.Linear(4, 4))  # creates the library's process group (collective) up front
    message = expect_rejected(make, fully_shard, TypeError, pattern, collectives="check")
    agree(f"{case}: message", lambda: _matches(message, pattern))


def _matches(message: str, pattern: str) -> None:
    assert re.search(pattern, message, re.S), message


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_subclass_refused(ranks: RankPools, case: str) -> None:
    """Every rank raises the TypeError at ``fully_shard``; nothing trains on stale weights."""
    if REFUSED[case][2]:
        pytest.importorskip("torchao")
    ranks.run(_refused, WORLD, case, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- supported controls

def _train_like_torch(rank: int, world: int, case: str, strategy: str) -> None:
    if case == "tagged_parameter":
        model = _with_weight(lambda w: TaggedParameter(w))()
    else:
        model = _float8(fp8_all_gather=case == "torchao_float8_fp8_all_gather")
    ref = copy.deepcopy(model)
    fully_shard(model, sharding_strategy=strategy)
    precompute = _precompute_for(case)
    precompute(model)  # a rank holds no row of one FP8 weight here: torchao needs a scale first
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(world * 16, 32, generator=g)
        y = torch.randn(world * 16, 32, generator=g)
        rows = slice(rank * 16, (rank + 1) * 16)
        loss = step_mean_loss(F.mse_loss(model(x[rows]), y[rows]), opt)
        precompute(model)
        # The mean of the ranks' losses, each on its own rows (DDP's gradient): float8 scales
        # come from each forward's own amax, so one forward of the whole batch would differ.
        ref_loss = sum(F.mse_loss(ref(x[r * 16:(r + 1) * 16]), y[r * 16:(r + 1) * 16])
                       for r in range(world)) / world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        agree(f"{case} {strategy} step {step}: loss",
              lambda: torch.testing.assert_close(loss, ref_loss.item(), rtol=1e-5, atol=1e-6))
    agree(f"{case} {strategy}: parameters",
          lambda: assert_close_to_reference(model, ref, rtol=1e-5, atol=1e-6))


def _precompute_for(case: str) -> Callable[[nn.Module], None]:
    """torchao's scale precompute after each step (FP8 all-gathers), else nothing. The
    single-process reference casts each forward with the same scale (amax of the whole
    weight)."""
    if case != "torchao_float8_fp8_all_gather":
        return lambda model: None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return precompute_float8_dynamic_scale_for_fsdp


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
@pytest.mark.parametrize("case", ["tagged_parameter", "torchao_float8_full_precision_gather",
                                  "torchao_float8_fp8_all_gather"])
def test_supported_parameter_classes_train(ranks: RankPools, case: str, strategy: str) -> None:
    """The check is not broader than it must be: these wrap and train like single-process
    torch (losses and parameters, 3 AdamW steps, world 2); torchao float8 with FP8 all-gathers
    was refused before, now trains right."""
    if case.startswith("torchao"):
        pytest.importorskip("torchao")
    ranks.run(_train_like_torch, WORLD, case, strategy, timeout_s=TIMEOUT_S)
