"""Cost of checkpoint checksums: save/load time with and without them (2 gloo ranks, CPU).

    python benchmarks/bench_checkpoint.py [root_dir]
"""
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2 import fully_shard
from megatron_fsdp_v2.testing import run_distributed

REPEATS = 7


def worker(rank, world, root):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    model = fully_shard(model, sharding_strategy="optim_grads_params")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    opt.zero_grad()
    times = {}

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    with_sums, without = os.path.join(root, "with"), os.path.join(root, "without")
    plain = os.path.join(root, "plain")

    def plain_save():  # the documented manual flow, as checkpoint.save did before
        msd, osd = mckpt.get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=plain)

    def plain_load():
        msd, osd = mckpt.get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=plain)
        mckpt.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for _ in range(REPEATS):
        timed("save, checksums", lambda: mckpt.save(model, opt, checkpoint_id=with_sums))
        timed("save, no checksums", lambda: mckpt.save(model, opt, checkpoint_id=without,
                                                       checksums=False))
        timed("plain dcp.save", plain_save)
        timed("plain dcp.load", plain_load)
        timed("load, verified", lambda: mckpt.load(model, opt, checkpoint_id=with_sums))
        timed("load, not verified", lambda: mckpt.load(model, opt, checkpoint_id=with_sums,
                                                       checksums=False))
    if rank == 0:
        size = sum(os.path.getsize(os.path.join(with_sums, f)) for f in os.listdir(with_sums))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.1f}M fp32 params, checkpoint {size / 2**20:.1f} MiB "
              f"(weights + AdamW state), world {world}, {REPEATS} repeats, median:")
        for name, ts in times.items():
            print(f"  {name:20s} {statistics.median(ts) * 1e3:8.1f} ms  "
                  f"(min {min(ts) * 1e3:.1f})")


if __name__ == "__main__":
    base = sys.argv[1] if len(sys.argv) > 1 else None
    with tempfile.TemporaryDirectory(dir=base) as root:
        run_distributed(worker, 2, root, timeout_s=300)
