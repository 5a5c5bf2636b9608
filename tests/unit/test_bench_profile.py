"""benchmarks/bench_training.py's --profile arithmetic, its per-round step-time ratios and its
configuration flags.

The breakdown ([Note: profile breakdown] there) sums the union of matching ranges inside the
benchmark's step ranges on the training thread: nested and overlapping ranges count once, time
outside a step (the barrier between steps) and on other threads not at all. Checked on
synthetic events with known answers.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_training as bench  # noqa: E402


@dataclass
class _Range:
    start: float
    end: float


@dataclass
class _Event:
    name: str
    thread: int
    time_range: _Range


def _ev(name: str, start_ms: float, end_ms: float, thread: int = 1) -> _Event:
    return _Event(name, thread, _Range(start_ms * 1e3, end_ms * 1e3))  # the profiler uses us


def test_intervals() -> None:
    assert bench._merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert bench._intersect([(0, 4), (5, 6)], [(3, 5.5)]) == [(3, 4), (5, 5.5)]
    assert bench._intersect([(0, 1)], [(1, 2)]) == []


def test_breakdown_counts_union_inside_steps() -> None:
    events = [
        _ev("c10d::barrier", 0, 1),  # between steps: not communication of a step
        _ev("bench::step", 1, 11),
        _ev("bench::forward", 1, 4),
        _ev("mfsdp::wait", 2, 3),  # in forward
        _ev("bench::backward", 4, 9),
        _ev("mfsdp::sync_collective", 5, 7),
        _ev("mfsdp::wait", 6, 8),  # overlaps the synchronous collective: 5..8 counts once
        _ev("megatron_fsdp_v2::pack_", 8, 8.5),
        _ev("bench::optimizer", 9, 11),
        _ev("c10d::allreduce_", 9, 9.5),  # the clip all-reduce
        _ev("mfsdp::wait", 2, 10, thread=2),  # another thread: ignored
        _ev("bench::step", 12, 22),
        _ev("bench::forward", 12, 22),
    ]
    out = bench.profile_breakdown(events, steps=2)
    assert out["step"] == pytest.approx(10.0)
    assert out["forward"] == pytest.approx((3 + 10) / 2)
    assert out["backward"] == pytest.approx(2.5)
    assert out["optimizer"] == pytest.approx(1.0)
    assert out["comm"] == pytest.approx((1 + 3 + 0.5) / 2)
    assert out["comm_forward"] == pytest.approx(0.5)
    assert out["comm_backward"] == pytest.approx(1.5)
    assert out["comm_optimizer"] == pytest.approx(0.25)
    assert out["kernels"] == pytest.approx(0.25)
    assert out["comm_names"]["mfsdp::wait"] == pytest.approx((1 + 2) / 2)
    assert out["comm_names"]["c10d::barrier"] == 0.0


def test_matrix_and_quick_flags() -> None:
    a = bench.parse_args(["--matrix"])
    assert (a.worlds, a.mps, a.micro_batch_list) == ([2, 4], ["fp32", "bf16"], [1, 4])
    a = bench.parse_args([])
    assert (a.worlds, a.mps, a.micro_batch_list) == ([4], ["fp32"], [1])
    a = bench.parse_args(["--quick", "--steps", "5", "--world-size", "2"])
    assert (a.model_size, a.steps, a.worlds) == ("tiny", 5, [2])  # explicit flags win


@pytest.mark.parametrize("argv", [["--mp", "fp16"], ["--world", "0"], ["--micro-batches", "x"],
                                  ["--world", "2,4", "--mesh", "2,2"]])
def test_bad_flags_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def _ranks(times_per_round: list[list[float]]) -> tuple[list[dict], list[list[dict]]]:
    """(measurement run, timing runs) of one system on two ranks; rank 1 is 10% slower, so the
    slowest rank's times are what counts."""
    def run(times: list[float]) -> list[dict]:
        return [{"rank": r, "losses": [1.0] * len(times),
                 "times": [t * (1 + r / 10) for t in times],
                 "comm": {"total_wire_bytes": 0, "calls": {}}, "peak_rss_kib": 1024,
                 "rss_base_kib": 512, "train_hwm_kib": None} for r in range(2)]
    return run([0.0]), [run(times) for times in times_per_round]


def test_paired_round_ratios() -> None:
    a = dict(warmup=1, world_size=2, micro_batches=1, batch_size=2, seq_len=4, model="gpt",
             num_params=10, mesh=None, mp="fp32", device="cpu", fsdp_kwargs={})
    # The second round ran on a machine twice as slow, for both systems: the per-round ratios
    # do not see it. The first step of each round is the warm-up; rank 1 is the slowest (x1.1).
    ours = bench.summarize("no_shard", *_ranks([[9.0, 1.1, 1.0, 1.2], [9.0, 2.0, 2.2, 2.0]]), a)
    peer = bench.summarize("ddp", *_ranks([[9.0, 1.1, 1.1, 1.0], [9.0, 2.0, 2.0, 2.4]]), a)
    assert ours["step_s_round_medians"] == pytest.approx([1.21, 2.2])
    assert peer["step_s_round_medians"] == pytest.approx([1.21, 2.2])
    assert bench.paired_round_ratios(ours, peer) == pytest.approx([1.0, 1.0])
    faster = bench.summarize("ddp", *_ranks([[9.0, 1.0, 1.0, 1.0], [9.0, 2.0, 2.0, 2.0]]), a)
    assert bench.paired_round_ratios(ours, faster) == pytest.approx([1.1, 1.0])
    assert bench._step_ratio(ours, faster).endswith("[1.00-1.10]")
    one_round = bench.summarize("ddp", *_ranks([[9.0, 1.0]]), a)
    assert "[" not in bench._step_ratio(one_round, one_round)  # no range from a single round


def test_peak_breakdown_names_what_a_step_holds_at_its_peak() -> None:
    """[Note: peak breakdown]: a step that keeps a 4 MiB tensor while a 2 MiB one lives, then
    frees both: the peak is 6 MiB, named by the op that allocated them; a tensor alive from
    before the step is not counted, nor one the step allocates after the peak is past."""
    import torch

    before = torch.ones(1 << 20)  # 4 MiB alive from before the step: not in the breakdown
    tracer = bench.PeakTracer()
    for _ in range(bench.PEAK_TRIES):
        tracer.start()
        kept = torch.zeros(1 << 20)  # 4 MiB
        temp = torch.zeros(1 << 19)  # 2 MiB
        del temp, kept
        after = torch.empty(1 << 18)  # 1 MiB, alone
        del after
        tracer.stop()
    found = tracer.result()
    assert before.sum() == 1 << 20
    assert "peak_mib" in found, found
    assert found["peak_mib"] == pytest.approx(6.0), found
    assert found["by_op_mib"] == {"aten::zeros": pytest.approx(6.0)}, found
    assert found["largest_mib"] == [pytest.approx(4.0), pytest.approx(2.0)], found
    lines = bench.render_peaks({"peaks": {"ours": found, "peer": {"errors": ["replay"]}}})
    assert "| **peak** | **6.0** |" in lines and "| aten::zeros | 6.0 |" in lines, lines
    assert lines[-1] == "- peer: torch's memory replay failed on every try: ['replay']", lines
