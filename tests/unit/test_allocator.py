"""The storage-freeing scratch buffer allocator
(``megatron_fsdp_v2._buffers._allocator.ScratchAllocator``).

Contract ([Note: storage-freeing scratch buffers]): one tensor object per key for its whole life;
``free`` shrinks its storage to zero bytes and ``allocate`` grows it back, so views taken once stay
attached and see the new contents; live/peak byte accounting; never an inference tensor.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable

import torch

from megatron_fsdp_v2._buffers._allocator import ScratchAllocator, order_free_after_use

CPU = torch.device("cpu")


def live_storage_bytes(alloc: ScratchAllocator, keys: Iterable[Hashable]) -> int:
    total = 0
    for key in keys:
        scratch = alloc.get(key)
        if scratch is not None and alloc.is_allocated(key):
            total += scratch.untyped_storage().nbytes()
    return total


def test_allocate_returns_a_1d_bucket_and_counts_bytes() -> None:
    alloc = ScratchAllocator()
    assert alloc.live_bytes == 0 and alloc.peak_bytes == 0
    assert alloc.get("a") is None and not alloc.is_allocated("a")
    a = alloc.allocate("a", 10, torch.float32, CPU)
    assert a.shape == (10,) and a.dtype == torch.float32 and a.device == CPU
    assert a.untyped_storage().nbytes() == 40
    assert alloc.is_allocated("a") and alloc.get("a") is a
    assert alloc.live_bytes == 40 and alloc.peak_bytes == 40
    b = alloc.allocate(("b", 1), 8, torch.bfloat16, CPU)
    assert b.dtype == torch.bfloat16
    assert alloc.live_bytes == 56 and alloc.peak_bytes == 56
    # Allocating a live key again returns the same tensor and counts nothing.
    assert alloc.allocate("a", 10, torch.float32, CPU) is a
    assert alloc.live_bytes == 56 and alloc.peak_bytes == 56


def test_free_releases_storage_but_keeps_the_tensor_object() -> None:
    alloc = ScratchAllocator()
    a = alloc.allocate("a", 16, torch.float32, CPU)
    alloc.allocate("b", 4, torch.float64, CPU)
    alloc.free("a")
    assert not alloc.is_allocated("a") and alloc.get("a") is a
    assert a.untyped_storage().nbytes() == 0
    assert alloc.live_bytes == 32 and alloc.peak_bytes == 96
    alloc.free("a")  # freeing a free key is a no-op
    alloc.free("never-allocated")
    assert alloc.live_bytes == 32
    assert alloc.allocate("a", 16, torch.float32, CPU) is a
    assert a.untyped_storage().nbytes() == 64
    assert alloc.live_bytes == 96 and alloc.peak_bytes == 96


def test_views_stay_attached_after_free_and_allocate() -> None:
    """What ZeRO-3 relies on: compute parameters and saved tensors are views of the scratch
    buffer."""
    alloc = ScratchAllocator()
    scratch = alloc.allocate("w", 12, torch.float32, CPU)
    scratch.copy_(torch.arange(12.0))
    weight = scratch[4:10].view(2, 3)
    saved = scratch[10:]
    assert torch.equal(weight, torch.arange(4.0, 10.0).view(2, 3))
    for round_ in range(3):
        alloc.free("w")
        assert weight.untyped_storage().nbytes() == 0
        again = alloc.allocate("w", 12, torch.float32, CPU)
        assert again is scratch
        again.fill_(float(round_))  # the "all-gather" refills the scratch buffer
        assert weight.untyped_storage()._cdata == scratch.untyped_storage()._cdata
        assert torch.equal(weight, torch.full((2, 3), float(round_)))
        assert torch.equal(saved, torch.full((2,), float(round_)))
        assert weight.data_ptr() == scratch.data_ptr() + 4 * scratch.element_size()


def test_a_new_size_or_dtype_replaces_a_free_bucket() -> None:
    alloc = ScratchAllocator()
    a = alloc.allocate("a", 10, torch.float32, CPU)
    alloc.free("a")
    b = alloc.allocate("a", 20, torch.float32, CPU)
    assert b is not a and b.numel() == 20 and alloc.get("a") is b
    assert alloc.live_bytes == 80
    alloc.free("a")
    c = alloc.allocate("a", 20, torch.bfloat16, CPU)
    assert c is not b and c.dtype == torch.bfloat16
    assert alloc.live_bytes == 40
    alloc.free("a")
    assert alloc.live_bytes == 0


def test_resizing_a_live_key_keeps_the_accounting() -> None:
    alloc = ScratchAllocator()
    alloc.allocate("a", 10, torch.float32, CPU)
    alloc.allocate("a", 20, torch.float32, CPU)
    assert alloc.live_bytes == live_storage_bytes(alloc, ["a"])
    alloc.free("a")
    assert alloc.live_bytes == 0


def test_peak_and_reset_peak() -> None:
    alloc = ScratchAllocator()
    alloc.allocate(0, 100, torch.float32, CPU)
    alloc.allocate(1, 50, torch.float32, CPU)
    alloc.free(0)
    alloc.allocate(2, 10, torch.float32, CPU)
    assert alloc.live_bytes == 240 and alloc.peak_bytes == 600
    alloc.reset_peak()
    assert alloc.peak_bytes == 240
    alloc.free(1)
    assert alloc.peak_bytes == 240 and alloc.live_bytes == 40
    alloc.allocate(0, 100, torch.float32, CPU)
    assert alloc.peak_bytes == 440


def test_adopt_takes_over_buckets_and_bytes() -> None:
    mine, theirs = ScratchAllocator(), ScratchAllocator()
    m = mine.allocate("m", 4, torch.float32, CPU)
    t_live = theirs.allocate("t", 8, torch.float32, CPU)
    t_free = theirs.allocate("u", 2, torch.float32, CPU)
    theirs.free("u")
    view = t_live[2:6]
    mine.adopt(theirs)
    # The same tensor objects, so views taken through the other allocator stay valid.
    assert mine.get("t") is t_live and mine.get("u") is t_free and mine.get("m") is m
    assert mine.is_allocated("t") and not mine.is_allocated("u")
    assert mine.live_bytes == 48 and mine.peak_bytes == 48
    assert theirs.live_bytes == 0 and theirs.get("t") is None and not theirs.is_allocated("t")
    mine.free("t")
    assert view.untyped_storage().nbytes() == 0 and mine.live_bytes == 16
    assert mine.allocate("u", 2, torch.float32, CPU) is t_free
    assert mine.allocate("t", 8, torch.float32, CPU) is t_live
    t_live.fill_(3.0)
    assert torch.equal(view, torch.full((4,), 3.0))
    # Adopting oneself changes nothing.
    before = (mine.live_bytes, mine.peak_bytes)
    mine.adopt(mine)
    assert (mine.live_bytes, mine.peak_bytes) == before and mine.get("t") is t_live


def test_never_an_inference_tensor() -> None:
    alloc = ScratchAllocator()
    with torch.inference_mode():
        a = alloc.allocate("a", 6, torch.float32, CPU)
        assert not a.is_inference()
        alloc.free("a")
        assert alloc.allocate("a", 6, torch.float32, CPU) is a
        # A new size inside inference mode still gives a normal tensor.
        alloc.free("a")
        b = alloc.allocate("a", 9, torch.float32, CPU)
        assert not b.is_inference()
    # Usable in autograd afterwards (an inference tensor would raise here).
    w = torch.ones(9, requires_grad=True)
    (b.fill_(2.0) * w).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.full((9,), 2.0))


def test_random_sequences_keep_accounting_exact() -> None:
    """live_bytes is always the bytes of the live scratch buffers, peak its running maximum."""
    rng = random.Random(0)
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    for _ in range(20):
        alloc = ScratchAllocator()
        keys = list(range(5))
        size = {k: (rng.randint(0, 64), rng.choice(dtypes)) for k in keys}
        objects: dict[int, torch.Tensor] = {}
        peak = 0
        for _ in range(60):
            key = rng.choice(keys)
            op = rng.random()
            if op < 0.5:
                if not alloc.is_allocated(key) and rng.random() < 0.2:
                    size[key] = (rng.randint(0, 64), rng.choice(dtypes))  # a new size: new object
                    objects.pop(key, None)
                numel, dtype = size[key]
                scratch = alloc.allocate(key, numel, dtype, CPU)
                assert objects.setdefault(key, scratch) is scratch
                assert scratch.untyped_storage().nbytes() == numel * scratch.element_size()
            elif op < 0.9:
                alloc.free(key)
                if key in objects:
                    assert objects[key].untyped_storage().nbytes() == 0
            else:
                alloc.reset_peak()
                peak = alloc.live_bytes
            assert alloc.live_bytes == live_storage_bytes(alloc, keys)
            peak = max(peak, alloc.live_bytes)
            assert alloc.peak_bytes == peak


class _FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_on: list[_FakeStream] = []

    def wait_stream(self, other: _FakeStream) -> None:
        self.waited_on.append(other)


class _FakeScratch:
    def __init__(self) -> None:
        self.recorded: list[_FakeStream] = []

    def record_stream(self, stream: _FakeStream) -> None:
        self.recorded.append(stream)


def test_free_on_another_stream_orders_reuse_after_it() -> None:
    """[Note: scratch buffers freed on another stream] (CUDA only, so with fake streams here): a
    scratch buffer allocated on the forward's stream and freed from the stream backward() was called
    from has its reuse ordered after the freeing stream's queued work; nothing on the same
    stream."""
    forward, caller = _FakeStream("forward"), _FakeStream("caller")
    scratch = _FakeScratch()
    order_free_after_use(scratch, forward, forward, in_arena=False)  # type: ignore[arg-type]
    order_free_after_use(scratch, None, caller, in_arena=False)  # type: ignore[arg-type]
    assert scratch.recorded == [] and forward.waited_on == []
    # A caching-allocator block: handed out again only after the caller stream's work.
    order_free_after_use(scratch, forward, caller, in_arena=False)  # type: ignore[arg-type]
    assert scratch.recorded == [caller] and forward.waited_on == []
    # A view of the trace pool's arena: the allocation stream waits on the freeing one.
    arena_view = _FakeScratch()
    order_free_after_use(arena_view, forward, caller, in_arena=True)  # type: ignore[arg-type]
    assert arena_view.recorded == [] and forward.waited_on == [caller]


def test_cpu_buckets_remember_no_stream() -> None:
    allocator = ScratchAllocator()
    allocator.allocate("k", 4, torch.float32, torch.device("cpu"))
    assert allocator._streams == {}
    allocator.free("k")
    assert not allocator.is_allocated("k")
