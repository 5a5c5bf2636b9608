"""Smoke tests for examples/: train.py under torchrun, and the collective byte counter the example
and benchmarks/bench_training.py rely on (it must see DDP's C++ reducer as well as our library)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_fsdp_v2.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_train_example_runs(strategy: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(EXAMPLES, "train.py"), "--strategy", strategy, "--steps", "3",
           "--micro-batches", "2", "--batch-size", "2", "--seq-len", "16", "--dim", "32",
           "--layers", "2", "--heads", "2", "--vocab", "64"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = re.findall(r"step\s+(\d+)/3 \| loss ([0-9.]+) .* comm\s+([0-9.]+) MiB/rank",
                       proc.stdout)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], proc.stdout
    assert all(math.isfinite(float(loss)) for _, loss, _ in steps)
    assert all(float(comm) > 0 for _, _, comm in steps), "no collective bytes counted"
    assert "memory_report rank 1:" in proc.stdout


def test_train_example_hsdp_mesh() -> None:
    """``--mesh 2,2``: HSDP (2 replicas x 2 shards, outer no_shard) on 4 CPU ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(EXAMPLES, "train.py"), "--mesh", "2,2", "--strategy", "optim_grads",
           "--steps", "3", "--micro-batches", "2", "--batch-size", "2", "--seq-len", "16",
           "--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh=2x2" in proc.stdout, proc.stdout
    steps = re.findall(r"step\s+(\d+)/3 \| loss ([0-9.]+) .* comm\s+([0-9.]+) MiB/rank",
                       proc.stdout)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], proc.stdout
    assert all(math.isfinite(float(loss)) for _, loss, _ in steps)
    assert all(float(comm) > 0 for _, _, comm in steps), "no collective bytes counted"
    assert "memory_report rank 3:" in proc.stdout


def _counter_worker(rank: int, world: int) -> dict[str, float]:
    import megatron_fsdp_v2 as mfsdp

    from comm_counter import CommCounter
    from model import GPT, GPTConfig, lm_loss, synthetic_batch

    cfg = GPTConfig(vocab=64, seq_len=16, dim=32, layers=2, heads=2)
    out = {}
    for system in ("ddp", "optim_grads_params"):
        torch.manual_seed(0)
        model = GPT(cfg)
        numel = model.num_params()
        if system == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            for block in model.blocks:
                mfsdp.fully_shard(block, sharding_strategy=system)
            mfsdp.fully_shard(model, sharding_strategy=system)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        counter = CommCounter()
        for step in range(3):
            with counter:
                batch = synthetic_batch(2, 16, 64, seed=0, step=step, micro=0, rank=rank)
                lm_loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
            stats = counter.reset()
        out[system] = stats.total_wire_bytes / (4 * numel * (world - 1) / world)
    return out


def test_comm_counter_sees_ddp_and_fully_shard() -> None:
    """Steady-state bytes per step, in units of one ring pass over the fp32 parameters: DDP's
    reducer all-reduce is 2, ZeRO-3's 2 all-gathers + 1 reduce-scatter is 3 (padding aside)."""
    results = run_distributed(_counter_worker, 2, timeout_s=180)
    for r in results:
        assert r["ddp"] == pytest.approx(2.0, rel=1e-6), r
        assert r["optim_grads_params"] == pytest.approx(3.0, rel=0.02), r
