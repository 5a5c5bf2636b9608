"""What a process group's backends can carry: which backend runs its collectives on tensors of
each device type, and on which device the library puts the tensors it communicates itself.

[Note: backend detection]
``dist.get_backend(group)`` returns the string the group was created with, which says little:
``init_process_group()`` with no backend stores ``"undefined"``, and device-qualified strings
(``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``) are kept verbatim, so comparing it with ``"nccl"``
misses all of them. ``dist.get_backend_config(group)`` is torch's resolved map, always
``"<device>:<backend>"`` pairs: ``"nccl"`` is ``"cuda:nccl"``, ``"gloo"`` is
``"cpu:gloo,cuda:gloo"`` (on every machine, GPU or not), ``"undefined"`` is the detected
accelerator's default (``"cuda:nccl"`` on a GPU machine, ``"cpu:gloo"`` without one), and a
device-qualified string is itself. The library asks every backend question through this module,
which reads that map and nothing else.

A group *moves CUDA tensors natively* when its backend for ``cuda`` is not the one that also
serves ``cpu``: NCCL, or a plugin registered for CUDA only. Gloo (likewise MPI, UCC) lists
``cuda`` too, but copies CUDA tensors through host memory; a job that picked such a backend for
every device picked host collectives (tests, CPU training, several ranks sharing one GPU), and
gets CPU placement from the library unless it passes a CUDA mesh itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "backend_for", "backend_impl", "collective_device", "collective_device_type",
    "device_backends", "group_timeout", "moves_cuda_natively", "parse_backend_config",
]


def parse_backend_config(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}`` (lower case), the form
    ``dist.get_backend_config`` returns. ``ValueError`` for an entry that is not
    ``device:backend``, or a device named twice."""
    backends: dict[str, str] = {}
    for entry in config.lower().split(","):
        device, sep, backend = (part.strip() for part in entry.partition(":"))
        if not sep or not device or not backend or ":" in backend:
            raise ValueError(
                f"backend config {config!r}: entry {entry!r} is not 'device:backend' (expected "
                "the form torch.distributed.get_backend_config returns, e.g. "
                "'cpu:gloo,cuda:nccl')"
            )
        if device in backends:
            raise ValueError(f"backend config {config!r} names device {device!r} twice")
        backends[device] = backend
    return backends


def moves_cuda_natively(backends: Mapping[str, str]) -> bool:
    """Whether a group with these per-device ``backends`` has a CUDA backend of its own (not the
    one that serves CPU tensors too): see ``[Note: backend detection]``."""
    cuda = backends.get("cuda")
    return cuda is not None and cuda != backends.get("cpu")


def device_backends(process_group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """``process_group``'s backend per device type (``None``: the default group)."""
    return parse_backend_config(str(dist.get_backend_config(process_group)))


def backend_for(process_group: dist.ProcessGroup | None, device_type: str) -> str:
    """The backend that runs ``process_group``'s collectives on tensors of ``device_type``; ``""``
    when the group has none for it."""
    return device_backends(process_group).get(device_type, "")


def collective_device_type(process_group: dist.ProcessGroup | None = None) -> str:
    """``"cuda"`` when ``process_group`` moves CUDA tensors natively and this process can use CUDA,
    else ``"cpu"``: the device type of the default mesh, and of the tensors the library
    communicates on its own (a checkpoint broadcast, a clipping scalar)."""
    if moves_cuda_natively(device_backends(process_group)) and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def collective_device(process_group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of :func:`collective_device_type`: the current CUDA device, or the CPU."""
    if collective_device_type(process_group) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_impl(process_group: dist.ProcessGroup, device: torch.device) -> Any:
    """The backend object (``ProcessGroupGloo``, ``ProcessGroupNCCL``, ...) that runs
    ``process_group``'s collectives on ``device``: ``dist.get_backend_impl`` where torch has it
    (2.14), else the group's ``_get_backend``."""
    get_impl = getattr(dist, "get_backend_impl", None)
    if get_impl is not None:
        return get_impl(process_group, device)
    return process_group._get_backend(device)


def group_timeout(process_group: dist.ProcessGroup) -> timedelta | None:
    """The timeout ``process_group``'s backends run collectives with; ``None`` when it cannot be
    read or its backends differ. torch has no public getter: each backend's ``options._timeout``."""
    timeouts = set()
    for device_type in device_backends(process_group):
        try:
            timeouts.add(backend_impl(process_group, torch.device(device_type)).options._timeout)
        except (AttributeError, RuntimeError, ValueError):
            return None
    return timeouts.pop() if len(timeouts) == 1 else None
