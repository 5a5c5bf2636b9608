"""examples/train_moe.py: a MoE decoder with expert parallelism (experts split over EP=2 by an
autograd all-to-all, each rank's experts a unit on the edp=2 sub-mesh with
``set_gradient_divide_factor(world)``, dense units on the whole world of 4) trains exactly as
one process holding every expert on the concatenated global batch: losses and every parameter,
for each strategy and, as the control, torch's FSDP2 with the same script; 2 micro-batches.

SGD, not AdamW: Adam is nearly invariant to a gradient's scale and would hide a wrong divide
factor. Top-2 routing, so each token's output mixes experts that may live on different ranks.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _fsdp2_api import TIMEOUT_S, _param_errors

from _comm_counts import CollectiveCounts
from _pool import RankPools

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import train_moe  # noqa: E402
from moe_model import MoEGPT, keep_local_experts  # noqa: E402
from train_moe import (  # noqa: E402
    build_meshes,
    build_model,
    clip_grad_norm_ep_,
    config_from,
    lm_loss,
    make_parser,
    step_batches,
    train_step,
    wrap,
)

pytestmark = pytest.mark.timeout(900)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TINY = ["--steps", "3", "--micro-batches", "2", "--batch-size", "2", "--seq-len", "8",
        "--dim", "16", "--hidden", "24", "--layers", "2", "--heads", "2", "--vocab", "32",
        "--experts", "4", "--top-k", "2", "--ep", "2"]
LR = 0.5  # large enough that a gradient off by the EP degree moves parameters visibly


def _moe_worker(rank: int, world: int, control: str, extra: list[str]) -> dict[str, Any]:
    """``control``: a strategy (ours) or ``"fsdp2"``; ``extra``: more options. This rank's
    losses (mean over ranks), the reference's, and this rank's parameters' mismatches against
    the reference's (clipped with torch's ``clip_grad_norm_`` where ``--clip`` is set)."""
    args = make_parser().parse_args([*TINY, *extra])
    cpu = torch.device("cpu")
    flat, ep_mesh = build_meshes(args.ep, cpu)
    cfg = config_from(args)
    model = build_model(cfg, args.seed, ep_mesh, cpu)
    fsdp2 = control == "fsdp2"
    wrap(model, flat, ep_mesh, fsdp2=fsdp2, **({} if fsdp2 else {"sharding_strategy": control}))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(args.steps):
        loss = train_step(model, step_batches(args, step, rank), optimizer, args.clip,
                          ep_mesh["ep"].get_group())
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    clip_all_reduces = None
    if args.clip > 0 and not fsdp2:  # the clip alone, on one more backward's gradients
        model.set_is_last_backward(True)  # type: ignore[operator]
        lm_loss(model, step_batches(args, 0, rank)[0]).backward()
        with CollectiveCounts() as counts:
            clip_grad_norm_ep_(model, args.clip, ep_mesh["ep"].get_group())
        clip_all_reduces = counts.get_comm_counts().get(torch.ops.c10d.allreduce_, 0)

    torch.manual_seed(args.seed)
    ref = MoEGPT(cfg)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_losses = []
    for step in range(args.steps):
        per_rank = [step_batches(args, step, r) for r in range(world)]
        global_batches = [torch.cat([b[i] for b in per_rank]) for i in range(args.micro_batches)]
        ref_losses.append(train_step(ref, global_batches, ref_optimizer, args.clip).item())
    keep_local_experts(ref, ep_mesh.get_local_rank("ep"), args.ep, None)  # this rank's view
    return {"losses": losses, "ref_losses": ref_losses, "errors": _param_errors(model, ref),
            "clip_all_reduces": clip_all_reduces}


def _check(results: list[dict[str, Any]], control: str) -> None:
    for rank, r in enumerate(results):
        assert not r["errors"], f"rank {rank} {control}:\n" + "\n".join(r["errors"][:4])
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} {control} losses: {m}")
        # One all-reduce per distinct group: the world (dense), edp (experts), ep (their sum).
        assert r["clip_all_reduces"] in (None, 3), (rank, control, r["clip_all_reduces"])


@pytest.mark.parametrize("control", [*STRATEGIES, "fsdp2"])
def test_moe_example_matches_single_process(ranks: RankPools, control: str) -> None:
    """Top-2 routing, no clipping."""
    _check(ranks.run(_moe_worker, 4, control, ["--clip", "0"], timeout_s=TIMEOUT_S), control)


@pytest.mark.parametrize("control", ["optim_grads_params", "fsdp2"])
@pytest.mark.parametrize("extra", [["--top-k", "1", "--clip", "0"], ["--clip", "0.05"]],
                         ids=["top1", "clipped"])
def test_moe_example_top1_and_clipping(ranks: RankPools, control: str,
                                       extra: list[str]) -> None:
    """Top-1 routing; and gradients clipped to a norm over every rank's experts (0.05 is
    below the gradient norm of every step, so the clip always acts)."""
    _check(ranks.run(_moe_worker, 4, control, extra, timeout_s=TIMEOUT_S), control)


def test_moe_example_runs_under_torchrun(launched_python: str) -> None:
    """The script as launched (its own process group, teardown and exit status): finite losses,
    all-to-alls counted. 2 CPU ranks, EP=2 x edp=1, the fewest that still send tokens to another
    rank's experts: each torchrun rank is a process of its own (forked from a server that
    imported torch: the ``launched_python`` fixture), and the 4-rank EP=2 x edp=2 runs of
    ``main`` are the cases below."""
    cmd = [launched_python, "-m", "torch.distributed.run", "--standalone", "--no-python",
           "--nproc_per_node=2", launched_python, os.path.join(EXAMPLES, "train_moe.py"), *TINY,
           "--strategy", "optim_grads_params"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_printed(proc.stdout)


def _main_worker(rank: int, world: int, argv: list[str]) -> str:
    """train_moe.py's ``main(argv)`` inside the pool's process group (which it must leave
    alone); what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_moe.main(argv)
    assert dist.is_initialized(), "train_moe.py destroyed its caller's process group"
    return out.getvalue()


@pytest.mark.parametrize("extra", [["--strategy", "optim_grads_params"], ["--fsdp2"]],
                         ids=["optim_grads_params", "fsdp2"])
def test_moe_example_main_runs(ranks: RankPools, extra: list[str]) -> None:
    """The script's ``main(argv)`` on 4 pool ranks, EP=2 x edp=2, ours and the FSDP2 control:
    the same checks on what every rank printed."""
    _check_printed("".join(ranks.run(_main_worker, 4, [*TINY, *extra], timeout_s=TIMEOUT_S)))


def _check_printed(stdout: str) -> None:
    """Rank 0 printed 3 steps, each with a finite loss and all-to-alls counted."""
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, stdout
    assert all("all_to_all=" in line for line in steps), stdout
    assert all(math.isfinite(float(line.split("| loss ")[1].split()[0])) for line in steps), stdout
