"""Checkpointing: sharded state dicts with uneven shards, DCP save/load with resharding across
world sizes and strategies, full state-dict export/import, compute-weight refresh after a load,
and rejection of mismatching checkpoints.

Tolerances. Resuming at the *same* world size and strategy is checked **bitwise** (losses and
every final fp32 parameter). Resuming at another world size or strategy changes how gradients
are reduced (other per-rank batch splits and collectives), so losses and final fp32 parameters
are checked with ``rtol=1e-6`` (``atol=1e-7`` for entries near zero) against the uninterrupted
run; a wrong row offset, a stale compute weight or a wrong Adam ``step`` moves them by orders of
magnitude more (measured margins: losses ~1e-7 relative, parameters within a quarter of the
envelope). Loads of given weights are checked bitwise on the main weights and by a forward
compared with an unwrapped model holding those weights: bitwise in fp32, ``1e-2`` with bf16
compute weights.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard
from megatron_fsdp_v2 import checkpoint as mckpt
from megatron_fsdp_v2._registry import record_of, state_of
from megatron_fsdp_v2.testing import run_distributed

from _models import OddMLP, TinyGPT, agree, all_ranks_ok, lm_loss, mlp_loss, step_mean_loss

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
GLOBAL_BATCH = 12  # divisible by every world size used here
RTOL, ATOL = 1e-6, 1e-7


# ---------------------------------------------------------------------- helpers

def make_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyGPT() if kind == "lm" else OddMLP()


def wrap(model: torch.nn.Module, strategy: str, mp: MixedPrecisionPolicy | None = None):
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in getattr(model, "blocks", []):  # TinyGPT: nested units, tied embedding
        fully_shard(block, sharding_strategy=strategy, **kw)
    return fully_shard(model, sharding_strategy=strategy, **kw)


def new_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def local_batch(kind: str, step: int, rank: int, world: int):
    """This rank's slice of the global batch of ``step``; the same global batch at any world."""
    g = torch.Generator().manual_seed(1000 + step)
    n = GLOBAL_BATCH // world
    rows = slice(rank * n, (rank + 1) * n)
    if kind == "lm":
        return torch.randint(0, 37, (GLOBAL_BATCH, 9), generator=g)[rows]
    x, y = torch.randn(GLOBAL_BATCH, 15, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    return x[rows], y[rows]


def sample_input(kind: str):
    g = torch.Generator().manual_seed(7)
    if kind == "lm":
        return torch.randint(0, 37, (2, 8), generator=g)
    return torch.randn(4, 15, generator=g)


def train(model, opt, kind: str, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    loss_fn = lm_loss if kind == "lm" else mlp_loss
    for step in steps:
        losses.append(step_mean_loss(loss_fn(model, local_batch(kind, step, rank, world)), opt))
    return losses


def expect_value_error(what: str, fn, *fragments: str) -> None:
    """``fn`` (run on every rank) must raise ValueError whose message contains ``fragments``."""
    try:
        fn()
        err = "no ValueError raised"
    except ValueError as e:
        missing = [f for f in fragments if f not in str(e)]
        err = f"message {str(e)!r} lacks {missing}" if missing else None
    if not all_ranks_ok(err is None):
        raise AssertionError(f"{what}: {err or 'failed on another rank'}")


def assert_same(actual: dict, expected: dict, *, exact: bool) -> None:
    assert list(actual) == list(expected), f"keys {list(actual)} != {list(expected)}"
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype, f"{key}: dtype {got.dtype} != {value.dtype}"
        if exact:
            assert torch.equal(got, value), f"{key}: max diff {(got - value).abs().max()}"
        else:
            torch.testing.assert_close(got, value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{key}: {m}")


def assert_losses(actual: list[float], expected: list[float], *, exact: bool) -> None:
    if exact:
        assert actual == expected, f"losses {actual} != {expected}"
    else:
        torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64), rtol=RTOL, atol=0.0)


def units_groups(model: torch.nn.Module) -> list:
    return [g for m in model.modules() if (s := state_of(m)) is not None for g in s.groups]


def main_weights_snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [g.main_weight.detach().clone() for g in units_groups(model)]


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


def test_dcp_reshard_and_resume() -> None:
    """World sizes 4 -> 2 -> 3 -> 4 (4->2, 4->3, 2->3, 2->4, 3->4), every strategy on both sides,
    nested units with a tied embedding (TinyGPT) and uneven/empty shards, frozen parameters and
    several buckets (OddMLP), and a checkpoint re-saved after a resharded resume."""
    with tempfile.TemporaryDirectory() as root:
        for world, consume, produce in PLAN:
            run_distributed(_reshard_worker, world, root, consume, produce, timeout_s=120)


# ---------------------------------------------------------------------- state dicts, refresh,
# full state dicts, bad checkpoints (one spawn)

def _reference_output(kind: str, weights: dict, dtype: torch.dtype) -> torch.Tensor:
    ref = make_model(kind, 5)
    ref.load_state_dict(weights)
    ref = ref.to(dtype)
    x = sample_input(kind)
    with torch.no_grad():
        return ref(x if kind == "lm" else x.to(dtype))


def _check_forward(what: str, model, kind: str, weights: dict, dtype: torch.dtype) -> None:
    with torch.no_grad():
        out = model(sample_input(kind))
    expected = _reference_output(kind, weights, dtype)
    tol = dict(rtol=0.0, atol=0.0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    agree(what, lambda: torch.testing.assert_close(out, expected, **tol))


def _check_sharded_state_dict(what: str, model, weights: dict) -> None:
    """``model.state_dict()``: fp32 main-weight DTensors holding exactly this rank's rows, with
    DCP chunk metadata at the true row offset (none for an empty shard)."""
    def check() -> None:
        sd = model.state_dict()
        assert list(sd) == list(weights), f"keys {list(sd)} != {list(weights)}"
        for key, value in sd.items():
            assert isinstance(value, DTensor), f"{key} is not a DTensor"
            assert value.dtype == torch.float32, f"{key}: {value.dtype} (main weights are fp32)"
            param = dict(model.named_parameters(remove_duplicate=False))[key]
            record = record_of(param)
            group, index = record.group, record.index
            local = value.to_local()
            if value.placements == (Shard(0),):
                lo, hi = group.local_row_range(index)
                chunks = value.__create_chunk_list__()  # what DCP asks
                if hi == lo:
                    assert chunks == [], f"{key}: empty shard has chunks {chunks}"
                else:
                    assert list(chunks[0].offsets) == [lo] + [0] * (value.dim() - 1), key
                    assert tuple(chunks[0].sizes) == tuple(local.shape), key
            else:
                lo, hi = 0, value.shape[0]
            assert torch.equal(local, weights[key][lo:hi]), f"{key}: rows {lo}..{hi} differ"
    agree(what, check)


def _check_marked(model) -> None:
    """Every group whose compute weights are not the main weights themselves is stale."""
    for group in units_groups(model):
        aliased = not group.plan.main_weight_separate and group.strategy.value in (
            "no_shard", "optim_grads_params")
        assert aliased or group.needs_refresh, f"group {group.fqns} not marked for a refresh"


def _check_saved_dtypes(ckpt: str, weights: dict) -> None:
    md = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    for key in weights:
        dtype = md[f"model.{key}"].properties.dtype
        assert dtype == torch.float32, f"{key} saved as {dtype}"


def _check_full(full: dict, weights: dict, rank: int) -> None:
    if rank == 0:
        assert_same(full, weights, exact=True)
        assert all(v.device.type == "cpu" for v in full.values())
    else:
        assert full == {}, f"rank {rank} got {len(full)} entries with rank0_only=True"


def _state_dict_worker(rank: int, world: int, root: str) -> None:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for kind in ("lm", "mlp"):
        # Loads alternate between two weight sets; a forward after each must see the new one
        # (the forward before it filled the replicated / gathered compute weights).
        w0 = make_model(kind, 0).state_dict()
        w1 = make_model(kind, 1).state_dict()
        for mp, dtype in ((None, torch.float32), (bf16, torch.bfloat16)):
            previous_ckpt = None
            for strategy in STRATEGIES:
                name = f"{kind} {strategy} {dtype}"

                # 1. model.load_state_dict of full tensors.
                model = wrap(make_model(kind, 0), strategy, mp)
                _check_forward(f"{name}: before load", model, kind, w0, dtype)
                model.load_state_dict(w1)
                _check_forward(f"{name}: after load_state_dict(full)", model, kind, w1, dtype)
                _check_sharded_state_dict(f"{name}: state_dict", model, w1)

                # 2. model.state_dict() -> load_state_dict of another wrapped model (sharded,
                # no gather).
                victim = wrap(make_model(kind, 0), strategy, mp)
                _check_forward(f"{name}: victim before load", victim, kind, w0, dtype)
                victim.load_state_dict(model.state_dict())
                _check_forward(f"{name}: after load_state_dict(sharded)", victim, kind, w1, dtype)

                # 3. Full state dict on every rank.
                mckpt.load_full_state_dict(victim, w0)
                _check_forward(f"{name}: after load_full_state_dict", victim, kind, w0, dtype)

                # 4. DCP, loaded through torch's own set_model_state_dict: the load_state_dict
                # post-hook marks every unit (nested ones too) for a refresh. The checkpoint
                # comes from the previous strategy (the first: its own).
                ckpt = os.path.join(root, f"sd_{kind}_{dtype}_{strategy}")
                mckpt.save(model, checkpoint_id=ckpt)
                if dtype == torch.bfloat16:
                    agree(f"{name}: checkpoint holds fp32 main weights",
                          lambda: _check_saved_dtypes(ckpt, w1))
                source = previous_ckpt or ckpt
                previous_ckpt = ckpt
                msd, _ = mckpt.get_state_dict(victim)
                dcp.load({"model": msd}, checkpoint_id=source)
                set_model_state_dict(victim, msd)
                agree(f"{name}: every unit marked after set_model_state_dict",
                      lambda: _check_marked(victim))
                _check_forward(f"{name}: after DCP load of {os.path.basename(source)}",
                               victim, kind, w1, dtype)

                # 5. Full state dict export: rank 0 only, plain fp32 CPU tensors, original
                # names (tied weights under both); imported by broadcast from rank 0.
                mckpt.load_full_state_dict(victim, w0)
                _check_forward(f"{name}: after load_full_state_dict (again)", victim, kind, w0,
                               dtype)
                full = mckpt.get_full_state_dict(model)
                agree(f"{name}: full state dict", lambda: _check_full(full, w1, rank))
                mckpt.load_full_state_dict(victim, full if rank == 0 else None,
                                           broadcast_from_rank0=True)
                _check_forward(f"{name}: after load_full_state_dict(broadcast)", victim, kind, w1,
                               dtype)
                _check_sharded_state_dict(f"{name}: state_dict after full load", victim, w1)

    _bad_checkpoints(rank, world, root)


def _bad_checkpoints(rank: int, world: int, root: str) -> None:
    strategy = "optim_grads_params"
    model = wrap(make_model("mlp", 0), strategy)
    opt = new_optimizer(model)
    train(model, opt, "mlp", range(1), rank, world)
    good = mckpt.get_full_state_dict(model, rank0_only=False)
    before = main_weights_snapshot(model)
    state_before = {k: {n: v.to_local().clone() if isinstance(v, DTensor) else v.clone()
                        for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}

    def check_unchanged() -> None:
        for a, b in zip(main_weights_snapshot(model), before):
            assert torch.equal(a, b), "main weights changed"
        now = opt.state_dict()["state"]
        for k, entries in state_before.items():
            for n, v in entries.items():
                cur = now[k][n]
                cur = cur.to_local() if isinstance(cur, DTensor) else cur
                assert torch.equal(cur, v), f"optimizer state {k}.{n} changed"

    def unchanged() -> None:
        agree("nothing was written", check_unchanged)

    wrong = dict(good)
    wrong["mid.weight"] = torch.zeros(18, 257)
    expect_value_error("full: wrong shape", lambda: mckpt.load_full_state_dict(model, wrong),
                       "'mid.weight'", "(18, 257)", "(17, 257)")
    expect_value_error("load_state_dict: wrong shape", lambda: model.load_state_dict(wrong),
                       "'mid.weight'", "(18, 257)", "(17, 257)")
    missing = {k: v for k, v in good.items() if k != "shared.bias"}
    expect_value_error("full: missing key", lambda: mckpt.load_full_state_dict(model, missing),
                       "'shared.bias'")
    extra = dict(good, **{"extra.weight": torch.zeros(2)})
    expect_value_error("full: unexpected key", lambda: mckpt.load_full_state_dict(model, extra),
                       "'extra.weight'")
    expect_value_error("full: wrong shape (broadcast)", lambda: mckpt.load_full_state_dict(
        model, wrong if rank == 0 else None, broadcast_from_rank0=True),
        "'mid.weight'", "(18, 257)")
    unchanged()

    # A DCP checkpoint of a model with other shapes (inp: 15 -> 259 instead of 257).
    torch.manual_seed(0)
    other = OddMLP()
    other.inp = torch.nn.Linear(15, 259)
    other.mid = torch.nn.Linear(259, 17)
    other = wrap(other, strategy)
    other_opt = new_optimizer(other)
    train(other, other_opt, "mlp", range(1), rank, world)
    bad = os.path.join(root, "bad_shapes")
    mckpt.save(other, other_opt, checkpoint_id=bad)
    expect_value_error("dcp: wrong shape", lambda: mckpt.load(model, opt, checkpoint_id=bad),
                       "'model.inp.weight'", "(259, 15)", "(257, 15)")
    msd, osd = mckpt.get_state_dict(other, other_opt)
    expect_value_error("set_state_dict: wrong shape", lambda: mckpt.set_state_dict(
        model, opt, model_state_dict=msd, optim_state_dict=osd), "'inp.weight'", "(259, 15)")
    # A checkpoint without the optimizer, loaded with one: its optimizer entries are missing.
    model_only = os.path.join(root, "model_only")
    mckpt.save(model, checkpoint_id=model_only)
    expect_value_error("dcp: missing optimizer state",
                       lambda: mckpt.load(model, opt, checkpoint_id=model_only), "optim.state.")
    unchanged()


def test_state_dicts_refresh_full_export_and_bad_checkpoints() -> None:
    """World 3 (uneven and empty shards), every strategy, fp32 and bf16 compute / fp32 main:
    sharded ``state_dict``/``load_state_dict``, DCP via torch's ``set_model_state_dict``, full
    state-dict export and broadcast import; each load is followed by a forward compared (fp32:
    bitwise) with an unwrapped model holding the loaded weights. Then mismatching checkpoints
    must raise a ValueError naming the key, and leave weights and optimizer state untouched."""
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_state_dict_worker, 3, root, timeout_s=150)
