"""Train a small mixture-of-experts decoder with expert parallelism and megatron_fsdp_v2.

    torchrun --nproc_per_node=4 examples/train_moe.py --ep 2 --strategy optim_grads
    torchrun --nproc_per_node=4 examples/train_moe.py --ep 2 --fsdp2   # torch's FSDP2, same run

The world is a 2-D (ep, edp) mesh, torchtitan-style: the experts of every MoE layer are split
over the ``ep`` ranks of an expert-parallel group (tokens travel to their expert and back by an
autograd all-to-all, see ``moe_model.py``) and each rank's experts are a fully_shard unit on
the expert-data-parallel sub-mesh ``edp`` (the ranks that hold the same experts); the dense
layers (embeddings, attention, norms, routers) are units on the whole world.

Gradient scale: each rank's loss is the mean over its own tokens, and fully_shard divides a
unit's gradient sum by its mesh size: right for the dense units (the mean over the world's
losses), but an expert's gradient on an edp rank already sums the contributions of every rank
of its EP group, so dividing by the edp size alone would scale it by ``ep``. The experts' units
call ``set_gradient_divide_factor(world)`` (FSDP2's method, as torchtitan does), so every
gradient is that of single-process training on the global batch; tests/distributed/
test_moe_example.py checks losses and parameters against one process holding every expert.

``--clip`` clips to the 2-norm over the whole model, every EP rank's experts included
(``clip_grad_norm_ep_``: a plain ``clip_grad_norm_`` would see only this rank's experts).

gloo on CPU, NCCL on GPU (one per local rank); ``main(argv)`` inside an existing process group
uses that group and leaves it to the caller (``train.setup_distributed``). Rank 0 prints per
step the loss (mean over ranks), throughput and the bytes this rank communicated (all-gathers,
reduce-scatters and the all-to-alls), counted by ``comm_counter.CommCounter``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_model import MoEConfig, MoEGPT, keep_local_experts  # noqa: E402
from train import (  # noqa: E402
    MiB,
    build_parser,
    peak_memory_bytes,
    setup_distributed,
    teardown_distributed,
)

import megatron_fsdp_v2 as mfsdp  # noqa: E402

from comm_counter import CommCounter  # noqa: E402
from model import lm_loss, synthetic_batch  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = build_parser(__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree (divides the world)")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is sent to")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--hidden", type=int, default=128, help="hidden width of each expert")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--fsdp2", action="store_true",
                   help="wrap with torch's FSDP2 instead (the control; --strategy ignored)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def config_from(args: argparse.Namespace) -> MoEConfig:
    return MoEConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, layers=args.layers,
                     heads=args.heads, experts=args.experts, top_k=args.top_k,
                     hidden=args.hidden)


def build_meshes(ep: int, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """The world's 1-D mesh (dense units) and its 2-D (ep, edp) view (experts)."""
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ValueError(f"--ep {ep} must divide the world size {world}")
    return (init_device_mesh(device.type, (world,)),
            init_device_mesh(device.type, (ep, world // ep), mesh_dim_names=("ep", "edp")))


def build_model(cfg: MoEConfig, seed: int, ep_mesh: DeviceMesh,
                device: torch.device) -> MoEGPT:
    """Every expert built from ``seed`` (the reference's weights), then only this rank's kept."""
    torch.manual_seed(seed)
    model = MoEGPT(cfg).to(device)
    ep = ep_mesh.size(0)
    # --ep 1: every rank holds every expert, nothing to exchange.
    keep_local_experts(model, ep_mesh.get_local_rank("ep"), ep,
                       ep_mesh["ep"].get_group() if ep > 1 else None)
    return model


def wrap(model: MoEGPT, flat: DeviceMesh, ep_mesh: DeviceMesh, *, fsdp2: bool = False,
         **options: Any) -> None:
    """Experts on the edp sub-mesh with the world as divide factor, blocks and root on the
    whole world. ``fsdp2``: torch's fully_shard (``options`` must then be FSDP2's)."""
    shard: Any = torch_fully_shard if fsdp2 else mfsdp.fully_shard
    world = flat.size()
    for block in model.blocks:
        experts = block.moe.experts
        shard(experts, mesh=ep_mesh["edp"], **options)
        experts.set_gradient_divide_factor(float(world))
        if fsdp2 and dist.get_backend() == "gloo" and world != ep_mesh["edp"].size():
            # gloo has no PREMUL_SUM: FSDP2 needs a plain sum there (then divides itself).
            experts.set_force_sum_reduction_for_comms(True)
        shard(block, mesh=flat, **options)
    shard(model, mesh=flat, **options)


def clip_grad_norm_ep_(model: torch.nn.Module, max_norm: float,
                       ep_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Clip every gradient to a global 2-norm over the whole model, experts of every EP rank
    included; returns that norm (the same on every rank).

    A plain ``clip_grad_norm_`` over ``model.parameters()`` would not do: an expert gradient is
    a DTensor on the edp sub-mesh, so its norm is reduced over the ranks that hold the *same*
    experts only, and ranks of different EP indices would clip by different norms. So: the
    dense gradients' norm (over the world), the local experts' norm (over edp), the latter's
    square summed over the EP group, as torchtitan does for its expert parameters.

    Collectives: one all-reduce per distinct group, three in all (the world for the dense
    norm, edp for the experts', ep for their sum). With fully_shard the norms come from
    ``megatron_fsdp_v2.clip_grad_norm_(params, inf)`` (the norm only: the clip coefficient is
    1), which reduces on the groups of the *parameters* it gets. ``get_total_norm``, which
    takes gradients, would do two more: its contract is one all-reduce on every library group
    per call whatever the list holds (a rank cannot tell from its gradients which groups its
    peers reduce on, see [Note: total norm of gradient lists] in
    ``megatron_fsdp_v2/_runtime/_clipping.py``), so its two
    calls here would reduce on both the world and edp groups. FSDP2's and the single-process
    reference's norms come from ``torch.nn.utils.get_total_norm`` (FSDP2's as DTensors).
    """
    dense, experts = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (experts if ".moe.experts." in name else dense).append(p)
    ours = isinstance(model, mfsdp.FSDPModule)

    def norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
        if ours:
            return mfsdp.clip_grad_norm_(params, float("inf")).float()
        total = torch.nn.utils.get_total_norm([p.grad for p in params])  # type: ignore[misc]
        return (total.full_tensor() if isinstance(total, DTensor) else total).float()

    experts_sq = norm(experts) ** 2
    if ep_group is not None:
        dist.all_reduce(experts_sq, group=ep_group)
    total = (norm(dense) ** 2 + experts_sq).sqrt()
    for params in (dense, experts):  # one list per mesh: DTensor foreach ops refuse mixed ones
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def train_step(model: torch.nn.Module, batches: list[torch.Tensor],
               optimizer: torch.optim.Optimizer, clip: float = 0.0,
               ep_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """One optimizer step over ``batches`` (micro-batches); returns this rank's loss. Also the
    single-process reference's step (a plain module: no window to close)."""
    loss_sum = torch.zeros((), device=batches[0].device)
    last_backward = getattr(model, "set_is_last_backward", None)
    for i, tokens in enumerate(batches):
        if last_backward is not None:
            last_backward(i == len(batches) - 1)
        loss = lm_loss(model, tokens) / len(batches)
        loss.backward()
        loss_sum += loss.detach()
    if clip > 0:
        clip_grad_norm_ep_(model, clip, ep_group)
    optimizer.step()
    optimizer.zero_grad()
    return loss_sum


def step_batches(args: argparse.Namespace, step: int, rank: int,
                 device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """This rank's micro-batches of ``step``."""
    return [synthetic_batch(args.batch_size, args.seq_len, args.vocab, seed=args.seed, step=step,
                            micro=i, rank=rank, device=device)
            for i in range(args.micro_batches)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mesh is not None:
        raise SystemExit("train_moe.py builds its own (ep, edp) mesh: use --ep, not --mesh")
    device, created = setup_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    flat, ep_mesh = build_meshes(args.ep, device)
    cfg = config_from(args)
    model = build_model(cfg, args.seed, ep_mesh, device)
    mp_policy = (mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            main_params_dtype=torch.float32)
                 if args.bf16 else None)
    options: dict[str, Any] = (
        {} if args.fsdp2 else {"sharding_strategy": args.strategy, "mp_policy": mp_policy})
    wrap(model, flat, ep_mesh, fsdp2=args.fsdp2, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    tokens_per_step = world * args.micro_batches * args.batch_size * args.seq_len
    if rank == 0:
        print(f"MoE GPT dim={cfg.dim} layers={cfg.layers} experts={cfg.experts} "
              f"top_k={cfg.top_k} | {'FSDP2' if args.fsdp2 else 'strategy=' + args.strategy} "
              f"world={world} mesh=ep{args.ep}xedp{world // args.ep} device={device.type} "
              f"backend={dist.get_backend()} | {tokens_per_step} tokens/step", flush=True)
    counter = CommCounter()
    for step in range(args.steps):
        batches = step_batches(args, step, rank, device)
        start = time.perf_counter()
        with counter:
            loss = train_step(model, batches, optimizer, args.clip, ep_mesh["ep"].get_group())
            if device.type == "cuda":
                torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        comm = counter.reset()
        dist.all_reduce(loss)  # logging, not counted
        if rank == 0:
            print(f"step {step + 1:3d}/{args.steps} | loss {loss.item() / world:.6f} | "
                  f"{tokens_per_step / elapsed:9,.0f} tok/s | {elapsed * 1e3:6.0f} ms | "
                  f"comm {comm.total_wire_bytes / MiB:7.2f} MiB/rank ({comm.summary()}) | "
                  f"peak {peak_memory_bytes(device) / MiB:.1f} MiB", flush=True)
    teardown_distributed(created)


if __name__ == "__main__":
    main()
