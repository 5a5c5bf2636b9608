"""Configuration types of ``megatron_fsdp_v2.api``: ``ShardingStrategy.parse`` and
``MixedPrecisionPolicy`` (validation and ``resolve``), against their docstrings."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatron_fsdp_v2.api import (
    SUPPORTED_DTYPES,
    MixedPrecisionPolicy,
    ResolvedDtypes,
    ShardingStrategy,
)

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
NAMES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
DTYPE_FIELDS = ["param_dtype", "reduce_dtype", "main_params_dtype", "main_grads_dtype",
                "grad_comm_dtype"]

# ---------------------------------------------------------------------------------------------
# ShardingStrategy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code, name", list(enumerate(NAMES)))
def test_parse_accepts_member_name_and_megatron_code(code: int, name: str) -> None:
    member = ShardingStrategy(name)
    assert member.value == name
    assert ShardingStrategy.parse(member) is member
    assert ShardingStrategy.parse(name) is member
    assert ShardingStrategy.parse(name.upper()) is member  # names are case-insensitive
    assert ShardingStrategy.parse(code) is member
    assert member == name  # a str enum


@pytest.mark.parametrize("value", ["zero3", "", "no-shard", "optim_grads_params ", -1, 4, 10])
def test_parse_rejects_unknown_values(value: object) -> None:
    with pytest.raises(ValueError, match="unknown sharding_strategy") as info:
        ShardingStrategy.parse(value)  # type: ignore[arg-type]
    for code, name in enumerate(NAMES):
        assert f"'{name}' ({code})" in str(info.value)  # lists every valid strategy


@pytest.mark.parametrize("value", [True, False, 1.0, None, b"optim", ["optim"]])
def test_parse_rejects_wrong_types(value: object) -> None:
    with pytest.raises(TypeError, match="sharding_strategy must be a str or int"):
        ShardingStrategy.parse(value)  # type: ignore[arg-type]


def test_strategy_properties_follow_the_table() -> None:
    # (model weights, main weights, main grads) sharded?
    table = {
        "no_shard": (False, False, False),
        "optim": (False, True, False),
        "optim_grads": (False, True, True),
        "optim_grads_params": (True, True, True),
    }
    assert [m.value for m in ShardingStrategy] == NAMES
    for name, (model, main, grads) in table.items():
        s = ShardingStrategy.parse(name)
        assert (s.shards_model_weights, s.shards_main_weights, s.shards_grads) == (
            model, main, grads), name


# ---------------------------------------------------------------------------------------------
# MixedPrecisionPolicy
# ---------------------------------------------------------------------------------------------


def expected_resolution(policy: dict, original: torch.dtype) -> ResolvedDtypes | type:
    """The docstring's rules, written independently: the resolved dtypes or the error type."""
    comm_a, comm_b = policy["reduce_dtype"], policy["grad_comm_dtype"]
    if comm_a is not None and comm_b is not None and comm_a != comm_b:
        return ValueError
    main_p, main_g = policy["main_params_dtype"], policy["main_grads_dtype"]
    if main_p is not None and main_g is not None and main_p != main_g:
        return ValueError
    model = policy["param_dtype"] if policy["param_dtype"] is not None else original
    main = main_p if main_p is not None else original
    grad = main_g if main_g is not None else main
    if grad != main:
        return ValueError
    comm = comm_b if comm_b is not None else comm_a if comm_a is not None else grad
    return ResolvedDtypes(model, main, grad, comm)


def test_resolve_every_combination() -> None:
    """All 5^5 field combinations over (None, fp32, bf16, fp16, fp64), for each wrap dtype."""
    choices = (None, F32, BF16, F16, F64)
    for values in itertools.product(choices, repeat=len(DTYPE_FIELDS)):
        fields = dict(zip(DTYPE_FIELDS, values))
        expect_by_dtype = {o: expected_resolution(fields, o) for o in SUPPORTED_DTYPES}
        try:
            policy = MixedPrecisionPolicy(**fields)
        except ValueError:
            # Construction fails only for contradictions independent of the wrap dtype.
            assert all(e is ValueError for e in expect_by_dtype.values()), fields
            continue
        for original, expected in expect_by_dtype.items():
            if expected is ValueError:
                with pytest.raises(ValueError, match="main_grads_dtype"):
                    policy.resolve(original)
            else:
                got = policy.resolve(original)
                assert got == expected, (fields, original, got)
                assert got.grad == got.main  # optimizers need grad.dtype == param.dtype


def test_documented_examples() -> None:
    # Default: everything in the parameters' dtype.
    for dtype in SUPPORTED_DTYPES:
        assert MixedPrecisionPolicy().resolve(dtype) == (dtype, dtype, dtype, dtype)
    # FSDP2: bf16 compute on an fp32 model keeps fp32 main weights, grads and reduction.
    assert MixedPrecisionPolicy(param_dtype=BF16).resolve(F32) == (BF16, F32, F32, F32)
    # Megatron-FSDP: a bf16 model with fp32 main weights.
    assert MixedPrecisionPolicy(main_params_dtype=F32).resolve(BF16) == (BF16, F32, F32, F32)
    # The README's policy, and a cheaper reduction under either name.
    readme = MixedPrecisionPolicy(param_dtype=BF16, main_params_dtype=F32)
    assert readme.resolve(F32) == readme.resolve(BF16) == (BF16, F32, F32, F32)
    for name in ("reduce_dtype", "grad_comm_dtype"):
        p = MixedPrecisionPolicy(param_dtype=BF16, main_params_dtype=F32, **{name: BF16})
        assert p.resolve(F32) == (BF16, F32, F32, BF16)
    both = MixedPrecisionPolicy(reduce_dtype=BF16, grad_comm_dtype=BF16)
    assert both.resolve(F32).comm == BF16
    # main_grads_dtype equal to the main weights is accepted, explicitly or through the default.
    assert MixedPrecisionPolicy(main_grads_dtype=F32).resolve(F32) == (F32, F32, F32, F32)
    assert MixedPrecisionPolicy(main_params_dtype=F32, main_grads_dtype=F32).resolve(BF16) == (
        BF16, F32, F32, F32)
    assert MixedPrecisionPolicy().cast_forward_inputs is True


def test_contradictions_raise_at_construction() -> None:
    with pytest.raises(ValueError, match="reduce_dtype=.*grad_comm_dtype=.*same setting"):
        MixedPrecisionPolicy(reduce_dtype=F32, grad_comm_dtype=BF16)
    with pytest.raises(ValueError, match="main_grads_dtype=.*differs from main_params_dtype"):
        MixedPrecisionPolicy(main_params_dtype=F32, main_grads_dtype=BF16)


def test_grads_dtype_must_match_the_resolved_main_dtype() -> None:
    policy = MixedPrecisionPolicy(main_grads_dtype=F32)  # valid until the wrap dtype is known
    with pytest.raises(ValueError, match="set main_params_dtype=torch.float32"):
        policy.resolve(BF16)


@pytest.mark.parametrize("field", DTYPE_FIELDS)
@pytest.mark.parametrize("bad", ["bfloat16", torch.float32.itemsize, object()])
def test_non_dtype_values_raise_type_error(field: str, bad: object) -> None:
    with pytest.raises(TypeError, match=f"MixedPrecisionPolicy.{field} must be a torch.dtype"):
        MixedPrecisionPolicy(**{field: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", DTYPE_FIELDS)
@pytest.mark.parametrize("bad", [torch.int8, torch.int64, torch.bool, torch.complex64])
def test_unsupported_dtypes_raise_value_error(field: str, bad: torch.dtype) -> None:
    with pytest.raises(ValueError, match=f"MixedPrecisionPolicy.{field}=.* is not supported"):
        MixedPrecisionPolicy(**{field: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1, 0, None, "yes"])
def test_cast_forward_inputs_must_be_bool(bad: object) -> None:
    with pytest.raises(TypeError, match="cast_forward_inputs must be a bool"):
        MixedPrecisionPolicy(cast_forward_inputs=bad)  # type: ignore[arg-type]
    assert MixedPrecisionPolicy(cast_forward_inputs=False).cast_forward_inputs is False


def test_policy_is_frozen_and_hashable() -> None:
    policy = MixedPrecisionPolicy(param_dtype=BF16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = F32  # type: ignore[misc]
    assert policy == MixedPrecisionPolicy(param_dtype=BF16)
    assert hash(policy) == hash(MixedPrecisionPolicy(param_dtype=BF16))


# ---------------------------------------------------------------------------------------------
# output_dtype and FSDP2's policy
# ---------------------------------------------------------------------------------------------


def test_output_dtype_is_validated_like_the_other_dtypes() -> None:
    with pytest.raises(TypeError, match="MixedPrecisionPolicy.output_dtype must be a torch.dtype"):
        MixedPrecisionPolicy(output_dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MixedPrecisionPolicy.output_dtype=.* is not supported"):
        MixedPrecisionPolicy(output_dtype=torch.int32)
    # It changes no buffer dtype.
    assert MixedPrecisionPolicy(output_dtype=F32).resolve(BF16) == (BF16, BF16, BF16, BF16)


@pytest.mark.parametrize("param, reduce, output, cast", [
    (None, None, None, True),
    (BF16, None, None, True),  # FSDP2 reduces in param_dtype when reduce_dtype is unset
    (BF16, F32, F32, False),
    (None, BF16, None, True),
    (F16, F16, BF16, True),
])
def test_from_fsdp2_keeps_fsdp2_semantics(param: torch.dtype | None, reduce: torch.dtype | None,
                                          output: torch.dtype | None, cast: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    torch_policy = TorchPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output,
                               cast_forward_inputs=cast)
    ours = MixedPrecisionPolicy.from_fsdp2(torch_policy)
    assert ours == MixedPrecisionPolicy(
        param_dtype=param, reduce_dtype=reduce if reduce is not None else param,
        output_dtype=output, cast_forward_inputs=cast,
    )
    # Sharded parameters and gradients stay in the parameters' dtype, as in FSDP2; gradients
    # are reduced in reduce_dtype, else in the compute dtype.
    for original in (F32, BF16):
        got = ours.resolve(original)
        assert (got.main, got.grad) == (original, original)
        assert got.model == (param or original)
        assert got.comm == (reduce or param or original)
