"""Peak RSS while wrapping and materializing a meta-device model of 8 blocks (2 gloo ranks, CPU),
against one rank's share of the model plus one block; and, for contrast, the same model built on
the CPU and then wrapped.

    python benchmarks/bench_meta_init.py [world_size] [width]

A figure, not a test: the peak (``VmHWM``, reset just before wrapping) includes allocator
slack, so it is printed, not asserted.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_fsdp_v2 import fully_shard
from megatron_fsdp_v2.testing import run_distributed

BLOCKS = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM (the peak resident set) to the current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(rank: int, world: int, width: int, meta: bool) -> tuple[int, int, int]:
    # One-time costs (the library's timeout process group, gloo's threads and buffers) are
    # not the model's: pay them on a tiny module first.
    fully_shard(nn.Linear(4, 4), sharding_strategy="optim_grads_params")
    torch.manual_seed(0)
    dist.barrier()
    _reset_peak()
    base = _status("VmRSS")
    if meta:
        with torch.device("meta"):
            model = nn.Sequential(*[Block(width) for _ in range(BLOCKS)])
    else:
        model = nn.Sequential(*[Block(width) for _ in range(BLOCKS)])
    for block in model:
        fully_shard(block, sharding_strategy="optim_grads_params")
    fully_shard(model, sharding_strategy="optim_grads_params")
    model.state_dict()  # materializes a meta model (local, no collective)
    peak = _status("VmHWM") - base
    block_bytes = sum(p.numel() * p.element_size() for p in model[0].parameters())
    total_bytes = block_bytes * BLOCKS
    return peak, total_bytes, block_bytes


def main() -> None:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    mib = 1 << 20
    for meta in (True, False):
        results = run_distributed(worker, world, width, meta, timeout_s=600)
        peak = max(r[0] for r in results)
        _, total, block = results[0]
        budget = total // world + block
        how = "meta-device build" if meta else "CPU build (contrast)"
        print(
            f"{how}: peak RSS while wrapping {BLOCKS} blocks = {peak / mib:.1f} MiB (max over "
            f"{world} ranks); one rank's share + one block = {total / world / mib:.1f} + "
            f"{block / mib:.1f} = {budget / mib:.1f} MiB; whole model {total / mib:.1f} MiB; "
            f"{'below' if peak < budget else 'NOT below'} the share + one block"
        )


if __name__ == "__main__":
    main()
