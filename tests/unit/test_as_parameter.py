"""``as_parameter`` gives what ``nn.Parameter(dtensor)`` gives (a DTensor parameter over the same
local rows, same placements, ``requires_grad`` as asked), on rank 1 of a fake world of 2."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp_v2._dtensor._parameter import as_parameter


@pytest.mark.parametrize("requires_grad", [True, False])
def test_same_as_nn_parameter(fake_mesh: object, requires_grad: bool) -> None:
    rows = torch.arange(12.0).view(3, 4)

    def fresh() -> DTensor:
        return DTensor.from_local(rows, fake_mesh, (Shard(0),), run_check=False)

    expected = nn.Parameter(fresh(), requires_grad=requires_grad)
    got = as_parameter(fresh(), requires_grad)
    assert isinstance(got, nn.Parameter) and type(got) is type(expected) is DTensor
    assert got.requires_grad is expected.requires_grad is requires_grad
    assert got.is_leaf and got.grad_fn is None
    assert got.placements == expected.placements and got.shape == expected.shape == (6, 4)
    assert got.to_local().data_ptr() == rows.data_ptr()  # the rows themselves, as nn.Parameter
    assert expected.to_local().data_ptr() == rows.data_ptr()
    module = nn.Linear(4, 6)
    module.weight = got  # register_parameter accepts it
    assert module.weight is got and dict(module.named_parameters())["weight"] is got


def test_refuses_a_tensor_with_autograd_history(fake_mesh: object) -> None:
    rows = torch.ones(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="without autograd history"):
        as_parameter(DTensor.from_local(rows * 2, fake_mesh, (Shard(0),), run_check=False), True)
