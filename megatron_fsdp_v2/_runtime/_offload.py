"""CPU offload's copying path (``CPUOffloadPolicy`` on an accelerator mesh): the main weights,
the main gradients and so the optimizer state in host memory, this rank's shard copied to the
device for each all-gather and each reduced gradient shard copied back. A part of a
:class:`~._flat_param_group.FlatParamGroup` (``group.host_offload``), used by its weights
(``_compute_weights.py``) and gradients (``_grads.py``, ``_reduce.py``).

[Note: host offload]
FSDP2's ``CPUOffloadPolicy`` (``_fsdp_param.py``) keeps each sharded parameter and its gradient
on the CPU (pinned when ``pin_memory``), copies the shard host-to-device (non-blocking) into the
all-gather input before each all-gather, copies each reduce-scatter's output device-to-host
(non-blocking when pinned and not accumulating, else blocking, then a CPU add), and blocks the
host on an event once at the end of backward before the optimizer step reads the gradients.
Here, for ``optim_grads_params`` (ZeRO-3) on a 1-D mesh:

* the plan keeps no persistent device shard: ``main_weight`` is a buffer of its own in host
  memory (``Refresh.CAST_AT_GATHER``, ``model_weight`` empty), and the optimizer-facing DTensors
  view it, so the optimizer state torch creates with ``zeros_like`` is host memory too and the
  step runs on the CPU;
* before each all-gather (:meth:`HostOffload.copy_in_and_gather`) this rank's host shard is
  copied into its own slot of the device ``unsharded_model_weight`` scratch buffer (the copy
  casts to the compute dtype, as the refresh kernel would) and the slot is all-gathered in place:
  the same collective, on the same buffer, as without offload;
* after each reduce-scatter (:meth:`HostOffload.grad_to_host`) the reduced shard, a slot of the
  device ``staged_grad`` scratch buffer, is copied into ``main_grad`` in host memory: the
  first write of a window straight into it (non-blocking when pinned, an event recorded), later
  micro-batches through a host copy of the shard added with the copy-out kernel, as FSDP2;
* the end of each window (``GroupGrads._finish_window``) waits for the last event, the one host
  sync per group and backward that FSDP2 has too; the copies run on the current stream, which
  orders them after the kernels that produce their inputs and before the collectives (the
  issuer's stream waits on it) and the frees (the caching allocator is stream-ordered).

Elsewhere: ``clip_grad_norm_`` moves a host norm part to the group's device for its
all-reduce (``_clipping.py``); ``get_full_state_dict`` and ``iter_full_weights`` gather the host
main weights on the group's device. Refused on this path (``NotImplementedError``, before any
collective): HSDP meshes (the outer reductions would run on host buffers), FP8 all-gather
parameters, tensor-parallel DTensors, ``torch.optim.Muon`` (its exchange) and
``set_all_reduce_hook`` (its collective on host gradients).

No per-parameter loop and no host read of a value: one copy per group and gather, one per
group and reduction. On a CPU mesh every buffer already is host memory, so the policy takes
the no-copy path ([Note: CPU offload] in ``_frontend/_fsdp2_compat.py``) unless the test-only
switch :data:`FORCE_COPIES_ENV` is set: then the CPU mesh runs this path, with the host buffers
separate allocations, so its logic (which buffer is copied where, and when) is checked on a CPU
machine against the run without the policy; the non-blocking copies, pinning and events only
run on CUDA (``tests/distributed/test_cpu_offload.py``'s GPU test, ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import ops
from ._gather import gather_weights
from ._issuer import GroupIssuer, Pending

__all__ = ["FORCE_COPIES_ENV", "HostOffload", "OffloadConfig", "copies_forced"]

FORCE_COPIES_ENV = "MEGATRON_FSDP_V2_TEST_OFFLOAD_COPIES"
"""Test-only: ``"1"`` makes ``CPUOffloadPolicy`` on a CPU mesh take the copying path (read at
``fully_shard`` time; see [Note: host offload])."""


def copies_forced() -> bool:
    """Whether the test-only switch :data:`FORCE_COPIES_ENV` is set."""
    return os.environ.get(FORCE_COPIES_ENV) == "1"


@dataclass(frozen=True)
class OffloadConfig:
    """``CPUOffloadPolicy``'s resolved settings for a unit that takes the copying path."""

    pin_memory: bool


class HostOffload:
    """One group's host buffers and copies (see [Note: host offload])."""

    def __init__(self, config: OffloadConfig, device: torch.device) -> None:
        """``device``: the group's compute device (its mesh's), where the gathers and
        reductions run; ``meta`` while estimating, then the host buffers are meta too."""
        self.device = device
        # Pinning needs a CUDA driver and only helps host-device copies (FSDP2 pins whenever
        # asked, and fails without one).
        self.pinned = config.pin_memory and device.type == "cuda"
        # Non-blocking copies from or to pageable memory would be synchronous anyway.
        self.non_blocking = self.pinned
        self._copied: torch.cuda.Event | None = None  # the last non-blocking device-to-host copy

    def empty(self, numel: int, dtype: torch.dtype, zeros: bool = False) -> torch.Tensor:
        """A host buffer (pinned when asked and CUDA is the compute device); ``zeros``:
        zero-filled."""
        if self.device.type == "meta":  # the estimator: nothing allocated
            return torch.empty(numel, dtype=dtype, device="meta")
        alloc = torch.zeros if zeros else torch.empty
        return alloc(numel, dtype=dtype, device="cpu", pin_memory=self.pinned)

    def copy_in_and_gather(
        self, unsharded_model_weight: torch.Tensor, host_main_shard: torch.Tensor, offset: int,
        issuer: GroupIssuer, async_op: bool,
    ) -> Pending:
        """Copy this rank's host main shard into its own slot of the device scratch buffer
        (cast to its dtype; ``offset``: where the slot starts), then all-gather the slot in
        place."""
        own_slot = unsharded_model_weight[offset : offset + host_main_shard.numel()]
        own_slot.copy_(host_main_shard, non_blocking=self.non_blocking)
        return gather_weights(unsharded_model_weight, own_slot, issuer, async_op)

    def grad_to_host(self, reduced: torch.Tensor, host_target: torch.Tensor,
                     accumulate: bool) -> None:
        """Write (``accumulate``: add) the reduced device shard into ``host_target`` (the
        optimizer-facing part of ``main_grad``), cast to its dtype: the same values as the
        copy-out kernel gives on the device."""
        if not accumulate and reduced.dtype == host_target.dtype:
            host_target.copy_(reduced, non_blocking=self.non_blocking)
            if self.non_blocking:
                # The scratch buffer ``reduced`` views is freed next: keep its memory from
                # other streams until the copy ran, and let the window's end wait for it.
                reduced.record_stream(torch.cuda.current_stream())
                event = torch.cuda.Event()
                event.record()
                self._copied = event
            return
        # The CPU add needs the values now: a blocking copy (FSDP2 blocks here too). A CPU
        # "device" (the forced test path) copies, so the add reads a host buffer of its own.
        staged = reduced.to("cpu", copy=True)
        self.wait_for_copies()  # an earlier non-blocking write into host_target
        ops.reduce_scatter_copy_out_(staged, host_target, accumulate=accumulate)

    def wait_for_copies(self) -> None:
        """Block the host until the last non-blocking device-to-host copy ran (before the
        optimizer, clipping or the user read the host gradients)."""
        event, self._copied = self._copied, None
        if event is not None:
            event.synchronize()
