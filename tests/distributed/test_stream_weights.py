"""``iter_full_weights``: full weights streamed out a bucket at a time (issue 38 item 7).

Every case compares the streamed ``(name, tensor)`` pairs, bitwise and in order, with torch's
``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`` of the same
model (and, before training, with FSDP2's full state dict of the same initial model, and the
unwrapped model's ``state_dict()``), counts the all-gathers the stream dispatched (one per
bucket), checks each gather's size against the bucket, and measures the bytes alive (the torch
profiler's allocation events) against torch's full state dict.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from megatron_fsdp_v2 import MixedPrecisionPolicy, checkpoint, iter_full_weights

from _comm_counts import CollectiveCounts
from _models import TinyGPT, agree, lm_loss, make_batches, wrap_blocks
from _pool import RankPools
from _training import train_steps

pytestmark = pytest.mark.timeout(600)
TIMEOUT_S = 120
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
_GATHER_OPS = ("_allgather_base", "all_gather_into_tensor", "allgather_into_tensor_coalesced")


class _Gathers(CollectiveCounts):
    """``CollectiveCounts`` that also records each all-gather's output bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.gather_bytes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = str(getattr(func, "_overloadpacket", func)).split(".")[-1]
        if name.rstrip("_") in _GATHER_OPS and isinstance(args[0], torch.Tensor):
            self.gather_bytes.append(args[0].numel() * args[0].element_size())
        return out


def _torch_full(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return [(k, _plain(v).detach().clone()) for k, v in sd.items()]


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A torchao float8 weight wrapper's inner tensor (the full-precision values), else ``t``."""
    return getattr(t, "_tensor", t) if type(t) is not torch.Tensor else t


def _stream(model: nn.Module, **kw: Any) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.clone()) for k, v in iter_full_weights(model, **kw)]


def _bitwise(what: str, got: list[tuple[str, torch.Tensor]],
             want: list[tuple[str, torch.Tensor]]) -> None:
    def check() -> None:
        assert [k for k, _ in got] == [k for k, _ in want], (
            f"names/order {[k for k, _ in got]} vs {[k for k, _ in want]}")
        for (k, a), (_, b) in zip(got, want):
            assert type(a) is torch.Tensor, f"{k}: yielded a {type(a).__name__}"
            assert a.dtype == b.dtype and a.shape == b.shape, (
                f"{k}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
            assert torch.equal(a, b), f"{k}: max diff {(a.float() - b.float()).abs().max()}"
    agree(what, check)


def _counted(model: nn.Module, **kw: Any) -> tuple[list[tuple[str, torch.Tensor]], _Gathers]:
    with _Gathers() as comm:
        out = _stream(model, **kw)
    return out, comm


# ---------------------------------------------------------------------- values and counts

def _values_and_counts(rank: int, world: int, strategy: str, bf16: bool) -> None:
    torch.manual_seed(0)
    ref = TinyGPT(layers=2)  # tied embedding / head, odd vocab (37): uneven and empty shards
    kw: dict[str, Any] = {}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = wrap_blocks(copy.deepcopy(ref), strategy, **kw)
    case = f"{strategy}{' bf16' if bf16 else ''}"
    # Before training: the unwrapped model's own state dict, and FSDP2's full state dict of the
    # same initial model (the control).
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    fsdp2 = copy.deepcopy(ref)
    for block in fsdp2.blocks:
        fsdp2_fully_shard(block)
    fsdp2_fully_shard(fsdp2)
    initial = _stream(model, bucket_size_mb=1)
    _bitwise(f"{case}: initial stream vs the unwrapped model",
             initial, [(k, v.detach()) for k, v in ref.state_dict().items()])
    _bitwise(f"{case}: initial stream vs FSDP2's full state dict", initial, _torch_full(fsdp2))
    train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                make_batches("lm", 1, 1, world, 2), lm_loss, rank=rank, mark=None,
                divide_by_micro=False)
    want = _torch_full(model)
    managed = [k for k, _ in model.named_parameters(remove_duplicate=False)]
    sharded = strategy != "no_shard"
    # Tiny buckets: every parameter alone (the tied head is gathered again, under its name).
    got, comm = _counted(model, bucket_size_mb=1e-9)
    _bitwise(f"{case}: one parameter per bucket", got, want)
    agree(f"{case}: gathers with one parameter per bucket", lambda: _check(
        len(comm.gather_bytes) == (len(managed) if sharded else 0),
        f"{len(comm.gather_bytes)} all-gathers for {len(managed)} entries"))
    # One bucket for the whole model: one all-gather.
    got, comm = _counted(model, bucket_size_mb=64)
    _bitwise(f"{case}: one bucket", got, want)
    agree(f"{case}: gathers with one bucket", lambda: _check(
        len(comm.gather_bytes) == (1 if sharded else 0), f"{comm.gather_bytes}"))
    # A bucket of 2 KiB: several parameters per gather, none over the bucket except a parameter
    # that alone exceeds it (gathered alone).
    bucket = 2048
    got, comm = _counted(model, bucket_size_mb=bucket / 2**20)
    _bitwise(f"{case}: 2 KiB buckets", got, want)
    biggest = max(v.numel() * v.element_size() for _, v in want)
    sizes = comm.gather_bytes

    def bounded() -> None:
        if not sharded:
            assert not sizes, sizes
            return
        assert 1 < len(sizes) < len(managed), f"{len(sizes)} gathers for {len(managed)}"
        # A gather over the bucket holds one parameter alone: every rank's slot is as long as
        # the largest holder's rows of it, at most the whole parameter.
        assert all(s <= max(bucket, world * biggest) for s in sizes), sizes

    agree(f"{case}: 2 KiB buckets' gathers", bounded)


def _check(ok: bool, message: str) -> None:
    assert ok, message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_values_and_counts(ranks: RankPools, strategy: str) -> None:
    """World 2, TinyGPT (blocks and root wrapped, tied weights): the stream equals the unwrapped
    model and FSDP2's full state dict before training, and torch's full state dict of ours after
    a step (fp32 and bf16 compute: fp32 main weights), for three bucket sizes; one all-gather
    per bucket (none under no_shard), none over the bucket unless a parameter alone is."""
    ranks.run(_values_and_counts, 2, strategy, False, timeout_s=TIMEOUT_S)
    ranks.run(_values_and_counts, 2, strategy, True, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- memory

def _alive_peak(fn: Any) -> int:
    """The most bytes allocated (and not yet freed) at any time during ``fn``, from the torch
    profiler's allocation events (the CPU allocator's, every thread)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    alive = peak = 0
    for _, nbytes in events:
        alive += nbytes
        peak = max(peak, alive)
    return peak


class _Stack(nn.Module):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _memory(rank: int, world: int, strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = wrap_blocks(_Stack(16, 64), strategy)  # 16 x 16.6 KB of fp32 weights
    want = _torch_full(model)
    bucket = 64 * 1024  # three layers (49.9 KB) per bucket
    checked = []

    def consume(to_rank: int | None) -> None:
        for (name, value), (_, expected) in zip(iter_full_weights(
                model, bucket_size_mb=bucket / 2**20, to_rank=to_rank), want):
            checked.append(name if torch.equal(value, expected) else f"{name} differs")

    def torch_full() -> None:
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    with _Gathers() as comm:
        consume(None)
    checked.clear()
    largest_gather = max(comm.gather_bytes, default=0)
    stream_peak = _alive_peak(lambda: consume(None))
    to_rank_peak = _alive_peak(lambda: consume(0))
    full_peak = _alive_peak(torch_full)
    model_bytes = sum(v.numel() * v.element_size() for _, v in want)
    agree(f"{strategy}: streamed values", lambda: _check(
        checked == [k for k, _ in want] * (2 if rank == 0 else 1), f"{checked}"))
    agree(f"{strategy}: gathers fill the bucket", lambda: _check(
        strategy == "no_shard" or 0.7 * bucket < largest_gather <= bucket, f"{comm.gather_bytes}"))
    # The bound: the iterator's buffer (gather region and assembly region, one bucket each),
    # plus what gloo's all-gather allocates for its output (a temporary the size of the gather,
    # copied into ours; NCCL gathers in place), plus small bookkeeping tensors (the agreement's
    # pickled object).
    bound = 2 * bucket + largest_gather + 4096
    agree(f"{strategy}: stream peak {stream_peak} within two buckets + gloo's temporary "
          f"({bound})", lambda: _check(stream_peak <= bound and to_rank_peak <= bound,
                                       f"{stream_peak}, to_rank {to_rank_peak}"))
    # Sharded: torch's full state dict gathers every parameter (no_shard: views, no bytes).
    agree(f"{strategy}: torch's full state dict holds the model ({model_bytes})",
          lambda: _check(full_peak >= model_bytes or strategy == "no_shard", f"{full_peak}"))
    return {"stream": stream_peak, "to_rank": to_rank_peak, "torch_full": full_peak,
            "model": model_bytes, "bucket": bucket, "largest_gather": largest_gather}


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_peak_memory_within_two_buckets(ranks: RankPools, strategy: str) -> None:
    """A 16-layer stack (266 KB of weights), 64 KiB buckets (filled to 49.9 KB): the bytes
    alive while streaming (every yielded tensor checked, none kept) stay within the iterator's
    two buckets plus gloo's temporary gather output on every rank, with and without
    ``to_rank``; torch's ``get_model_state_dict(full_state_dict=True)`` holds at least the
    whole model."""
    results = ranks.run(_memory, 2, strategy, timeout_s=TIMEOUT_S)
    print(strategy, results)


# ---------------------------------------------------------------------- HSDP, meta, to_rank

def _hsdp(rank: int, world: int, outer: str) -> None:
    torch.manual_seed(0)
    ref = TinyGPT(layers=2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = wrap_blocks(copy.deepcopy(ref), "optim_grads_params", mesh=mesh,
                        outer_dp_sharding_strategy=outer)
    initial = _stream(model, bucket_size_mb=1e-3)
    _bitwise(f"HSDP outer {outer}: initial stream vs the unwrapped model",
             initial, [(k, v.detach()) for k, v in ref.state_dict().items()])
    train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                make_batches("lm", 1, 1, world, 2), lm_loss, rank=rank, mark=None,
                divide_by_micro=False)
    # torch's full_tensor refuses outer optim's sub-shards (design.md, DTensor paths): there the
    # control is the library's own full state dict (one whole-group gather).
    want = (list(checkpoint.get_full_state_dict(model, rank0_only=False,
                                                cpu_offload=False).items())
            if outer == "optim" else _torch_full(model))
    for mb in (1e-9, 1e-3, 64):
        got, comm = _counted(model, bucket_size_mb=mb)
        _bitwise(f"HSDP outer {outer}, {mb} MiB buckets", got, want)
        if mb == 64:
            agree(f"HSDP outer {outer}: one gather", lambda: _check(
                len(comm.gather_bytes) == 1, f"{comm.gather_bytes}"))


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hsdp(ranks: RankPools, outer: str) -> None:
    """2 x 2 mesh, inner ZeRO-3: the stream equals the unwrapped model before training and the
    full state dict after a step (outer ``optim``: ranks hold distinct sub-shards, gathered over
    the whole mesh in one collective per bucket)."""
    ranks.run(_hsdp, 4, outer, timeout_s=TIMEOUT_S)


def _meta(rank: int, world: int, strategy: str) -> None:
    torch.manual_seed(7)
    ref = TinyGPT(layers=2)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = TinyGPT(layers=2)
    model = wrap_blocks(model, strategy)
    got = _stream(model, bucket_size_mb=1e-3)  # materializes first
    _bitwise(f"{strategy} meta: stream vs the model built on the CPU",
             got, [(k, v.detach()) for k, v in ref.state_dict().items()])
    _bitwise(f"{strategy} meta: stream vs torch's full state dict", got, _torch_full(model))


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_meta_init(ranks: RankPools, strategy: str) -> None:
    ranks.run(_meta, 2, strategy, timeout_s=TIMEOUT_S)


def _to_rank(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = wrap_blocks(TinyGPT(layers=2), "optim_grads_params")
    want = _torch_full(model)
    with _Gathers() as comm:
        got = _stream(model, bucket_size_mb=1e-3, to_rank=1)
    _bitwise("to_rank=1", got, want if rank == 1 else [])
    counts = [None] * world
    dist.all_gather_object(counts, len(comm.gather_bytes))
    agree("to_rank: every rank joins every gather", lambda: _check(
        counts[0] == counts[1] and counts[0] > 1, f"{counts}"))


def test_to_rank(ranks: RankPools) -> None:
    """``to_rank=1``: rank 1 yields every entry, rank 0 nothing, both run the same gathers."""
    ranks.run(_to_rank, 2, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- misuse

def _errors(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = wrap_blocks(TinyGPT(layers=2), "optim_grads_params")
    for kw, exc, needle in (
        (dict(bucket_size_mb=0), ValueError, "positive"),
        (dict(bucket_size_mb=float("nan")), ValueError, "positive"),
        (dict(bucket_size_mb="64"), TypeError, "number of MiB"),
        (dict(bucket_size_mb=True), TypeError, "number of MiB"),
        (dict(bucket_size_mb=1, to_rank=1.0), TypeError, "to_rank"),
    ):
        def call(kw: dict[str, Any] = kw, exc: type = exc, needle: str = needle) -> None:
            try:
                iter_full_weights(model, **kw)
            except exc as e:
                assert needle in str(e), str(e)
            else:
                raise AssertionError(f"{kw} was accepted")
        agree(f"rejected {kw}", call)
    agree("an unwrapped model", lambda: _raises(
        lambda: iter_full_weights(nn.Linear(2, 2), bucket_size_mb=1), ValueError, "fully_shard"))
    # Known only at the first next(): a rank outside the mesh, then ranks that disagree
    # (before any gather; the group stays usable).
    agree("to_rank outside the mesh", lambda: _raises(
        lambda: next(iter_full_weights(model, bucket_size_mb=1, to_rank=5)), ValueError,
        "not a rank of the model's mesh"))
    agree("different bucket sizes", lambda: _raises(
        lambda: next(iter_full_weights(model, bucket_size_mb=1 + rank)), ValueError,
        "same bucket_size_mb"))
    _bitwise("after the errors", _stream(model, bucket_size_mb=1e-3), _torch_full(model))


def _raises(fn: Any, exc: type, needle: str) -> None:
    try:
        fn()
    except exc as e:
        assert needle in str(e), str(e)
    else:
        raise AssertionError("no error")


def test_bad_arguments(ranks: RankPools) -> None:
    """Bad arguments raise ``TypeError``/``ValueError`` at the call (no collective); a
    ``to_rank`` outside the mesh and ranks passing different sizes raise on every rank at the
    first ``next``, before any gather, and the stream works afterwards."""
    ranks.run(_errors, 2, timeout_s=TIMEOUT_S)


def _early_stop(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = wrap_blocks(TinyGPT(layers=2), "optim_grads_params")
    want = _torch_full(model)
    # Rank 1 breaks out after the first entry: its closed iterator joins the remaining gathers,
    # so rank 0 gets every value.
    got: list[tuple[str, torch.Tensor]] = []
    for name, value in iter_full_weights(model, bucket_size_mb=1e-3):
        got.append((name, value.clone()))
        if rank == 1:
            break
    _bitwise("rank 1 broke out early", got, want if rank == 0 else want[:1])
    # Rank 1's loop body raises at the third entry: the loop's iterator is closed as the
    # exception leaves it, and joins the remaining gathers.
    got = []

    def consume() -> None:
        for name, value in iter_full_weights(model, bucket_size_mb=1e-3):
            if rank == 1 and len(got) == 2:
                raise KeyError("the consumer failed")
            got.append((name, value.clone()))

    try:
        consume()
        raised = False
    except KeyError:
        raised = True
    agree("the consumer's exception", lambda: _check(raised == (rank == 1), f"{raised}"))
    _bitwise("rank 1 raised in its loop", got, want if rank == 0 else want[:2])
    # Rank 1 keeps its iterator and stops calling next: rank 0 is told which rank stopped at
    # its next bucket, after the group's collective timeout (3 s here), instead of waiting in
    # the transport; rank 1, closing its iterator after that, is told rank 0 left.
    torch.manual_seed(0)
    short = wrap_blocks(TinyGPT(layers=2), "optim_grads_params", timeout=3.0)
    it = iter_full_weights(short, bucket_size_mb=1e-3)
    next(it)
    error = ""
    start = time.monotonic()
    if rank == 0:
        try:
            list(it)
        except RuntimeError as e:
            error = str(e)
    waited = time.monotonic() - start
    dist.barrier()  # rank 1 goes on only after rank 0 gave up
    if rank == 1:
        try:
            it.close()
        except RuntimeError as e:
            error = str(e)
    agree("a rank that stopped calling next is named", lambda: _check(
        f"iter_full_weights: rank {1 - rank} of its group" in error
        and (rank == 1 or waited < 3.0 + 2.0), f"{error} (after {waited:.1f}s)"))
    dist.barrier()
    _bitwise("afterwards", _stream(model, bucket_size_mb=1e-3), want)


def test_early_stop(ranks: RankPools) -> None:
    """A rank that breaks out of the loop lets the others finish with the right values; one that
    keeps its iterator and stops calling ``next`` is named by the others' ``RuntimeError``."""
    ranks.run(_early_stop, 2, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- TP and FP8

def _tp(rank: int, world: int) -> None:
    from _tp_common import STRATEGIES as TP_STRATEGIES
    from _tp_common import apply_tp, batches, build_model, dp_tp_mesh, train, wrap_ours
    from torch.distributed.tensor import Shard

    ref = build_model()
    unwrapped = [(k, v.detach()) for k, v in ref.state_dict().items()]
    for strategy in TP_STRATEGIES:
        mesh = dp_tp_mesh()
        model = wrap_ours(apply_tp(build_model(), mesh["tp"]), mesh["dp"], strategy)
        _bitwise(f"dp x tp {strategy}: initial stream vs the unwrapped model",
                 _stream(model, bucket_size_mb=1e-3), unwrapped)
        train(model, batches(1, 1, 2), mesh["dp"].get_local_rank())
        want = _torch_full(model)
        # One TP all-gather per parameter TP shards (its last placement), besides the buckets'.
        tp_sharded = sum(1 for p in model.parameters() if isinstance(p.placements[-1], Shard))
        for mb in (1e-9, 1e-3, 64):
            got, comm = _counted(model, bucket_size_mb=mb)
            _bitwise(f"dp x tp {strategy}, {mb} MiB buckets", got, want)
            if mb == 64:  # one bucket: one dp all-gather (none under no_shard)
                expected = tp_sharded + (strategy != "no_shard")
                agree(f"dp x tp {strategy}: all-gathers", lambda: _check(
                    len(comm.gather_bytes) == expected,
                    f"{len(comm.gather_bytes)}, expected {expected}"))


def test_tensor_parallel(ranks: RankPools) -> None:
    """dp 2 x tp 2 (colwise, rowwise, sequence-parallel norms; uneven dp rows), every strategy:
    the stream gives the global (TP-gathered) values, equal to the unwrapped model before
    training and to torch's full state dict after a step."""
    ranks.run(_tp, 4, timeout_s=TIMEOUT_S)


def _fp8_model() -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return convert_to_float8_training(
        model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def _fp8(rank: int, world: int) -> None:
    from megatron_fsdp_v2 import fully_shard

    ref = _fp8_model()
    unwrapped = [(k, _plain(v).detach()) for k, v in ref.state_dict().items()]
    for strategy in STRATEGIES:
        model = _fp8_model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, sharding_strategy=strategy, mp_policy=policy)
        fully_shard(model, sharding_strategy=strategy, mp_policy=policy)
        got = _stream(model, bucket_size_mb=1e-3)
        _bitwise(f"fp8 {strategy}: stream vs the unwrapped model", got, unwrapped)
        _bitwise(f"fp8 {strategy}: stream vs torch's full state dict", got, _torch_full(model))


def test_float8(ranks: RankPools) -> None:
    """torchao float8 weights (FP8 all-gather, bf16 compute), every strategy: plain fp32 full
    values, equal to the unwrapped model's and to torch's full state dict (its float8 wrapper
    unwrapped)."""
    pytest.importorskip("torchao")
    ranks.run(_fp8, 2, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- the example

def test_example_feeds_another_process(launched_python: str) -> None:
    """``examples/stream_weights.py`` under torchrun on 2 ranks (ZeRO-1, 10 KiB buckets): rank
    0 pushes the streamed weights through a bounded queue to an engine process it spawned; the
    engine's weights equal the model's full state dict bitwise and its logits the wrapped
    model's (the script exits non-zero otherwise). The ranks are forked from a server that
    imported torch (the ``launched_python`` fixture); the engine is spawned as the script says."""
    import os
    import subprocess

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    cmd = [launched_python, "-m", "torch.distributed.run", "--standalone", "--no-python",
           "--nproc_per_node=2", launched_python,
           os.path.join(root, "examples", "stream_weights.py"), "--strategy", "optim",
           "--bucket-mb", "0.01"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "received weights equal the model's (bitwise)" in proc.stdout, proc.stdout
