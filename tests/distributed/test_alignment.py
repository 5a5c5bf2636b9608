"""Every pointer a kernel or NCCL gets from the flat buffers is 16-byte aligned (issue 23, item 4).

A model whose first parameter is an odd-length vector, with odd row sizes and more odd vectors
after it: packed back to back, they would move later views, shards and collective slots off
16 bytes (see [Note: row-aligned flat buffers] in ``_layout.py``). For every strategy at world 2
and 3 the test trains it and checks, on every rank:

* each buffer role's base (``model_weight``, ``main_weight``, ``main_grad``);
* each optimizer-facing local tensor and its gradient's local tensor (a ``main_grad`` view);
* each compute parameter as the module's forward sees it (a forward pre-hook on the leaf
  modules: views of ``model_weight`` or of the gathered bucket);
* each collective's tensors and every rank's slot start (the three functions of
  ``_collectives.py`` all flat-buffer collectives go through, patched to record them);

in fp32, and with bf16 compute weights, a bf16 communication dtype, the trace pool and both
bucket options (coalesced reductions and refreshes), where the roles have different dtypes and
the buckets hold several groups at element offsets. Training matches single-process torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

# private: records the buffer sizes the flat collectives are called with
from megatron_fsdp_v2._comm import _collectives as comm

# private: the units' parameter groups and their flat-buffer row layout
from megatron_fsdp_v2._registry import state_of

from _models import agree, assert_close_to_reference, reference_copy
from _pool import RankPools

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
VARIANTS = ["fp32", "bf16-pool-buckets"]
TIMEOUT_S = 240
ALIGN_BYTES = 16


class OddFirst(nn.Module):
    """An odd-length vector first in parameter order, then odd row sizes (5, 12, 19, 9) and
    odd-length vectors (7, 9, 3): none of them is a multiple of 16 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.router_bias = nn.Parameter(0.1 * torch.randn(7))
        self.first = nn.Linear(5, 7)
        self.emb = nn.Embedding(53, 12)
        self.ln = nn.LayerNorm(12)
        self.mix = nn.Linear(12 + 7, 9)
        self.out = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.ln(self.emb(idx)), torch.tanh(self.first(x) + self.router_bias)], -1)
        return self.out(torch.tanh(self.mix(h)))


class Misaligned:
    """What was found misaligned, kept until every rank can agree on it (a hook that raised on
    one rank would leave the others in a collective)."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.checked = 0

    def check(self, what: str, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if tensor.numel() == 0:
            return  # nothing is read through an empty view
        self.checked += 1
        if tensor.data_ptr() % ALIGN_BYTES:
            self.found.append(f"{what}: data_ptr {tensor.data_ptr()} % {ALIGN_BYTES} = "
                              f"{tensor.data_ptr() % ALIGN_BYTES} ({tensor.dtype})")

    def check_slots(self, what: str, full: torch.Tensor, slot_numel: int) -> None:
        """Every rank's slot of ``full`` starts ``slot_numel`` elements after the previous."""
        self.check(what, full)
        if slot_numel * full.element_size() % ALIGN_BYTES:
            self.found.append(f"{what}: slots of {slot_numel} x {full.dtype} elements")


@contextmanager
def collectives_checked(seen: Misaligned) -> Iterator[None]:
    """Record the tensors of every flat-buffer collective while the block runs."""
    originals = comm.all_gather_into, comm.reduce_scatter_into, comm.all_reduce_inplace

    def all_gather_into(output: torch.Tensor, shard: torch.Tensor, *a: Any, **kw: Any) -> Any:
        seen.check("all-gather input", shard)
        seen.check_slots("all-gather output", output, shard.numel())
        return originals[0](output, shard, *a, **kw)

    def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, *a: Any, **kw: Any) -> Any:
        seen.check("reduce-scatter output", output)
        seen.check_slots("reduce-scatter input", full, output.numel())
        return originals[1](output, full, *a, **kw)

    def all_reduce_inplace(buffer: torch.Tensor, *a: Any, **kw: Any) -> Any:
        seen.check("all-reduce buffer", buffer)
        return originals[2](buffer, *a, **kw)

    comm.all_gather_into = all_gather_into  # type: ignore[assignment]
    comm.reduce_scatter_into = reduce_scatter_into  # type: ignore[assignment]
    comm.all_reduce_inplace = all_reduce_inplace  # type: ignore[assignment]
    try:
        yield
    finally:
        comm.all_gather_into, comm.reduce_scatter_into, comm.all_reduce_inplace = originals


def check_buffers(model: nn.Module, seen: Misaligned, when: str) -> None:
    """Buffer bases, optimizer-facing local tensors and their gradients' local tensors."""
    for module in model.modules():
        state = state_of(module)
        if state is None:
            continue
        for group in state.groups:
            seen.check(f"{when} {group.name} model_weight", group.model_weight)
            seen.check(f"{when} {group.name} main_weight", group.main_weight)
            main_grad = group.grads._main_grad
            if main_grad is not None and main_grad.untyped_storage().nbytes():
                seen.check(f"{when} {group.name} main_grad", main_grad)
            for record in group.records:
                seen.check(f"{when} {record.fqn} optimizer-facing", record.dist_param)
                if record.dist_param.grad is not None:
                    seen.check(f"{when} {record.fqn} grad (main_grad view)",
                               record.dist_param.grad)


def compute_view_hooks(model: nn.Module, seen: Misaligned) -> Callable[[], None]:
    """Check the compute parameters each leaf module's forward reads; returns the remover."""
    handles = []
    for name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params or name == "":
            continue

        def hook(mod: nn.Module, args: Any, name: str = name) -> None:
            for pname, p in mod.named_parameters(recurse=False):
                seen.check(f"forward {name}.{pname} compute view", p)

        handles.append(module.register_forward_pre_hook(hook))
    # The root's own parameter (router_bias) is read in the root's forward, after its hooks.
    handles.append(model.register_forward_pre_hook(
        lambda mod, args: seen.check("forward router_bias compute view", mod.router_bias)
    ))
    return lambda: [h.remove() for h in handles]  # type: ignore[func-returns-value]


def _batches(world: int, steps: int, micro: int) -> list[list[list[tuple[torch.Tensor, ...]]]]:
    """batches[step][micro][rank]: (x, idx, y), the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [[[(torch.randn(2, 5, generator=g), torch.randint(0, 53, (2,), generator=g),
               torch.randn(2, 3, generator=g)) for _ in range(world)] for _ in range(micro)]
            for _ in range(steps)]


def _worker(rank: int, world: int, strategy: str, variant: str) -> None:
    torch.manual_seed(0)
    model = OddFirst()
    ref = reference_copy(model)
    options: dict[str, Any] = dict(sharding_strategy=strategy, timeout=60.0)
    if variant != "fp32":
        options.update(
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.bfloat16),
            enable_trace_pool=True, reduce_bucket_size_mb=1.0, refresh_bucket_size_mb=1.0,
        )
    fully_shard(model.mix, **options)
    fully_shard(model.out, **options)
    fully_shard(model, **options)
    seen = Misaligned()
    check_buffers(model, seen, "after wrap")
    remove_hooks = compute_view_hooks(model, seen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    steps, micro = 3, 2
    losses, ref_losses = [], []
    with collectives_checked(seen):
        for step_batches in _batches(world, steps, micro):
            total = ref_total = 0.0
            for i, parts in enumerate(step_batches):
                model.set_is_last_backward(i == micro - 1)
                x, idx, y = parts[rank]
                loss = F.mse_loss(model(x, idx).float(), y) / micro
                loss.backward()
                total += loss.item()
                ref_x, ref_idx, ref_y = (torch.cat(t) for t in zip(*parts))
                ref_loss = F.mse_loss(ref(ref_x, ref_idx), ref_y) / micro
                ref_loss.backward()
                ref_total += ref_loss.item()
            check_buffers(model, seen, f"after backward {len(losses)}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            losses.append(total)
            ref_losses.append(ref_total)
        # The refresh after the last step (optim, optim_grads) runs in this forward.
        model(*step_batches[0][rank][:2])
    remove_hooks()
    check_buffers(model, seen, "end")
    case = f"{strategy} {variant} world={world} rank={rank}"

    def aligned() -> None:
        assert seen.checked > 0, f"{case}: nothing was checked"
        assert not seen.found, f"{case}: misaligned: " + "; ".join(seen.found[:8])

    agree("16-byte alignment", aligned)
    # Each rank's loss is its own micro-batches'; their mean over ranks is the global batch's.
    mean_losses = torch.tensor(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    tol = (1e-5, 1e-6) if variant == "fp32" else (5e-2, 2e-2)  # bf16 compute and communication
    agree("losses match single-process torch", lambda: torch.testing.assert_close(
        mean_losses, torch.tensor(ref_losses), rtol=tol[0], atol=tol[1]))
    agree("parameters match single-process torch",
          lambda: assert_close_to_reference(model, ref, rtol=tol[0], atol=tol[1]))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"w{w}")
def test_every_view_and_slot_is_16_byte_aligned(ranks: RankPools, world_size: int,
                                                strategy: str, variant: str) -> None:
    ranks.run(_worker, world_size, strategy, variant, timeout_s=TIMEOUT_S)
