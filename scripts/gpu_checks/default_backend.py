"""``torch.distributed.init_process_group()`` without a backend, as most torchrun scripts call
it, then ``fully_shard(model)`` without a mesh: the library must recognise NCCL behind the
backend strings torch reports for such groups (``"undefined"``, or a per-device list such as
``"cpu:gloo,cuda:nccl"``), build a CUDA default mesh, train like a single process, and move a
full state dict in and out (``get_full_state_dict`` / ``load_full_state_dict``). Also with
the backend given as ``"cpu:gloo,cuda:nccl"``. World 1, environment rendezvous as torchrun sets
it up.

    python scripts/gpu_checks/default_backend.py --device cuda
    python scripts/gpu_checks/default_backend.py --device cpu    # dry run: the CPU default
"""

from __future__ import annotations

import os

import _common as c
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

STRATEGIES = ("no_shard", "optim_grads_params")


def _check(backend: str | None, device: torch.device, steps: int) -> list[str]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(c.free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(backend)  # no device_id either: the plainest torchrun script
    lines = [f"init_process_group({backend!r}): get_backend() = {dist.get_backend()!r}"]
    try:
        for strategy in STRATEGIES:
            label = f"backend={backend!r} {strategy}"
            model, reference = c.build(strategy, c.PLAIN, device)
            param = next(model.parameters())
            assert isinstance(param, DTensor), type(param)
            mesh_type = param.device_mesh.device_type
            if mesh_type != device.type:
                raise c.CheckFailed(f"{label}: the default mesh is a {mesh_type!r} mesh for a "
                                    f"model on {device}")
            initial = {k: v.cpu() for k, v in c.full_params(model).items()}
            batches = c.make_batches(steps, 2, 1, device)
            losses = c.train(model, batches, optimizer="sgd")
            ref_losses = c.train_reference(reference, batches, optimizer="sgd")
            ref_params = {k: v.detach().cpu() for k, v in reference.named_parameters()}
            params = {k: v.cpu() for k, v in c.full_params(model).items()}
            error = c.assert_same_training(label, losses=losses, ref_losses=ref_losses,
                                           params=params, ref_params=ref_params,
                                           initial=initial, tolerance=1e-4)
            full = c.mfsdp.checkpoint.get_full_state_dict(model)
            c.assert_bitwise(f"{label}: get_full_state_dict", {k: v.cpu() for k, v in
                                                                  full.items()}, params)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            c.mfsdp.checkpoint.load_full_state_dict(model, full, broadcast_from_rank0=True)
            c.assert_bitwise(f"{label}: load_full_state_dict",
                             {k: v.cpu() for k, v in c.full_params(model).items()}, params)
            c.train(model, batches[:1])  # trains on after the load
            lines.append(f"{label}: {mesh_type} mesh, matches single-process (relative error "
                         f"{error:.1e}), full state dict round trip")
    finally:
        dist.destroy_process_group()
    return lines


def main() -> None:
    args = c.parse_args(__doc__ or "", [("--steps", {"type": int, "default": 2})])
    device = c.setup_device(args.device)
    # On CPU a per-device string naming NCCL would need a GPU: only the default there.
    backends: list[str | None] = [None, "cpu:gloo,cuda:nccl"] if device.type == "cuda" else [None]
    failures = []
    for backend in backends:
        try:
            for line in _check(backend, device, args.steps):
                print(f"[default_backend] {line}")
        except Exception as e:  # noqa: BLE001 - one line per backend string
            failures.append(f"backend={backend!r}: {type(e).__name__}: {e}")
            print(f"[default_backend] backend={backend!r}: FAILED {type(e).__name__}: {e}")
    c.finish("default_backend", failures)


if __name__ == "__main__":
    main()
