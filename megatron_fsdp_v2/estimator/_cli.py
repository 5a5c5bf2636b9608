"""The estimator's command line, ``python -m megatron_fsdp_v2.estimator``: every strategy (and
HSDP on the meshes asked for) side by side for one model preset, as a table of per-rank memory
and per-iteration collectives (:func:`table`), with the cheapest configuration that fits a memory
budget marked. The numbers come from :func:`~._estimate.estimate`.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..api import MixedPrecisionPolicy, ShardingStrategy
from ._estimate import Estimate, estimate

__all__ = ["STRATEGIES", "main", "table"]

STRATEGIES = tuple(s.value for s in ShardingStrategy)  # every strategy, in code order
_GIB = float(1 << 30)


def _parse_mesh(text: str) -> tuple[int, int]:
    try:
        r, s = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes RxS (e.g. 8x128), got {text!r}") from None
    return r, s


def table(rows: list[tuple[str, Estimate]], budget_gib: float | None) -> str:
    """The side-by-side table the command line prints; ``*`` marks the configuration with the
    fewest wire bytes communicated among those whose total fits ``budget_gib``."""
    fits = [(label, e) for label, e in rows
            if budget_gib is None or e.memory.device_bytes <= budget_gib * _GIB]
    best = min(fits, key=lambda r: r[1].bytes_communicated)[0] if fits else None
    head = (f"{'':2}{'configuration':<40}{'model':>9}{'main':>9}{'grads':>9}{'temp':>9}"
            f"{'optim':>9}{'total':>9}{'host':>9}  {'AG n/GiB':>13}{'RS n/GiB':>13}{'AR n/GiB':>13}"
            f"{'wire GiB':>10}{'pad':>8}")
    lines = [head, "-" * len(head)]
    for label, e in rows:
        m = e.memory
        cols = [m.model_weights, m.main_weights, m.main_grads, m.temporary_peak,
                m.optimizer_state, m.total, m.host_bytes]
        comm = [e.collectives[k] for k in ("all_gather", "reduce_scatter", "all_reduce")]
        lines.append(
            f"{'*' if label == best else ' ':2}{label:<40}"
            + "".join(f"{c / _GIB:>9.2f}" for c in cols) + "  "
            + "".join(f"{f'{n}/{b / _GIB:.1f}':>13}" for n, b in comm)
            + f"{e.bytes_communicated / _GIB:>10.1f}{e.padding_ratio:>8.3%}"
        )
    lines.append("memory in GiB per rank (optim: AdamW state; host: the part of total CPU offload "
                 "keeps in host memory, not counted against the budget); collectives per "
                 "iteration: count/"
                 "GiB of full buffers, and GiB one rank sends (ring); * = fewest sent that fits "
                 "the budget"
                 + (f" ({budget_gib} GiB)" if budget_gib is not None else ""))
    if best is None:
        lines.append(f"nothing fits {budget_gib} GiB")
    lines.append("not modelled: activations (and their recomputation), the model's non-parameter "
                 "buffers, framework/allocator overhead, gradient clipping's all-reduce")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from ._presets import PRESETS, build_preset, tp_plan

    parser = argparse.ArgumentParser(
        prog="python -m megatron_fsdp_v2.estimator",
        description="Per-rank memory and per-iteration collectives of every strategy, from the "
                    "library's own wrapping code under a fake process group (no GPU, no "
                    "allocation).")
    parser.add_argument("--model", choices=sorted(PRESETS), default="llama")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048, help="GPT position embeddings")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--param-dtype", choices=("bf16", "fp32", "fp8"), default="bf16",
                        help="compute dtype (main weights and gradients stay fp32); fp8: bf16 "
                             "compute with the blocks' linears as torchao float8 linears "
                             "gathered in FP8 (needs torchao; scales precomputed every step)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree: the preset's Megatron-style TP plan on a "
                             "(world-size/tp, tp) mesh, then every strategy over the dp ranks "
                             "(memory and dp collectives; TP's own collectives are not counted)")
    parser.add_argument("--mesh", type=_parse_mesh, action="append", default=[],
                        help="also estimate HSDP on an RxS mesh (repeatable; with --tp, "
                             "HSDP x TP: R*S = world-size/tp)")
    parser.add_argument("--reshard-to", type=int, action="append", default=[],
                        help="also estimate optim_grads_params with reshard_after_forward=N "
                             "(backward all-gathers within groups of N ranks; repeatable)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="also estimate optim_grads_params with CPUOffloadPolicy (main "
                             "weights, gradients and optimizer state in host memory)")
    parser.add_argument("--budget-gib", type=float, default=None)
    args = parser.parse_args(argv)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)
          if args.param_dtype in ("bf16", "fp8") else None)
    model_fn, block = build_preset(args)
    rows: list[tuple[str, Estimate]] = []
    common: dict[str, Any] = dict(world_size=args.world_size, wrap=(block,), mp_policy=mp,
                                  micro_batches=args.micro_batches, rank=args.rank,
                                  float8=args.param_dtype == "fp8")
    if args.tp > 1:
        if args.param_dtype == "fp8":
            parser.error("--param-dtype fp8 with --tp: fully_shard gathers FP8 weights on a "
                         "data-parallel mesh only (FSDP x TP refuses them)")
        common.update(tp=args.tp, tp_plan=tp_plan(args.model))
    # The last element: reshard_after_forward, or "offload" (CPUOffloadPolicy, the default
    # schedule).
    configs: list[tuple[str, tuple[int, int] | None, str, bool | int | str]] = [
        (s, None, "no_shard", True) for s in STRATEGIES
    ]
    configs += [("optim_grads_params", None, "no_shard", n) for n in args.reshard_to]
    if args.cpu_offload:
        configs.append(("optim_grads_params", None, "no_shard", "offload"))
    for mesh in args.mesh:  # outer no_shard under each inner strategy, then outer optim
        configs += [(s, mesh, "no_shard", True) for s in STRATEGIES]
        configs.append(("optim_grads_params", mesh, "optim", True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # fully_shard's padding warnings: summarized below
        for strategy, mesh, outer, reshard in configs:
            offload = reshard == "offload"
            schedule: bool | int = True if isinstance(reshard, str) else reshard
            est = estimate(model_fn, sharding_strategy=strategy, mesh_shape=mesh,
                           outer_dp_sharding_strategy=outer, cpu_offload=offload,
                           reshard_after_forward=schedule, **common)
            label = (f"{strategy} + CPU offload" if offload else strategy if reshard is True
                     else f"{strategy} reshard to {reshard}")
            if mesh is not None:
                label = f"hsdp {mesh[0]}x{mesh[1]} {strategy}"
                label += " +outer optim" if outer == "optim" else ""
            rows.append((label, est))
    params = sum(p.numel() for p in _count_model(model_fn))
    print(f"{args.model}: {params / 1e9:.2f}B parameters, world size {args.world_size}, "
          f"{args.micro_batches} micro-batch(es), "
          + ("bf16 compute, float8 linears gathered in FP8" if args.param_dtype == "fp8"
             else f"{args.param_dtype} compute") + f", rank {args.rank}"
          + (f", tp {args.tp} (dp {args.world_size // args.tp})" if args.tp > 1 else ""))
    print(table(rows, args.budget_gib))
    padded = {str(w.message).split("'")[1] for w in caught if "padded" in str(w.message)}
    if padded:
        print(f"padding above max_padding_ratio in {len(padded)} parameter(s), e.g. "
              f"{sorted(padded)[0]!r}: rows too wide to shard evenly (see the pad column)")


def _count_model(model_fn: Callable[[], nn.Module]) -> list[torch.Tensor]:
    with torch.device("meta"):
        return list(model_fn().parameters())


if __name__ == "__main__":
    main()
