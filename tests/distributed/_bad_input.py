"""What the bad-input tests share: a snapshot of everything a failed wrap must leave as it was,
``expect_rejected`` (the error, its message, and the module untouched), and small models.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from _comm_counts import CollectiveCounts

_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def snapshot(module: nn.Module) -> list[Any]:
    """Everything a failed wrap must leave as it was: classes, attributes, hooks, and each
    parameter's identity, type, attributes and value."""
    out: list[Any] = []
    for name, m in module.named_modules(remove_duplicate=False):
        hooks = [(h, list(getattr(m, h))) for h in _HOOK_DICTS]
        out.append((name, type(m), sorted(vars(m)), hooks))
        for pname, p in m._parameters.items():
            if p is None:
                out.append((name, pname, None))
                continue
            value = p.detach().clone() if _has_data(p) else None
            if value is not None and value.layout is not torch.strided:
                value = value.to_dense()
            out.append((name, pname, id(p), type(p), p.requires_grad, sorted(vars(p)), value))
    return out


def _has_data(p: torch.Tensor) -> bool:
    """False for meta tensors, a lazy module's uninitialized parameters, wrapper subclasses
    (their identity is compared instead: not every one supports ``equal``) and ZeRO-3 compute
    parameters whose storage is freed."""
    if (p.device.type == "meta" or isinstance(p, nn.UninitializedParameter)
            or is_traceable_wrapper_subclass(p)):
        return False
    if p.layout is not torch.strided:
        return True
    needed = (p.storage_offset() + p.numel()) * p.element_size()
    return p.untyped_storage().nbytes() >= needed


def assert_same(before: list[Any], after: list[Any]) -> None:
    assert len(before) == len(after), "module structure changed"
    for a, b in zip(before, after):
        assert len(a) == len(b), f"changed: {a[:2]}"
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert isinstance(y, torch.Tensor) and torch.equal(x, y), f"value changed: {a[:2]}"
            else:
                assert x == y, f"changed: {a[:2]}: {x} != {y}"


def expect_rejected(make: Callable[[], nn.Module], call: Callable[[nn.Module], Any],
                    exc: type[BaseException], pattern: str, *,
                    collectives: bool | str = False) -> str:
    """Build a module, call ``call`` on it, and check the error, that the module is untouched and
    (unless ``collectives``) that no collective ran and no process group was created.
    ``collectives="check"``: a check of what the rank holds (its parameters), which may fail on
    some ranks only: the only collectives allowed are the cross-rank check's all-gathers, which
    share the error so that every rank raises it."""
    module = make()
    before = snapshot(module)
    groups_before = dist.distributed_c10d._world.group_count if dist.is_initialized() else None
    with CollectiveCounts() as comm:
        with pytest.raises(exc) as info:
            call(module)
    message = str(info.value)
    assert re.search(pattern, message, re.S), f"message {message!r} does not match {pattern!r}"
    assert_same(before, snapshot(module))
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    if collectives == "check":
        assert counts.get("c10d._allgather_base_") == 1, f"no cross-rank check: {counts}"
        assert set(counts) <= {"c10d._allgather_base_", "c10d.allgather_"}, counts
    elif not collectives:
        assert comm.get_total_counts() == 0, f"collectives issued: {counts}"
    if collectives != True and groups_before is not None:  # noqa: E712
        assert dist.distributed_c10d._world.group_count == groups_before, "a group was created"
    return message


class TwoLinear(nn.Module):
    def __init__(self, a: nn.Module | None = None, b: nn.Module | None = None) -> None:
        super().__init__()
        self.a = a if a is not None else nn.Linear(4, 4)
        self.b = b if b is not None else nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class WithParam(nn.Module):
    def __init__(self, extra: torch.Tensor, requires_grad: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = nn.Parameter(extra, requires_grad=requires_grad)
