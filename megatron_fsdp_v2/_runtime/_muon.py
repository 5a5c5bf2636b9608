"""``torch.optim.Muon`` on ``fully_shard`` parameters: torch's own step, each matrix
orthogonalized whole on one rank (see [Note: distributed Muon]).

[Note: distributed Muon]
Muon orthogonalizes each 2-D update as a whole (Newton-Schulz on the full momentum), so a step on
row shards is wrong and a step through DTensor (each Newton-Schulz operation redistributed) is
slow and not one process's numbers. When a ``torch.optim.Muon`` (the class itself, not a
subclass) holds parameters this library manages, its step runs as:

1. **Momentum, locally.** ``buf.lerp_(grad, 1 - momentum)`` and the nesterov ``lerp`` are
   elementwise: on each rank's rows they give the bits one process gives on the whole matrix.
2. **To the owners.** :class:`~._whole_matrices.WholeMatrices` (planned once per parameter set,
   every rank the same owners) sends each rank's rows of the update to the matrix's owner in
   bfloat16, the dtype torch's Newton-Schulz casts to first: one all-to-all per process group,
   none where every matrix is whole on its owner (``no_shard``, or a matrix inside one rank's
   shard).
3. **Newton-Schulz, once.** The owner runs torch's own ``_zeropower_via_newtonschulz`` on the
   whole matrix with the group's coefficients, steps and eps.
4. **Back, and applied.** The owners' results come back (one all-to-all) and every rank applies
   its rows exactly as torch does: ``param.mul_(1 - lr * weight_decay)`` and ``param.add_(update,
   alpha=-adjusted_lr)``, with torch's ``_adjust_lr`` on the full shape.

The step runs inside ``optimizer.step()`` as the closure the global pre-step hook passes in
(the user's closure, if any, runs first), so per-optimizer pre-step hooks still run before it;
then the managed parameters' gradients are hidden from torch's own loop (``.grad`` set to
``None`` for its duration, put back by the post-step hook), which so steps nothing twice.

Per parameter, torch's semantics: a matrix with no gradient on any rank is left alone (no
weight decay, no momentum); a rank whose gradient is ``None`` while another rank's is not (see
[Note: gradients the optimizer sees]) takes its rows as zeros, computed aside and kept only when
the owner reports that some rank had a gradient. Momentum buffers are created as torch creates
them (``zeros_like(p.grad)``: DTensors placed as the parameter), so they go through state dicts
and checkpoints like any optimizer state.

Tensor-parallel matrices (FSDP x TP) are orthogonalized whole too: their exchange runs over the
whole dp x TP mesh, each rank's piece a block of the global matrix (its dp rows of its TP
shard), in the same one all-to-all each way. A param group with ``"tp_mode": "per_shard"``
(Megatron's per-shard mode, an explicit choice) orthogonalizes each TP rank's shard on its own
instead: gathered over the dp ranks only, no TP traffic; the learning-rate adjustment still
reads the parameter's full shape.

Refused before anything changes: a Muon that mixes managed matrices with others (``ValueError``),
a parameter that is not 2-D (``ValueError``), and, checked across ranks when the parameter set
is first seen, Muon groups that differ between ranks (``ValueError``). Under ``torch.compile``
tracing the step stays torch's (through DTensor).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import _muon as torch_muon
from torch.optim.optimizer import _to_scalar

from .. import _registry
from .._comm._backends import group_timeout
from .._comm._process_groups import whole_mesh_process_group
from ._whole_matrices import WholeMatrices, local_tensor, newton_schulz_flops

__all__ = ["MuonPlan", "is_distributed_muon", "muon_closure", "restore_hidden_grads"]

MUON: type[torch.optim.Optimizer] = torch.optim.Muon
# The keys that must agree across ranks (the learning rate and weight decay may be scheduled:
# they are read every step, like torch's).
_STATIC_KEYS = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn",
                "tp_mode")
# A param group's "tp_mode" (ours; torch's Muon keeps unknown keys): how a tensor-parallel matrix
# is orthogonalized.
TP_MODES = ("whole", "per_shard")


@dataclass
class MuonPlan:
    """A Muon's managed parameters, in order, and their owners (cached per parameter set)."""

    signature: tuple[int, ...]
    params: list[torch.Tensor]
    group_of: list[dict[str, Any]]  # each parameter's param group
    whole: WholeMatrices


def is_distributed_muon(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step runs as [Note: distributed Muon]: a ``torch.optim.Muon``
    holding managed parameters, outside ``torch.compile`` tracing."""
    if type(optimizer) is not MUON or torch.compiler.is_compiling():
        return False
    return any(_registry.record_of(p) is not None
               for group in optimizer.param_groups for p in group["params"])


def plan_of(optimizer: torch.optim.Optimizer) -> MuonPlan:
    """The cached plan, rebuilt (and checked, across ranks too) when the parameters change."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    signature = (_registry.wrap_generation[0], *map(id, params))
    cached = _registry.muon_plans.get(optimizer)
    if cached is not None and cached.signature == signature:
        return cached
    group_of = [group for group in optimizer.param_groups for _ in group["params"]]
    for i, p in enumerate(params):
        record = _registry.record_of(p)
        if record is None or p is not record.dist_param:
            raise ValueError(
                f"torch.optim.Muon holds parameters managed by fully_shard and parameter {i} "
                f"(shape {tuple(p.shape)}), which is not: its matrices would be orthogonalized "
                "by another rule. Give Muon only model.parameters() of fully_shard-wrapped "
                "modules (wrap the module that owns this matrix too), or use a separate "
                "torch.optim.Muon for the unmanaged ones. Nothing was changed"
            )
        if record.group.host_offload is not None:
            raise NotImplementedError(
                f"torch.optim.Muon: parameter '{record.fqn}' of {record.group.owner} is kept in "
                "host memory by offload_policy=CPUOffloadPolicy(), and Muon's whole-matrix "
                "exchange is not implemented for host buffers. Leave offload_policy unset, or "
                "use AdamW. Nothing was changed"
            )
        if p.ndim != 2:
            raise ValueError(
                f"torch.optim.Muon: parameter '{record.fqn}' of {record.group.owner} has shape "
                f"{tuple(p.shape)}; Muon takes 2-D parameters only (give the others to AdamW). "
                "Nothing was changed"
            )
    modes = [group.get("tp_mode", "whole") for group in group_of]
    for mode in modes:
        if mode not in TP_MODES:
            raise ValueError(
                f"torch.optim.Muon param group 'tp_mode' {mode!r}: use 'whole' (a tensor-"
                "parallel matrix orthogonalized as the global matrix, the default) or "
                "'per_shard' (each TP rank's shard on its own). Nothing was changed"
            )
    # The first collective: every local check has passed. Before the plan, whose TP blocks
    # are gathered.
    _check_agreement(params, group_of)
    whole = WholeMatrices(params, cost=newton_schulz_flops,
                          per_tp_shard=[mode == "per_shard" for mode in modes])
    plan = MuonPlan(signature, params, group_of, whole)
    _registry.muon_plans[optimizer] = plan
    return plan


def _check_agreement(params: list[torch.Tensor], group_of: list[dict[str, Any]]) -> None:
    """Every rank that exchanges with this one holds the same Muon: same matrices in the same
    order, the same static settings (one all-gather per process group, once per parameter
    set)."""
    described = []
    for p, group in zip(params, group_of):
        record = _registry.record_of(p)
        assert record is not None
        described.append((record.fqn, tuple(p.shape), tuple(repr(group[k]) for k in _STATIC_KEYS
                                                            if k in group)))
    digest = hashlib.sha256(repr(described).encode()).hexdigest()
    for process_group in _process_groups(params):
        digests: list[str | None] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(digests, digest, group=process_group)
        if len(set(digests)) > 1:
            differing = [dist.get_global_rank(process_group, r)
                         for r, d in enumerate(digests) if d != digests[0]]
            raise ValueError(
                "torch.optim.Muon differs between ranks that share these matrices (global ranks "
                f"{differing} differ from rank {dist.get_global_rank(process_group, 0)}): the "
                "same parameters, in the same param groups and order, with the same momentum, "
                "nesterov, ns_coefficients, ns_steps, eps and adjust_lr_fn on every rank. "
                "Nothing was changed"
            )


def _process_groups(params: list[torch.Tensor]) -> list[dist.ProcessGroup]:
    seen: dict[int, dist.ProcessGroup] = {}
    for p in params:
        record = _registry.record_of(p)
        assert record is not None
        groups = [record.group.process_group, *record.group.axis_process_groups.values()]
        if record.tp is not None:  # the exchange runs over the whole dp x TP mesh
            groups.append(whole_mesh_process_group(record.tp.dist_mesh,
                                                   group_timeout(record.group.process_group)))
        for process_group in groups:
            if dist.get_world_size(process_group) > 1:
                seen.setdefault(id(process_group), process_group)
    return list(seen.values())


def muon_closure(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None,
                 finish_gradients: Callable[[], None]) -> Callable[[], Any]:
    """The closure the pre-step hook gives ``optimizer.step``: the user's ``closure`` (forward
    and backward; then ``finish_gradients``, the reductions of a window it left open), the
    distributed step, then the managed gradients hidden from torch's loop. The plan (and its
    checks) comes first, so bad input changes nothing."""
    plan = plan_of(optimizer)

    def run() -> Any:
        loss = None
        if closure is not None:
            loss = closure()
            finish_gradients()
        with torch.no_grad():
            _step(optimizer, plan)
        hidden = [(p, p.grad) for p in plan.params if p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        _registry.muon_hidden_grads[optimizer] = hidden
        return loss

    return run


def restore_hidden_grads(optimizer: torch.optim.Optimizer) -> None:
    """After the step (or before the next, if it raised): the gradients torch's loop did not
    see are the parameters' again."""
    for p, grad in _registry.muon_hidden_grads.pop(optimizer, []):
        p.grad = grad


def _step(optimizer: torch.optim.Optimizer, plan: MuonPlan) -> None:
    updates: list[torch.Tensor] = []
    present: list[bool] = []
    aside: dict[int, torch.Tensor] = {}  # momentum computed with zeros for a None gradient
    for i, (p, group) in enumerate(zip(plan.params, plan.group_of)):
        grad = p.grad
        state = optimizer.state.get(p)
        buf = state.get("momentum_buffer") if state else None
        momentum = group["momentum"]
        if grad is not None:
            if buf is None:  # torch: zeros_like(p.grad), created at the first gradient
                buf = torch.zeros_like(grad, memory_format=torch.preserve_format)
                optimizer.state[p]["momentum_buffer"] = buf
            buf_rows, grad_rows = local_tensor(buf), local_tensor(grad)
            buf_rows.lerp_(grad_rows, 1 - momentum)
            update = grad_rows.lerp(buf_rows, momentum) if group["nesterov"] else buf_rows
        else:
            dtype = local_tensor(buf).dtype if buf is not None else p.dtype
            zeros = torch.zeros_like(local_tensor(p), dtype=dtype)
            buf_rows = (local_tensor(buf) if buf is not None else zeros).lerp(zeros, 1 - momentum)
            update = zeros.lerp(buf_rows, momentum) if group["nesterov"] else buf_rows
            aside[i] = buf_rows
        updates.append(update)
        present.append(grad is not None)
    wholes = plan.whole.to_owners(updates, present=present, dtype=torch.bfloat16)
    results = {}
    for i, whole in wholes.items():
        group = plan.group_of[i]
        results[i] = None if whole is None else torch_muon._zeropower_via_newtonschulz(
            whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
    rows = plan.whole.from_owners(results, dtype=torch.bfloat16)
    for i, (p, group, update_rows) in enumerate(zip(plan.params, plan.group_of, rows)):
        if update_rows is None:
            continue  # no rank had a gradient: torch skips the parameter
        if i in aside:
            _keep_momentum(optimizer, p, aside[i])
        lr = _to_scalar(group["lr"])
        adjusted_lr = torch_muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape)
        param_rows = local_tensor(p)
        param_rows.mul_(1 - lr * group["weight_decay"])
        param_rows.add_(update_rows, alpha=-adjusted_lr)


def _keep_momentum(optimizer: torch.optim.Optimizer, p: torch.Tensor,
                   buf_rows: torch.Tensor) -> None:
    buf = optimizer.state[p].get("momentum_buffer")
    if buf is not None:
        local_tensor(buf).copy_(buf_rows)
        return
    assert isinstance(p, DTensor)
    optimizer.state[p]["momentum_buffer"] = DTensor.from_local(
        buf_rows, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
