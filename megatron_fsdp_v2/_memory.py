"""``memory_report``: the bytes this rank holds per buffer role."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from . import _registry
from ._allocator import BucketAllocator

__all__ = ["MemoryReport", "memory_report"]


@dataclass
class MemoryReport:
    """Bytes this rank holds per buffer role, summed over the units of a module tree."""

    model_weights: int = 0
    main_weights: int = 0
    main_grads: int = 0
    temporary_peak: int = 0
    padding: int = 0
    padding_ratio: float = 0.0
    num_groups: int = 0

    @property
    def total(self) -> int:
        return self.model_weights + self.main_weights + self.main_grads + self.temporary_peak

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"model_weights={self.model_weights / mib:.2f}MiB main_weights="
            f"{self.main_weights / mib:.2f}MiB main_grads={self.main_grads / mib:.2f}MiB "
            f"temporary_peak={self.temporary_peak / mib:.2f}MiB padding={self.padding_ratio:.3%} "
            f"groups={self.num_groups}"
        )


def memory_report(module: nn.Module) -> MemoryReport:
    """Per-role bytes of every unit in ``module``'s tree (``main_grads`` at their size during the
    optimizer step; ``temporary_peak`` is the high-water mark of temporary buckets so far)."""
    report = MemoryReport()
    allocators: dict[int, BucketAllocator] = {}
    content = padded = 0
    for m in module.modules():
        state = _registry.state_of(m)
        if state is None:
            continue
        allocators[id(state.allocator)] = state.allocator
        for group in state.groups:
            sizes = group.memory_bytes()
            report.model_weights += sizes["model_weights"]
            report.main_weights += sizes["main_weights"]
            report.main_grads += sizes["main_grads"]
            report.padding += sizes["padding"]
            report.num_groups += 1
            content += group.layout.content_numel
            padded += group.layout.padding_numel
    report.temporary_peak = sum(a.peak_bytes for a in allocators.values())
    report.padding_ratio = padded / max(content, 1)
    return report
