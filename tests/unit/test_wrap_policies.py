"""``fully_shard``'s grouped options: :class:`CommPolicy`, :class:`ShardingPolicy` and
:class:`InitPolicy` (see [Note: grouped and flat options] in
``megatron_fsdp_v2/_frontend/_policies.py``).

Every field of a policy is a flat keyword too, with the same default; the policies and the flat
keywords together are exactly what ``parse_options`` validates, so nothing is lost or added. A
world-1 gloo group wraps models both ways and compares the validated options and one training
step; a field given both ways, a policy of the wrong type and an unknown keyword raise
``TypeError`` with no process group at all (so before any collective) and leave the module
untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, get_type_hints

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import megatron_fsdp_v2
from megatron_fsdp_v2 import (
    CommPolicy,
    FSDPModule,
    InitPolicy,
    ShardingPolicy,
    ShardingStrategy,
    _registry,
    fully_shard,
)
from megatron_fsdp_v2._frontend import _fully_shard, _policies, _wrap_options

POLICIES = {"comm_policy": CommPolicy, "sharding_policy": ShardingPolicy,
            "init_policy": InitPolicy}
# fully_shard's own keywords that are not policy fields: FSDP2's, the strategy, the policies
FLAT_KEYWORDS = {"mesh", "sharding_strategy", "reshard_after_forward", "mp_policy",
                 "offload_policy", "ignored_params", "shard_placement_fn", "dp_mesh_dims",
                 *POLICIES}
FIELDS = {f.name: (keyword, cls) for keyword, cls in POLICIES.items()
          for f in dataclasses.fields(cls)}

# The defaults of the flat keywords before they were grouped (fully_shard's signature then).
FORMER_DEFAULTS = {
    "gradient_scaling_factor": None, "max_padding_ratio": 0.01, "check_ranks": True,
    "overlap": True, "timeout": timedelta(minutes=5), "sync_module_states": True,
    "outer_dp_sharding_strategy": "no_shard", "param_init_fn": None,
    "enable_trace_pool": False, "collective_impl": "native", "reduce_bucket_size_mb": None,
    "refresh_bucket_size_mb": None,
}



def _init_fn(module: nn.Module) -> None:
    """A ``param_init_fn`` (never called: the models here are not on the meta device)."""


# Values a world-1 mesh accepts, every field of each policy (non-default where the mesh allows),
# and the ``WrapOptions`` attribute each lands in (validated, in the wiring's types).
SETTINGS = {
    "comm_policy": {"overlap": False, "timeout": 30.0, "collective_impl": "auto",
                    "reduce_bucket_size_mb": 2.0, "refresh_bucket_size_mb": 3.0,
                    "enable_trace_pool": True, "gradient_scaling_factor": 0.25},
    "sharding_policy": {"outer_dp_sharding_strategy": "no_shard", "max_padding_ratio": 0.5},
    "init_policy": {"sync_module_states": False, "param_init_fn": _init_fn,
                    "check_ranks": False},
}
VALIDATED = {"timeout": ("timeout", timedelta(seconds=30)),
             "outer_dp_sharding_strategy": ("outer_strategy", ShardingStrategy.NO_SHARD)}
STRATEGY_OF = {"comm_policy": "optim", "sharding_policy": "optim_grads_params",
               "init_policy": "optim_grads"}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.fixture
def world1_mesh() -> Iterator[DeviceMesh]:
    """A real gloo group of one rank: fully_shard runs its whole path."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        _registry.reset()
        dist.destroy_process_group()


def _spy_options(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``WrapOptions`` of each fully_shard call, from the real ``parse_options``."""
    seen: list[Any] = []

    def parse(*args: Any, **kwargs: Any) -> Any:
        seen.append(_wrap_options.parse_options(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(_fully_shard, "parse_options", parse)
    return seen


# ---------------------------------------------------------------------- the surface


def test_policies_are_exported_frozen_dataclasses() -> None:
    for cls in POLICIES.values():
        assert getattr(megatron_fsdp_v2, cls.__name__) is cls
        assert cls.__name__ in megatron_fsdp_v2.__all__
        assert cls.__doc__ and all(f.name in cls.__doc__ for f in dataclasses.fields(cls))
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls().__setattr__(dataclasses.fields(cls)[0].name, None)


def test_fields_and_keywords_are_exactly_what_parse_options_takes() -> None:
    parse = set(inspect.signature(_wrap_options.parse_options).parameters) - {"module"}
    assert set(FIELDS) == parse - FLAT_KEYWORDS, "a policy field parse_options does not take"
    own = set(inspect.signature(fully_shard).parameters) - {"module", "flat"}
    assert own == FLAT_KEYWORDS
    assert not own & set(FIELDS), "a field both a policy's and fully_shard's own keyword"
    # the flat form of the fields is typed: FlatOptions declares each with its policy's type
    hints = get_type_hints(_policies.FlatOptions)
    assert set(hints) == set(FIELDS)
    for name, (_, cls) in FIELDS.items():
        assert hints[name] == get_type_hints(cls)[name], name


def test_defaults_are_the_former_flat_defaults() -> None:
    defaults = {f.name: f.default for cls in POLICIES.values() for f in dataclasses.fields(cls)}
    assert defaults == FORMER_DEFAULTS
    assert _policies.flat_options({}, {}) == FORMER_DEFAULTS


def test_flat_options_takes_each_field_from_where_it_was_given() -> None:
    comm = CommPolicy(overlap=False, reduce_bucket_size_mb=4.0)
    got = _policies.flat_options({"comm_policy": comm}, {"max_padding_ratio": 0.2,
                                                          "check_ranks": False})
    want = dict(FORMER_DEFAULTS, overlap=False, reduce_bucket_size_mb=4.0,
                max_padding_ratio=0.2, check_ranks=False)
    assert got == want


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_field_given_both_ways_raises_type_error_naming_both(field: str) -> None:
    keyword, cls = FIELDS[field]
    model = Tiny()
    before = copy.deepcopy(model.state_dict())
    assert not dist.is_initialized()  # so the error is raised before any collective
    with pytest.raises(TypeError) as err:
        fully_shard(model, **{keyword: cls(), field: FORMER_DEFAULTS[field]})  # equal values
    message = str(err.value)
    assert f"{field}=" in message and f"{keyword}=" in message and cls.__name__ in message
    assert type(model) is Tiny and _registry.state_of(model) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("keyword", sorted(POLICIES))
def test_a_policy_of_the_wrong_type_raises_type_error(keyword: str) -> None:
    model = Tiny()
    with pytest.raises(TypeError, match=rf"{keyword}=.*{POLICIES[keyword].__name__}.*dict"):
        fully_shard(model, **{keyword: {"overlap": False}})
    assert type(model) is Tiny and _registry.state_of(model) is None


def test_an_unknown_keyword_raises_type_error_listing_the_fields() -> None:
    model = Tiny()
    with pytest.raises(TypeError, match="unexpected keyword argument 'overlapp'.*CommPolicy"):
        fully_shard(model, overlapp=False)  # type: ignore[call-arg]
    assert type(model) is Tiny and _registry.state_of(model) is None


def test_an_invalid_value_gets_the_same_error_either_way(world1_mesh: DeviceMesh) -> None:
    errors = []
    for kw in ({"collective_impl": "fastest"},
               {"comm_policy": CommPolicy(collective_impl="fastest")}):
        model = Tiny()
        with pytest.raises(ValueError) as err:
            fully_shard(model, mesh=world1_mesh, **kw)  # type: ignore[arg-type]
        errors.append(str(err.value))
        assert type(model) is Tiny and _registry.state_of(model) is None
    assert errors[0] == errors[1] and "fastest" in errors[0]


# ---------------------------------------------------------------------- grouped == flat


@pytest.mark.parametrize("keyword", sorted(SETTINGS))
def test_grouped_and_flat_give_the_same_options_and_step(
    world1_mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch, keyword: str,
) -> None:
    seen = _spy_options(monkeypatch)
    settings, strategy = SETTINGS[keyword], STRATEGY_OF[keyword]
    results = []
    for kw in (settings, {keyword: POLICIES[keyword](**settings)}):
        torch.manual_seed(0)
        model = Tiny()
        fully_shard(model, mesh=world1_mesh, sharding_strategy=strategy, **kw)
        assert isinstance(model, FSDPModule)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        results.append((loss.detach(), {n: p.to_local().detach().clone()
                                        for n, p in model.named_parameters()}))
    flat, grouped = seen
    assert flat == grouped
    assert set(settings) == {f.name for f in dataclasses.fields(POLICIES[keyword])}
    for name, value in settings.items():  # every field reached the validated options
        attribute, want = VALIDATED.get(name, (name, value))
        assert getattr(flat, attribute) == want, name
    assert torch.equal(results[0][0], results[1][0])
    for name, p in results[0][1].items():
        assert torch.equal(p, results[1][1][name]), name
