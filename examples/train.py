"""Train a small GPT on synthetic tokens with megatron_fsdp_v2.

    torchrun --nproc_per_node=4 examples/train.py --strategy optim_grads
    torchrun --nproc_per_node=4 examples/train.py --mesh 2,2   # HSDP: 2 replicas x 2 shards
    torchrun --nproc_per_node=4 examples/train.py --fp8        # torchao float8, FP8 all-gathers

Runs on CPU over gloo by default, and on GPUs over NCCL (one GPU per local rank) when CUDA is
available. Every step rank 0 prints the loss (mean over ranks), throughput, the bytes this rank
communicated, and memory per rank.

Bytes communicated are counted by ``comm_counter.CommCounter``, a ``TorchDispatchMode`` that
sees every ``c10d`` collective at the dispatcher (the flat all-gathers and reduce-scatters of
fully_shard, the all-reduce of clip_grad_norm_), and reports ring-algorithm bytes sent per rank:
``2(N-1)/N * S`` for an all-reduce of S bytes, ``(N-1)/N * S`` for an all-gather or
reduce-scatter whose full buffer is S bytes. The per-step logging collectives run outside it.

Memory per rank: ``memory_report`` (bytes of fully_shard's buffers: compute weights, main
weights, main grads, peak scratch buffers; and the optimizer's state) and the process peak:
resident-set high-water mark on CPU, ``torch.cuda.max_memory_allocated`` on GPU.

``--fp8`` converts the blocks' linears to torchao float8 training (``Float8LinearConfig(
enable_fsdp_float8_all_gather=True)``: FP8 matmuls and weights gathered as FP8 bytes; torchao is
imported only then) and calls ``precompute_float8_dynamic_scale_for_fsdp`` after wrapping and
after every optimizer step (one all-reduce of every weight's amax). The tied output head stays
a plain linear. 1-D meshes only (no ``--mesh``).

``main(argv)`` also runs inside a process group that already exists (called by a harness, a
test's ranks or your own launcher): it trains on that group's ranks and leaves the group, and the
process, to the caller; under torchrun it creates the group and ends it (``setup_distributed``,
``teardown_distributed``).

``--help`` prints once (rank 0) with every option's default. ``examples/train_hf.py`` trains
Hugging Face models with this same loop (``train``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import IO

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron_fsdp_v2 as mfsdp  # noqa: E402

from comm_counter import CommCounter  # noqa: E402
from model import GPT, GPTConfig, lm_loss, synthetic_batch  # noqa: E402

MiB = 1 << 20
# torch 2.14 renamed all_gather_into_tensor to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RankZeroArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that prints (help, usage errors) on global rank 0 only.

    Under torchrun every rank parses the same command line, so ``--help`` or a typo would print
    once per rank; the other ranks exit with the same status, silently. Outside torchrun
    (``RANK`` unset) it prints as usual.
    """

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)


def build_parser(description: str) -> argparse.ArgumentParser:
    """The options every example shares (strategy, batch shape, optimizer, mesh); the model
    size options are the caller's. Every option has a help string, so
    ``ArgumentDefaultsHelpFormatter`` shows each default."""
    p = RankZeroArgumentParser(description=description,
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="what is sharded: no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2), "
                        "optim_grads_params (ZeRO-3)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="gradient-accumulation micro-batches per step")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch per rank")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 compute weights, fp32 main weights and gradients")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="adamw: AdamW on every parameter; muon: torch.optim.Muon on the blocks' "
                        "matrices (each orthogonalized whole on one rank) and AdamW on the rest")
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights (the same on every rank) and of the data")
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="R,S",
                   help="HSDP on an R x S mesh (R replicas, outer no_shard; --strategy along "
                        "the S ranks of each replica); None: a 1-D mesh over the world "
                        "(default: %(default)s)")
    return p


def make_parser() -> argparse.ArgumentParser:
    p = build_parser(__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--fp8", action="store_true",
                   help="torchao float8 linears in the blocks, with FP8 all-gathers (needs "
                        "torchao; dims multiples of 16)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def parse_mesh(text: str) -> tuple[int, int]:
    """``--mesh R,S``: the (replicate, shard) shape of an HSDP mesh."""
    try:
        r, s = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes R,S (e.g. 2,2), got {text!r}") from None
    if r < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"--mesh sizes must be positive, got {text!r}")
    return r, s


def build_mesh(shape: tuple[int, int] | None, device: torch.device):
    """The 2-D (replicate, shard) mesh of ``--mesh``, or ``None`` (fully_shard's 1-D default)."""
    if shape is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if shape[0] * shape[1] != dist.get_world_size():
        raise SystemExit(f"--mesh {shape[0]},{shape[1]} needs {shape[0] * shape[1]} ranks, "
                         f"got a world of {dist.get_world_size()}")
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def setup_distributed() -> tuple[torch.device, bool]:
    """This rank's device, and whether this call created the process group.

    Launched by torchrun (no group yet): NCCL on the local rank's GPU when CUDA is available,
    else gloo on CPU; the group is then the example's to end (``teardown_distributed``). Called
    inside a process group that already exists (``main(argv)`` from a harness, a test's ranks
    or your own launcher), it uses that group and leaves it to its owner: the device is the
    current CUDA device when the group's backend includes NCCL, else CPU.
    """
    if dist.is_initialized():
        if "nccl" in dist.get_backend() and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device()), False
        return torch.device("cpu"), False
    if "RANK" not in os.environ:
        script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "examples/train.py"
        raise SystemExit(f"launch with torchrun, e.g. `torchrun --nproc_per_node=4 {script}`")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank), True
    dist.init_process_group("gloo")
    return torch.device("cpu"), True


def teardown_distributed(created: bool) -> None:
    """End the run: when ``setup_distributed`` created the process group (``created``), wait for
    every rank, destroy the group and, on gloo, exit the process; otherwise nothing (the group
    and the process are the caller's)."""
    if not created:
        return
    dist.barrier()
    backend = dist.get_backend()
    dist.destroy_process_group()
    if backend == "gloo":
        # Every result is printed and the group is destroyed. About one gloo process in 25 aborts
        # in C++ static destructors at interpreter exit ("terminate called without an active
        # exception", FSDP2 too), which torchrun reports as a failed job: skip those destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def peak_memory_bytes(device: torch.device) -> int:
    """Process peak: CUDA allocator high-water mark on GPU, resident-set high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def fmt_ranks(values: list[float]) -> str:
    return "[" + " ".join(f"{v:.1f}" for v in values) + "]"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, created = setup_distributed()

    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, layers=args.layers,
                    heads=args.heads)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(cfg).to(device)
    if args.fp8:
        to_float8(model)
    title = (f"GPT {model.num_params() / 1e6:.2f}M params (dim={cfg.dim} layers={cfg.layers} "
             f"heads={cfg.heads} vocab={cfg.vocab} seq={cfg.seq_len})")
    train(model, list(model.blocks), args, device, title=title, loss_fn=lm_loss,
          batch_len=args.seq_len, vocab=args.vocab)
    teardown_distributed(created)


def float8_api() -> tuple[Callable[..., torch.nn.Module], Callable[[torch.nn.Module], None],
                         type]:
    """torchao's (convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp,
    Float8LinearConfig), imported only for ``--fp8``; a clear error if torchao is missing."""
    try:
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )
    except ImportError as e:
        raise SystemExit(
            f"--fp8 needs torchao (float8 training), which is not importable here ({e}); "
            "install it with `pip install --no-deps torchao==0.18.0` (the version "
            "scripts/install.sh pins), or run without --fp8"
        ) from None
    return convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp, Float8LinearConfig


def to_float8(model: torch.nn.Module) -> None:
    """Convert the blocks' linears to torchao float8 training with FP8 all-gathers (the output
    head is tied to the embedding and stays plain)."""
    convert, _, config_cls = float8_api()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("blocks.") and (
            module.in_features % 16 or module.out_features % 16
        ):
            raise SystemExit(f"--fp8: {name} is {module.in_features}x{module.out_features}; "
                             "float8 matmuls need both dims multiples of 16 (choose --dim)")
    convert(model, config=config_cls(enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda module, fqn: fqn.startswith("blocks."))


def build_optimizers(model: torch.nn.Module, blocks: list[torch.nn.Module],
                     args: argparse.Namespace) -> list[torch.optim.Optimizer]:
    """``--optimizer adamw``: one AdamW. ``muon``: ``torch.optim.Muon`` on the blocks' 2-D
    weights (on fully_shard parameters each matrix is orthogonalized whole on one rank, see
    ``megatron_fsdp_v2.optim``) and AdamW on everything else (embeddings, head, norms, biases)."""
    adamw = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if getattr(args, "optimizer", "adamw") == "adamw":
        return [torch.optim.AdamW(model.parameters(), **adamw)]
    matrices = {id(p) for block in blocks for p in block.parameters() if p.ndim == 2}
    return [
        torch.optim.Muon([p for p in model.parameters() if id(p) in matrices], lr=args.muon_lr,
                         weight_decay=0.1),
        torch.optim.AdamW([p for p in model.parameters() if id(p) not in matrices], **adamw),
    ]


def held_bytes(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """``memory_report``'s total with the state of every optimizer."""
    reports = [mfsdp.memory_report(model, optimizer=opt) for opt in optimizers]
    return reports[0].total + sum(r.optimizer_state for r in reports[1:])


def train(model: torch.nn.Module, blocks: list[torch.nn.Module], args: argparse.Namespace,
          device: torch.device, *, title: str,
          loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor], batch_len: int,
          vocab: int) -> None:
    """Wrap ``blocks`` then ``model``, train ``args.steps`` steps on ``synthetic_batch(...,
    batch_len, ...)`` tokens with ``loss_fn(model, tokens)``, print (rank 0) the loss, throughput,
    communication and memory of every step. Shared by ``train.py`` and ``train_hf.py``, whose
    ``main`` then calls ``teardown_distributed``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mp_policy = (
        mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)
        if args.bf16 else None
    )
    mesh = build_mesh(args.mesh, device)
    # HSDP (--mesh R,S): the strategy along the inner axis, gradients all-reduced across the R
    # replicas once per step (outer no_shard).
    wrap = dict(sharding_strategy=args.strategy, mp_policy=mp_policy, mesh=mesh)
    if mesh is not None:
        wrap["outer_dp_sharding_strategy"] = "no_shard"
    for block in blocks:
        mfsdp.fully_shard(block, **wrap)
    mfsdp.fully_shard(model, **wrap)
    fp8 = getattr(args, "fp8", False)
    # torchao float8 scales from the all-reduced amax of every weight: after wrapping (a rank
    # may hold no row of a weight) and after every optimizer step.
    precompute = float8_api()[1] if fp8 else (lambda module: None)
    precompute(model)
    # Built after wrapping, on the sharded (DTensor) parameters.
    optimizers = build_optimizers(model, blocks, args)

    tokens_per_step = world * args.micro_batches * args.batch_size * args.seq_len
    if rank == 0:
        print(f"{title} | "
              f"strategy={args.strategy} world={world} "
              f"mesh={'x'.join(map(str, args.mesh)) if args.mesh else world} "
              f"device={device.type} "
              f"backend={dist.get_backend()} | {args.micro_batches} micro-batches x "
              f"{args.batch_size} seqs/rank = {tokens_per_step} tokens/step | "
              f"{'bf16 compute, fp32 main' if args.bf16 else 'fp32'}"
              f"{', float8 linears (FP8 all-gathers)' if fp8 else ''}", flush=True)
        peak = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                else "RSS high-water mark")
        print("comm = ring-algorithm bytes sent by this rank, counted by a TorchDispatchMode over "
              "c10d ops (all-gathered: the full buffers of its all-gathers, 1 byte per element "
              "for FP8 weights); held = memory_report total (fully_shard buffers + optimizer "
              f"state); peak = {peak}", flush=True)

    counter = CommCounter()
    step_times: list[float] = []
    for step in range(args.steps):
        batches = [synthetic_batch(args.batch_size, batch_len, vocab, seed=args.seed,
                                   step=step, micro=i, rank=rank, device=device)
                   for i in range(args.micro_batches)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with counter:
            loss_sum = torch.zeros((), device=device)
            for i, tokens in enumerate(batches):
                model.set_is_last_backward(i == args.micro_batches - 1)
                loss = loss_fn(model, tokens) / args.micro_batches
                loss.backward()
                loss_sum += loss.detach()
            if args.clip > 0:
                mfsdp.clip_grad_norm_(model.parameters(), args.clip)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            precompute(model)
            if device.type == "cuda":
                torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        step_times.append(elapsed)
        comm = counter.reset()

        # Logging (not counted): every rank's loss, held bytes and peak memory.
        mine = torch.tensor([loss_sum.item(), held_bytes(model, optimizers),
                             peak_memory_bytes(device)],
                            dtype=torch.float64, device=device)
        everyone = torch.empty(world * 3, dtype=torch.float64, device=device)
        _all_gather_single(everyone, mine)
        everyone = everyone.view(world, 3).cpu()
        if rank == 0:
            print(f"step {step + 1:3d}/{args.steps} | loss {everyone[:, 0].mean():.4f} | "
                  f"{tokens_per_step / elapsed:9,.0f} tok/s | {elapsed * 1e3:6.0f} ms | "
                  f"comm {comm.total_wire_bytes / MiB:7.2f} MiB/rank ({comm.summary()}; "
                  f"all-gathered {comm.payload_bytes['all_gather']:,} B) | "
                  f"held MiB {fmt_ranks((everyone[:, 1] / MiB).tolist())} | "
                  f"peak MiB {fmt_ranks((everyone[:, 2] / MiB).tolist())}", flush=True)

    reports = [None] * world
    dist.all_gather_object(reports, "; ".join(
        f"with {type(opt).__name__}: {mfsdp.memory_report(model, optimizer=opt)}"
        for opt in optimizers))
    if rank == 0:
        steady = sorted(step_times[1:] or step_times)
        median = steady[len(steady) // 2]
        print(f"done: median step {median * 1e3:.0f} ms, {tokens_per_step / median:,.0f} tok/s "
              f"(step 1 excluded)")
        for r, text in enumerate(reports):
            print(f"memory_report rank {r}: {text}")


if __name__ == "__main__":
    main()
