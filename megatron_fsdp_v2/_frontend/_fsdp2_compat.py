"""FSDP2 (``torch.distributed.fsdp.fully_shard``) arguments that ``fully_shard`` accepts or
refuses with the alternative (the route that lets ``torch.nn.utils.clip_grad_norm_`` work on
its parameters is ``_runtime/_clip_route.py``'s). Conversion and validation: no collective, and
no user module is changed.

[Note: FSDP2 arguments]
Each FSDP2 argument either maps onto this library with FSDP2's semantics or is refused with
``NotImplementedError`` naming what to use, before any collective:

* ``mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(...)``: converted by
  ``MixedPrecisionPolicy.from_fsdp2`` (same compute, reduction and output dtypes).
* ``reshard_after_forward``: ``True``/``None`` is ZeRO-3's schedule (2N all-gathers per window
  of N micro-batches); ``False`` keeps a ZeRO-3 unit's gathered weights from its forward to its
  backward (N all-gathers); only ``optim_grads_params`` shards model weights, so ``True`` with
  another strategy is a contradiction (``ValueError``) and ``False`` there changes nothing. An
  ``int`` ``n`` reshards to groups of ``n`` consecutive ranks after forward (ZeRO++'s hpZ; see
  [Note: resharding to a smaller group] in ``_runtime/_compute_weights.py``), validated as FSDP2
  does (:func:`post_forward_group_size`): a factor of the shard axis' size; ``1`` means
  ``False`` (with FSDP2's warning) and the axis' size means ``True``. ZeRO-3 on a 1-D mesh only.
* ``offload_policy``: ``OffloadPolicy()`` (no offload), or ``CPUOffloadPolicy(pin_memory=...)``
  with ``optim_grads_params``; see [Note: CPU offload] below.
* ``dp_mesh_dims``: the data-parallel dims of one SPMD mesh, resolved in ``_mesh.py`` (see
  [Note: SPMD meshes and dp_mesh_dims] there).
* ``shard_placement_fn``: called once per managed parameter, as FSDP2 does; ``None`` or
  ``Shard(0)`` (FSDP2's default) is what every parameter gets. Any other placement (another
  dim, or a ``ShardPlacementResult`` with its own mesh) raises ``NotImplementedError`` naming
  the parameter: flat buffers shard a parameter by rows, contiguous spans of dim 0 (uneven
  over ranks), so no other dim can be the sharded one without a copy per gather.
* a list of modules as one unit: see [Note: several modules as one unit] in ``_module_lists.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch.nn as nn

from .. import _registry
from .._runtime._offload import OffloadConfig, copies_forced
from ..api import MixedPrecisionPolicy, ShardingStrategy

__all__ = [
    "check_shard_placements",
    "convert_mp_policy",
    "host_offload_config",
    "parse_offload_policy",
    "parse_reshard_after_forward",
    "post_forward_group_size",
]


def _is_torch_class(obj: object, name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == name and cls.__module__.startswith("torch.distributed.fsdp")


def convert_mp_policy(mp_policy: object) -> MixedPrecisionPolicy:
    """Ours as given, FSDP2's converted, anything else a ``TypeError`` naming both."""
    if mp_policy is None:
        return MixedPrecisionPolicy()
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    if _is_torch_class(mp_policy, "MixedPrecisionPolicy"):
        return MixedPrecisionPolicy.from_fsdp2(mp_policy)
    cls = type(mp_policy)
    name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    hint = ""
    if _is_torch_class(mp_policy, "MixedPrecision"):  # FSDP1's policy
        hint = (" (for FSDP1's MixedPrecision: param_dtype and reduce_dtype carry over; buffers "
                "keep their dtype)")
    raise TypeError(
        f"mp_policy must be a MixedPrecisionPolicy, got {name}: use "
        "megatron_fsdp_v2.MixedPrecisionPolicy or FSDP2's "
        f"torch.distributed.fsdp.MixedPrecisionPolicy{hint}"
    )


# [Note: CPU offload]
# FSDP2's ``CPUOffloadPolicy`` keeps the sharded parameters (here: the main weights), their
# gradients and hence the optimizer state in host memory, runs the optimizer step there, and
# copies this rank's shard to the device for each all-gather (and the reduced gradient shard
# back after each reduce-scatter). Which strategies: only ``optim_grads_params``, the one that
# shards the model weights, as FSDP2 (which always does); ``optim``/``optim_grads`` hold full
# model weights on every rank's device, so offloading their shards would leave the larger part
# on the device, and ``no_shard`` has nothing sharded. These are refused (``NotImplementedError``)
# whatever the device, so a configuration that runs on a CPU machine also runs on a GPU one or
# fails there for the device alone.
#
# Which path (:func:`host_offload_config`): on an accelerator mesh (CUDA) the copying path of
# [Note: host offload] in ``_runtime/_offload.py``: main weights and gradients in (pinned, with
# ``pin_memory=True``) host memory, an H2D copy into each all-gather's input, a D2H copy after
# each reduce-scatter; 1-D meshes only (HSDP's outer reductions would run on host buffers:
# ``NotImplementedError``), not with FP8 all-gather parameters or tensor-parallel DTensors
# (refused when the groups are built), ``torch.optim.Muon`` (at its first step) or
# ``set_all_reduce_hook``. On a CPU mesh (gloo) every flat buffer already is host
# memory, so the policy is accepted and changes nothing: no copy, no extra buffer, the same
# collectives and the same bits as without it (``tests/distributed/test_cpu_offload.py`` checks
# the data pointers, the memory report and the losses against FSDP2 with the same policy and
# one process); ``pin_memory`` is checked (a bool) and unused there. The test-only switch
# ``_offload.FORCE_COPIES_ENV`` makes a CPU mesh take the copying path, so its logic is tested
# on CPU machines; the estimator (meta buffers) models the copying path too.
# ``memory_report(...).host_bytes`` says which bytes live in host memory, ``.offloaded_bytes``
# which of them the policy put there.

def parse_offload_policy(offload_policy: object, strategy: ShardingStrategy) -> bool:
    """Whether ``offload_policy`` asks for CPU offload (see [Note: CPU offload]); ``TypeError``
    for anything but FSDP2's policies, ``NotImplementedError`` for a strategy without it."""
    if offload_policy is None:
        return False
    if _is_torch_class(offload_policy, "CPUOffloadPolicy"):
        pin_memory = getattr(offload_policy, "pin_memory", True)
        if not isinstance(pin_memory, bool):
            raise TypeError(
                f"CPUOffloadPolicy(pin_memory=...) must be a bool, got "
                f"{type(pin_memory).__name__} ({pin_memory!r})"
            )
        if strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
            raise NotImplementedError(
                f"offload_policy=CPUOffloadPolicy() with sharding_strategy={strategy.value!r}: "
                "CPU offload keeps the sharded parameters, their gradients and the optimizer "
                "state in host memory, as FSDP2 (which always shards parameters); only "
                "sharding_strategy='optim_grads_params' shards the model weights ("
                f"{strategy.value!r} keeps full weights on every rank's device). Use "
                "sharding_strategy='optim_grads_params', or leave offload_policy unset"
            )
        return True
    if _is_torch_class(offload_policy, "OffloadPolicy"):  # FSDP2's default: no offload
        return False
    raise TypeError(
        "offload_policy must be None, torch.distributed.fsdp.OffloadPolicy() (no offload) or "
        f"torch.distributed.fsdp.CPUOffloadPolicy(), got {type(offload_policy).__name__}"
    )


def host_offload_config(offload_policy: object, device_type: str, hsdp: bool
                        ) -> OffloadConfig | None:
    """For a ``CPUOffloadPolicy`` accepted by :func:`parse_offload_policy`: the copying path's
    settings on a mesh of ``device_type``, or ``None`` for the no-copy path of a CPU mesh (see
    [Note: CPU offload]); ``NotImplementedError`` for the copying path on an HSDP mesh."""
    if device_type == "cpu" and not copies_forced() and not _registry.meta_buffers[0]:
        return None
    if hsdp:
        raise NotImplementedError(
            f"offload_policy=CPUOffloadPolicy() on a 2-D (HSDP) {device_type!r} mesh: the "
            "outer reductions would run on the gradients in host memory, which is not "
            "implemented. Use a 1-D mesh (FSDP over every rank) with the policy, or leave "
            "offload_policy unset"
        )
    return OffloadConfig(pin_memory=bool(getattr(offload_policy, "pin_memory", True)))


def parse_reshard_after_forward(value: object, strategy: ShardingStrategy) -> bool | int:
    """Whether a unit frees its gathered weights after forward, or the size of the group it
    reshards them to (an ``int``, checked against the mesh by :func:`post_forward_group_size`);
    see [Note: FSDP2 arguments]."""
    if value is None:
        return True
    if not isinstance(value, bool):
        if isinstance(value, int):
            if value != 1 and not strategy.shards_model_weights:
                raise ValueError(
                    f"reshard_after_forward={value} reshards model weights to groups of {value} "
                    "ranks after forward, which only sharding_strategy='optim_grads_params' "
                    f"does; {strategy.value!r} keeps them replicated. Drop "
                    "reshard_after_forward, or use sharding_strategy='optim_grads_params'"
                )
            return value
        raise TypeError(
            "reshard_after_forward must be a bool, an int (the size of the group to reshard "
            f"to) or None, got {value!r}"
        )
    if value and not strategy.shards_model_weights:
        raise ValueError(
            f"reshard_after_forward=True shards model weights between uses, which only "
            f"sharding_strategy='optim_grads_params' does; {strategy.value!r} keeps them "
            "replicated. Drop reshard_after_forward, or use sharding_strategy="
            "'optim_grads_params'"
        )
    return value


def post_forward_group_size(
    value: bool | int, shard_size: int, two_d: bool, trace_pool: bool
) -> tuple[bool, int]:
    """``(reshard_after_forward, post-forward group size)`` for ``parse_reshard_after_forward``'s
    result on a mesh whose shard axis has ``shard_size`` ranks; the size is 0 where weights
    are freed whole (``True``) or kept (``False``). FSDP2's rules: an ``int`` must be a factor
    of ``shard_size`` (``ValueError``); ``1`` is ``False`` (warned, as FSDP2 does) and
    ``shard_size`` is ``True``."""
    if isinstance(value, bool):
        return value, 0
    if value < 1 or value > shard_size or shard_size % value != 0:
        raise ValueError(
            f"reshard_after_forward={value}: an int is the size of the group each rank "
            f"reshards to after forward, so it must be a factor of the shard axis' size "
            f"{shard_size} (1..{shard_size}, dividing it). Pass one of "
            f"{[d for d in range(1, shard_size + 1) if shard_size % d == 0]}, or a bool"
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool): the gathered weights are kept until "
            "backward, as with reshard_after_forward=False", stacklevel=4,
        )
        return False, 0
    if value == shard_size:
        return True, 0
    if two_d:
        raise NotImplementedError(
            f"reshard_after_forward={value} on a 2-D (HSDP) mesh is not supported: the "
            "post-forward groups are built over a 1-D mesh. Use a 1-D mesh, or "
            "reshard_after_forward=True/False"
        )
    if trace_pool:
        raise NotImplementedError(
            f"reshard_after_forward={value} with enable_trace_pool=True is not supported: "
            "the post-forward shards are not planned in the trace pool's arena. Pass "
            "enable_trace_pool=False, or reshard_after_forward=True/False"
        )
    return True, value


def check_shard_placements(fn: object, managed: Iterable[tuple[str, nn.Parameter]]) -> None:
    """FSDP2's ``shard_placement_fn`` (see [Note: FSDP2 arguments]): every parameter must get
    ``None`` or ``Shard(0)``. No collective; the function is called once per parameter."""
    if fn is None:
        return
    if not callable(fn):
        raise TypeError(f"shard_placement_fn must be callable or None, got {type(fn).__name__}")
    from torch.distributed.tensor import Shard

    for fqn, param in managed:
        placement = fn(param)
        if placement is None:
            continue
        if isinstance(placement, Shard) and placement.dim in (0, -max(param.dim(), 1)):
            continue
        if isinstance(placement, Shard):
            what = f"Shard({placement.dim})"
        else:
            what = f"a {type(placement).__name__} ({placement!r})"
        raise NotImplementedError(
            f"shard_placement_fn returned {what} for parameter {fqn!r}: megatron_fsdp_v2 "
            "shards every parameter by rows (Shard(0), uneven across ranks) because its flat "
            "buffers hold contiguous spans of dim 0; another dim or a mesh of its own is not "
            "supported. Return None or Shard(0) for it, or leave the parameter out of the unit "
            "(ignored_params)"
        )
