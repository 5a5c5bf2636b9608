"""Scratch buffers (ZeRO-3 gathered weights, reduce-scatter scratch) with storage freeing.

[Note: storage-freeing scratch buffers]
Each key owns one tensor object for its whole life; ``free`` shrinks the tensor's storage to zero
bytes and ``allocate`` grows it back. Views taken once (compute parameters' ``.data``, tensors
autograd saved for backward) stay attached to the same storage object, so they see the newly
gathered data after every re-allocation without being rebuilt. This is how a ZeRO-3 weight saved
in forward is valid again once the pre-backward all-gather refills its scratch buffer. On CUDA,
scratch buffers are allocated and freed on the caller stream and freed only after the collective
using them was waited on, so the caching allocator never hands memory to another stream while a
collective still reads it (see [Note: scratch buffers freed on another stream] for a caller stream
that changed).

[Note: scratch buffers freed on another stream]
The caller stream is not always the same between a scratch buffer's allocation and its free: a
backward run outside the stream its forward ran under executes the hooks inside backward on the
forward's stream S (the autograd engine runs each node, and its hooks, on its forward stream),
but the final callback on the stream ``backward()`` was called from, D. A scratch buffer allocated
on S and freed from D, after only D waited for its collective (and after D's copy-out read it),
would go back to S's pool at once: S could reuse the memory while the collective or the
copy-out still runs. So each scratch buffer remembers the stream it was allocated on, and a free
from another stream orders the reuse after everything that stream has queued so far (its wait for
the collective included): ``record_stream`` for a caching-allocator block (the allocator then
hands the block out again only after that stream's work up to the free is done), and, for a
view of the trace pool's arena, which the caching allocator never sees, the allocation stream
waits on the freeing one (the next scratch buffer in those bytes is allocated on one of the two).
CUDA only; never exercised on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["ScratchAllocator", "allocation_stream", "order_free_after_use"]


def allocation_stream(scratch: torch.Tensor) -> Any:
    """The stream ``scratch`` is allocated on now (the current stream of its CUDA device), None
    off CUDA."""
    return torch.cuda.current_stream(scratch.device) if scratch.is_cuda else None


def order_free_after_use(scratch: torch.Tensor, allocated_on: Any, freeing_on: Any,
                         in_arena: bool) -> None:
    """Before ``scratch`` (allocated on stream ``allocated_on``) is freed while ``freeing_on``
    is current: make reuse of its memory wait for ``freeing_on``'s queued work (see [Note:
    scratch buffers freed on another stream]). Nothing off CUDA or on the allocation stream."""
    if allocated_on is None or freeing_on is None or freeing_on == allocated_on:
        return
    if in_arena:
        allocated_on.wait_stream(freeing_on)
    else:
        scratch.record_stream(freeing_on)


class ScratchAllocator:
    """Storage-freeing allocator for scratch buffers, with live/peak byte accounting."""

    # Whether a key's scratch buffer may move between iterations (``TracePoolAllocator``); here it
    # never does, so views of a scratch buffer stay valid for the whole run.
    moves_scratch = False

    def __init__(self) -> None:
        self._scratch: dict[Hashable, torch.Tensor] = {}
        self._live: set[Hashable] = set()
        # The stream each live CUDA scratch buffer was allocated on (see [Note: scratch buffers
        # freed on another stream]).
        self._streams: dict[Hashable, Any] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The 1-D scratch buffer for ``key``, with its storage allocated (contents undefined)."""
        scratch = self._scratch.get(key)
        if scratch is not None and key in self._live and (
            scratch.numel() != numel or scratch.dtype != dtype
        ):
            self.free(key)  # replaced below: its bytes leave the accounting first
        if scratch is None or scratch.numel() != numel or scratch.dtype != dtype:
            # Never an inference tensor (it lives for the whole run), even when first needed
            # inside ``torch.inference_mode()``.
            with torch.inference_mode(False):
                scratch = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[key] = scratch
        elif key not in self._live:
            scratch.untyped_storage().resize_(numel * scratch.element_size())
        if key not in self._live:
            self._live.add(key)
            self.live_bytes += numel * scratch.element_size()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if scratch.is_cuda:
                self._streams[key] = allocation_stream(scratch)
        return scratch

    def _order_free(self, key: Hashable, scratch: torch.Tensor, in_arena: bool = False) -> None:
        """See [Note: scratch buffers freed on another stream]."""
        allocated_on = self._streams.pop(key, None)
        if allocated_on is not None:
            order_free_after_use(scratch, allocated_on, allocation_stream(scratch), in_arena)

    def adopt(self, other: ScratchAllocator) -> None:
        """Take over ``other``'s scratch buffers (the same tensor objects, so existing views stay
        valid)."""
        if other is self:
            return
        self._scratch.update(other._scratch)
        self._live |= other._live
        self.live_bytes += other.live_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        other._scratch, other._live, other.live_bytes = {}, set(), 0

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The tensor object for ``key`` (allocated or not), or None if never allocated."""
        return self._scratch.get(key)

    def is_allocated(self, key: Hashable) -> bool:
        return key in self._live

    def free(self, key: Hashable) -> None:
        """Release the storage of ``key``'s scratch buffer; the tensor object stays for reuse."""
        if key not in self._live:
            return
        scratch = self._scratch[key]
        self.live_bytes -= scratch.numel() * scratch.element_size()
        self._order_free(key, scratch)
        scratch.untyped_storage().resize_(0)
        self._live.discard(key)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    @property
    def arena_bytes(self) -> int:
        """Bytes held between iterations (the trace pool's arena); none here."""
        return 0

    def pin(self, key: Hashable) -> None:
        """Views of ``key``'s live scratch buffer were handed to autograd (compute parameters used
        in forward): it must get the same memory back when allocated again before the next
        iteration. Storage freeing always does; the trace pool needs to know (see
        [Note: trace-planned pool] in ``_trace_pool.py``)."""

    def begin_iteration(self) -> bool:
        """The root's pre-forward (the trace pool's iteration boundary). Returns whether
        scratch buffers may have moved (never here)."""
        return False

    def release(self) -> None:
        """Drop memory held between iterations (the trace pool's arena); none here."""
