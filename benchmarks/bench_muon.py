"""Muon step benchmark: ``torch.optim.Muon`` on fully_shard parameters (each matrix whole on one
rank, one all-to-all each way; see [Note: distributed Muon]) next to AdamW's step on the same
model, to gathering every matrix on every rank, and to torch's Muon through DTensor.

    python benchmarks/bench_muon.py                       # 4 ranks, benchmark GPT (512x8), ZeRO-3
    python benchmarks/bench_muon.py --world 2 --dim 128 --layers 2 --steps 2   # smoke run

Every rank builds the GPT of ``examples/model.py``, wraps each block and the root with
``fully_shard``, runs one forward/backward for gradients, then times optimizer steps on those
same gradients (``--warmup`` untimed, ``--steps`` timed; a step's time is the slowest rank's,
the figure the median over steps). Steps compared, all over the blocks' 2-D weights (Muon's
usual share; embeddings, head, norms and biases would be AdamW's in every case):

* ``adamw``: ``torch.optim.AdamW`` on those matrices (elementwise, on the local rows);
* ``muon``: ``torch.optim.Muon`` on them, as megatron_fsdp_v2 runs it;
* ``gather_all``: the same Muon update with every matrix's momentum all-gathered to every rank
  (one all-gather per matrix), Newton-Schulz on every matrix on every rank, each rank keeping
  its rows: what a user writes without an owner assignment;
* ``dtensor``: ``torch.optim.Muon`` stepping through DTensor (a subclass, which the library
  leaves to DTensor): what one gets on FSDP2-style sharded parameters today.

Collectives and bytes are counted by ``examples/comm_counter.CommCounter`` (every ``c10d`` op
at the dispatcher; ring-algorithm bytes sent per rank) on the last timed step; "momentum" is
this rank's fp32 momentum shard of those matrices, the figure the exchange's bytes compare to.
CPU (gloo) by default; NCCL with one GPU per rank when CUDA is available.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

SYSTEMS = ("adamw", "muon", "gather_all", "dtensor")


class _DTensorMuon(torch.optim.Muon):
    """torch's Muon, stepping through DTensor (the library runs only Muon itself its way)."""


class _GatherAllMuon(torch.optim.Optimizer):
    """Muon's update with every matrix gathered whole on every rank."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr, "momentum": 0.95, "weight_decay": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        from torch.optim import _muon

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf, grad = state["momentum_buffer"].to_local(), p.grad.to_local()
                buf.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buf, group["momentum"])
                whole = state["momentum_buffer"].full_tensor()  # shape only; replaced below
                whole = _gather_rows(update, p, whole)
                ortho = _muon._zeropower_via_newtonschulz(whole, (3.4445, -4.7750, 2.0315), 5,
                                                          1e-7)
                lo, hi = _rows(p)
                local = p.to_local()
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(ortho[lo:hi], alpha=-_muon._adjust_lr(group["lr"], None, p.shape))


def _rows(p: torch.Tensor) -> tuple[int, int]:
    from megatron_fsdp_v2._registry import record_of

    record = record_of(p)
    assert record is not None
    return record.local_rows


def _gather_rows(update: torch.Tensor, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``update`` (uneven) gathered whole, in bf16, on every rank."""
    world = dist.get_world_size()
    counts = [torch.zeros(1, dtype=torch.int64, device=update.device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([update.shape[0]], device=update.device))
    most = max(int(c.item()) for c in counts)
    padded = torch.zeros(most, p.shape[1], dtype=torch.bfloat16, device=update.device)
    padded[: update.shape[0]] = update
    gathered = torch.empty(world * most, p.shape[1], dtype=torch.bfloat16, device=update.device)
    dist.all_gather_into_tensor(gathered, padded)
    parts = [gathered[r * most : r * most + int(counts[r].item())] for r in range(world)]
    return torch.cat(parts)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.nn.functional as F  # noqa: N812

    import megatron_fsdp_v2 as mfsdp

    from comm_counter import CommCounter
    from model import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim,
                          layers=args.layers, heads=max(1, args.dim // 64))).to(device)
    for block in model.blocks:
        mfsdp.fully_shard(block, sharding_strategy=args.strategy)
    mfsdp.fully_shard(model, sharding_strategy=args.strategy)
    matrices = [p for block in model.blocks for p in block.parameters() if p.ndim == 2]
    tokens = synthetic_batch(2, args.seq_len, args.vocab, seed=0, step=0, micro=0, rank=rank,
                             device=device)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    momentum_bytes = sum(p.to_local().numel() * 4 for p in matrices)
    results: dict[str, Any] = {"momentum_bytes": momentum_bytes}
    for system in args.systems:
        if system == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(matrices, lr=1e-3, weight_decay=0.1)
        elif system == "muon":
            opt = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1)
        elif system == "gather_all":
            opt = _GatherAllMuon(matrices, lr=0.02)
        else:
            opt = _DTensorMuon(matrices, lr=0.02, weight_decay=0.1)
        times = []
        counter = CommCounter()
        for i in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            if i == args.warmup + args.steps - 1:
                with counter:
                    opt.step()
            else:
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times.append(elapsed.item())
        comm = counter.reset()
        if system == "muon":
            from megatron_fsdp_v2 import _registry

            plan = _registry.muon_plans[opt].whole
            results["exchanged"] = (len(plan.exchanged), len(matrices))
        results[system] = {"ms": statistics.median(times) * 1e3,
                           "collectives": comm.total_calls,
                           "summary": comm.summary(), "bytes": comm.total_wire_bytes}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="ranks")
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    p.add_argument("--dim", type=int, default=512, help="model width (benchmark GPT: 512)")
    p.add_argument("--layers", type=int, default=8, help="blocks (benchmark GPT: 8)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")
    args = p.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    from megatron_fsdp_v2.testing import run_distributed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    per_rank = run_distributed(_rank, args.world, args, backend=backend, timeout_s=3600.0)
    first = per_rank[0]
    print(f"Muon step, GPT {args.dim}x{args.layers} (vocab {args.vocab}), blocks' matrices, "
          f"{args.strategy}, {args.world} ranks, {backend}; momentum on rank 0: "
          f"{first['momentum_bytes'] / 2**20:.2f} MiB (fp32)")
    if "exchanged" in first:
        moved, total = first["exchanged"]
        print(f"matrices split across ranks (exchanged): {moved} of {total}; the other "
              f"{total - moved} sit whole in one rank's shard and are computed there")
    print("| step | ms (median, slowest rank) | x AdamW | collectives | bytes sent, rank 0 "
          "| x momentum |")
    print("|---|---|---|---|---|---|")
    base = first.get("adamw", {}).get("ms")
    for system in args.systems:
        r = first[system]
        ratio = f"{r['ms'] / base:.2f}" if base else "-"
        print(f"| {system} | {r['ms']:.1f} | {ratio} | {r['collectives']} ({r['summary']}) | "
              f"{r['bytes'] / 2**20:.2f} MiB | {r['bytes'] / first['momentum_bytes']:.2f} |")


if __name__ == "__main__":
    main()
