"""A managed parameter's record (:class:`ParamRecord`: its names, its compute and
optimizer-facing objects, its place in a flat group) and the device a mesh's buffers live on.
Kept apart from ``_flat_param_group.py`` so that modules which only read records (the registered
parameters, the registry, the extension gathers, clipping) need not import the group."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._buffers._layout import ItemLayout
from .._buffers._plan import Extent
from .._dtensor._row_layout import RowLayout
from .._dtensor._tp_params import TPFace

if TYPE_CHECKING:
    from ._flat_param_group import FlatParamGroup

__all__ = ["ParamRecord", "contiguous_stride", "mesh_device"]


@dataclass(eq=False)
class ParamRecord:
    """One managed parameter (FSDP2's ``FSDPParam``): its names, its two faces and its place."""

    fqn: str  # relative to the unit's module
    group: FlatParamGroup
    index: int  # in the group
    item: ItemLayout
    compute_param: nn.Parameter  # the module's original object; autograd sees it in forward
    dist_param: nn.Parameter  # the optimizer-facing DTensor parameter
    local_rows: tuple[int, int]  # dim-0 rows (of the TP-local tensor, if tp) of the local shard
    tp: TPFace | None = None  # a tensor-parallel parameter (see [Note: 2-D parameters])

    @functools.cached_property
    def row_layout(self) -> RowLayout:
        """This parameter's rows on this rank, the value the DTensor paths of state dicts and
        checkpoints take (built once: the group's plan and layout never change)."""
        group = self.group
        placements = tuple(group._placements)
        if self.tp is not None:
            placements = self.tp.dist_placements(placements)
        return RowLayout(
            row_sharded=group.plan.optimizer_placement is not Extent.FULL,
            rows=self.local_rows,
            shape=self.item.shape if self.tp is None else self.tp.shape,
            placements=placements,
            tp_offsets=None if self.tp is None else self.tp.tp_offsets(),
        )


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's buffers live on for ``mesh`` (the current CUDA device for a
    ``cuda`` mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a zero-size dim counts as 1)."""
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
