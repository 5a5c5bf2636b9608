"""Bad input: a clear TypeError/ValueError (RuntimeError for runtime misuse) that names the
problem and the fix, raised before any collective, with the module left untouched. Checked in
this process without a process group; the cases that need ranks: ``test_errors_distributed.py``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _bad_input import (
    expect_rejected,
)

from megatron_fsdp_v2 import MixedPrecisionPolicy, ShardingStrategy, fully_shard

# ---------------------------------------------------------------------- in-process (no group)

@pytest.fixture
def no_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")


def test_no_process_group(no_process_group: None) -> None:
    msg = expect_rejected(lambda: nn.Linear(4, 4), fully_shard, ValueError,
                          r"initialized default process group.*torchrun --nproc_per_node")
    assert "init_process_group" in msg


@pytest.mark.parametrize("value, exc, pattern", [
    ("zero3", ValueError, r"unknown sharding_strategy 'zero3'; valid strategies are 'no_shard' "
                          r"\(0\), 'optim' \(1\), 'optim_grads' \(2\), 'optim_grads_params' \(3\)"),
    (4, ValueError, r"unknown sharding_strategy 4; valid strategies"),
    (-1, ValueError, r"unknown sharding_strategy -1; valid strategies"),
    (2.0, TypeError, r"sharding_strategy must be a str or int, got float"),
    (True, TypeError, r"sharding_strategy must be a str or int"),
    (None, TypeError, r"sharding_strategy must be a str or int, got NoneType"),
])
def test_unknown_strategy(no_process_group: None, value: Any, exc: type, pattern: str) -> None:
    expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, sharding_strategy=value),
                    exc, pattern)
    assert ShardingStrategy.parse("OPTIM_GRADS") is ShardingStrategy.OPTIM_GRADS
    assert ShardingStrategy.parse(0) is ShardingStrategy.NO_SHARD


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"reduce_dtype": torch.float32, "grad_comm_dtype": torch.bfloat16}, ValueError,
     r"reduce_dtype=torch.float32 and grad_comm_dtype=torch.bfloat16 "
     r"name the same setting"),
    ({"main_params_dtype": torch.float32, "main_grads_dtype": torch.bfloat16}, ValueError,
     r"main_grads_dtype=torch.bfloat16 differs from "
     r"main_params_dtype=torch.float32.*Set them equal"),
    ({"param_dtype": torch.int8}, ValueError,
     r"param_dtype=torch.int8 is not supported; use one of"),
    ({"param_dtype": "bf16"}, TypeError, r"param_dtype must be a torch.dtype or None"),
    ({"cast_forward_inputs": "yes"}, TypeError, r"cast_forward_inputs must be a bool"),
])
def test_inconsistent_mixed_precision_policy(kwargs: dict, exc: type, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        MixedPrecisionPolicy(**kwargs)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"mp_policy": "bf16"}, TypeError, r"mp_policy must be a MixedPrecisionPolicy, got str"),
    ({"param_init_fn": "reset"}, TypeError, r"param_init_fn must be a callable taking a module"),
    ({"timeout": -1}, ValueError, r"timeout must be positive and finite"),
    ({"timeout": timedelta(0)}, ValueError, r"timeout must be positive and finite"),
    ({"timeout": "5m"}, TypeError, r"timeout must be a datetime.timedelta, a number of seconds"),
    ({"gradient_scaling_factor": "0.5"}, TypeError, r"gradient_scaling_factor must be a number"),
    ({"gradient_scaling_factor": 0.0}, ValueError, r"gradient_scaling_factor must be a positive"),
    ({"gradient_scaling_factor": float("nan")}, ValueError, r"positive finite number"),
    ({"max_padding_ratio": -0.1}, ValueError, r"max_padding_ratio must be a finite number >= 0"),
    ({"max_padding_ratio": None}, TypeError, r"max_padding_ratio must be a number"),
])
def test_bad_arguments(no_process_group: None, kwargs: dict, exc: type, pattern: str) -> None:
    expect_rejected(lambda: nn.Linear(4, 4), lambda m: fully_shard(m, **kwargs), exc, pattern)


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"fully_shard expects an nn.Module, got function"):
        fully_shard(lambda x: x)  # type: ignore[arg-type]
