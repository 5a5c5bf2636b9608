"""Two and three ranks sharing one GPU: gloo process groups with the model on ``cuda:0`` in
every rank, every strategy, plain fp32 and bf16 + trace pool + buckets + activation
checkpointing, against a single-process run of the same model on the same data.

Several ranks of one NCCL communicator on one GPU are refused by NCCL ("Duplicate GPU
detected"), so this is the only multi-rank check one GPU allows. gloo takes CUDA tensors for
every collective the library issues (all-reduce, broadcast and all-gather natively, through
pinned host copies; reduce-scatter as an all-reduce of a copy, torch's gloo backend), and the
library runs its CUDA path: side streams, events, the CUDA kernels. The mesh is
``init_device_mesh("cuda", (world,))`` (a gloo group behind a CUDA mesh), passed explicitly:
the library's default mesh is a CPU one for gloo.

    python scripts/gpu_checks/shared_gpu.py --device cuda
    python scripts/gpu_checks/shared_gpu.py --device cpu   # dry run: the usual CPU gloo ranks
"""

from __future__ import annotations

import os

import _common as c
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# Relative tolerance against the fp32 single-process run: fp32 differs by summation order only;
# bf16 compute rounds each forward and backward (the reference computes in fp32).
TOLERANCE = {False: 1e-4, True: 5e-2}


def _worker(rank: int, world: int, device_type: str, strategies: list[str], steps: int,
            self_test: bool) -> list[str]:
    if device_type == "cuda":
        os.environ["LOCAL_RANK"] = "0"  # every rank on the one GPU (DeviceMesh reads it)
    device = c.setup_device(device_type)
    mesh = init_device_mesh(device.type, (world,))
    lines = []
    failures = []
    for strategy in strategies:
        for config in c.CONFIGS:
            label = f"world {world} {strategy} {config.name}"
            model, reference = c.build(strategy, config, device, mesh=mesh)
            initial = {k: v.cpu() for k, v in c.full_params(model).items()}
            batches = c.make_batches(steps, 2, world, device)
            if self_test and rank == 1:  # one rank trains on other data: must not match
                batches = c.make_batches(steps, 2, world, device, seed=7)
            losses = c.train(model, batches, rank, optimizer="sgd")
            mean_losses = losses.clone()
            dist.all_reduce(mean_losses)  # the reference's loss is the mean over ranks
            mean_losses /= world
            params = {k: v.cpu() for k, v in c.full_params(model).items()}
            ref_losses = c.train_reference(reference, batches, optimizer="sgd")
            ref_params = {k: v.detach().cpu() for k, v in reference.named_parameters()}
            try:
                error = c.assert_same_training(label, losses=mean_losses, ref_losses=ref_losses,
                                       params=params, ref_params=ref_params, initial=initial,
                                       tolerance=TOLERANCE[config.bf16])
                lines.append(f"[shared_gpu] {label}: matches single-process (largest relative "
                             f"error {error:.1e}, tolerance {TOLERANCE[config.bf16]:.0e})")
            except c.CheckFailed as e:
                failures.append(str(e))
                lines.append(f"[shared_gpu] {label}: FAILED {e}")
    if failures:
        raise c.CheckFailed("\n".join(lines))
    return lines


def main() -> None:
    args = c.parse_args(__doc__ or "", [
        ("--worlds", {"default": "2,3"}),
        ("--steps", {"type": int, "default": 3}),
        ("--strategies", {"default": ",".join(c.STRATEGIES)}),
        ("--timeout", {"type": float, "default": 240.0}),
        ("--self-test", {"action": "store_true",
                         "help": "rank 1 trains on other data: must fail"}),
    ])
    failures = []
    for world in (int(w) for w in args.worlds.split(",")):
        try:
            results = c.run_distributed(_worker, world, args.device, args.strategies.split(","),
                                      args.steps, args.self_test, timeout_s=args.timeout)
            print("\n".join(results[0]))
        except Exception as e:  # noqa: BLE001 - the ranks' tracebacks, one world at a time
            failures.append(f"world {world}: {e}")
            print(f"[shared_gpu] world {world}: FAILED\n{e}")
    c.finish("shared_gpu", failures)


if __name__ == "__main__":
    main()
