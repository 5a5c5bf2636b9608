"""Push a fully_shard model's full weights to another process, a bucket at a time.

    torchrun --nproc_per_node=2 examples/stream_weights.py [--strategy optim_grads_params]
                                                           [--bucket-mb 0.25] [--steps 2]

What a reinforcement-learning trainer does every few steps: hand the current weights to an
inference engine. Here the engine is a stand-in process that rank 0 starts with
``torch.multiprocessing`` and that holds an unwrapped copy of the model. After a few training
steps every rank iterates ``megatron_fsdp_v2.iter_full_weights(model, bucket_size_mb=...,
to_rank=0)``: all ranks join each bucket's all-gather, only rank 0 gets the tensors. Rank 0
copies each one (the yielded tensor is a view of the iterator's reused buffer) and puts it on a
bounded queue; the engine writes it into its model. No rank ever holds the whole model: the
trainer side holds two buckets and the few copies in flight on the queue.

At the end the engine sends back what it holds, and rank 0 checks it against the model's full
state dict (``megatron_fsdp_v2.checkpoint.get_full_state_dict``): the same names and the same
bits; and the engine's logits on a fixed batch against the wrapped model's. It prints one line
and exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_fsdp_v2 import checkpoint, fully_shard, iter_full_weights  # noqa: E402

from model import GPT, GPTConfig, lm_loss, synthetic_batch  # noqa: E402

_CONFIG = dict(vocab=101, seq_len=16, dim=32, layers=3, heads=2)  # odd vocab: uneven shards


def _batch(step: int, rank: int) -> torch.Tensor:
    return synthetic_batch(2, _CONFIG["seq_len"], _CONFIG["vocab"], seed=0, step=step, micro=0,
                           rank=rank)


def engine(weights: Any, results: Any, probe: torch.Tensor) -> None:
    """The consumer: an unwrapped model filled entry by entry from ``weights`` (``(name,
    tensor)`` pairs, ``None`` at the end); then sends back its state dict and its logits on
    ``probe``."""
    torch.manual_seed(1)  # other initial values than the trainer's: every entry must arrive
    model = GPT(GPTConfig(**_CONFIG))
    targets = model.state_dict()
    received = []
    with torch.no_grad():
        while (item := weights.get()) is not None:
            name, tensor = item
            targets[name].copy_(tensor)
            received.append(name)
            del tensor, item  # free the shared-memory copy now
        logits = model(probe)
    # As bytes, not shared tensors: this process exits before the trainer reads them.
    blob = io.BytesIO()
    torch.save((received, model.state_dict(), logits), blob)
    results.put(blob.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--strategy", default="optim_grads_params",
                        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    parser.add_argument("--bucket-mb", type=float, default=0.25,
                        help="the gather bucket, MiB (the iterator holds two)")
    parser.add_argument("--steps", type=int, default=2, help="training steps before the push")
    args = parser.parse_args(argv)

    launched = not dist.is_initialized()  # under torchrun; a harness may own the group
    if launched:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**_CONFIG))
    for block in model.blocks:
        fully_shard(block, sharding_strategy=args.strategy)
    fully_shard(model, sharding_strategy=args.strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        lm_loss(model, _batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()

    probe = _batch(1000, 0)[:, :-1]
    ctx = mp.get_context("spawn")
    weights: Any = ctx.Queue(maxsize=4)  # backpressure: at most 4 copies in flight
    results: Any = ctx.Queue()
    consumer = ctx.Process(target=engine, args=(weights, results, probe)) if rank == 0 else None
    if consumer is not None:
        consumer.start()
    sent = 0
    for name, tensor in iter_full_weights(model, bucket_size_mb=args.bucket_mb, to_rank=0):
        # A copy: the yielded tensor is a view of the iterator's buffer, reused by the next
        # bucket; the queue moves the copy into shared memory for the engine.
        weights.put((name, tensor.clone()))
        sent += 1
    if consumer is not None:
        weights.put(None)
        received, engine_state, engine_logits = torch.load(io.BytesIO(results.get(timeout=120)))
        consumer.join(timeout=60)

    # The checks: the model's full state dict (every rank takes part), its own logits.
    full = checkpoint.get_full_state_dict(model)
    with torch.no_grad():
        logits = model(probe)
    if rank == 0:
        errors = []
        if received != list(full):
            errors.append(f"received {received} for {list(full)}")
        errors += [f"{k} differs" for k in full if not torch.equal(engine_state[k], full[k])]
        diff = (engine_logits - logits).abs().max().item()
        if diff > 1e-5:
            errors.append(f"logits differ by {diff:.3g}")
        print(f"stream_weights ({args.strategy}, {world} ranks, {args.bucket_mb} MiB buckets): "
              f"{sent} tensors pushed, "
              f"{sum(t.numel() * t.element_size() for t in full.values()) / 2**20:.3f} MiB; "
              + ("received weights equal the model's (bitwise), logits max diff "
                 f"{diff:.3g}" if not errors else "MISMATCH: " + "; ".join(errors)),
              flush=True)
        if errors or (consumer is not None and consumer.exitcode != 0):
            raise SystemExit(1)
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
