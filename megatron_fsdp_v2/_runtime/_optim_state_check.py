"""The check in front of torch's full optimizer state dict (``get_optimizer_state_dict`` with
``full_state_dict=True``; installed by ``_torch_patches/_optim_state_dict.py``): torch gathers
each state tensor rank by rank, in the order of each rank's own ``optimizer.state``. A rank
whose shard of a parameter is empty holds a zero-row gradient of it, hence state (empty
tensors), like every other rank; but a parameter only some ranks used (or an optimizer loaded
with state on some ranks only) leaves the ranks pairing different tensors. Refused on every
rank, before any gather. It reads the records of the optimizer's parameters (their groups'
plans and process groups), hence its place in the runtime, beside the optimizer hooks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _registry
from .._buffers._plan import Extent
from .._dtensor._uneven_gather import ALTERNATIVE

__all__ = ["check_full_optim_state_dict"]


def check_full_optim_state_dict(optimizers: Any, info: Any) -> None:
    """Raise on every rank when a full optimizer state dict would pair different tensors (one
    small all-reduce per library process group); nothing for other state dicts."""
    if getattr(info, "full_state_dict", False) and getattr(info, "handle_optim", True):
        for optimizer in optimizers:
            _check_states_everywhere(optimizer)


def _check_states_everywhere(optimizer: torch.optim.Optimizer) -> None:
    """Raise on every rank when some rank lacks state for a sharded parameter others have."""
    # Per process group over which the parameters' shards differ: (name, has state), device.
    by_process_group: dict[Any, tuple[list[tuple[str, bool]], torch.device]] = {}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            record = _registry.record_of(param)
            if record is None or record.group.plan.optimizer_placement is Extent.FULL:
                continue
            entries, _ = by_process_group.setdefault(
                record.group.norm_process_group, ([], record.group.device)
            )
            entries.append((record.fqn, bool(optimizer.state.get(param))))
    for process_group, (entries, device) in by_process_group.items():
        flags = torch.tensor([int(has) for _, has in entries], dtype=torch.int64, device=device)
        lowest, highest = flags.clone(), flags.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=process_group)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=process_group)
        uneven = [name for (name, _), lo, hi in zip(entries, lowest.tolist(), highest.tolist())
                  if lo != hi]
        if uneven:
            raise NotImplementedError(
                f"get_optimizer_state_dict(full_state_dict=True): optimizer state of "
                f"{uneven[:3]}{' ...' if len(uneven) > 3 else ''} exists on some ranks only "
                "(a parameter some ranks did not use has no gradient and no optimizer state "
                "there), so torch would gather different tensors together; "
                f"nothing was gathered. {ALTERNATIVE}"
            )
