"""Checkpointing: sharded state dicts with uneven shards, full state-dict export/import,
compute-weight refresh after a load, and rejection of mismatching checkpoints (tolerances:
``_checkpoint.py``).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from _checkpoint import (
    STRATEGIES,
    assert_same,
    expect_value_error,
    main_weights_snapshot,
    make_model,
    new_optimizer,
    sample_input,
    train,
    units_groups,
    wrap,
)
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp_v2 import MixedPrecisionPolicy
from megatron_fsdp_v2 import checkpoint as mckpt

# private: a parameter's shard rows (record_of(p)) to check the state dict's local shards
from megatron_fsdp_v2._registry import record_of

from _models import OddMLP, agree
from _pool import RankPools

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


def test_state_dicts_refresh_full_export_and_bad_checkpoints(ranks: RankPools) -> None:
    """World 3 (uneven and empty shards), every strategy, fp32 and bf16 compute / fp32 main:
    sharded ``state_dict``/``load_state_dict``, DCP via torch's ``set_model_state_dict``, full
    state-dict export and broadcast import; each load is followed by a forward compared (fp32:
    bitwise) with an unwrapped model holding the loaded weights. Then mismatching checkpoints
    must raise a ValueError naming the key, and leave weights and optimizer state untouched."""
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_state_dict_worker, 3, root, timeout_s=150)
