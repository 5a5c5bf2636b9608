"""Micro-benchmark of the collectives behind ``fully_shard(..., collective_impl=...)``.

For each backend (gloo on CPU; NCCL too when CUDA has enough GPUs), world size and buffer size,
spawned ranks time, on one flat fp32 buffer of that size:

  * ``RS``       reduce_scatter_tensor of the buffer into a shard
  * ``AR``       all_reduce of the same buffer in place (the ``auto`` reduce-scatter on gloo)
  * ``AG``       all_gather_into_tensor of a shard into the buffer (ZeRO-3 gather)
  * ``AG-in``    the same, in place (the shard is the rank's slot of the buffer: the refresh)
  * ``bcast``    one broadcast per rank from its slot, issued asynchronously, waited together
                 (the ``auto`` all-gather on gloo)

Each figure is the median over ``--reps`` repetitions (after one warm-up) of the slowest rank's
time. The table prints the times, the ratios native / substitute (> 1: the substitute is
faster) and the decision ``megatron_fsdp_v2._comm._collective_impl.RULES`` makes at that point.

    python benchmarks/bench_collectives.py                      # gloo, worlds 2 and 4 (~1 min)
    python benchmarks/bench_collectives.py --world 2 3 4 --reps 9 --sizes 16K 1M 16M 128M
    python benchmarks/bench_collectives.py --check-bitwise --world 3 4   # RS vs AR bits

``--check-bitwise`` compares, at every point, this rank's slot of the all-reduced buffer with
the reduce-scatter's output, bit for bit, on random data of mixed magnitudes (fp32 and bf16):
the ``auto`` reduce-scatter substitution claims they are equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_fsdp_v2._comm._collective_impl import (  # noqa: E402
    ALL_GATHER,
    REDUCE_SCATTER,
    choose,
)

OPS = ("RS", "AR", "AG", "AG-in", "bcast")
# torch 2.14 renamed the flat-tensor collectives (the old names warn).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} B"


def _broadcasts(buf: torch.Tensor, world: int) -> None:
    n = buf.numel() // world
    works = [dist.broadcast(buf[r * n : (r + 1) * n], src=r, async_op=True) for r in range(world)]
    for work in works:
        assert work is not None
        work.wait()


def _time(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median over ``reps`` of the slowest rank's seconds for ``fn`` (one warm-up first)."""
    times = []
    for i in range(reps + 1):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i > 0:
            times.append(float(elapsed.item()))
    return statistics.median(times)


def _time_point(n: int, world: int, rank: int, reps: int, device: torch.device
                ) -> dict[str, float]:
    """Every op of :data:`OPS` on an ``n``-element fp32 buffer."""
    buf = torch.randn(n, device=device)
    shard = torch.randn(n // world, device=device)
    own = buf[rank * (n // world) : (rank + 1) * (n // world)]
    ops: dict[str, Callable[[], object]] = {
        "RS": lambda: _reduce_scatter_single(shard, buf),
        "AR": lambda: dist.all_reduce(buf),
        "AG": lambda: _all_gather_single(buf, shard),
        "AG-in": lambda: _all_gather_single(buf, own),
        "bcast": lambda: _broadcasts(buf, world),
    }
    return {name: _time(fn, reps, device) for name, fn in ops.items()}


def _mixed(n: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-4, 4, (n,), generator=g).double()
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def _rank_main(rank: int, world: int, backend: str, init_file: str, sizes: list[int], reps: int,
               check_bitwise: bool, results: Any) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    rows = []
    for nbytes in sizes:
        # fp32 elements, a multiple of world (``nbytes`` rounded down: the table shows nbytes)
        n = max(world, nbytes // 4 // world * world)
        if check_bitwise:
            for dtype in (torch.float32, torch.bfloat16):
                x = _mixed(n, dtype, 1000 + rank, device)
                reduced = x.clone()
                dist.all_reduce(reduced)
                shard = torch.empty(n // world, dtype=dtype, device=device)
                _reduce_scatter_single(shard, x)
                mine = reduced[rank * (n // world) : (rank + 1) * (n // world)]
                same = torch.tensor([int(torch.equal(mine, shard))], device=device)
                dist.all_reduce(same, op=dist.ReduceOp.MIN)
                rows.append((nbytes, str(dtype).removeprefix("torch."), bool(same.item())))
            continue
        rows.append((nbytes, _time_point(n, world, rank, reps, device)))
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _run(backend: str, world: int, sizes: list[int], reps: int, check_bitwise: bool) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(r, world, backend, init_file, sizes, reps,
                                                      check_bitwise, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = results.get(timeout=1800)
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"{backend} world {world}: a rank exited with {p.exitcode}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["16K", "256K", "4M", "32M", "128M"],
                        help="full buffer sizes (bytes; K/M/G suffixes)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", nargs="+", default=None,
                        help="default: gloo, and nccl when CUDA has enough devices")
    parser.add_argument("--check-bitwise", action="store_true",
                        help="compare all-reduce slots with reduce-scatter outputs bit for bit")
    args = parser.parse_args()
    sizes = [_parse_size(s) for s in args.sizes]
    backends = args.backend or ["gloo"] + (["nccl"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, median of {args.reps} reps "
          "(slowest rank), fp32 buffers")
    for backend in backends:
        for world in args.world:
            if backend == "nccl" and torch.cuda.device_count() < world:
                print(f"nccl world {world}: skipped ({torch.cuda.device_count()} GPUs)")
                continue
            rows = _run(backend, world, sizes, args.reps, args.check_bitwise)
            if args.check_bitwise:
                for nbytes, dtype, same in rows:
                    verdict = "identical" if same else "DIFFERENT"
                    print(f"{backend} world {world} {_human(nbytes):>9} {dtype:>8}: all-reduce "
                          f"slot vs reduce-scatter {verdict}")
                continue
            print(f"\n{backend}, world {world}")
            print(f"{'bytes':>9} " + " ".join(f"{op + ' ms':>9}" for op in OPS)
                  + f" {'RS/AR':>6} {'AG/bc':>6} {'AGin/bc':>7}  auto: RS as, AG as")
            for nbytes, t in rows:
                ms = " ".join(f"{t[op] * 1e3:9.2f}" for op in OPS)
                rs_as = choose("auto", backend, REDUCE_SCATTER, nbytes, world)
                ag_as = choose("auto", backend, ALL_GATHER, nbytes, world)
                print(f"{_human(nbytes):>9} {ms} {t['RS'] / t['AR']:6.2f} "
                      f"{t['AG'] / t['bcast']:6.2f} {t['AG-in'] / t['bcast']:7.2f}  "
                      f"{rs_as}, {ag_as}")


if __name__ == "__main__":
    main()
