"""Optimizer-step benchmark: ``optimizer.step()`` over a wrapped model's DTensor parameters, on
their local tensors (the default, see [Note: local optimizer step]) and through DTensor (forced
by a no-op per-optimizer step hook), against the same optimizer over the plain model.

One process (a one-rank gloo group), one thread, so the ratios show the per-op cost of the two
paths and nothing else: every system steps the same parameters with the same gradients.

    python benchmarks/bench_optimizer_step.py                      # AdamW, 29.5M-param GPT
    python benchmarks/bench_optimizer_step.py --optimizer sgd --model units
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _model(kind: str) -> torch.nn.Module:
    if kind == "units":
        return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(64)))
    from model import GPT, GPTConfig

    return GPT(GPTConfig(vocab=8192, seq_len=128, dim=512, layers=8, heads=8))


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                             foreach=True if kind == "adamw_foreach" else None)


def time_steps(system: str, args: argparse.Namespace) -> list[float]:
    """Milliseconds of each timed ``optimizer.step()`` of ``system``."""
    import megatron_fsdp_v2 as mfsdp

    torch.manual_seed(0)
    model = _model(args.model)
    strategy, _, path = system.partition("/")
    if strategy != "torch":
        children = model.blocks if hasattr(model, "blocks") else list(model)
        for child in children:
            mfsdp.fully_shard(child, sharding_strategy=strategy)
        mfsdp.fully_shard(model, sharding_strategy=strategy)
    opt = _optimizer(args.optimizer, model.parameters())
    if path == "dtensor":
        opt.register_step_pre_hook(lambda *a: None)  # any step hook keeps the DTensor step
    for p in model.parameters():  # the same gradients for every system
        p.grad = torch.full_like(p, 1e-3)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.step()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=["gpt", "units"], default="gpt",
                   help="gpt: 29.5M-param GPT (101 parameters); units: 64 nn.Linear(16, 16)")
    p.add_argument("--optimizer", choices=["adamw", "adamw_foreach", "sgd"], default="adamw")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="passes over the systems, alternating")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            systems = ["torch"] + [f"{s}/{path}" for s in STRATEGIES
                                   for path in ("local", "dtensor")]
            samples: dict[str, list[float]] = {s: [] for s in systems}
            for r in range(args.rounds):
                for system in systems if r % 2 == 0 else reversed(systems):
                    samples[system] += time_steps(system, args)
        finally:
            dist.destroy_process_group()
    base = statistics.median(samples["torch"])
    print(f"optimizer.step(), {args.optimizer}, model {args.model}, one process, one thread; "
          f"median of {args.rounds} x {args.steps} steps")
    print(f"{'system':<32}{'ms':>9}{'/ torch':>9}{'local / dtensor':>17}")
    for system in systems:
        ms = statistics.median(samples[system])
        pair = ""
        if system.endswith("/local"):
            other = statistics.median(samples[system.replace("/local", "/dtensor")])
            pair = f"{ms / other:.2f}x"
        print(f"{system:<32}{ms:9.1f}{ms / base:8.2f}x{pair:>17}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
