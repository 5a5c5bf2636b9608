"""Benchmark the megatron_fsdp_v2 flat-buffer kernels against the ATen ops FSDP2 uses.

Each job is timed three ways in one run:
  * ours      -- megatron_fsdp_v2.ops (the C++/CUDA kernels, or the reference ops
                 when MFSDP_USE_REFERENCE_OPS=1 / no extension),
  * baselines -- the ATen ops PyTorch FSDP2 uses for the same job
                 (_foreach_copy_ onto views, _chunk_cat, Tensor.copy_ with a cast,
                 _foreach_add_, _foreach_norm, ...),
  * plain     -- a same-dtype fp32 ``dst.copy_(src)`` moving the same number of bytes
                 (on CUDA: the device-to-device copy bandwidth).

Inputs: the parameter list of a 12-layer, 768-wide GPT (50304-token embedding,
~124M parameters, 147 tensors) and one large flat buffer (64M fp32 elements on
CPU, 512M on CUDA). "bytes" counts bytes read plus bytes written (an accumulating
destination is read and written). Times are medians over --iters after warm-up.

The fp8 suite (``--suite fp8``, also part of ``all``) times ``fp8_quantize_`` (fp32
main-weight shard -> float8_e4m3fn with its amax, one pass) against torch's two-pass
expression, ``(x * scale).clamp(-max, max).to(fp8)`` plus ``x.abs().amax()``: for one
shard and for a flat group of 64 shards (one call against a per-shard loop and against
the ``_foreach_*`` equivalent), at each of --fp8-numels elements.

    python benchmarks/bench_kernels.py --device cpu --iters 10
    python benchmarks/bench_kernels.py --device cuda --iters 50 --dtype bfloat16
    python benchmarks/bench_kernels.py --suite fp8 --threads 2 --fp8-numels 1M,16M
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import megatron_fsdp_v2.ops as mops

ALIGN = 64  # elements; parameters start on aligned offsets in the flat buffer


@dataclass
class Job:
    name: str
    nbytes: int
    ours: Callable[[], object]
    baselines: dict[str, Callable[[], object]] = field(default_factory=dict)


def gpt_param_shapes(layers: int = 12, hidden: int = 768, vocab: int = 50304) -> list[tuple]:
    shapes: list[tuple] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden,)]                       # ln1 weight, bias
        shapes += [(3 * hidden, hidden), (3 * hidden,)]        # qkv
        shapes += [(hidden, hidden), (hidden,)]                # attention proj
        shapes += [(hidden,), (hidden,)]                       # ln2 weight, bias
        shapes += [(4 * hidden, hidden), (4 * hidden,)]        # fc1
        shapes += [(hidden, 4 * hidden), (hidden,)]            # fc2
    shapes += [(hidden,), (hidden,)]                           # final layer norm
    return shapes


def aligned_offsets(numels: list[int]) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for n in numels:
        offsets.append(cursor)
        cursor += (n + ALIGN - 1) // ALIGN * ALIGN
    return offsets, cursor


def make_timer(device: torch.device, iters: int, warmup: int):
    """Returns time_round_robin(fns) -> median seconds per fn.

    The functions of one job are timed in interleaved rounds (a, b, c, a, b, c, ...)
    so that noise from other processes on a shared machine hits all of them alike.
    """

    def once(fn: Callable) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        start_s = time.perf_counter()
        fn()
        return time.perf_counter() - start_s

    def time_round_robin(fns: list[Callable]) -> list[float]:
        for fn in fns:
            for _ in range(warmup):
                fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(iters):
            for i, fn in enumerate(fns):
                samples[i].append(once(fn))
        return [statistics.median(s) for s in samples]

    return time_round_robin


def build_jobs(device: torch.device, dtype: torch.dtype, flat_numel: int) -> list[Job]:
    f32 = torch.float32
    dt_name = str(dtype).removeprefix("torch.")
    e32, edt = 4, torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=f32):
        return torch.randn(*shape, generator=gen, device=device, dtype=f32).to(dtype)

    shapes = gpt_param_shapes()
    params = [randn(*s) for s in shapes]                    # fp32 main weights / inputs
    grads = [randn(*s) for s in shapes]                     # fp32 unsharded grads
    numels = [p.numel() for p in params]
    n_param = sum(numels)
    offsets, flat_len = aligned_offsets(numels)

    flat32 = torch.zeros(flat_len, device=device)
    flat_dt = torch.zeros(flat_len, device=device, dtype=dtype)
    views32 = [flat32.narrow(0, o, n) for o, n in zip(offsets, numels)]
    views_dt = [flat_dt.narrow(0, o, n) for o, n in zip(offsets, numels)]
    packed_dt = torch.zeros(n_param, device=device, dtype=dtype)  # gap-free, for _chunk_cat
    grads_1d = [g.view(-1) for g in grads]
    params_1d = [p.view(-1) for p in params]
    pre = 1.0 / 8

    big32 = randn(flat_numel)
    big_dt = randn(flat_numel, dtype=dtype)
    big_out32 = torch.zeros(flat_numel, device=device)
    big_out_dt = torch.zeros(flat_numel, device=device, dtype=dtype)

    # Many small tensors (a unit of biases and norms): the per-call cost of the op's argument
    # checks and dispatch, not bandwidth.
    tiny = [randn(4) for _ in range(512)]
    tiny_offsets, tiny_len = aligned_offsets([4] * len(tiny))
    tiny_flat = torch.zeros(tiny_len, device=device)
    tiny_views = [tiny_flat.narrow(0, o, 4) for o in tiny_offsets]

    def chunk_cat_copy_in():
        # FSDP2 foreach_reduce: cast grads to the reduce dtype, _chunk_cat, pre-divide.
        cast = [g.to(dtype) for g in grads_1d]
        torch._chunk_cat(cast, 0, 1, out=packed_dt.view(1, -1))
        packed_dt.mul_(pre)

    def foreach_cast_scale():
        torch._foreach_copy_(views_dt, grads_1d)
        torch._foreach_mul_(views_dt, pre)

    def norm_sum_of_squares():
        return torch.stack(torch._foreach_norm(grads, 2)).square().sum()

    return [
        Job(
            "pack f32->f32 (weight copy-in)",
            n_param * 2 * e32,
            lambda: mops.pack_(params, offsets, flat32),
            {
                "_foreach_copy_ (views)": lambda: torch._foreach_copy_(views32, params_1d),
                "torch.cat(out=)": lambda: torch.cat(params_1d, out=flat32[:n_param]),
            },
        ),
        Job(
            "pack f32->f32, 512 tensors of 4 (per-call cost)",
            len(tiny) * 4 * 2 * e32,
            lambda: mops.pack_(tiny, tiny_offsets, tiny_flat),
            {"_foreach_copy_ (views)": lambda: torch._foreach_copy_(tiny_views, tiny)},
        ),
        Job(
            f"pack f32->{dt_name} x1/8 (grad -> RS input)",
            n_param * (e32 + edt),
            lambda: mops.pack_(grads, offsets, flat_dt, scale=pre),
            {
                "cast+_chunk_cat+mul_ (FSDP2)": chunk_cat_copy_in,
                "_foreach_copy_+_foreach_mul_": foreach_cast_scale,
            },
        ),
        Job(
            "pack f32 accumulate (grad acc)",
            n_param * 3 * e32,
            lambda: mops.pack_(grads, offsets, flat32, accumulate=True),
            {"_foreach_add_ (views)": lambda: torch._foreach_add_(views32, grads_1d)},
        ),
        Job(
            f"refresh_from_shard f32->{dt_name}",
            flat_numel * (e32 + edt),
            lambda: mops.refresh_from_shard_(big32, big_out_dt, 0),
            {"copy_ (cast)": lambda: big_out_dt.copy_(big32)},
        ),
        Job(
            f"rs_copy_in f32->{dt_name} x1/8",
            flat_numel * (e32 + edt),
            lambda: mops.reduce_scatter_copy_in_(big32, big_out_dt, pre_scale=pre),
            {
                "torch.mul(out=)": lambda: torch.mul(big32, pre, out=big_out_dt),
                "copy_+mul_": lambda: big_out_dt.copy_(big32).mul_(pre),
            },
        ),
        Job(
            f"rs_copy_out {dt_name}->f32 acc x0.5",
            flat_numel * (edt + 2 * e32),
            lambda: mops.reduce_scatter_copy_out_(big_dt, big_out32, post_scale=0.5,
                                                  accumulate=True),
            {"add_(alpha=)": lambda: big_out32.add_(big_dt, alpha=0.5)},
        ),
        Job(
            "rs_copy_out f32->f32 (plain)",
            flat_numel * 2 * e32,
            lambda: mops.reduce_scatter_copy_out_(big32, big_out32),
            {"copy_": lambda: big_out32.copy_(big32)},
        ),
        Job(
            "sum_of_squares f32 (params)",
            n_param * e32,
            lambda: mops.multi_tensor_sum_of_squares(grads),
            {"_foreach_norm+square+sum": norm_sum_of_squares},
        ),
    ]


def parse_numel(text: str) -> int:
    """'16M' -> 16 * 2**20, '512K' -> 512 * 2**10, '1000' -> 1000."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def build_fp8_jobs(device: torch.device, numels: list[int],
                   fp8: torch.dtype = torch.float8_e4m3fn) -> list[Job]:
    """fp8_quantize_ against torch's two-pass quantize + amax, one shard and 64 shards."""
    max_finite = torch.finfo(fp8).max
    fmt = str(fp8).removeprefix("torch.float8_")
    gen = torch.Generator(device=device).manual_seed(1)
    jobs = []
    for n in numels:
        label = f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)
        x = torch.randn(n, generator=gen, device=device) * 100
        scale = torch.tensor(max_finite / 400.0, device=device)
        flat8 = torch.empty(n, dtype=fp8, device=device)
        amax = torch.empty((), device=device)

        def expression(x=x, scale=scale):
            return (x * scale).clamp(-max_finite, max_finite).to(fp8), x.abs().amax()

        def expression_into_flat(x=x, scale=scale, flat8=flat8, amax=amax):
            flat8.copy_((x * scale).clamp(-max_finite, max_finite).to(fp8))
            amax.copy_(x.abs().amax())

        jobs.append(Job(
            f"fp8_quantize f32->{fmt}+amax {label}", n * 5,
            lambda x=x, scale=scale, flat8=flat8, amax=amax: mops.fp8_quantize_(
                [x], [scale], [0], flat8, [amax]),
            {"torch expr + amax (new)": expression,
             "torch expr->copy_ + amax": expression_into_flat},
        ))

        # A flat group: 64 shards, each with its own scale; amaxes are views of one
        # buffer (what one all-reduce of all amaxes needs).
        shards = list(x.tensor_split(64))
        offsets = [0]
        for shard in shards[:-1]:
            offsets.append(offsets[-1] + shard.numel())
        scales = [torch.tensor(max_finite / (300.0 + i), device=device) for i in range(64)]
        amax_buf = torch.empty(64, device=device)
        amaxes = list(amax_buf.unbind())
        views8 = [flat8.narrow(0, o, sh.numel()) for o, sh in zip(offsets, shards)]

        def loop(shards=shards, scales=scales, views8=views8, amaxes=amaxes):
            for shard, sc, view, am in zip(shards, scales, views8, amaxes):
                view.copy_((shard * sc).clamp(-max_finite, max_finite).to(fp8))
                am.copy_(shard.abs().amax())

        def foreach(shards=shards, scales=scales, views8=views8, amax_buf=amax_buf):
            scaled = torch._foreach_mul(shards, scales)
            torch._foreach_clamp_min_(scaled, -max_finite)
            torch._foreach_clamp_max_(scaled, max_finite)
            torch._foreach_copy_(views8, scaled)
            amax_buf.copy_(torch.stack(torch._foreach_norm(shards, float("inf"))))

        jobs.append(Job(
            f"fp8_quantize 64 shards {label}", n * 5,
            lambda shards=shards, scales=scales, offsets=offsets, flat8=flat8, amaxes=amaxes:
                mops.fp8_quantize_(shards, scales, offsets, flat8, amaxes),
            {"per-shard torch loop": loop, "_foreach_ mul/clamp/copy/norm": foreach},
        ))
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="low-precision model / communication dtype")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU intra-op threads (default: torch's default)")
    parser.add_argument("--flat-numel", type=int, default=None,
                        help="elements of the large flat buffer (default 64M cpu, 512M cuda)")
    parser.add_argument("--suite", default="all", choices=["all", "flat", "fp8"],
                        help="flat: the flat-buffer copies and reduction; fp8: fp8_quantize_")
    parser.add_argument("--fp8-numels", default="1M,16M",
                        help="comma-separated element counts of the fp8 jobs (K/M suffixes)")
    args = parser.parse_args()

    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        if device.index is None:  # torch 2.11's set_device refuses a bare "cuda"
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    flat_numel = args.flat_numel or (64 << 20 if device.type == "cpu" else 512 << 20)
    timer = make_timer(device, args.iters, args.warmup)

    jobs = build_jobs(device, dtype, flat_numel) if args.suite != "fp8" else []
    if args.suite != "flat":
        jobs += build_fp8_jobs(device, [parse_numel(t) for t in args.fp8_numels.split(",")])
    max_bytes = max(j.nbytes for j in jobs)
    plain_src = torch.ones(max_bytes // 8 + 1, device=device)
    plain_dst = torch.empty_like(plain_src)

    print(f"megatron_fsdp_v2 kernel benchmark: device={device} "
          f"threads={torch.get_num_threads()} dtype={args.dtype} iters={args.iters} "
          f"(median), build={mops.build_info()}, reference_ops="
          f"{mops.USE_REFERENCE_OPS or not mops.HAS_EXTENSION}")
    header = (f"{'op':42s} {'MB':>7s} {'ours GB/s':>9s} | {'baseline':30s} {'GB/s':>6s} "
              f"{'ours/base':>9s} | {'plain GB/s':>10s} {'ours/plain':>10s}")
    print(header)
    print("-" * len(header))
    for job in jobs:
        n_plain = job.nbytes // 8
        plain_fn = lambda n=n_plain: plain_dst[:n].copy_(plain_src[:n])  # noqa: E731
        times = timer([job.ours, plain_fn, *job.baselines.values()])
        ours, plain = job.nbytes / times[0] / 1e9, job.nbytes / times[1] / 1e9
        for i, (name, t) in enumerate(zip(job.baselines, times[2:])):
            base = job.nbytes / t / 1e9
            lead = (f"{job.name:42s} {job.nbytes / 1e6:7.0f} {ours:9.2f}" if i == 0
                    else f"{'':42s} {'':7s} {'':9s}")
            tail = f"{plain:10.2f} {ours / plain:9.2f}x" if i == 0 else ""
            print(f"{lead} | {name:30s} {base:6.2f} {ours / base:8.2f}x | {tail}")

if __name__ == "__main__":
    main()
