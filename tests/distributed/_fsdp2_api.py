"""What the ``test_fsdp2_api_*`` files share: a small model with its single-process reference,
the batches, a training loop that counts collectives with ``CollectiveCounts``
(``_comm_counts.py``), and the checks.

Distributed cases train on gloo ranks against a single-process reference that sees the same
global batch (every rank feeds the whole batch, so averaged gradients equal the reference's), and
where useful against FSDP2 itself (``torch.distributed.fsdp.fully_shard``) on the same input.
Workers collect their findings and return them; the assertions run in the test process, after
every rank finished.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import fully_shard

# private: tells our parameters from FSDP2's (record_of) and counts the units' parameter groups
from megatron_fsdp_v2._registry import record_of, state_of

from _comm_counts import CollectiveCounts

# The tests' model (inp -> Linear+Tanh blocks -> out), imported from here as ``Net``.
from _models import LinearTanhStack as Net
from _models import shard_rows

TIMEOUT_S = 240  # per case, generous: the CPUs are shared


# ---------------------------------------------------------------------- model and helpers

def _net(seed: int = 0) -> tuple[Net, Net]:
    torch.manual_seed(seed)
    model = Net()
    return model, copy.deepcopy(model)


def _wrap(model: nn.Module, wrap: Any = fully_shard, **kw: Any) -> None:
    for block in model.blocks:  # type: ignore[attr-defined]
        wrap(block, **kw)
    wrap(model, **kw)


def _batches(steps: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g))
             for _ in range(micro)] for _ in range(steps)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _param_errors(model: nn.Module, ref: nn.Module, rtol: float = 1e-5,
                  atol: float = 1e-6) -> list[str]:
    """This rank's shard of each parameter against the reference's rows."""
    errors = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = ref_params[name].detach()
        if isinstance(p, DTensor) and record_of(p) is None:  # FSDP2's: a collective
            local, want = p.full_tensor().detach(), full
        elif isinstance(p, DTensor):
            lo, hi = shard_rows(p)
            local, want = p.to_local().detach(), full[lo:hi]
        else:
            local, want = p.detach(), full
        try:
            torch.testing.assert_close(local.float(), want.float(), rtol=rtol, atol=atol)
        except AssertionError as e:
            errors.append(f"{name}: {e}")
    return errors


def _count(comm: CollectiveCounts, *names: str) -> int:
    counts = comm.get_comm_counts()
    return sum(v for k, v in counts.items() if str(k).split(".")[-1].rstrip("_") in names)


def _gathers(comm: CollectiveCounts) -> int:
    return _count(comm, "_allgather_base", "all_gather_into_tensor",
                  "allgather_into_tensor_coalesced")


def _reduce_scatters(comm: CollectiveCounts) -> int:
    return _count(comm, "_reduce_scatter_base", "reduce_scatter_tensor",
                  "reduce_scatter_tensor_coalesced")


def _n_groups(model: nn.Module) -> int:
    return sum(len(s.groups) for m in model.modules() if (s := state_of(m)) is not None)


def _train(model: nn.Module, ref: nn.Module, steps: int, micro: int, *, count_step: int = -1,
           between: Any = None) -> dict[str, Any]:
    """AdamW on both; ``micro`` micro-batches per step, the non-last ones marked with
    ``set_requires_gradient_sync(False)``. ``between(model, ref)`` runs after each non-last
    micro-batch. Returns both loss curves, the collectives of step ``count_step`` and
    parameter mismatches after each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, ref_losses, errors = [], [], []
    counts = None
    for step, parts in enumerate(_batches(steps, micro)):
        comm = CollectiveCounts()
        with comm if step == count_step else _null():
            for i, batch in enumerate(parts):
                model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
                loss = _loss(model, batch) / micro
                loss.backward()
                ref_loss = _loss(ref, batch) / micro
                ref_loss.backward()
                losses.append(loss.item())
                ref_losses.append(ref_loss.item())
                if between is not None and i < micro - 1:
                    between(model, ref)
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == count_step:
            counts = (_gathers(comm), _reduce_scatters(comm))
        errors += [f"step {step}: {e}" for e in _param_errors(model, ref)]
    return {"losses": losses, "ref_losses": ref_losses, "counts": counts, "errors": errors,
            "groups": _n_groups(model)}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def _check_training(results: list[dict[str, Any]], rtol: float = 1e-5) -> None:
    for rank, r in enumerate(results):
        assert not r["errors"], f"rank {rank}: " + "\n".join(r["errors"][:5])
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=rtol, atol=1e-7,
                                   msg=lambda m: f"rank {rank} losses: {m}")
