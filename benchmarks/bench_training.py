"""Training benchmark: megatron_fsdp_v2's four strategies against DDP, ZeRO-1 and FSDP2.

    python benchmarks/bench_training.py --out /tmp/bench/training.md   # CPU/gloo, NCCL on GPUs
    python benchmarks/bench_training.py --model-size tiny --vocab 512 --seq-len 32 --steps 2 \
        --rounds 1
    python benchmarks/bench_training.py --world-size 4 --mesh 2,2 \
        --systems optim_grads,optim_grads_params,fsdp2_noreshard,fsdp2   # HSDP vs FSDP2's HSDP

With ``--mesh R,S`` (R x S = ``--world-size``) our systems run HSDP: the strategy along the S
ranks of each replica, gradients all-reduced across the R replicas once per step
(``outer_dp_sharding_strategy="no_shard"``); the FSDP2 peers run FSDP2's HSDP on the same 2-D
mesh (``torch.distributed.fsdp.fully_shard(module, mesh=<2-D mesh>)``: shards along dim 1,
replicates along dim 0, all-reduces across replicas after every reduce-scatter). DDP and
ZeRO-1 stay 1-D over the world.

Every system trains the same GPT (``examples/model.py``) from the same initial weights on the
same synthetic tokens with the same AdamW, gradient clipping and micro-batching. Each run of a
system is one fresh process group (``--world-size`` spawned ranks, file rendezvous; gloo on CPU,
NCCL with one GPU per rank on CUDA), so what one system allocates never shows in another's peak.

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
  range over all timed steps of all rounds.
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


def _build(system: str, cfg: Any, device: torch.device, a: dict[str, Any]) -> tuple[
        torch.nn.Module, torch.optim.Optimizer, Callable[[], Any], Callable[[bool], Any]]:
    """(model, optimizer, clip(), micro_batch_context(is_last)) for one system."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from model import GPT

    torch.manual_seed(a["seed"])  # identical initial weights for every system and rank
    model = GPT(cfg).to(device)
    adamw = dict(lr=a["lr"], betas=(0.9, 0.95), weight_decay=0.1)
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
    if system in OURS:
        import megatron_fsdp_v2 as mfsdp

        wrap: dict[str, Any] = dict(sharding_strategy=system)
        if hsdp_mesh is not None:
            wrap.update(mesh=hsdp_mesh, outer_dp_sharding_strategy="no_shard")
        for block in model.blocks:
            mfsdp.fully_shard(block, **wrap)
        mfsdp.fully_shard(model, **wrap)
        opt = torch.optim.AdamW(model.parameters(), **adamw)

        def ours_clip() -> Any:
            return mfsdp.clip_grad_norm_(model.parameters(), clip) if clip > 0 else None

        def ours_micro(is_last: bool) -> Any:
            model.set_is_last_backward(is_last)
            return contextlib.nullcontext()

        return model, opt, ours_clip, ours_micro
    if system in ("ddp", "zero1"):
        ddp = DDP(model, **ddp_kwargs)
        if system == "ddp":
            opt = torch.optim.AdamW(ddp.parameters(), **adamw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                          parameters_as_bucket_view=True, **adamw)
        return (ddp, opt, torch_clip(ddp),
                lambda last: contextlib.nullcontext() if last else ddp.no_sync())
    if system in ("fsdp2", "fsdp2_noreshard"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        # HSDP (--mesh R,S): FSDP2 shards along dim 1 and replicates along dim 0.
        mesh = hsdp_mesh if hsdp_mesh is not None else init_device_mesh(
            device.type, (dist.get_world_size(),))
        reshard = system == "fsdp2"
        for block in model.blocks:
            fsdp2_fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fsdp2_fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        return model, opt, torch_clip(model), lambda last: contextlib.nullcontext()
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def _run_system(rank: int, world: int, device: torch.device, system: str, a: dict[str, Any],
                kind: str) -> dict[str, Any]:
    """``kind="time"``: warm-up + timed steps, nothing else running. ``kind="measure"``: a few
    untimed steps; bytes counted on the last one; memory recorded."""
    from comm_counter import CommCounter
    from model import GPTConfig, lm_loss, synthetic_batch

    cfg = GPTConfig(vocab=a["vocab"], seq_len=a["seq_len"], dim=a["dim"], layers=a["layers"],
                    heads=a["heads"])
    result: dict[str, Any] = {"rank": rank, "rss_base_kib": _read_status_kib("VmRSS")}
    model, opt, clip, micro_context = _build(system, cfg, device, a)
    gc.collect()
    result["rss_after_build_kib"] = _read_status_kib("VmRSS")
    result["hwm_reset"] = _reset_rss_hwm()
    if device.type == "cuda":
        torch.cuda.synchronize()
        result["cuda_peak_build"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    counter = CommCounter()
    micro = a["micro_batches"]
    num_steps = a["measure_steps"] if kind == "measure" else a["warmup"] + a["steps"]
    losses, times = [], []
    for step in range(num_steps):
        batches = [synthetic_batch(a["batch_size"], a["seq_len"], a["vocab"], seed=a["seed"],
                                   step=step, micro=i, rank=rank, device=device)
                   for i in range(micro)]
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        counting = kind == "measure" and step == num_steps - 1
        start = time.perf_counter()
        with counter if counting else contextlib.nullcontext():
            loss_sum = torch.zeros((), device=device)
            for i, tokens in enumerate(batches):
                with micro_context(i == micro - 1):
                    loss = lm_loss(model, tokens) / micro
                    loss.backward()
                loss_sum += loss.detach()
            clip()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss_sum.item())
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
                        mesh: tuple[int, int] | None = None) -> float:
    """Ring bytes per rank per step for fp32 parameters/gradients of ``num_params`` elements
    (no padding, no clipping all-reduce), from each system's collective pattern. With an HSDP
    ``mesh`` (R, S), ours and FSDP2 shard over S and all-reduce over R."""
    if mesh is not None and (system in OURS or system.startswith("fsdp2")):
        r, sz = mesh
        full = 4.0 * num_params
        psi_s = full * (sz - 1) / sz  # one all-gather or reduce-scatter over the inner axis
        outer_shard = 2 * (full / sz) * (r - 1) / r  # all-reduce of a shard over the replicas
        outer_full = 2 * full * (r - 1) / r
        return {
            "no_shard": 2 * psi_s + outer_full,  # inner all-reduce, then the outer one
            "optim": 2 * psi_s + outer_shard,
            "optim_grads": (m + 1) * psi_s + outer_shard,
            "optim_grads_params": 3 * m * psi_s + outer_shard,
            "fsdp2_noreshard": m * (2 * psi_s + outer_shard),  # outer all-reduce per micro-batch
            "fsdp2": m * (3 * psi_s + outer_shard),
        }[system]
    psi = 4.0 * num_params * (n - 1) / n  # one all-gather or reduce-scatter of everything
    return psi * {
        "no_shard": 2,             # 1 all-reduce
        "ddp": 2,                  # 1 all-reduce (no_sync on all but the last micro-batch)
        "optim": 2,                # 1 reduce-scatter + 1 all-gather
        "zero1": 3,                # 1 all-reduce + broadcasts of every partition
        "optim_grads": m + 1,      # m reduce-scatters + 1 all-gather
        "fsdp2_noreshard": 2 * m,  # per micro-batch: 1 all-gather + 1 reduce-scatter
        "optim_grads_params": 3 * m,  # per micro-batch: 2 all-gathers + 1 reduce-scatter
        "fsdp2": 3 * m,
    }[system]


def label_of(system: str, a: dict[str, Any]) -> str:
    """The table label: ``(HSDP RxS)`` appended to the systems that run on the 2-D mesh."""
    mesh = a.get("mesh")
    if mesh and (system in OURS or system.startswith("fsdp2")):
        return f"{SYSTEMS[system]} (HSDP {mesh[0]}x{mesh[1]})"
    return SYSTEMS[system]


def summarize(system: str, measured: list[dict[str, Any]], timed_runs: list[list[dict[str, Any]]],
              a: dict[str, Any]) -> dict[str, Any]:
    """Aggregate one system: its measurement run (per-rank results) and its timing runs."""
    timed: list[float] = []
    curves: list[list[float]] = []
    for ranks in [measured] + timed_runs:
        steps = len(ranks[0]["losses"])
        curves.append([statistics.fmean(r["losses"][s] for r in ranks) for s in range(steps)])
    for ranks in timed_runs:
        per_step = [max(r["times"][s] for r in ranks) for s in range(len(ranks[0]["times"]))]
        timed += per_step[a["warmup"]:]
    longest = max(curves, key=len)
    comm = max((r["comm"] for r in measured), key=lambda c: c["total_wire_bytes"])
    tokens = a["world_size"] * a["micro_batches"] * a["batch_size"] * a["seq_len"]
    out: dict[str, Any] = {
        "system": system,
        "label": label_of(system, a),
        "comm": comm,
        "comm_mib": comm["total_wire_bytes"] / MiB,
        "comm_expected_mib": expected_comm_bytes(system, a["num_params"], a["world_size"],
                                                 a["micro_batches"], a.get("mesh")) / MiB,
        "losses": longest,
        "loss_run_spread": max(abs(x - y) for c in curves for x, y in zip(c, longest)),
        "per_rank": [{k: v for k, v in r.items() if k not in ("losses", "times")}
                     for r in measured],
    }
    if timed:
        q = statistics.quantiles(timed, n=4) if len(timed) >= 2 else [timed[0]] * 3
        out.update(step_s_median=statistics.median(timed), step_s_p25=q[0], step_s_p75=q[2],
                   step_s_all=timed, tokens_per_s=tokens / statistics.median(timed))
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


def render(summary: dict[str, Any], a: dict[str, Any]) -> str:
    rows, failures = summary["systems"], summary["failures"]
    cuda = a["device"] == "cuda"
    mem = "CUDA max allocated" if cuda else "RSS HWM"
    ddp = rows.get("ddp")
    lines = [
        f"## Training benchmark: {a['num_params'] / 1e6:.1f}M-param GPT (dim {a['dim']}, "
        f"{a['layers']} blocks, {a['heads']} heads, vocab {a['vocab']}), world size "
        f"{a['world_size']} on {a['device_desc']}"
        + (f", HSDP mesh {a['mesh'][0]}x{a['mesh'][1]} (replicate x shard) for ours and FSDP2"
           if a.get("mesh") else ""),
        "",
        f"{a['micro_batches']} micro-batch(es) x {a['batch_size']} x {a['seq_len']} tokens per "
        f"rank per step, fp32, AdamW, clip {a['clip']}. Timing: {a['rounds']} round(s) over the "
        f"systems in alternating order, each run in fresh processes with {a['warmup']} warm-up + "
        f"{a['steps']} timed steps; median [interquartile range] of the slowest rank's step time "
        f"over all timed steps. Bytes and memory: one more fresh run per system "
        f"({a['measure_steps']} untimed steps, bytes counted on the last).",
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
    lines += ["", "Ratios, ours / closest peer (below 1: ours is faster, leaner or sends less):",
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
        lines.append(f"| {o['label']} | {p['label']} | "
                     f"{_ratio(o.get('step_s_median'), p.get('step_s_median'))} | "
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
    notes = [
        "",
        "Notes:",
        "- comm: ring-algorithm bytes sent per rank in one steady-state step, counted for every "
        "system by one TorchDispatchMode over c10d ops (examples/comm_counter.py; it sees DDP's "
        "C++ reducer too): 2(N-1)/N*S per all-reduce, (N-1)/N*S per all-gather / reduce-scatter / "
        "broadcast of an S-byte buffer. expected: the same from each system's collective pattern "
        "for fp32 parameters (no padding, no clipping all-reduce).",
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
                 "main weights + main grads + temporary-bucket peak).")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    presets = ", ".join(f"{k} ({dim}x{layers})" for k, (dim, layers, _) in MODEL_SIZES.items())
    p.add_argument("--model-size", default="medium", help=f"one of {presets}, or DIMxLAYERS")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads (default: from --model-size)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch per rank")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mesh", default=None, metavar="R,S",
                   help="HSDP on an R x S mesh (R x S = --world-size) for ours (outer no_shard) "
                        "and FSDP2 (its HSDP); default: 1-D over the world")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated subset of: " + ", ".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps before the timed ones, per round")
    p.add_argument("--rounds", type=int, default=2,
                   help="timing rounds over the systems, alternating order")
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
    if args.steps < 1 or args.rounds < 0 or args.warmup < 0:
        p.error("--steps must be >= 1, --rounds and --warmup >= 0")
    if args.mesh is not None:
        try:
            shape = [int(v) for v in args.mesh.split(",")]
        except ValueError:
            shape = []
        if len(shape) != 2 or min(shape) < 1:
            p.error(f"--mesh takes R,S (e.g. 2,2), got {args.mesh!r}")
        if shape[0] * shape[1] != args.world_size:
            p.error(f"--mesh {args.mesh} needs --world-size {shape[0] * shape[1]}, "
                    f"got {args.world_size}")
        args.mesh = shape
    return args


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
    if device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs as many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or max(1, cores // args.world_size)
    device_desc = (f"{args.world_size}x {torch.cuda.get_device_name(0)} (NCCL)" if device == "cuda"
                   else f"CPU ({cores} cores, {threads} thread(s) per rank, gloo)")
    from model import GPT, GPTConfig

    with torch.device("meta"):
        num_params = GPT(GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=dim, layers=layers,
                                   heads=heads)).num_params()
    a = dict(vars(args), dim=dim, layers=layers, heads=heads, device=device, threads=threads,
             systems=systems, device_desc=device_desc, num_params=num_params,
             measure_steps=max(3, args.warmup + 1), load_start=os.getloadavg()[0],
             torch_version=torch.__version__)
    print(f"{num_params / 1e6:.1f}M-param GPT dim={dim} layers={layers} heads={heads}; world size "
          f"{args.world_size} on {device_desc}"
          f"{'; HSDP mesh ' + 'x'.join(map(str, args.mesh)) if args.mesh else ''}; "
          f"systems: {', '.join(systems)}; 1 measurement run + "
          f"{args.rounds} timing round(s) of {args.warmup} warm-up + {args.steps} timed steps",
          flush=True)

    measured: dict[str, list[dict[str, Any]]] = {}
    timed: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in systems}
    failures: dict[str, str] = {}
    t_start = time.monotonic()
    plan = [("measure", systems)] + [("time", systems[::-1] if r % 2 == 0 else systems)
                                     for r in range(args.rounds)]
    for i, (kind, order) in enumerate(plan):
        label = "measure" if kind == "measure" else f"round {i}"
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
                if device == "cpu":
                    peak = "/".join(f"{r['peak_rss_kib'] / 1024:.0f}" for r in ranks) + " MiB RSS"
                else:
                    peak = ("/".join(f"{r['cuda_peak_train'] / MiB:.0f}" for r in ranks)
                            + " MiB CUDA")
                detail = (f"comm {c['total_wire_bytes'] / MiB:.1f} MiB ({_fmt_calls(c['calls'])}) "
                          f"| peak {peak}")
            else:
                timed[system].append(ranks)
                steps = [max(r["times"][s] for r in ranks) for s in range(len(ranks[0]["times"]))]
                detail = "step ms " + " ".join(f"{x * 1e3:.0f}" for x in steps[args.warmup:])
            loss = statistics.fmean(r["losses"][-1] for r in ranks)
            print(f"[{label:8s}] {system:20s} {detail} | loss {loss:.6f} "
                  f"| {time.monotonic() - t0:.0f}s", flush=True)

    summary = {"config": a,
               "systems": {s: summarize(s, measured[s], timed[s], a)
                           for s in systems if s not in failures},
               "failures": failures,
               "wall_s": time.monotonic() - t_start,
               "load_end": os.getloadavg()[0]}
    table = render(summary, a)
    print()
    print(table)
    if args.out:
        out = os.path.abspath(args.out)
        md = out if out.endswith(".md") else out + ".md"
        os.makedirs(os.path.dirname(md), exist_ok=True)
        with open(md, "w") as f:
            f.write(table)
        with open(os.path.splitext(md)[0] + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {md} and {os.path.splitext(md)[0]}.json")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
