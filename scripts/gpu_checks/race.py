"""Race amplifier: overlap on (collectives on CUDA side streams, each delayed by an injected
``torch.cuda._sleep``) against overlap off (``fully_shard(overlap=False)``: every collective
synchronous, in stream order), compared bitwise on the losses and the final parameters, for
every strategy, plain fp32 and with bf16 compute + the trace pool + reduction and refresh
buckets + activation checkpointing. World 1 (NCCL on one GPU).

At world 1 NCCL moves no data (an in-place collective is a no-op, an out-of-place one a copy),
so the bits cannot differ through the reduction itself: a difference means a buffer was read
before its collective completed, or freed and reused while a collective still used it.

Run under ``TORCH_CUDA_SANITIZER=1`` too (gpu_check.sh does, with fewer steps): torch's CUDA
sanitizer then reports any kernel that touches a tensor another stream uses without an event in
between, delayed or not.

    python scripts/gpu_checks/race.py --device cuda
    python scripts/gpu_checks/race.py --device cpu     # dry run: gloo, nothing delayed
"""

from __future__ import annotations

import os

import _common as c
import torch


def _run(strategy: str, config: c.Config, device: torch.device, *, overlap: bool,
         steps: int, micro: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model, _ = c.build(strategy, config, device, overlap=overlap)
    losses = c.train(model, c.make_batches(steps, micro, 1, device))
    c.synchronize(device)
    return losses.cpu(), {k: v.cpu() for k, v in c.local_params(model).items()}


def main() -> None:
    args = c.parse_args(__doc__ or "", [
        ("--steps", {"type": int, "default": 3}),
        ("--micro-batches", {"type": int, "default": 2}),
        # About 1 ms at an H200's ~2 GHz: longer than any kernel of this model.
        ("--sleep-cycles", {"type": int, "default": 2_000_000}),
        ("--strategies", {"default": ",".join(c.STRATEGIES)}),
        ("--self-test", {"action": "store_true",
                         "help": "drop every asynchronous collective: must fail"}),
    ])
    device = c.setup_device(args.device)
    sanitizer = "TORCH_CUDA_SANITIZER" in os.environ
    name = "race" + (" under TORCH_CUDA_SANITIZER" if sanitizer else "")
    failures: list[str] = []
    with c.single_rank_group(device):
        amplifier = c.SideStreamSleep(args.sleep_cycles)
        if args.self_test:
            _drop_async_collectives()
        for strategy in args.strategies.split(","):
            for config in c.CONFIGS:
                label = f"{strategy} {config.name}"
                try:
                    off = _run(strategy, config, device, overlap=False, steps=args.steps,
                               micro=args.micro_batches)
                    delayed_before = amplifier.count
                    on = _run(strategy, config, device, overlap=True, steps=args.steps,
                              micro=args.micro_batches)
                    delayed = amplifier.count - delayed_before
                    c.assert_bitwise(f"{label}: losses, overlap on vs off",
                                     {"losses": on[0]}, {"losses": off[0]})
                    c.assert_bitwise(f"{label}: parameters, overlap on vs off", on[1], off[1])
                    if device.type == "cuda" and delayed == 0:
                        raise c.CheckFailed(f"{label}: no collective ran on a side stream")
                    print(f"[{name}] {label}: bitwise equal ({delayed} collectives on side "
                          f"streams, each after a {args.sleep_cycles}-cycle sleep)"
                          if device.type == "cuda" else
                          f"[{name}] {label}: bitwise equal (cpu: gloo async, no delay)")
                except Exception as e:  # noqa: BLE001 - one line per failing case
                    failures.append(f"{label}: {type(e).__name__}: {e}")
                    print(f"[{name}] {label}: FAILED {type(e).__name__}: {e}")
        amplifier.remove()
    c.finish(name, failures)


def _drop_async_collectives() -> None:
    """Self-test: the overlapped run loses its collectives (at world 1 an out-of-place
    reduce-scatter's copy into ``main_grad``), so the comparison must see different bits."""
    from megatron_fsdp_v2._comm import _collectives

    original = _collectives.CommStreams.run

    def run(streams, launch, *, async_op, reduce):  # type: ignore[no-untyped-def]
        return None if async_op else original(streams, launch, async_op=async_op, reduce=reduce)

    _collectives.CommStreams.run = run  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
