"""``memory_report``: the bytes this rank holds per buffer role (and, if asked, per optimizer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import _registry
from .._buffers._allocator import ScratchAllocator

__all__ = ["MemoryReport", "memory_report"]


@dataclass
class MemoryReport:
    """Bytes this rank holds per buffer role, summed over the units of a module tree.

    ``main_weights`` counts only main weights in buffers of their own (a main dtype that differs
    from the compute dtype). Where the main dtype equals the compute dtype the main weights are
    views of the model-weight buffer (the rank's rows of it), already counted in
    ``model_weights``; their bytes are in ``main_weights_aliased`` instead, so that
    ``main_weights=0`` is not mistaken for missing weights. ``optimizer_state`` is filled only
    when ``memory_report`` is given the optimizer.
    """

    model_weights: int = 0
    main_weights: int = 0
    main_grads: int = 0
    temporary_peak: int = 0
    padding: int = 0
    padding_ratio: float = 0.0
    num_groups: int = 0
    # After the original fields, so positional construction keeps its meaning.
    main_weights_aliased: int = 0
    optimizer_state: int = 0
    # The trace pool's arenas (enable_trace_pool=True): held between steps; the scratch buffers
    # served from them are also counted, as the storage-freeing allocator would hold them, in
    # temporary_peak. 0 without the trace pool or before its first plan.
    trace_pool_arena: int = 0
    # FP8 parameters (FSDP2's all-gather extensions, torchao float8): the persistent replicated
    # FP8 buffers of optim/optim_grads (already part of model_weights; ZeRO-3's FP8 scratch
    # buffers are in temporary_peak), and the bytes of the tensors the parameters hold outside
    # the flat buffers (torchao's per-weight scales), each storage once.
    fp8_weights: int = 0
    fp8_scales: int = 0
    def __post_init__(self) -> None:
        # Where the bytes live (``host_bytes``, set by memory_report) is not a field: it depends
        # on the mesh's device, not on the plan, so the fields (which the estimator reproduces
        # on meta buffers, compared with asdict against real runs) leave it out.
        self._host_bytes = 0
        self._offloaded_bytes = 0

    @property
    def total(self) -> int:
        """Bytes held, each byte once: aliased main weights are not added again; temporaries
        count as the larger of ``temporary_peak`` and ``trace_pool_arena``."""
        return (self.model_weights + self.main_weights + self.main_grads
                + max(self.temporary_peak, self.trace_pool_arena) + self.optimizer_state
                + self.fp8_scales)

    @property
    def host_bytes(self) -> int:
        """The part of ``total`` in host (CPU) memory: every byte of a unit on a CPU mesh,
        what ``CPUOffloadPolicy`` keeps there on an accelerator mesh (:attr:`offloaded_bytes`),
        and optimizer state kept on the CPU (AdamW's ``step`` scalars, for one). In an estimate
        (meta buffers; it models accelerator runs) :attr:`offloaded_bytes`."""
        return self._host_bytes

    @property
    def offloaded_bytes(self) -> int:
        """The part of ``total`` that ``CPUOffloadPolicy``'s copying path keeps in host memory
        (see [Note: host offload] in ``_offload.py``): the main weights and main gradients of
        its groups, and (given the optimizer) their optimizer state. 0 without the policy, and
        on a CPU mesh without the test-only switch (there it changes no buffer)."""
        return self._offloaded_bytes

    @property
    def device_bytes(self) -> int:
        """The part of ``total`` in accelerator memory (``total - host_bytes``)."""
        return self.total - self.host_bytes

    def __str__(self) -> str:
        mib = 1 << 20
        if self.main_weights_aliased and not self.main_weights:
            main = "aliases model_weights"
        elif self.main_weights_aliased:  # some groups alias, others have their own buffers
            main = (f"{self.main_weights / mib:.2f}MiB(+{self.main_weights_aliased / mib:.2f}MiB "
                    "aliasing model_weights)")
        else:
            main = f"{self.main_weights / mib:.2f}MiB"
        optim = (f"optimizer_state={self.optimizer_state / mib:.2f}MiB "
                 if self.optimizer_state else "")
        arena = (f"trace_pool_arena={self.trace_pool_arena / mib:.2f}MiB "
                 f"(storage-freeing peak {self.temporary_peak / mib:.2f}MiB) "
                 if self.trace_pool_arena else "")
        fp8 = (f"(of which fp8_weights={self.fp8_weights / mib:.2f}MiB) "
               f"fp8_scales={self.fp8_scales}B " if self.fp8_weights or self.fp8_scales else "")
        return (
            f"model_weights={self.model_weights / mib:.2f}MiB {fp8}main_weights={main} "
            f"main_grads={self.main_grads / mib:.2f}MiB {optim}"
            f"temporary_peak={self.temporary_peak / mib:.2f}MiB {arena}"
            f"padding={self.padding_ratio:.3%} groups={self.num_groups}"
        )


def memory_report(module: nn.Module, optimizer: torch.optim.Optimizer | None = None
                  ) -> MemoryReport:
    """Per-role bytes of every unit in ``module``'s tree (``main_grads`` at their size during the
    optimizer step; ``temporary_peak`` is the high-water mark of scratch buffers so far;
    ``trace_pool_arena`` the trace pool's arenas, see [Note: trace-planned pool]).

    With ``optimizer``, ``optimizer_state`` is the bytes of the tensors in its state for the
    parameters these units manage (this rank's local shards: AdamW's moments of a sharded
    parameter count its local rows only), as they are now: the state exists after the first
    ``optimizer.step()``. State of parameters outside ``module``'s units is not counted.
    """
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"memory_report(optimizer=...) takes a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    report = MemoryReport()
    allocators: dict[int, ScratchAllocator] = {}
    host_allocators: set[int] = set()  # those of units on a CPU mesh (their scratch is host)
    host = 0  # bytes in host memory (MemoryReport.host_bytes)
    offloaded = 0  # of which CPUOffloadPolicy's copying path put there
    offloaded_params: list[torch.Tensor] = []
    content = padded = 0
    managed: list[torch.Tensor] = []
    scale_storages: dict[int, int] = {}  # storage -> bytes: torchao stacks all scales in one
    host_scale_storages: set[int] = set()
    for _, state in _registry.unit_states(module):
        allocators[id(state.allocator)] = state.allocator
        for group in state.groups:
            sizes = group.memory_bytes()
            report.model_weights += sizes["model_weights"]
            report.main_weights += sizes["main_weights"]
            report.main_grads += sizes["main_grads"]
            report.padding += sizes["padding"]
            if group.host_offload is not None:  # main weights and gradients in host memory
                offloaded += sizes["main_weights"] + sizes["main_grads"]
                offloaded_params += group.dist_params
            if group.device.type == "cpu":  # the rest of a group's buffers share its device
                host += (sizes["model_weights"] + sizes["main_weights"]
                                      + sizes["main_grads"])
                host_allocators.add(id(state.allocator))
            elif group.host_offload is not None:
                host += sizes["main_weights"] + sizes["main_grads"]
            report.num_groups += 1
            if not group.plan.main_weight_separate:
                report.main_weights_aliased += (
                    group.main_weight.numel() * group.main_weight.element_size()
                )
            content += group.layout.content_numel
            padded += group.layout.padding_numel
            managed += group.dist_params
            if group.extension is not None:
                report.fp8_weights += group.extension.persistent_bytes()
                for t in group.extension.side_tensors():
                    storage = t.untyped_storage()
                    scale_storages[storage._cdata] = storage.nbytes()
                    if t.device.type == "cpu":
                        host_scale_storages.add(storage._cdata)
    report.fp8_scales = sum(scale_storages.values())
    host += sum(scale_storages[k] for k in host_scale_storages)
    report.temporary_peak = sum(a.peak_bytes for a in allocators.values())
    report.trace_pool_arena = sum(a.arena_bytes for a in allocators.values())
    # ``total`` counts the larger of the two per report; per allocator is at most that.
    host += min(
        sum(max(a.peak_bytes, a.arena_bytes) for k, a in allocators.items()
            if k in host_allocators),
        max(report.temporary_peak, report.trace_pool_arena),
    )
    report.padding_ratio = padded / max(content, 1)
    if optimizer is not None:
        report.optimizer_state, host_state = _optimizer_state_bytes(optimizer, managed)
        host += host_state
        offloaded += _optimizer_state_bytes(optimizer, offloaded_params)[0]
    report._host_bytes = host  # not fields (see MemoryReport.__post_init__)
    report._offloaded_bytes = offloaded
    return report


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
                           ) -> tuple[int, int]:
    """Bytes of the state tensors ``optimizer`` keeps for ``params`` on this rank (DTensor
    state: its local shard; scalars such as AdamW's ``step`` included), and how many of them
    are in host memory."""
    total = host = 0
    for param in params:
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                nbytes = local.numel() * local.element_size()
                total += nbytes
                if local.device.type == "cpu":
                    host += nbytes
    return total, host
