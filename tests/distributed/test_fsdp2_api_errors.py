"""FSDP2-style arguments fully_shard rejects, a bad list of modules, bad method arguments, and the
clip route installed by wrapping. Argument errors are raised before any collective, so they are
checked in this process without a process group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _fsdp2_api import (
    TIMEOUT_S,
    Net,
    _wrap,
)
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import FSDPModule, fully_shard

from _pool import RankPools

pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------------- argument errors

def _untouched(model: nn.Module) -> bool:
    return not isinstance(model, FSDPModule) and not any(
        isinstance(p, DTensor) for p in model.parameters()
    )


@pytest.mark.parametrize("kwargs, error, needles", [
    ({"reshard_after_forward": 2, "sharding_strategy": "optim_grads"}, ValueError,
     ["reshard_after_forward=2", "only sharding_strategy='optim_grads_params'"]),
    ({"reshard_after_forward": "yes"}, TypeError, ["reshard_after_forward must be a bool"]),
    ({"reshard_after_forward": True, "sharding_strategy": "optim_grads"}, ValueError,
     ["only sharding_strategy='optim_grads_params'", "'optim_grads'"]),
    ({"offload_policy": CPUOffloadPolicy(), "sharding_strategy": "optim_grads"},
     NotImplementedError, ["CPU offload", "sharding_strategy='optim_grads_params'"]),
    ({"offload_policy": "cpu"}, TypeError, ["offload_policy must be"]),
    ({"mp_policy": torch.distributed.fsdp.MixedPrecision(param_dtype=torch.bfloat16)},
     TypeError, ["megatron_fsdp_v2.MixedPrecisionPolicy", "FSDP1"]),
    ({"mp_policy": {"param_dtype": torch.bfloat16}}, TypeError,
     ["torch.distributed.fsdp.MixedPrecisionPolicy", "dict"]),
], ids=["int-without-zero3", "not-bool", "true-without-zero3", "cpu-offload", "offload-type",
        "fsdp1-mp", "mp-dict"])
def test_argument_errors(kwargs: dict[str, Any], error: type[Exception],
                         needles: list[str]) -> None:
    """Raised before any collective (no process group exists here), module untouched."""
    model = Net()
    with pytest.raises(error) as info:
        fully_shard(model, **kwargs)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert _untouched(model)


def test_list_with_nested_modules_is_refused() -> None:
    """A list is one unit (test_module_lists.py); one member inside another is refused."""
    model = Net()
    with pytest.raises(ValueError, match="inside item 0"):
        fully_shard([model.blocks[0], model.blocks[0][0]])  # type: ignore[arg-type]
    assert _untouched(model)


def _method_errors_worker(rank: int, world: int) -> list[str]:
    model = Net()
    _wrap(model)
    found = []
    for call, error, needle in [
        (lambda: model.set_reshard_after_backward(1), TypeError,
         "reshard_after_backward must be a bool"),
        (lambda: model.set_reshard_after_forward(2), ValueError,
         "reshard_after_forward should be a bool"),
        (lambda: model.set_modules_to_forward_prefetch(model.blocks[0]), TypeError,
         "expects a list"),
        (lambda: model.set_modules_to_backward_prefetch([model.out]), TypeError,
         "not a fully_shard module"),
    ]:
        try:
            call()
            found.append(f"no error (expected {error.__name__}: {needle})")
        except error as e:
            found.append("ok" if needle in str(e) else f"unclear: {e}")
    return found


def test_methods_reject_bad_arguments(ranks: RankPools) -> None:
    for rank, found in enumerate(ranks.run(_method_errors_worker, 2, timeout_s=TIMEOUT_S)):
        assert found == ["ok"] * 4, (rank, found)


def test_clip_route_is_installed_by_wrapping_and_removed_by_reset(fresh_python) -> None:
    """Importing the package leaves torch alone; the first wrap replaces
    ``torch.nn.utils.clip_grad_norm_`` (both attributes); ``_registry.reset`` restores it."""
    code = (
        "import torch.nn.utils as u, torch.nn.utils.clip_grad as c\n"
        "before = (u.clip_grad_norm_, c.clip_grad_norm_)\n"
        "import megatron_fsdp_v2\n"
        "from megatron_fsdp_v2 import _registry\n"
        "from megatron_fsdp_v2._torch_patches import _clip_grad\n"
        "assert (u.clip_grad_norm_, c.clip_grad_norm_) == before\n"
        "_clip_grad.install()\n"
        "routed = u.clip_grad_norm_\n"
        "_clip_grad.install()\n"
        "assert u.clip_grad_norm_ is c.clip_grad_norm_ is routed is not before[0]\n"
        "_registry.reset()\n"
        "assert (u.clip_grad_norm_, c.clip_grad_norm_) == before\n"
    )
    fresh_python.run(code)
