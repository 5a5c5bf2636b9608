"""Checkpointing: DCP save/load with resharding across world sizes and strategies, and resuming
from it (tolerances: ``_checkpoint.py``).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _checkpoint import (
    assert_losses,
    assert_same,
    make_model,
    new_optimizer,
    train,
    wrap,
)
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import checkpoint as mckpt

from _models import agree
from _pool import RankPools

# ---------------------------------------------------------------------- DCP resharding chain
# Each job ("tag") is trained from step 0 (or resumed from another tag), saved at step
# ``save_at`` and continued to ``end``; its losses after ``save_at`` and its final full fp32
# parameters are stored next to the checkpoint. Later spawns load the checkpoint at other world
# sizes and strategies, continue, and must reproduce them.

SOURCES = {
    # world 4
    "A_lm": dict(kind="lm", strategy="optim_grads_params", save_at=2, end=4),
    "A_mlp": dict(kind="mlp", strategy="optim", save_at=2, end=4),
    # resumed from A_mlp in another strategy, one more step, saved again: ranks with empty
    # shards hold a stale Adam step for those parameters, which must never reach the file
    "A2_mlp": dict(kind="mlp", strategy="optim_grads_params", save_at=3, end=5, resume="A_mlp"),
    # world 2
    "B_lm": dict(kind="lm", strategy="optim_grads", save_at=2, end=4),
    "B_mlp": dict(kind="mlp", strategy="no_shard", save_at=2, end=4),
    # world 3: resumed from B_mlp (2 -> 3), one more step, saved again (a chained checkpoint:
    # the Adam steps of parameters with empty shards must stay right)
    "C_mlp": dict(kind="mlp", strategy="optim_grads_params", save_at=3, end=5, resume="B_mlp"),
    "C_lm": dict(kind="lm", strategy="no_shard", save_at=2, end=4),
}
PLAN = [
    # (world, [(tag, strategy) to load and continue], [tags to produce])
    (4, [], ["A_lm", "A_mlp", "A2_mlp"]),
    (2, [("A_lm", "no_shard"), ("A_mlp", "optim_grads_params"), ("A2_mlp", "optim")],
     ["B_lm", "B_mlp"]),
    (3, [("A_lm", "optim"), ("A_mlp", "optim_grads"), ("B_lm", "optim_grads_params")],
     ["C_mlp", "C_lm"]),
    (4, [("B_lm", "optim"), ("B_mlp", "optim_grads"), ("C_mlp", "no_shard"),
         ("C_lm", "optim_grads")], []),
]


def _ckpt(root: str, tag: str) -> str:
    return os.path.join(root, tag)


def _produce(rank: int, world: int, root: str, tag: str) -> None:
    spec = SOURCES[tag]
    kind, strategy, save_at, end = spec["kind"], spec["strategy"], spec["save_at"], spec["end"]
    model = wrap(make_model(kind, 0), strategy)
    opt = new_optimizer(model)
    start = 0
    if "resume" in spec:
        mckpt.load(model, opt, checkpoint_id=_ckpt(root, spec["resume"]))
        start = SOURCES[spec["resume"]]["save_at"]
    train(model, opt, kind, range(start, save_at), rank, world)
    mckpt.save(model, opt, checkpoint_id=_ckpt(root, tag), extra={"train_step": save_at})
    agree(f"{tag}: saved Adam steps", lambda: _check_saved_steps(_ckpt(root, tag), save_at))
    losses = train(model, opt, kind, range(save_at, end), rank, world)
    full = mckpt.get_full_state_dict(model, rank0_only=False)
    if rank == 0:
        torch.save({"losses": losses, "full": full, "kind": kind, "save_at": save_at, "end": end},
                   _ckpt(root, tag) + ".ref.pt")

    # Same world size and strategy: the resumed run is bitwise identical.
    model2 = wrap(make_model(kind, 1), strategy)
    opt2 = new_optimizer(model2)
    mckpt.load(model2, opt2, checkpoint_id=_ckpt(root, tag))
    agree(f"{tag}: live tensors unmarked", lambda: _check_unmarked(model2, opt2))
    losses2 = train(model2, opt2, kind, range(save_at, end), rank, world)
    full2 = mckpt.get_full_state_dict(model2, rank0_only=False)
    agree(f"{tag} resumed at world {world} ({strategy})", lambda: (
        assert_losses(losses2, losses, exact=True), assert_same(full2, full, exact=True)))


def _check_unmarked(model, opt) -> None:
    """Checkpointing left no attribute on live parameters or optimizer states (they stay
    picklable for ``torch.load(weights_only=True)``)."""
    tensors = list(model.parameters())
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        for obj in (t, t._local_tensor) if isinstance(t, DTensor) else (t,):
            leaked = [a for a in vars(obj) if "create" in a or "mfsdp_rows" in a]
            assert not leaked, f"tensor of shape {tuple(t.shape)} carries {leaked}"


def _check_equal(actual, expected) -> None:
    assert actual == expected, f"{actual} != {expected}"


def _check_saved_steps(path: str, expected: int) -> None:
    """Every parameter's saved Adam ``step`` is the number of steps taken (collective read)."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    steps = {k: torch.zeros((), dtype=m.properties.dtype) for k, m in md.items()
             if k.startswith("optim.state.") and k.endswith(".step")}
    assert steps, "no optimizer steps in the checkpoint"
    dcp.load(steps, checkpoint_id=path)
    for key, value in steps.items():
        assert value.item() == expected, f"{key} = {value.item()}, expected {expected}"


def _consume(rank: int, world: int, root: str, tag: str, strategy: str) -> None:
    dist.barrier()  # the producer's reference file is complete
    ref = torch.load(_ckpt(root, tag) + ".ref.pt")
    kind = ref["kind"]
    model = wrap(make_model(kind, 1), strategy)  # other initial weights: all must come from disk
    opt = new_optimizer(model)
    if kind == "lm":  # the documented manual flow: get_state_dict, dcp.load, set_state_dict
        msd, osd = mckpt.get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "train_step": -1}
        dcp.load(state, checkpoint_id=_ckpt(root, tag))
        mckpt.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        extra = {"train_step": state["train_step"]}
    else:
        extra = mckpt.load(model, opt, checkpoint_id=_ckpt(root, tag), extra={"train_step": -1})
    agree(f"{tag}: extra entries", lambda: _check_equal(extra, {"train_step": ref["save_at"]}))
    losses = train(model, opt, kind, range(ref["save_at"], ref["end"]), rank, world)
    full = mckpt.get_full_state_dict(model, rank0_only=False)
    agree(f"{tag} -> world {world} {strategy}", lambda: (
        assert_losses(losses, ref["losses"], exact=False),
        assert_same(full, ref["full"], exact=False)))


def _reshard_worker(rank: int, world: int, root: str, consume: list, produce: list) -> None:
    for tag, strategy in consume:
        _consume(rank, world, root, tag, strategy)
    for tag in produce:
        _produce(rank, world, root, tag)


def test_dcp_reshard_and_resume(ranks: RankPools) -> None:
    """World sizes 4 -> 2 -> 3 -> 4 (4->2, 4->3, 2->3, 2->4, 3->4), every strategy on both sides,
    nested units with a tied embedding (TinyGPT) and uneven/empty shards, frozen parameters and
    several buckets (OddMLP), and a checkpoint re-saved after a resharded resume."""
    with tempfile.TemporaryDirectory() as root:
        for world, consume, produce in PLAN:
            ranks.run(_reshard_worker, world, root, consume, produce, timeout_s=120)
