"""Temporary buckets (ZeRO-3 gathered weights, reduce-scatter scratch) with storage freeing.

[Note: storage-freeing buckets]
Each key owns one tensor object for its whole life; ``free`` shrinks the tensor's storage to zero
bytes and ``allocate`` grows it back. Views taken once (compute parameters' ``.data``, tensors
autograd saved for backward) stay attached to the same storage object, so they see the newly
gathered data after every re-allocation without being rebuilt. This is how a ZeRO-3 weight saved
in forward is valid again once the pre-backward all-gather refills its bucket. On CUDA, buckets
are allocated and freed on the caller stream and freed only after the collective using them was
waited on, so the caching allocator never hands memory to another stream while a collective
still reads it.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

__all__ = ["BucketAllocator"]


class BucketAllocator:
    """Storage-freeing allocator for temporary buckets, with live/peak byte accounting."""

    # Whether a key's bucket may move between iterations (``TracePoolAllocator``); here it never
    # does, so views of a bucket stay valid for the whole run.
    moves_buckets = False

    def __init__(self) -> None:
        self._buckets: dict[Hashable, torch.Tensor] = {}
        self._live: set[Hashable] = set()
        self.live_bytes = 0
        self.peak_bytes = 0

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The 1-D bucket for ``key``, with its storage allocated (contents undefined)."""
        bucket = self._buckets.get(key)
        if bucket is not None and key in self._live and (
            bucket.numel() != numel or bucket.dtype != dtype
        ):
            self.free(key)  # replaced below: its bytes leave the accounting first
        if bucket is None or bucket.numel() != numel or bucket.dtype != dtype:
            # Never an inference tensor (it lives for the whole run), even when first needed
            # inside ``torch.inference_mode()``.
            with torch.inference_mode(False):
                bucket = torch.empty(numel, dtype=dtype, device=device)
            self._buckets[key] = bucket
        elif key not in self._live:
            bucket.untyped_storage().resize_(numel * bucket.element_size())
        if key not in self._live:
            self._live.add(key)
            self.live_bytes += numel * bucket.element_size()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return bucket

    def adopt(self, other: BucketAllocator) -> None:
        """Take over ``other``'s buckets (the same tensor objects, so existing views stay valid)."""
        if other is self:
            return
        self._buckets.update(other._buckets)
        self._live |= other._live
        self.live_bytes += other.live_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        other._buckets, other._live, other.live_bytes = {}, set(), 0

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The tensor object for ``key`` (allocated or not), or None if never allocated."""
        return self._buckets.get(key)

    def is_allocated(self, key: Hashable) -> bool:
        return key in self._live

    def free(self, key: Hashable) -> None:
        """Release the storage of ``key``'s bucket; the tensor object stays for reuse."""
        if key not in self._live:
            return
        bucket = self._buckets[key]
        self.live_bytes -= bucket.numel() * bucket.element_size()
        bucket.untyped_storage().resize_(0)
        self._live.discard(key)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    @property
    def arena_bytes(self) -> int:
        """Bytes held between iterations (the trace pool's arena); none here."""
        return 0

    def pin(self, key: Hashable) -> None:
        """Views of ``key``'s live bucket were handed to autograd (compute parameters used in
        forward): it must get the same memory back when allocated again before the next
        iteration. Storage freeing always does; the trace pool needs to know (see
        [Note: trace-planned pool] in ``_trace_pool.py``)."""

    def begin_iteration(self) -> bool:
        """The root's pre-forward (the trace pool's iteration boundary). Returns whether
        buckets may have moved (never here)."""
        return False

    def release(self) -> None:
        """Drop memory held between iterations (the trace pool's arena); none here."""
