"""benchmarks/bench_layouts.py: its layouts give the right values (its own checks pass) at one rank
in this process and at three spawned gloo ranks on uneven shapes, its checks catch a wrong
result, its (a) plan is the library's, and its torch.chunk rows are torch.chunk's."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_layouts as bench  # noqa: E402

# Uneven on purpose: rows that 3 ranks do not divide, fewer rows than ranks, odd row sizes.
ODD = bench.Group("odd", (torch.Size([5, 3]), torch.Size([3]), torch.Size([7]),
                          torch.Size([1, 4]), torch.Size([2, 16])))


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A real gloo process group of one rank in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_align_numel_is_the_librarys() -> None:
    from megatron_fsdp_v2._buffers._layout import ALIGN_NUMEL

    assert bench.ALIGN_NUMEL == ALIGN_NUMEL


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 16])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_chunk_range_is_torch_chunk(rows: int, world: int) -> None:
    t = torch.arange(rows)
    chunks = torch.chunk(t, world)
    for rank in range(world):
        lo, hi = bench.chunk_range(rows, world, rank)
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert t[lo:hi].tolist() == want


def test_rows_plan_padding_is_the_librarys() -> None:
    from megatron_fsdp_v2._buffers._layout import build_layout

    shapes = bench.gpt_groups("small")[0].shapes
    parts = bench.rows_plan(shapes, 4)
    assert len(parts) == 1  # a GPT block is one flat group
    assert bench.rows_padding(parts, shapes) == build_layout(shapes, 4).padding_numel


@pytest.mark.parametrize("kind", bench.LAYOUTS + bench.EXTRA_LAYOUTS)
def test_every_layout_is_right_at_one_rank(one_rank: None, kind: str) -> None:
    for index, group in enumerate([ODD, bench.gpt_groups("tiny")[0]]):
        params, grads = bench.group_data(group, index, 1, torch.device("cpu"))
        state = bench.make_layout(kind, group, params, grads[0], 1, 0)
        state.gather()
        state.reduce()
        bench.check(state, params, grads)


@pytest.mark.parametrize("kind", ["a", "b", "c"])
def test_check_catches_a_wrong_gather_and_a_wrong_reduction(one_rank: None, kind: str) -> None:
    params, grads = bench.group_data(ODD, 0, 1, torch.device("cpu"))
    state = bench.make_layout(kind, ODD, params, grads[0], 1, 0)
    state.gather()
    state.reduce()
    state.gathered()[0][2, 1] += 1
    with pytest.raises(AssertionError, match="gathered parameter 0"):
        bench.check(state, params, grads)
    state.gather()  # right again
    bench.check(state, params, grads)
    piece, _, _ = state.reduced()[2]
    piece[0] += 1
    with pytest.raises(AssertionError, match="gradient 2"):
        bench.check(state, params, grads)


class _PreloadedRanks:
    """``bench.launch``'s ``mp``, whose ``"spawn"`` context is the rank pools' fork server's
    (torch and the library imported once per session, see [Note: ranks fork from a preloaded
    server]): a spawned rank spent seconds of CPU importing torch before its first line."""

    @staticmethod
    def get_context(method: str) -> object:
        # private: the rank pools' multiprocessing context (the preloaded fork server)
        from megatron_fsdp_v2.testing._pool import _context

        assert method == "spawn", method
        return _context()


def test_three_gloo_ranks_on_uneven_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's own rank code (fresh processes, file rendezvous: ``launch`` as written,
    its ranks forked from the preloaded server instead of spawned) checks every layout after
    its warm-up and its timed round; a mismatch would fail the launch."""
    monkeypatch.setattr(bench, "mp", _PreloadedRanks)
    world = 3
    groups = [ODD, bench.gpt_groups("tiny")[0]]
    a = dict(world=world, layouts=list(bench.LAYOUTS + bench.EXTRA_LAYOUTS), rounds=1,
             threads=1, timeout=120, device="cpu", groups=groups,
             rows_plans=[bench.rows_plan(g.shapes, world) for g in groups])
    out = bench.launch(a)
    assert out["params"] == sum(g.numel for g in groups)
    # (b) pads each parameter to 3 * ceil(rows / 3) rows: ODD 5->6 rows of 3, 3->3, 7->9,
    # 1->3 rows of 4, 2->3 rows of 16; the tiny GPT's 128- and 384-row tensors to 129 and 384.
    gpt_pad = sum((-(-s[0] // 3) * 3 - s[0]) * bench.row_numel(s) for s in groups[1].shapes)
    assert out["b"]["padding"] == 3 + 0 + 2 + 8 + 16 + gpt_pad
    assert out["c"]["collectives"] == 2 * (len(ODD.shapes) + len(groups[1].shapes))
    assert out["b"]["copy"] > 0 and out["a"]["copy"] == out["c"]["copy"] == 0
    assert out["c_uncoalesced"]["launches"] == out["c"]["collectives"]
    assert all(len(out[k]["times"]) == 1 for k in bench.LAYOUTS + bench.EXTRA_LAYOUTS)
