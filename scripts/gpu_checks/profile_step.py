"""One profiled bf16 ZeRO-3 (``optim_grads_params``) step at world 1: communication on side
streams overlapping compute, and the step's peak memory against ``memory_report``.

Streams and overlap (CUDA). At world 1 NCCL moves no data (an in-place collective is a no-op,
an out-of-place one a device copy), so the wire time a collective would take on more ranks is
stood in for by ``torch.cuda._sleep`` injected on the side stream right before each collective
(``_common.SideStreamSleep``): exactly where a real collective's time would sit. The trace must
show (1) no communication on the compute stream: neither an injected sleep nor an NCCL kernel
runs on the stream the GEMMs run on; (2) communication overlapping compute: at least
``--min-overlap`` of the communication time runs while a compute kernel runs.

Memory. ``memory_report(model, optimizer).total`` is what the library predicts it holds at its
worst moment: persistent buffers (main weights, main gradients at full size, optimizer state)
plus the high-water mark of its scratch buffers (gathered weights, reduce-scatter inputs).
What the library does not hold (activations, autograd's bf16 gradients of one unit before its
post-backward stages them, the batch) is made small here: few tokens against large weights,
estimated and printed. The step's peak (CUDA: ``max_memory_allocated`` during the step minus
what was allocated before the model was built; CPU: the same from the profiler's allocation
events) must be within ``--tolerance`` (15%) of the prediction: above, the library holds
memory it does not report (a leaked scratch buffer, an arena kept twice); far below, the report
overstates what planning should reserve. An AdamW with ``fused=True`` keeps the optimizer step
free of temporaries of its own.

    python scripts/gpu_checks/profile_step.py --device cuda
    python scripts/gpu_checks/profile_step.py --device cpu    # dry run: memory only
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import _common as c
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP_RANGE = "gpu_check::measured_step"


@dataclass(frozen=True)
class Kernel:
    """One GPU activity of the trace: name, stream, start and end (microseconds)."""

    name: str
    stream: int
    start: float
    end: float


def is_communication(kernel: Kernel) -> bool:
    """An injected sleep (the stand-in for wire time) or a kernel of NCCL's."""
    name = kernel.name.lower()
    return "spin_kernel" in name or "nccl" in name


def compute_stream(kernels: Sequence[Kernel]) -> int | None:
    """The stream with the most kernel time outside communication and copies: the stream the
    model's GEMMs and elementwise kernels run on."""
    busy: dict[int, float] = {}
    for k in kernels:
        if is_communication(k) or k.name.startswith(("Memcpy", "Memset")):
            continue
        busy[k.stream] = busy.get(k.stream, 0.0) + (k.end - k.start)
    return max(busy, key=lambda s: busy[s]) if busy else None


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(start: float, end: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


@dataclass
class OverlapReport:
    compute_stream: int | None
    communication_streams: set[int]
    communication_us: float
    overlapped_us: float
    on_compute_stream: list[str]

    @property
    def fraction(self) -> float:
        return self.overlapped_us / self.communication_us if self.communication_us else 0.0


def overlap_report(kernels: Sequence[Kernel]) -> OverlapReport:
    """Where communication ran, and how much of its time ran while compute kernels did."""
    stream = compute_stream(kernels)
    compute = _union((k.start, k.end) for k in kernels
                     if k.stream == stream and not is_communication(k))
    communication = [k for k in kernels if is_communication(k)]
    return OverlapReport(
        compute_stream=stream,
        communication_streams={k.stream for k in communication},
        communication_us=sum(k.end - k.start for k in communication),
        overlapped_us=sum(_covered(k.start, k.end, compute) for k in communication),
        on_compute_stream=sorted({k.name for k in communication if k.stream == stream}),
    )


def gpu_kernels(prof: profile) -> list[Kernel]:
    """The GPU activities (kernels, copies) of a trace; range annotations left out."""
    return [
        Kernel(e.name, e.device_resource_id, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    ]


def peak_from_allocations(prof: profile, window: str) -> int:
    """CPU: the highest bytes allocated (counted from the profiler's start) inside the range
    ``window``, from the profiler's allocation and free events."""
    events = list(prof.profiler.kineto_results.events())  # type: ignore[union-attr]
    ranges = [e for e in events if e.name() == window]
    if len(ranges) != 1:
        raise c.CheckFailed(f"expected one '{window}' range in the trace, found {len(ranges)}")
    begin, end = ranges[0].start_ns(), ranges[0].end_ns()
    allocated = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if e.device_type() != DeviceType.CPU:
            continue
        allocated += e.nbytes()
        if begin <= e.start_ns() <= end:
            peak = max(peak, allocated)
    return peak


def unheld_estimate(dim: int, layers: int, tokens: int, vocab: int) -> int:
    """Bytes of the step the library does not hold: saved activations (bf16: each block's
    input, LayerNorm output, and both sides of the GELU; fp32 logits) and one block's bf16
    autograd gradients before its post-backward stages them."""
    activations = layers * tokens * (dim + dim + 4 * dim + 4 * dim) * 2 + tokens * vocab * 4 * 2
    block_grads = (2 * 4 * dim * dim + 6 * dim) * 2
    return activations + block_grads


def main() -> None:
    args = c.parse_args(__doc__ or "", [
        ("--dim", {"type": int, "default": None,
                   "help": "model width (default 2048 on cuda, 256 on cpu)"}),
        ("--layers", {"type": int, "default": 4}),
        ("--seq", {"type": int, "default": None,
                   "help": "tokens per sequence + 1 (default 129 on cuda, 33 on cpu)"}),
        ("--batch", {"type": int, "default": None, "help": "default 4 on cuda, 2 on cpu"}),
        ("--sleep-cycles", {"type": int, "default": 100_000,
                            "help": "stand-in wire time per collective (~50 us on an H200)"}),
        ("--tolerance", {"type": float, "default": 0.15}),
        # A schedule that waits right after each launch overlaps ~0%; the first GPU run's
        # figure is printed, to set this from.
        ("--min-overlap", {"type": float, "default": 0.1}),
        ("--self-test", {"action": "store_true",
                         "help": "hold an unreported 30%% extra during the step: must fail"}),
    ])
    device = c.setup_device(args.device)
    # Weights large against activations, so that what the library does not hold stays small.
    cuda = device.type == "cuda"
    dim = args.dim or (2048 if cuda else 256)
    args.seq = args.seq or (129 if cuda else 33)
    args.batch = args.batch or (4 if cuda else 2)
    failures: list[str] = []
    with c.single_rank_group(device):
        amplifier = c.SideStreamSleep(args.sleep_cycles)
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            model, optimizer, batches = _setup(args, device, dim)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            delayed = amplifier.count
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                extra = _measured_step(model, optimizer, batches[-1], args.self_test)
                torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated() - base
            delayed = amplifier.count - delayed
            failures += _check_streams(gpu_kernels(prof), delayed, args.min_overlap)
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                model, optimizer, batches = _setup(args, device, dim)
                extra = _measured_step(model, optimizer, batches[-1], args.self_test)
            measured = peak_from_allocations(prof, STEP_RANGE)
            print("[profile_step] streams and overlap: not applicable on cpu (gloo runs "
                  "collectives on its own threads)")
        amplifier.remove()
        report = c.mfsdp.memory_report(model, optimizer)
        failures += _check_memory(measured, report, args, dim, extra)
    c.finish("profile_step", failures)


def _setup(args: argparse.Namespace, device: torch.device, dim: int
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[list[torch.Tensor]]]:
    model, _ = c.build("optim_grads_params", c.Config("bf16", bf16=True), device,
                       layers=args.layers, dim=dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = [[m[0] for m in step] for step in c.make_batches(
        3, 1, 1, device, batch=args.batch, seq=args.seq)]
    for step in batches[:-1]:  # warm-up: prefetch order recorded, optimizer state created
        c.train_step(model, optimizer, step)
    return model, optimizer, batches


def _measured_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   micro_batches: list[torch.Tensor], self_test: bool) -> int:
    """One training step inside the ``STEP_RANGE`` range; returns the bytes of the self-test's
    unreported allocation (0 without it)."""
    with record_function(STEP_RANGE):
        held = None
        if self_test:
            report = c.mfsdp.memory_report(model, optimizer)
            held = torch.empty(int(0.3 * report.total), dtype=torch.uint8,
                               device=micro_batches[0].device)
        c.train_step(model, optimizer, micro_batches)
        extra = 0 if held is None else held.numel()
        del held
    return extra


def _check_streams(kernels: list[Kernel], delayed: int, min_overlap: float) -> list[str]:
    report = overlap_report(kernels)
    print(f"[profile_step] {len(kernels)} GPU activities; compute stream "
          f"{report.compute_stream}, communication streams "
          f"{sorted(report.communication_streams)}; {delayed} collectives delayed; "
          f"communication {report.communication_us:.0f} us, of which "
          f"{report.overlapped_us:.0f} us ({report.fraction:.0%}) overlapped compute")
    failures = []
    if delayed == 0 or report.communication_us == 0:
        failures.append("no collective ran on a side stream (none delayed, or no injected "
                        "sleep in the trace)")
    if report.on_compute_stream:
        failures.append(f"communication on the compute stream: {report.on_compute_stream}")
    if report.fraction < min_overlap:
        failures.append(f"only {report.fraction:.0%} of communication time overlapped compute "
                        f"(want >= {min_overlap:.0%})")
    return failures


def _check_memory(measured: int, report: c.mfsdp.MemoryReport, args: argparse.Namespace,
                  dim: int, extra: int) -> list[str]:
    predicted = report.total
    unheld = unheld_estimate(dim, args.layers, args.batch * (args.seq - 1), 97)
    error = (measured - predicted) / predicted
    mib = 1 << 20
    print(f"[profile_step] memory: step peak {measured / mib:.1f} MiB, memory_report total "
          f"{predicted / mib:.1f} MiB ({error:+.1%}); {report}; not held by the library "
          f"(estimate) {unheld / mib:.1f} MiB" + (f"; self-test extra {extra / mib:.1f} MiB"
                                                   if extra else ""))
    if abs(error) > args.tolerance:
        return [f"step peak {measured / mib:.1f} MiB is {error:+.1%} off memory_report's "
                f"{predicted / mib:.1f} MiB (tolerance {args.tolerance:.0%})"]
    return []


if __name__ == "__main__":
    main()
