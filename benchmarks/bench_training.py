"""Training benchmark: megatron_fsdp_v2's four strategies against DDP, ZeRO-1 and FSDP2.

    python benchmarks/bench_training.py --out /tmp/bench/training.md   # CPU/gloo, NCCL on GPUs
    python benchmarks/bench_training.py --quick --world 2 --profile   # smoke run + breakdown
    python benchmarks/bench_training.py --rounds 0 --systems optim_grads_params,fsdp2 \
        --peak-breakdown   # what each system's step holds at its memory peak
    python benchmarks/bench_training.py --matrix   # --world 2,4 --mp fp32,bf16 --micro-batches 1,4
    python benchmarks/bench_training.py --world 4 --mesh 2,2 \
        --systems optim_grads,optim_grads_params,fsdp2_noreshard,fsdp2   # HSDP vs FSDP2's HSDP
    python benchmarks/bench_training.py --model units --world 2 --rounds 3   # per-unit cost
    python benchmarks/bench_training.py --model units --world 2 --systems no_shard,ddp \
        --fsdp-kwargs reduce_bucket_size_mb=25   # coalesced reductions vs DDP's buckets
    python benchmarks/bench_training.py --model units --world 2 --systems optim,zero1 \
        --fsdp-kwargs reduce_bucket_size_mb=25,refresh_bucket_size_mb=25   # and refreshes

``--world``, ``--mp`` and ``--micro-batches`` take comma-separated lists; each combination is
one configuration with its own table (and, with several, a closing table of ratios per
configuration). ``--mp bf16``: bf16 compute weights with fp32 main weights and gradients
reduced in fp32 (ours: ``MixedPrecisionPolicy(param_dtype=bf16)``; FSDP2: the same with
``reduce_dtype=fp32``; DDP and ZeRO-1, which keep fp32 weights: ``torch.autocast`` to bf16 around
the forward), so the losses then differ from DDP's by bf16 rounding. ``--profile``: one more
fresh run per system, rank 0 traced with ``torch.profiler`` (see [Note: profile breakdown]).

With ``--mesh R,S`` (R x S = ``--world-size``) our systems run HSDP: the strategy along the S
ranks of each replica, gradients all-reduced across the R replicas once per step
(``outer_dp_sharding_strategy="no_shard"``); the FSDP2 peers run FSDP2's HSDP on the same 2-D
mesh (``torch.distributed.fsdp.fully_shard(module, mesh=<2-D mesh>)``: shards along dim 1,
replicates along dim 0, all-reduces across replicas after every reduce-scatter). DDP and
ZeRO-1 stay 1-D over the world.

``--model units`` replaces the GPT by the many-small-units case: ``--units`` (default 64)
``nn.Linear(16, 16)`` layers with tanh in a Sequential, each wrapped as a unit (FSDP2: each
one, then the root; DDP/ZeRO-1: the whole model), ``--batch-size`` random 16-wide rows per
micro-batch and rank, MSE loss against random targets, the same AdamW and clipping (``--optimizer
sgd``: SGD with momentum instead, for both models). It measures the fixed cost every unit pays
(hooks, one collective launch per group) rather than compute or bandwidth; ``--fsdp-kwargs
reduce_bucket_size_mb=...`` shows what coalescing the reductions buys, and
``refresh_bucket_size_mb=...`` what coalescing the refresh all-gathers of ``optim`` and
``optim_grads`` after each step buys.

Every system trains the same model (the GPT of ``examples/model.py`` by default) from the same
initial weights on the same synthetic data with the same AdamW, gradient clipping and
micro-batching. Each run of a system is one fresh process group (``--world-size`` spawned
ranks, file rendezvous; gloo on CPU, NCCL with one GPU per rank on CUDA), so what one system
allocates never shows in another's peak.

* **Measurement run** (one per system, untimed, ``max(3, warmup + 1)`` steps): bytes
  communicated and peak memory. Bytes are counted on the last step (steady state: DDP rebuilds
  its buckets on step 2, megatron_fsdp_v2 skips the first refresh) by
  ``examples/comm_counter.CommCounter``, a ``TorchDispatchMode`` that sees every ``c10d`` op at
  the dispatcher, including the all-reduces DDP's C++ reducer issues. Bytes are ring-algorithm
  bytes sent per rank: ``2(N-1)/N * S`` for an all-reduce of S bytes, ``(N-1)/N * S`` for an
  all-gather, reduce-scatter or broadcast whose full buffer is S bytes; the table puts next to
  them what each system's collective pattern predicts. Peak memory on CPU is
  ``getrusage(RUSAGE_SELF).ru_maxrss`` of each rank (the whole process), also shown above the
  RSS before the model is built (the torch runtime); these runs set ``MALLOC_MMAP_THRESHOLD_``
  (``--malloc-mmap-threshold``) so that freed tensors leave the resident set instead of staying
  in glibc's heap, where RSS would follow allocation order rather than live bytes. On CUDA it is
  ``torch.cuda.max_memory_allocated``. For megatron_fsdp_v2, ``memory_report`` too.
* **Timing runs**: ``--rounds`` rounds over the systems, in alternating order, so machine noise
  hits every system alike; each runs ``--warmup`` untimed then ``--steps`` timed steps with
  nothing else active (no counter, default allocator settings). A step's time is the slowest
  rank's (ranks start each step after a barrier); the table shows the median and interquartile
  range over all timed steps of all rounds. Step-time ratios also show the range of the
  per-round ratios (``paired_round_ratios``: each round's median against the peer's in the same
  round), the spread a difference has to exceed before it says anything.
* **Losses**: the table shows each system's largest loss difference from DDP over all steps
  (they must agree, or the timing means nothing), the loss curves, and each system's largest
  difference between its own runs.

Peer settings: DDP and the DDP under ZeRO-1 use ``gradient_as_bucket_view=True``,
``ZeroRedundancyOptimizer`` uses ``parameters_as_bucket_view=True`` (their leaner, faster
settings); FSDP2 wraps every block and then the root with ``reshard_after_forward`` True or False
and reduce-scatters every micro-batch (its default; ``set_requires_gradient_sync(False)`` would
trade unsharded gradient memory for fewer reductions). Gradient accumulation: DDP/ZeRO-1 use
``no_sync()`` on all but the last micro-batch; megatron_fsdp_v2 uses ``set_is_last_backward``.
Clipping: ``torch.nn.utils.clip_grad_norm_`` for the peers, ``megatron_fsdp_v2.clip_grad_norm_``
for ours.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MiB = 1 << 20

SYSTEMS: dict[str, str] = {
    "no_shard": "mfsdp no_shard",
    "optim": "mfsdp optim",
    "optim_grads": "mfsdp optim_grads",
    "optim_grads_params": "mfsdp optim_grads_params",
    "ddp": "DDP",
    "zero1": "ZeRO-1 (ZeroRedundancyOptimizer + DDP)",
    "fsdp2_noreshard": "FSDP2 reshard_after_forward=False",
    "fsdp2": "FSDP2 reshard_after_forward=True",
}
OURS = ("no_shard", "optim", "optim_grads", "optim_grads_params")
PEERS = {"no_shard": "ddp", "optim": "zero1", "optim_grads": "fsdp2_noreshard",
         "optim_grads_params": "fsdp2"}
UNIT_DIM = 16  # --model units: width of each nn.Linear unit
MODEL_SIZES = {  # name -> (dim, layers, heads)
    "tiny": (128, 2, 4),
    "small": (256, 4, 4),
    "medium": (512, 8, 8),
    "large": (768, 12, 12),
}


# ----------------------------------------------------------------------------- rank side

def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_rss_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


# [Note: peak breakdown] `--peak-breakdown`: one more fresh run per system in which rank 0 traces
# one steady-state step with torch.profiler's memory profiling and replays its allocation
# timeline (torch.profiler._memory_profiler, the data behind export_memory_timeline): the peak
# of the bytes allocated during that step and still alive, and which op allocated each of
# them (AccumulateGrad/MmBackward0: autograd's gradients; aten::linear/gelu/...: activations;
# "[memory]": no op, e.g. a library's own buffer from its allocator or a collective's thread;
# "?": torch's profiler could not name it). Tensors alive from before the step (the sharded
# weights, optimizer state, a persistent gradient buffer) are not in it: it shows what the
# step adds on top, the part the systems' schedules decide. torch's replay of the data flow
# raises an AssertionError on some steps' traces; each of the PEAK_TRIES steps is tried in turn.
PEAK_TRIES = 3


class PeakTracer:
    """Rank 0's memory trace of one step at a time, until one replays (see [Note: peak
    breakdown])."""

    def __init__(self) -> None:
        self.found: dict[str, Any] | None = None
        self.errors: list[str] = []
        self._profiler: Any = None

    def start(self) -> None:
        if self.found is None:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                     record_shapes=True, with_stack=True)
            self._profiler.start()

    def stop(self) -> None:
        if self._profiler is None:
            return
        self._profiler.stop()
        try:
            self.found = _step_peak(self._profiler)
        except AssertionError as e:  # torch's data-flow replay; see the Note
            self.errors.append(f"{type(e).__name__}: {str(e)[:120]}")
        self._profiler = None

    def result(self) -> dict[str, Any]:
        return self.found if self.found is not None else {"errors": self.errors}


def _step_peak(profiler: Any) -> dict[str, Any]:
    """The peak of the step's live allocations and, per allocating op, its bytes at the peak."""
    from torch.profiler._memory_profiler import Action, MemoryProfile

    memory = MemoryProfile(profiler.profiler.kineto_results)
    creator: dict[Any, str] = {}
    for node in memory._data_flow_graph.flow_nodes:
        for key in node.outputs:
            creator.setdefault(key, node._event.name)
    live: dict[Any, int] = {}
    total, peak, at_peak = 0, 0, {}
    for _, action, (key, _version), size in memory.timeline:
        if action == Action.CREATE:
            live[key] = size
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == Action.DESTROY:
            total -= live.pop(key, 0)
    by_op: dict[str, int] = {}
    for key, size in at_peak.items():
        by_op[creator.get(key, "?")] = by_op.get(creator.get(key, "?"), 0) + size
    return {"peak_mib": peak / MiB, "tensors": len(at_peak),
            "by_op_mib": {k: v / MiB for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "largest_mib": sorted((v / MiB for v in at_peak.values()), reverse=True)[:12]}


def _range(name: str, enabled: bool) -> Any:
    return torch.profiler.record_function(name) if enabled else contextlib.nullcontext()


# [Note: profile breakdown] What --profile sums, per system, from rank 0's CPU trace of
# --profile-steps steps (ms per step). Each category is the union of the matching ranges'
# intervals on the training thread, inside the benchmark's step ranges (ranges nest, and a wait
# may sit inside a launch, so durations are never simply added):
# * forward / backward / optimizer step: the benchmark's own bench:: ranges around the forward
#   and loss, loss.backward(), and clip + step + zero_grad; the same for every system.
# * exposed communication: time the training thread spends in a collective or blocked on one.
#   Ours: mfsdp::wait and mfsdp::sync_collective (every wait is named). Everyone: c10d ops
#   called on the training thread (the launch; for a synchronous collective such as the clip
#   all-reduce or ZeRO-1's broadcasts, the collective). The peers' waits on asynchronous work
#   (DDP's reducer at the end of backward, FSDP2's wait for a prefetched all-gather or a
#   reduce-scatter) run inside C++ or un-named Python and show as backward or forward time,
#   so their column is a lower bound, marked "(min)". comm_forward / comm_backward /
#   comm_optimizer split it by phase.
# * copy kernels: flat-buffer copy ops: ours (megatron_fsdp_v2:: ops: pack, refresh and
#   reduce-scatter copies) and FSDP2's (fsdp:: copy-in/copy-out ops).
_COMM_PREFIXES = ("mfsdp::wait", "mfsdp::sync_collective", "c10d::", "gloo:", "nccl:")
_KERNEL_PREFIXES = ("megatron_fsdp_v2::", "fsdp::")
Intervals = list[tuple[float, float]]


def _merge(intervals: Intervals) -> Intervals:
    merged: Intervals = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two merged interval lists."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _ms(intervals: Intervals) -> float:
    return sum(hi - lo for lo, hi in intervals) / 1e3  # profiler times are in microseconds


def profile_breakdown(events: Any, steps: int) -> dict[str, Any]:
    """Per-step ms of each category in [Note: profile breakdown], and the names seen."""
    main = {e.thread for e in events if e.name == "bench::step"}
    raw: dict[str, Intervals] = {
        k: [] for k in ("step", "forward", "backward", "optimizer", "comm", "kernels")}
    comm_names: dict[str, Intervals] = {}
    totals: dict[str, float] = {}
    for e in events:
        if e.thread not in main:
            continue
        span = (e.time_range.start, e.time_range.end)
        name = e.name
        totals[name] = totals.get(name, 0.0) + (span[1] - span[0]) / 1e3
        if name.startswith("bench::"):
            raw[name[len("bench::"):]].append(span)
        elif name.startswith(_COMM_PREFIXES):
            raw["comm"].append(span)
            comm_names.setdefault(name, []).append(span)
        elif name.startswith(_KERNEL_PREFIXES):
            raw["kernels"].append(span)
    merged = {k: _merge(v) for k, v in raw.items()}
    step = merged["step"]  # the benchmark's barrier between steps is outside
    out: dict[str, Any] = {k: _ms(_intersect(v, step)) / steps for k, v in merged.items()}
    for phase in ("forward", "backward", "optimizer"):
        out[f"comm_{phase}"] = _ms(_intersect(merged["comm"], merged[phase])) / steps
    out["comm_names"] = {k: _ms(_intersect(_merge(v), step)) / steps
                         for k, v in sorted(comm_names.items())}
    # Inclusive time per name, for reading a trace without a viewer (--out's .json).
    out["top"] = {k: v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:40]}
    return out


class _Units(torch.nn.Module):
    """``--model units``: ``n`` small ``nn.Linear`` units; ``blocks`` is what gets wrapped one
    by one (the GPT's attribute name, so every system wraps both models the same way)."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _make_model(a: dict[str, Any]) -> torch.nn.Module:
    if a["model"] == "units":
        return _Units(a["units"], UNIT_DIM)
    from model import GPT, GPTConfig

    return GPT(GPTConfig(vocab=a["vocab"], seq_len=a["seq_len"], dim=a["dim"],
                         layers=a["layers"], heads=a["heads"]))


def _make_batch(a: dict[str, Any], step: int, micro: int, rank: int,
                device: torch.device) -> Any:
    """One micro-batch of this rank, deterministic in (seed, step, micro, rank)."""
    if a["model"] == "units":
        g = torch.Generator().manual_seed(((a["seed"] * 1_000_003 + step) * 1009 + micro) * 131
                                          + rank)
        x = torch.randn(a["batch_size"], UNIT_DIM, generator=g)
        return x.to(device), torch.randn(a["batch_size"], UNIT_DIM, generator=g).to(device)
    from model import synthetic_batch

    return synthetic_batch(a["batch_size"], a["seq_len"], a["vocab"], seed=a["seed"],
                           step=step, micro=micro, rank=rank, device=device)


def _loss(a: dict[str, Any], model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if a["model"] == "units":
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).float(), y)
    from model import lm_loss

    return lm_loss(model, batch)


def _optimizer(a: dict[str, Any], params: Any, zero1: bool = False) -> torch.optim.Optimizer:
    if a["optimizer"] == "sgd":
        cls: Any = torch.optim.SGD
        kwargs: dict[str, Any] = dict(lr=a["lr"], momentum=0.9)
    else:
        cls, kwargs = torch.optim.AdamW, dict(lr=a["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls,
                                       parameters_as_bucket_view=True, **kwargs)
    return cls(params, **kwargs)


def _build(system: str, device: torch.device, a: dict[str, Any]) -> tuple[
        torch.nn.Module, torch.optim.Optimizer, Callable[[], Any], Callable[[bool], Any]]:
    """(model, optimizer, clip(), micro_batch_context(is_last)) for one system."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(a["seed"])  # identical initial weights for every system and rank
    model = _make_model(a).to(device)
    ddp_kwargs = dict(device_ids=[device.index] if device.type == "cuda" else None,
                      gradient_as_bucket_view=True)
    clip = a["clip"]

    def torch_clip(m: torch.nn.Module) -> Callable[[], Any]:
        return lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), clip) if clip > 0 else None

    hsdp_mesh = None
    if a.get("mesh") and (system in OURS or system.startswith("fsdp2")):
        from torch.distributed.device_mesh import init_device_mesh

        hsdp_mesh = init_device_mesh(device.type, tuple(a["mesh"]),
                                     mesh_dim_names=("replicate", "shard"))
    bf16 = a["mp"] == "bf16"
    if system in OURS:
        import megatron_fsdp_v2 as mfsdp

        wrap: dict[str, Any] = dict(sharding_strategy=system)
        if bf16:  # bf16 compute weights, fp32 main weights, gradients reduced in fp32
            wrap.update(mp_policy=mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        if hsdp_mesh is not None:
            wrap.update(mesh=hsdp_mesh, outer_dp_sharding_strategy="no_shard")
        wrap.update(a.get("fsdp_kwargs") or {})  # --fsdp-kwargs: options under test
        for block in model.blocks:
            mfsdp.fully_shard(block, **wrap)
        mfsdp.fully_shard(model, **wrap)
        opt = _optimizer(a, model.parameters())

        def ours_clip() -> Any:
            return mfsdp.clip_grad_norm_(model.parameters(), clip) if clip > 0 else None

        def ours_micro(is_last: bool) -> Any:
            model.set_is_last_backward(is_last)
            return contextlib.nullcontext()

        return model, opt, ours_clip, ours_micro
    if system in ("ddp", "zero1"):
        ddp = DDP(model, **ddp_kwargs)
        opt = _optimizer(a, ddp.parameters(), zero1=system == "zero1")
        return (ddp, opt, torch_clip(ddp),
                lambda last: contextlib.nullcontext() if last else ddp.no_sync())
    if system in ("fsdp2", "fsdp2_noreshard"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        # HSDP (--mesh R,S): FSDP2 shards along dim 1 and replicates along dim 0.
        mesh = hsdp_mesh if hsdp_mesh is not None else init_device_mesh(
            device.type, (dist.get_world_size(),))
        reshard = system == "fsdp2"
        fsdp2_mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                    if bf16 else MixedPrecisionPolicy())
        for block in model.blocks:
            fsdp2_fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=fsdp2_mp)
        fsdp2_fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=fsdp2_mp)
        opt = _optimizer(a, model.parameters())
        return model, opt, torch_clip(model), lambda last: contextlib.nullcontext()
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def _run_system(rank: int, world: int, device: torch.device, system: str, a: dict[str, Any],
                kind: str) -> dict[str, Any]:
    """``kind="time"``: warm-up + timed steps, nothing else running. ``kind="measure"``: a few
    untimed steps; bytes counted on the last one; memory recorded."""
    from comm_counter import CommCounter

    result: dict[str, Any] = {"rank": rank, "rss_base_kib": _read_status_kib("VmRSS")}
    model, opt, clip, micro_context = _build(system, device, a)
    gc.collect()
    result["rss_after_build_kib"] = _read_status_kib("VmRSS")
    result["hwm_reset"] = _reset_rss_hwm()
    if device.type == "cuda":
        torch.cuda.synchronize()
        result["cuda_peak_build"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    counter = CommCounter()
    micro = a["micro_batches"]
    num_steps = {"measure": a["measure_steps"], "time": a["warmup"] + a["steps"],
                 "profile": a["warmup"] + a["profile_steps"],
                 "peak": max(a["warmup"], 1) + PEAK_TRIES}[kind]
    peak_tracer = PeakTracer() if kind == "peak" and rank == 0 else None
    # DDP and ZeRO-1 hold fp32 weights: bf16 compute for them is autocast (FSDP2 and ours cast
    # the weights once per gather/refresh instead).
    autocast = (a["mp"] == "bf16" and system in ("ddp", "zero1"))
    profiler = None
    if kind == "profile" and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU])
    ranges = kind == "profile"  # bench:: ranges, only where a profiler may run
    losses, times = [], []
    for step in range(num_steps):
        if profiler is not None and step == a["warmup"]:
            profiler.start()
        if peak_tracer is not None and step >= num_steps - PEAK_TRIES:
            peak_tracer.start()
        batches = [_make_batch(a, step, i, rank, device) for i in range(micro)]
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        counting = kind == "measure" and step == num_steps - 1
        start = time.perf_counter()
        with counter if counting else contextlib.nullcontext(), _range("bench::step", ranges):
            loss_sum = torch.zeros((), device=device)
            for i, tokens in enumerate(batches):
                with micro_context(i == micro - 1):
                    with _range("bench::forward", ranges), (
                            torch.autocast(device.type, dtype=torch.bfloat16) if autocast
                            else contextlib.nullcontext()):
                        loss = _loss(a, model, tokens) / micro
                    with _range("bench::backward", ranges):
                        loss.backward()
                loss_sum += loss.detach()
            with _range("bench::optimizer", ranges):
                clip()
                opt.step()
                opt.zero_grad(set_to_none=a["zero_grad"] == "none")
            if device.type == "cuda":
                torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss_sum.item())
        if peak_tracer is not None:
            peak_tracer.stop()
    if profiler is not None:
        profiler.stop()
        result["profile"] = profile_breakdown(profiler.events(), a["profile_steps"])
    if peak_tracer is not None:
        result["peak_breakdown"] = peak_tracer.result()
    result.update(kind=kind, losses=losses, times=times)
    if kind == "measure":
        result["comm"] = counter.stats.as_dict()
        result["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result["train_hwm_kib"] = _read_status_kib("VmHWM") if result["hwm_reset"] else None
        if device.type == "cuda":
            result["cuda_peak_train"] = torch.cuda.max_memory_allocated(device)
        if system in OURS:
            import megatron_fsdp_v2 as mfsdp

            r = mfsdp.memory_report(model)
            result["memory_report"] = {k: getattr(r, k) for k in (
                "model_weights", "main_weights", "main_grads", "temporary_peak", "padding")}
            result["memory_report"]["total"] = r.total
    return result


def _rank_entry(rank: int, world: int, init_file: str, system: str, a: dict[str, Any], kind: str,
                results: Any) -> None:
    use_cuda = a["device"] == "cuda"
    torch.set_num_threads(a["threads"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        if use_cuda:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=a["timeout"]),
                                    device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=a["timeout"]))
        results.put((rank, "ok", _run_system(rank, world, device, system, a, kind)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # the result is in the pipe
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown (seconds with torch loaded); nothing is left to do


# ----------------------------------------------------------------------------- parent side

def launch(system: str, a: dict[str, Any],
           kind: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Run one system on ``world_size`` fresh processes; (per-rank results, None) or
    (None, error)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = a["world_size"]
    outcomes: dict[int, tuple[str, Any]] = {}
    # Children read the environment at exec time; see the memory note in the module docstring.
    env_extra = {}
    if kind == "measure" and a["device"] == "cpu" and a["malloc_mmap_threshold"] > 0:
        env_extra["MALLOC_MMAP_THRESHOLD_"] = str(a["malloc_mmap_threshold"])
    saved = {k: os.environ.get(k) for k in env_extra}
    os.environ.update(env_extra)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "rendezvous")
            procs = [ctx.Process(target=_rank_entry,
                                 args=(r, world, init_file, system, a, kind, results), daemon=True)
                     for r in range(world)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + a["timeout"]
            try:
                while len(outcomes) < world and time.monotonic() < deadline:
                    try:
                        rank, status, payload = results.get(timeout=1.0)
                    except queue.Empty:
                        if all(not p.is_alive() for p in procs) and results.empty():
                            break
                        continue
                    outcomes[rank] = (status, payload)
                    if status == "error":
                        # Let the others report, briefly.
                        deadline = min(deadline, time.monotonic() + 10)
            finally:
                for p in procs:
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
                        p.join()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = [f"rank {r}: {payload}" for r, (s, payload) in sorted(outcomes.items())
              if s == "error"]
    if errors:
        return None, errors[0]
    missing = [r for r in range(world) if r not in outcomes]
    if missing:
        return None, f"ranks {missing} did not finish within {a['timeout']}s"
    return [outcomes[r][1] for r in range(world)], None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


def expected_comm_bytes(system: str, num_params: int, n: int, m: int,
                        mesh: tuple[int, int] | None = None, mp: str = "fp32") -> float:
    """Ring bytes per rank per step for fp32 parameters/gradients of ``num_params`` elements
    (no padding, no clipping all-reduce), from each system's collective pattern. With an HSDP
    ``mesh`` (R, S), ours and FSDP2 shard over S and all-reduce over R. With ``mp="bf16"``, ours
    and FSDP2 gather bf16 weights (half the bytes); gradients are reduced in fp32 everywhere and
    ZeRO-1 broadcasts its fp32 parameters."""
    w = 0.5 if mp == "bf16" else 1.0  # bytes of a gathered weight relative to fp32
    if mesh is not None and (system in OURS or system.startswith("fsdp2")):
        r, sz = mesh
        full = 4.0 * num_params
        psi_s = full * (sz - 1) / sz  # one all-gather or reduce-scatter over the inner axis
        outer_shard = 2 * (full / sz) * (r - 1) / r  # all-reduce of a shard over the replicas
        outer_full = 2 * full * (r - 1) / r
        return {
            "no_shard": 2 * psi_s + outer_full,  # inner all-reduce, then the outer one
            "optim": (1 + w) * psi_s + outer_shard,
            "optim_grads": (m + w) * psi_s + outer_shard,
            "optim_grads_params": m * (1 + 2 * w) * psi_s + outer_shard,
            # FSDP2 all-reduces over the replicas after every micro-batch's reduce-scatter.
            "fsdp2_noreshard": m * ((1 + w) * psi_s + outer_shard),
            "fsdp2": m * ((1 + 2 * w) * psi_s + outer_shard),
        }[system]
    psi = 4.0 * num_params * (n - 1) / n  # one all-gather or reduce-scatter of everything
    return psi * {
        "no_shard": 2,                  # 1 all-reduce
        "ddp": 2,                       # 1 all-reduce (no_sync on all but the last micro-batch)
        "optim": 1 + w,                 # 1 reduce-scatter + 1 all-gather
        "zero1": 3,                     # 1 all-reduce + broadcasts of every partition
        "optim_grads": m + w,           # m reduce-scatters + 1 all-gather
        "fsdp2_noreshard": m * (1 + w),  # per micro-batch: 1 all-gather + 1 reduce-scatter
        "optim_grads_params": m * (1 + 2 * w),  # per micro-batch: 2 all-gathers + 1 RS
        "fsdp2": m * (1 + 2 * w),
    }[system]


def label_of(system: str, a: dict[str, Any]) -> str:
    """The table label: ``(HSDP RxS)`` appended to the systems that run on the 2-D mesh."""
    mesh = a.get("mesh")
    label = SYSTEMS[system]
    if system in OURS and a.get("fsdp_kwargs"):
        label += " (" + ", ".join(f"{k}={v!r}" for k, v in a["fsdp_kwargs"].items()) + ")"
    if mesh and (system in OURS or system.startswith("fsdp2")):
        return f"{label} (HSDP {mesh[0]}x{mesh[1]})"
    return label


def summarize(system: str, measured: list[dict[str, Any]], timed_runs: list[list[dict[str, Any]]],
              a: dict[str, Any]) -> dict[str, Any]:
    """Aggregate one system: its measurement run (per-rank results) and its timing runs."""
    timed: list[float] = []
    round_medians: list[float] = []  # one per timing round, for paired_round_ratios
    curves: list[list[float]] = []
    for ranks in [measured] + timed_runs:
        steps = len(ranks[0]["losses"])
        curves.append([statistics.fmean(r["losses"][s] for r in ranks) for s in range(steps)])
    for ranks in timed_runs:
        per_step = [max(r["times"][s] for r in ranks) for s in range(len(ranks[0]["times"]))]
        timed += per_step[a["warmup"]:]
        if per_step[a["warmup"]:]:
            round_medians.append(statistics.median(per_step[a["warmup"]:]))
    longest = max(curves, key=len)
    comm = max((r["comm"] for r in measured), key=lambda c: c["total_wire_bytes"])
    tokens = (a["world_size"] * a["micro_batches"] * a["batch_size"]
              * (a["seq_len"] if a["model"] == "gpt" else 1))  # units: rows
    out: dict[str, Any] = {
        "system": system,
        "label": label_of(system, a),
        "comm": comm,
        "comm_mib": comm["total_wire_bytes"] / MiB,
        "comm_expected_mib": expected_comm_bytes(system, a["num_params"], a["world_size"],
                                                 a["micro_batches"], a.get("mesh"),
                                                 a["mp"]) / MiB,
        "losses": longest,
        "loss_run_spread": max(abs(x - y) for c in curves for x, y in zip(c, longest)),
        "per_rank": [{k: v for k, v in r.items() if k not in ("losses", "times")}
                     for r in measured],
    }
    if timed:
        q = statistics.quantiles(timed, n=4) if len(timed) >= 2 else [timed[0]] * 3
        out.update(step_s_median=statistics.median(timed), step_s_p25=q[0], step_s_p75=q[2],
                   step_s_all=timed, step_s_round_medians=round_medians,
                   tokens_per_s=tokens / statistics.median(timed))
    if a["device"] == "cuda":
        out["peak_mib"] = max(max(r["cuda_peak_build"], r["cuda_peak_train"])
                              for r in measured) / MiB
        out["peak_above_base_mib"] = out["peak_mib"]
        out["train_peak_mib"] = max(r["cuda_peak_train"] for r in measured) / MiB
    else:
        out["peak_mib"] = max(r["peak_rss_kib"] for r in measured) / 1024
        out["peak_above_base_mib"] = max(r["peak_rss_kib"] - r["rss_base_kib"]
                                         for r in measured) / 1024
        out["base_mib"] = max(r["rss_base_kib"] for r in measured) / 1024
        out["train_peak_mib"] = (max(r["train_hwm_kib"] for r in measured) / 1024
                                 if measured[0]["train_hwm_kib"] is not None else None)
        out["peak_per_rank_mib"] = [r["peak_rss_kib"] / 1024 for r in measured]
    if "memory_report" in measured[0]:
        out["memory_report_mib"] = {k: v / MiB for k, v in measured[0]["memory_report"].items()}
    return out


def _fmt_calls(calls: dict[str, int]) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}
    return " ".join(f"{short.get(k, k)}{v}" for k, v in sorted(calls.items())) or "-"


def _ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}x" if x is not None and y else "n/a"


def paired_round_ratios(ours: dict[str, Any], peer: dict[str, Any]) -> list[float]:
    """Step time ours / peer per timing round: each round's median against the peer's median
    in the same round. A round runs the systems back to back, so a machine that is slower
    for a while (other load, 4 ranks sharing 2 cores) slows both sides of a ratio alike; the
    spread of these ratios is what a difference must exceed to be real."""
    xs = ours.get("step_s_round_medians") or []
    ys = peer.get("step_s_round_medians") or []
    return [x / y for x, y in zip(xs, ys) if y]


def _step_ratio(ours: dict[str, Any], peer: dict[str, Any]) -> str:
    """The median ratio, and with two rounds or more the range of the per-round ratios."""
    text = _ratio(ours.get("step_s_median"), peer.get("step_s_median"))
    rounds = paired_round_ratios(ours, peer)
    if len(rounds) >= 2:
        text += f" [{min(rounds):.2f}-{max(rounds):.2f}]"
    return text


_MP_DESC = {"fp32": "fp32",
            "bf16": "bf16 compute with fp32 main weights and fp32 gradient reduction (DDP and "
                    "ZeRO-1: autocast)"}
_PROFILE_COLUMNS = (("step", "step"), ("forward", "forward"), ("backward", "backward"),
                    ("comm", "exposed comm"), ("optimizer", "optimizer step"),
                    ("kernels", "copy kernels"))


def render_profile(summary: dict[str, Any], a: dict[str, Any]) -> list[str]:
    """The --profile table: ms per step of each category (see [Note: profile breakdown]), each
    of ours next to its peer, with the ratio."""
    profiles = summary["profiles"]
    if not profiles:
        return []
    lines = ["", f"Profile (rank 0, torch.profiler CPU trace of {a['profile_steps']} step(s) "
             "after the warm-up, one more fresh run per system; ms per step; ratio = ours / "
             "peer):", "",
             "| system | " + " | ".join(h for _, h in _PROFILE_COLUMNS)
             + " | copy-kernel share |",
             "|---" * (len(_PROFILE_COLUMNS) + 2) + "|"]

    def cell(name: str, key: str) -> str:
        value = profiles[name][key]
        if key == "comm":
            split = "/".join(f"{profiles[name]['comm_' + p]:.1f}"
                             for p in ("forward", "backward", "optimizer"))
            return f"{value:.1f}{'' if name in OURS else ' (min)'} [{split}]"
        return f"{value:.1f}"

    def row(name: str) -> str:
        pr = profiles[name]
        share = f"{pr['kernels'] / pr['step']:.1%}" if pr["step"] else "n/a"
        return (f"| {label_of(name, a)} | "
                + " | ".join(cell(name, k) for k, _ in _PROFILE_COLUMNS) + f" | {share} |")

    done: set[str] = set()
    for ours, peer in PEERS.items():
        pair = [n for n in (ours, peer) if n in profiles]
        for name in pair:
            if name not in done:
                lines.append(row(name))
                done.add(name)
        if len(pair) == 2:
            o, p = profiles[ours], profiles[peer]
            lines.append(f"| ratio {ours} / {peer} | " + " | ".join(
                "n/a" if k == "comm" else _ratio(o[k], p[k]) for k, _ in _PROFILE_COLUMNS)
                + " | |")
    for name in profiles:
        if name not in done:
            lines.append(row(name))
    lines += ["", "exposed comm: [in forward/backward/optimizer step]; (min): the peer's waits "
              "on asynchronous collectives are not named in a CPU trace and count as forward or "
              "backward time (see [Note: profile breakdown] in this file). copy kernels: "
              "megatron_fsdp_v2:: ops for ours, fsdp:: copy-in/out ops for FSDP2.",
              "", "Exposed communication counted (ms per step, by range name): " + "; ".join(
        f"{n}: " + ", ".join(f"{k} {v:.1f}" for k, v in pr["comm_names"].items())
        for n, pr in profiles.items()) + "."]
    return lines


def render_matrix(summaries: list[dict[str, Any]]) -> str:
    """One line per configuration: step-time and peak-above-base ratios of ours to each peer."""
    systems = summaries[0]["config"]["systems"]
    pairs = [(o, p) for o, p in PEERS.items() if o in systems and p in systems]
    lines = ["## Matrix: ours / peer (step time [per-round range], peak RSS above base)", "",
             "| world | mp | micro-batches | " + " | ".join(f"{o} / {p}" for o, p in pairs) + " |",
             "|---|---|---|" + "---|" * len(pairs)]
    for summary in summaries:
        a, rows = summary["config"], summary["systems"]
        cells = []
        for o, p in pairs:
            if o in rows and p in rows:
                step = _step_ratio(rows[o], rows[p])
                peak = _ratio(rows[o]["peak_above_base_mib"], rows[p]["peak_above_base_mib"])
                cells.append(f"{step}, {peak}")
            else:
                cells.append("n/a")
        lines.append(f"| {a['world_size']} | {a['mp']} | {a['micro_batches']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_peaks(summary: dict[str, Any]) -> list[str]:
    """The --peak-breakdown table: each system's live-tensor peak of one step and the MiB at
    that peak per allocating op (see [Note: peak breakdown])."""
    peaks = {s: p for s, p in summary.get("peaks", {}).items() if "peak_mib" in p}
    failed = {s: p["errors"] for s, p in summary.get("peaks", {}).items() if s not in peaks}
    if not peaks and not failed:
        return []
    names = list(peaks)
    ops: list[str] = []
    for p in peaks.values():
        ops += [op for op, mib in p["by_op_mib"].items() if mib >= 0.5 and op not in ops]
    lines = ["", "Live tensors at the peak of one step, rank 0, MiB by allocating op (tensors "
             "alive from before the step not included; see [Note: peak breakdown]):", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
             "| **peak** | " + " | ".join(f"**{peaks[n]['peak_mib']:.1f}**" for n in names) + " |"]
    for op in ops:
        lines.append(f"| {op} | " + " | ".join(
            f"{peaks[n]['by_op_mib'].get(op, 0.0):.1f}" for n in names) + " |")
    lines.append("| largest tensors | " + " | ".join(
        " ".join(f"{v:.1f}" for v in peaks[n]["largest_mib"][:6]) for n in names) + " |")
    lines += [f"- {s}: torch's memory replay failed on every try: {e}" for s, e in failed.items()]
    return lines


def render(summary: dict[str, Any], a: dict[str, Any]) -> str:
    rows, failures = summary["systems"], summary["failures"]
    cuda = a["device"] == "cuda"
    mem = "CUDA max allocated" if cuda else "RSS HWM"
    ddp = rows.get("ddp")
    lines = [
        f"## Training benchmark: {a['model_desc']}, world size "
        f"{a['world_size']} on {a['device_desc']}"
        + (f", HSDP mesh {a['mesh'][0]}x{a['mesh'][1]} (replicate x shard) for ours and FSDP2"
           if a.get("mesh") else ""),
        "",
        f"{a['micro_batches']} micro-batch(es) x {a['batch_desc']} per "
        f"rank per step, {_MP_DESC[a['mp']]}, {a['optimizer_desc']}, clip {a['clip']}. "
        f"Timing: {a['rounds']} "
        f"round(s) over the systems in alternating order, each run in fresh processes with "
        f"{a['warmup']} warm-up + {a['steps']} timed steps; median [interquartile range] of "
        f"the slowest rank's step time over all timed steps. Bytes and memory: one more fresh "
        f"run per system ({a['measure_steps']} untimed steps, bytes counted on the last).",
        "",
        f"| system | step ms | tokens/s | comm MiB/step/rank | expected | collectives/step "
        f"| peak {mem} MiB | peak above base MiB | our buffers MiB | max abs loss diff vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in a["systems"]:
        if name in failures:
            lines.append(f"| {label_of(name, a)} | excluded: {failures[name]} "
                         "| | | | | | | | |")
            continue
        r = rows[name]
        loss_diff = (f"{max(abs(x - y) for x, y in zip(r['losses'], ddp['losses'])):.1e}"
                     if ddp else "n/a")
        step = (f"{r['step_s_median'] * 1e3:.0f} "
                f"[{r['step_s_p25'] * 1e3:.0f}-{r['step_s_p75'] * 1e3:.0f}]"
                if "step_s_median" in r else "n/a")
        tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "n/a"
        buffers = f"{r['memory_report_mib']['total']:.1f}" if "memory_report_mib" in r else "-"
        lines.append(
            f"| {r['label']} | {step} | {tps} | {r['comm_mib']:.1f} | "
            f"{r['comm_expected_mib']:.1f} | {_fmt_calls(r['comm']['calls'])} | "
            f"{r['peak_mib']:.0f} | {r['peak_above_base_mib']:.0f} | {buffers} | {loss_diff} |")
    lines += ["", "Ratios, ours / closest peer (below 1: ours is faster, leaner or sends less; "
              "step time: the ratio of the medians over all timed steps, then [lowest-highest] "
              "of the per-round ratios, each round's median against the peer's in the same "
              "round):",
              "",
              "| ours | peer | step time | peak memory | peak above base | comm bytes |",
              "|---|---|---|---|---|---|"]
    for ours, peer in PEERS.items():
        if ours not in a["systems"] or peer not in a["systems"]:
            continue
        if ours not in rows or peer not in rows:
            missing = "ours" if ours not in rows else "peer"
            lines.append(f"| {label_of(ours, a)} | {label_of(peer, a)} | n/a ({missing} "
                         "excluded) | | | |")
            continue
        o, p = rows[ours], rows[peer]
        lines.append(f"| {o['label']} | {p['label']} | {_step_ratio(o, p)} | "
                     f"{_ratio(o['peak_mib'], p['peak_mib'])} | "
                     f"{_ratio(o['peak_above_base_mib'], p['peak_above_base_mib'])} | "
                     f"{_ratio(o['comm_mib'], p['comm_mib'])} |")
    if rows:
        names = [n for n in a["systems"] if n in rows]
        steps = max(len(rows[n]["losses"]) for n in names)
        lines += ["", "Loss curves (mean over ranks; timing runs):", "",
                  "| step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for s in range(steps):
            lines.append(f"| {s + 1} | " + " | ".join(
                f"{rows[n]['losses'][s]:.6f}" if s < len(rows[n]["losses"]) else ""
                for n in names) + " |")
    lines += render_profile(summary, a)
    lines += render_peaks(summary)
    notes = [
        "",
        "Notes:",
        "- comm: ring-algorithm bytes sent per rank in one steady-state step, counted for every "
        "system by one TorchDispatchMode over c10d ops (examples/comm_counter.py; it sees DDP's "
        "C++ reducer too): 2(N-1)/N*S per all-reduce, (N-1)/N*S per all-gather / reduce-scatter / "
        "broadcast of an S-byte buffer. expected: the same from each system's collective pattern "
        "(no padding, no clipping all-reduce; with bf16, weights are gathered in bf16).",
    ]
    if a.get("mesh"):
        notes.append(
            f"- HSDP {a['mesh'][0]}x{a['mesh'][1]}: ours shard over the {a['mesh'][1]} ranks of "
            "a replica and all-reduce the reduced gradient shard over the replicas once per step "
            "(outer no_shard); FSDP2's HSDP all-reduces over the replicas after every "
            "micro-batch's reduce-scatter. expected: inner ring bytes over S plus outer "
            "all-reduce bytes over R.")
    if cuda:
        notes.append("- peak memory: torch.cuda.max_memory_allocated over the whole run, max over "
                     "ranks.")
    else:
        base = min((r["base_mib"] for r in rows.values()), default=0.0)
        notes.append(
            "- peak memory: getrusage(RUSAGE_SELF).ru_maxrss of each rank's process, max over "
            "ranks, over the whole run: the torch runtime, the full fp32 model every rank builds "
            "before wrapping, and training. 'above base' subtracts the RSS before the model is "
            f"built ({base:.0f} MiB or more: the torch runtime). The measurement runs set "
            f"MALLOC_MMAP_THRESHOLD_={a['malloc_mmap_threshold']} so freed tensors leave the RSS "
            "(glibc would otherwise keep them in its heap, and RSS would depend on allocation "
            "order, not on live bytes); the timing runs use the default allocator settings.")
    notes.append("- our buffers: megatron_fsdp_v2.memory_report().total on rank 0 (model weights + "
                 "main weights + main grads + scratch-buffer peak).")
    notes.append(
        "- losses: every system starts from the same weights and data; 'max abs loss diff' is "
        "over all steps. Max difference of a system's curve between its own runs: "
        + ", ".join(f"{k} {v['loss_run_spread']:.1e}" for k, v in rows.items()) + ".")
    notes.append(f"- machine load average (1 min) at start / end: {a['load_start']:.1f} / "
                 f"{summary['load_end']:.1f} on {os.cpu_count()} cores; total wall time "
                 f"{summary['wall_s']:.0f} s.")
    for name, why in failures.items():
        notes.append(f"- {SYSTEMS[name]} excluded: {why}")
    return "\n".join(lines + notes) + "\n"


QUICK = dict(model_size="tiny", vocab=512, seq_len=32, warmup=1, steps=2, rounds=1)


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} takes positive integers separated by commas, got {text!r}")
    return values


def _literal_kwargs(p: argparse.ArgumentParser, text: str) -> dict[str, Any]:
    """``K=V,...`` with Python-literal values (``--fsdp-kwargs``)."""
    import ast

    kwargs: dict[str, Any] = {}
    for part in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = part.partition("=")
        try:
            if not sep or not key.strip().isidentifier():
                raise ValueError(part)
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            p.error(f"--fsdp-kwargs takes K=V pairs with Python-literal values, got {part!r}")
    return kwargs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    presets = ", ".join(f"{k} ({dim}x{layers})" for k, (dim, layers, _) in MODEL_SIZES.items())
    p.add_argument("--model", choices=["gpt", "units"], default="gpt",
                   help="gpt: the GPT of examples/model.py (--model-size); units: --units "
                        f"wrapped nn.Linear({UNIT_DIM}, {UNIT_DIM}) units (per-unit fixed cost)")
    p.add_argument("--units", type=int, default=64, help="units of --model units")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="AdamW (betas 0.9/0.95, weight decay 0.1) or SGD with momentum 0.9")
    p.add_argument("--model-size", default="medium", help=f"one of {presets}, or DIMxLAYERS")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads (default: from --model-size)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch per rank")
    p.add_argument("--micro-batches", default="1",
                   help="micro-batches per step; a comma-separated list (e.g. 1,4) runs each")
    p.add_argument("--world", "--world-size", dest="world", default="4",
                   help="ranks; a comma-separated list (e.g. 2,4) runs each")
    p.add_argument("--mp", default="fp32",
                   help="compute precision, fp32 or bf16 (bf16 compute weights, fp32 main "
                        "weights, fp32 reduction; DDP/ZeRO-1 use autocast); a comma-separated "
                        "list (fp32,bf16) runs each")
    p.add_argument("--matrix", action="store_true",
                   help="the full matrix: --world 2,4 --mp fp32,bf16 --micro-batches 1,4")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                   for k, v in QUICK.items())
                        + " (flags given explicitly win)")
    p.add_argument("--mesh", default=None, metavar="R,S",
                   help="HSDP on an R x S mesh (R x S = --world) for ours (outer no_shard) "
                        "and FSDP2 (its HSDP); default: 1-D over the world")
    p.add_argument("--fsdp-kwargs", default="", metavar="K=V,...",
                   help="extra fully_shard arguments for our systems, values as Python literals "
                        "(e.g. collective_impl='auto',enable_trace_pool=True)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated subset of: " + ", ".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps before the timed (or profiled) ones, per run")
    p.add_argument("--rounds", type=int, default=2,
                   help="timing rounds over the systems, alternating order")
    p.add_argument("--profile", action="store_true",
                   help="one more run per system with torch.profiler on rank 0: forward, "
                        "backward, exposed communication, optimizer step and copy kernels per "
                        "step, side by side with the peer")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps per system")
    p.add_argument("--peak-breakdown", action="store_true",
                   help="one more run per system: rank 0's live-tensor peak of one steady-state "
                        "step and the ops that allocated it (see [Note: peak breakdown])")
    p.add_argument("--zero-grad", choices=["none", "zeros"], default="none",
                   help="every system's optimizer.zero_grad between steps: none = "
                        "set_to_none=True (free gradient memory where the system can), zeros = "
                        "set_to_none=False (keep it allocated and zero it in place)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / world size)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=65536,
                   help="MALLOC_MMAP_THRESHOLD_ for the CPU memory runs (0: leave glibc's default)")
    p.add_argument("--timeout", type=int, default=600,
                   help="seconds allowed for one run of one system")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", default=None, help="write the table as markdown (and .json beside it)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    if args.matrix:
        args.world, args.mp, args.micro_batches = "2,4", "fp32,bf16", "1,4"
    args.fsdp_kwargs = _literal_kwargs(p, args.fsdp_kwargs)
    args.worlds = _int_list("--world", args.world)
    args.micro_batch_list = _int_list("--micro-batches", args.micro_batches)
    args.mps = [m.strip() for m in args.mp.split(",") if m.strip()]
    if not args.mps or any(m not in ("fp32", "bf16") for m in args.mps):
        p.error(f"--mp takes fp32, bf16 or both (fp32,bf16), got {args.mp!r}")
    if args.units < 1:
        p.error(f"--units must be >= 1, got {args.units}")
    if args.steps < 1 or args.rounds < 0 or args.warmup < 0 or args.profile_steps < 1:
        p.error("--steps and --profile-steps must be >= 1, --rounds and --warmup >= 0")
    if args.mesh is not None:
        try:
            shape = [int(v) for v in args.mesh.split(",")]
        except ValueError:
            shape = []
        if len(shape) != 2 or min(shape) < 1:
            p.error(f"--mesh takes R,S (e.g. 2,2), got {args.mesh!r}")
        if any(shape[0] * shape[1] != w for w in args.worlds):
            p.error(f"--mesh {args.mesh} needs --world {shape[0] * shape[1]}, "
                    f"got {args.world}")
        args.mesh = shape
    return args


def _run_config(a: dict[str, Any]) -> dict[str, Any]:
    """Measurement run, timing rounds and (``--profile``) profiling run of every system for one
    (world, mp, micro-batches) configuration; the summary ``render`` formats."""
    systems = a["systems"]
    print(f"== {a['model_desc']}; world size {a['world_size']} on {a['device_desc']}"
          f"{'; HSDP mesh ' + 'x'.join(map(str, a['mesh'])) if a.get('mesh') else ''}; "
          f"{a['mp']}, {a['micro_batches']} micro-batch(es); systems: {', '.join(systems)}; "
          f"1 measurement run + {a['rounds']} timing round(s) of {a['warmup']} warm-up + "
          f"{a['steps']} timed steps" + (" + 1 profiling run" if a["profile"] else ""),
          flush=True)
    measured: dict[str, list[dict[str, Any]]] = {}
    timed: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in systems}
    profiles: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    t_start = time.monotonic()
    plan = [("measure", systems)] + [("time", systems[::-1] if r % 2 == 0 else systems)
                                     for r in range(a["rounds"])]
    if a["profile"]:
        plan.append(("profile", systems))
    if a["peak_breakdown"]:
        plan.append(("peak", systems))
    peaks: dict[str, dict[str, Any]] = {}
    for i, (kind, order) in enumerate(plan):
        label = kind if kind != "time" else f"round {i}"
        for system in order:
            if system in failures:
                continue
            t0 = time.monotonic()
            ranks, error = launch(system, a, kind)
            if error is not None:
                failures[system] = _last_line(error)
                print(f"[{label}] {system}: FAILED ({failures[system]})\n{error}", flush=True)
                continue
            if kind == "measure":
                measured[system] = ranks
                c = max((r["comm"] for r in ranks), key=lambda c: c["total_wire_bytes"])
                if a["device"] == "cpu":
                    peak = "/".join(f"{r['peak_rss_kib'] / 1024:.0f}" for r in ranks) + " MiB RSS"
                else:
                    peak = ("/".join(f"{r['cuda_peak_train'] / MiB:.0f}" for r in ranks)
                            + " MiB CUDA")
                detail = (f"comm {c['total_wire_bytes'] / MiB:.1f} MiB ({_fmt_calls(c['calls'])}) "
                          f"| peak {peak}")
            elif kind == "time":
                timed[system].append(ranks)
                steps = [max(r["times"][s] for r in ranks) for s in range(len(ranks[0]["times"]))]
                detail = "step ms " + " ".join(f"{x * 1e3:.0f}" for x in steps[a["warmup"]:])
            elif kind == "peak":
                peaks[system] = ranks[0]["peak_breakdown"]
                pb = peaks[system]
                detail = (f"step's live-tensor peak {pb['peak_mib']:.1f} MiB" if "peak_mib" in pb
                          else f"peak breakdown failed: {pb['errors']}")
            else:
                profiles[system] = ranks[0]["profile"]
                pr = profiles[system]
                detail = "profile ms/step " + " ".join(
                    f"{k} {pr[k]:.1f}" for k in ("step", "forward", "backward", "comm",
                                                 "optimizer"))
            loss = statistics.fmean(r["losses"][-1] for r in ranks)
            print(f"[{label:8s}] {system:20s} {detail} | loss {loss:.6f} "
                  f"| {time.monotonic() - t0:.0f}s", flush=True)
    return {"config": a,
            "systems": {s: summarize(s, measured[s], timed[s], a)
                        for s in systems if s not in failures},
            "profiles": profiles,
            "peaks": peaks,
            "failures": failures,
            "wall_s": time.monotonic() - t_start,
            "load_end": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_size in MODEL_SIZES:
        dim, layers, heads = MODEL_SIZES[args.model_size]
    else:
        try:
            dim, layers = (int(x) for x in args.model_size.lower().split("x"))
        except ValueError:
            raise SystemExit(
                f"--model-size {args.model_size!r}: use a preset or DIMxLAYERS") from None
        heads = max(1, dim // 64)
    heads = args.heads or heads
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < max(args.worlds):
        raise SystemExit(f"--world {max(args.worlds)} needs as many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    cores = len(os.sched_getaffinity(0))
    shape = dict(vars(args), dim=dim, layers=layers, heads=heads)
    with torch.device("meta"):
        num_params = _make_model(shape).num_params()  # type: ignore[operator]
    if args.model == "units":
        model_desc = (f"{args.units} wrapped nn.Linear({UNIT_DIM}, {UNIT_DIM}) units "
                      f"({num_params:,} parameters)")
        batch_desc = f"{args.batch_size} rows of {UNIT_DIM} (MSE)"
    else:
        model_desc = (f"{num_params / 1e6:.1f}M-param GPT (dim {dim}, {layers} blocks, "
                      f"{heads} heads, vocab {args.vocab})")
        batch_desc = f"{args.batch_size} x {args.seq_len} tokens"
    optimizer_desc = "AdamW" if args.optimizer == "adamw" else "SGD (momentum 0.9)"
    optimizer_desc += (", zero_grad(set_to_none=True)" if args.zero_grad == "none"
                       else ", zero_grad(set_to_none=False)")
    summaries, tables = [], []
    for world in args.worlds:
        for mp_name in args.mps:
            for micro in args.micro_batch_list:
                threads = args.threads or max(1, cores // world)
                device_desc = (f"{world}x {torch.cuda.get_device_name(0)} (NCCL)"
                               if device == "cuda"
                               else f"CPU ({cores} cores, {threads} thread(s) per rank, gloo)")
                a = dict(vars(args), dim=dim, layers=layers, heads=heads, device=device,
                         threads=threads, systems=systems, device_desc=device_desc,
                         num_params=num_params, world_size=world, mp=mp_name,
                         model_desc=model_desc, batch_desc=batch_desc,
                         optimizer_desc=optimizer_desc,
                         micro_batches=micro, measure_steps=max(3, args.warmup + 1),
                         load_start=os.getloadavg()[0], torch_version=torch.__version__)
                summary = _run_config(a)
                summaries.append(summary)
                tables.append(render(summary, a))
                print()
                print(tables[-1], flush=True)
    if len(summaries) > 1:
        tables.append(render_matrix(summaries))
        print(tables[-1])
    if args.out:
        out = os.path.abspath(args.out)
        md = out if out.endswith(".md") else out + ".md"
        os.makedirs(os.path.dirname(md), exist_ok=True)
        with open(md, "w") as f:
            f.write("\n".join(tables))
        with open(os.path.splitext(md)[0] + ".json", "w") as f:
            json.dump(summaries, f, indent=1)
        print(f"wrote {md} and {os.path.splitext(md)[0]}.json")
    return 1 if any(s["failures"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
