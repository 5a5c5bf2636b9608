"""Models built under ``torch.device("meta")`` (materialized by fully_shard in whole-tree module
order, each rank keeping its rows), torchtitan's ``to_empty`` + seed-checkpoint flow, and the
conversions (``.to``, ``.to_empty``, ``.double()``) of wrapped modules.

References: the same model built on the device with the same seed (bitwise), and single-process
PyTorch training on the concatenated global batch (rtol 1e-5 / atol 1e-6). Cases of one world
size share a pool of ranks (``_pool.RankPools``); every check agrees across ranks before it
raises, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import MixedPrecisionPolicy, checkpoint, fully_shard

# private: builds the expected local rows of a parameter from its row layout
from megatron_fsdp_v2._dtensor._local_rows import local_rows_dtensor

# private: a parameter's flat-buffer record (its row layout)
from megatron_fsdp_v2._registry import record_of

from _models import (
    TinyGPT,
    agree,
    lm_loss,
    make_batches,
    reference_copy,
    wrap_blocks,
)
from _pool import RankPools
from _training import train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TIMEOUT_S = 280
RTOL, ATOL = 1e-5, 1e-6


class NormNet(nn.Module):
    """Buffers to materialize (BatchNorm running stats) next to an embedding and linears."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)
        self.out = nn.Linear(5, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.lin(self.emb(idx))))


class RawParam(nn.Module):
    """A bare ``nn.Parameter``: its module has no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict (parameters and buffers; every rank calls it for a wrapped model)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return checkpoint.get_full_state_dict(model, rank0_only=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bitwise(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    def check() -> None:
        assert got.keys() == want.keys(), f"keys differ: {sorted(got)} vs {sorted(want)}"
        for k, v in want.items():
            g = got[k]
            assert g.device == v.device and g.dtype == v.dtype, f"{k}: {g.dtype}/{g.device}"
            diff = (g.double() - v.double()).abs().max().item() if g.numel() else 0.0
            assert torch.equal(g, v), f"{k} differs from the device-built value (max {diff})"
    agree(what, check)


# ---------------------------------------------------------------------- meta == device


def _meta_equals_device(rank: int, world: int, strategy: str) -> None:
    # TinyGPT: tied embedding/head (the head's init runs on a scratch copy), LayerNorms.
    for trigger in ("forward", "full_state_dict", "state_dict"):
        case = f"{strategy} TinyGPT trigger={trigger}"
        torch.manual_seed(7)
        ref = TinyGPT(layers=3)
        after_ref = torch.rand(4)  # where ordinary construction leaves the random stream
        torch.manual_seed(7)
        with torch.device("meta"):
            model = TinyGPT(layers=3)
        model = wrap_blocks(model, strategy)
        tokens = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(3))
        if trigger == "forward":
            out = model(tokens)
        elif trigger == "full_state_dict":
            sd = checkpoint.get_full_state_dict(model, rank0_only=False)
            _bitwise(f"{case}: full state dict", sd, ref.state_dict())
        else:
            model.state_dict()
        after_meta = torch.rand(4)
        agree(f"{case}: random stream after materialization",
              lambda: torch.testing.assert_close(after_meta, after_ref, rtol=0, atol=0))
        _bitwise(f"{case}: parameters", _full_params(model), _full_params(ref))
        if trigger == "forward":
            agree(f"{case}: first forward",
                  lambda: torch.testing.assert_close(out, ref(tokens), rtol=RTOL, atol=ATOL))
        # A rank keeps only its rows: the ranks' local parts add up to the model once.
        held = torch.tensor([sum(p.to_local().numel() for p in model.parameters())])
        dist.all_reduce(held)
        total = sum(p.numel() for p in model.parameters())
        expected = total * (world if strategy == "no_shard" else 1)
        agree(f"{case}: elements held", lambda: _assert(
            held.item() == expected, f"{held.item()} held over all ranks, expected {expected}"))
    # Mixed precision: bf16 compute weights cast from the materialized values, as at wrap.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    torch.manual_seed(7)
    built = wrap_blocks(TinyGPT(layers=3), strategy, mp_policy=mp)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = TinyGPT(layers=3)
    model = wrap_blocks(model, strategy, mp_policy=mp)
    out, want = model(tokens), built(tokens)
    agree(f"{strategy} bf16 compute: forward (bitwise)",
          lambda: torch.testing.assert_close(out, want, rtol=0, atol=0))
    _bitwise(f"{strategy} bf16 compute: main weights", _full_params(model), _full_params(built))
    # NormNet: buffers (BatchNorm running stats) materialized too; one unit.
    torch.manual_seed(11)
    ref_n = NormNet()
    torch.manual_seed(11)
    with torch.device("meta"):
        net = NormNet()
    net = fully_shard(net, sharding_strategy=strategy)
    idx = torch.arange(8).view(4, 2) % 11
    net.train()
    net(idx.view(-1))
    ref_n(idx.view(-1))
    _bitwise(f"{strategy} NormNet: parameters and buffers after a training forward",
             _full_params(net), _full_params(ref_n))


def _param_ids(model: nn.Module) -> dict[str, int]:
    return {n: id(p) for n, p in model.named_parameters()}


def _assert(ok: bool, message: str) -> None:
    assert ok, message


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads", "optim_grads_params"])
def test_meta_equals_device(ranks: RankPools, strategy: str) -> None:
    """World 3: wrapped on meta (blocks, then the root) and materialized by the first forward,
    ``get_full_state_dict`` or ``state_dict()``: every parameter and buffer bitwise equals the
    model built on the device with the same seed, and the random stream ends where it does."""
    ranks.run(_meta_equals_device, 3, strategy, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- param_init_fn, errors


def _init_and_errors(rank: int, world: int) -> None:
    # No reset_parameters on RawParam: wrapping works (torchtitan's flow may still to_empty
    # and initialize); materializing raises, naming the parameter, before writing anything.
    x = torch.ones(2, 4)
    with torch.device("meta"):
        bad = fully_shard(RawParam())
    torch.manual_seed(0)
    for attempt in (lambda: bad(x), lambda: checkpoint.get_full_state_dict(bad)):
        try:
            attempt()
        except RuntimeError as e:
            assert "'scale'" in str(e) and "param_init_fn" in str(e), str(e)
            assert "to_empty" in str(e), str(e)
        else:
            raise AssertionError("a meta parameter without reset_parameters was materialized")
    agree("nothing consumed from the random stream", lambda: torch.testing.assert_close(
        torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0))))
    # ... and the to_empty flow still works for it: load values broadcast from rank 0.
    torch.manual_seed(1)
    src = RawParam()
    bad.to_empty(device="cpu")
    checkpoint.load_full_state_dict(bad, src.state_dict() if rank == 0 else None,
                                    broadcast_from_rank0=True)
    _bitwise("RawParam to_empty + load", _full_params(bad), _full_params(src))
    agree("RawParam to_empty + load: forward", lambda: torch.testing.assert_close(
        bad(x), src(x), rtol=0, atol=0))
    with torch.device("meta"):
        bad = RawParam()
    try:
        fully_shard(bad, param_init_fn="reset")  # type: ignore[arg-type]
    except TypeError as e:
        assert "param_init_fn must be a callable" in str(e), str(e)
    else:
        raise AssertionError("a non-callable param_init_fn was accepted")

    # param_init_fn replaces reset_parameters, module by module in order.
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        for name, p in module.named_parameters(recurse=False):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) * (len(name) + 1))

    with torch.device("meta"):
        model = RawParam()
    model = fully_shard(model, param_init_fn=init)
    y = model(x)
    # Once per module holding meta parameters, parent before child (module order).
    assert calls == ["FSDPRawParam", "Linear"], calls
    ref = RawParam()
    with torch.no_grad():
        for m in ref.modules():
            init(m)
    _bitwise("param_init_fn: parameters", _full_params(model), _full_params(ref))
    agree("param_init_fn: forward", lambda: torch.testing.assert_close(y, ref(x)))

    # A meta parameter in ignored_params is not materialized: named at the first forward.
    with torch.device("meta"):
        model = RawParam()
    model = fully_shard(model, ignored_params=[model.scale], param_init_fn=init)
    try:
        model(x)
    except RuntimeError as e:
        assert "'scale'" in str(e) and "meta" in str(e), str(e)
    else:
        raise AssertionError("a parameter left on meta was not reported")


def test_param_init_fn_and_errors(ranks: RankPools) -> None:
    ranks.run(_init_and_errors, 3, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------- torchtitan's flow


def _mean_losses(model: nn.Module, ref: nn.Module | None, rank: int, world: int, case: str,
                 steps: int = 3) -> list[float]:
    """Adam steps on this rank's micro-batches; returns each step's loss averaged over the
    ranks. With ``ref``, the single-process reference on the concatenated batch must give the
    same losses and parameters."""
    batches = make_batches("lm", steps, 1, world, 2)
    per_step = train_steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), batches,
                           lm_loss, rank=rank, mark=None, divide_by_micro=False)
    losses = []
    for (loss,) in per_step:
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    if ref is not None:
        ref_steps = train_steps(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), batches,
                                lm_loss, rank=None, mark=None, divide_by_micro=False)
        for step, (ref_loss,) in enumerate(ref_steps):
            agree(f"{case}: loss of step {step}", lambda: torch.testing.assert_close(
                torch.tensor(losses[step]), ref_loss, rtol=RTOL, atol=ATOL))
        got, want = _full_params(model), _full_params(ref)
        agree(f"{case}: parameters after training", lambda: [
            torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"{k}: {m}") for k in want
        ])
    return losses


def _seed_checkpoint(rank: int, world: int, strategy: str) -> None:
    case = f"{strategy} seed checkpoint"
    # The seed checkpoint: a CPU-built model, only on rank 0.
    torch.manual_seed(5)
    seed_model = TinyGPT(layers=2)
    ref = reference_copy(seed_model)
    cpu_built = wrap_blocks(reference_copy(seed_model), strategy)
    seed_sd = seed_model.state_dict() if rank == 0 else None
    # torchtitan: build on meta (another seed: values must come from the checkpoint), wrap,
    # to_empty on the device, load the full state dict broadcast from rank 0.
    torch.manual_seed(1000 + rank)
    with torch.device("meta"):
        model = TinyGPT(layers=2)
    model = wrap_blocks(model, strategy)
    dist_params = {n: id(p) for n, p in model.named_parameters()}
    model.to_empty(device="cpu")
    replaced = [n for n, p in model.named_parameters() if dist_params.get(n) != id(p)]
    assert not replaced, f"to_empty replaced parameters {replaced}"
    assert all(record_of(p) is not None for p in model.parameters())
    checkpoint.load_full_state_dict(model, seed_sd, broadcast_from_rank0=True)
    _bitwise(f"{case}: loaded parameters", _full_params(model), _full_params(ref))
    losses = _mean_losses(model, ref, rank, world, case)
    cpu_losses = _mean_losses(cpu_built, None, rank, world, case)
    agree(f"{case}: losses equal the CPU-built run's", lambda: _assert(
        losses == cpu_losses, f"{losses} vs {cpu_losses}"))
    _bitwise(f"{case}: parameters equal the CPU-built run's", _full_params(model),
             _full_params(cpu_built))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_checkpoint_flow(ranks: RankPools, strategy: str) -> None:
    """Meta model, fully_shard, ``to_empty(device="cpu")``, ``load_full_state_dict`` broadcast
    from rank 0: trains like the single-process reference and bitwise like the CPU-built
    wrapped model."""
    ranks.run(_seed_checkpoint, 2, strategy, timeout_s=TIMEOUT_S)


def _conversions(rank: int, world: int, strategy: str) -> None:
    case = f"{strategy} conversions"
    torch.manual_seed(3)
    ref = TinyGPT(layers=2)
    model = wrap_blocks(reference_copy(ref), strategy)
    tokens = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(4))
    before = _full_params(model)
    params = _param_ids(model)
    order = [n for n, _ in model.named_parameters()]
    # Other dtypes or devices: refused before anything changes.
    for convert in (lambda m: m.double(), lambda m: m.to(torch.bfloat16),
                    lambda m: m.to_empty(device="meta"), lambda m: m.blocks[0].half()):
        try:
            convert(model)
        except NotImplementedError as e:
            assert "nothing was changed" in str(e), str(e)
        else:
            raise AssertionError(f"{case}: a conversion after fully_shard was accepted")
        _assert(_param_ids(model) == params, f"{case}: parameters replaced")
        _bitwise(f"{case}: unchanged after a refused conversion", _full_params(model), before)
    model.to("cpu")  # a no-op is fine (parameters in their order)
    _assert([n for n, _ in model.named_parameters()] == order, f"{case}: order changed")
    model.float()
    _bitwise(f"{case}: unchanged after no-op conversions", _full_params(model), before)
    # to_empty on the same device, then an init written in place through the DTensor
    # parameters (torchtitan's init_weights) reaches forward.
    model.to_empty(device="cpu")
    _assert(_param_ids(model) == params, f"{case}: parameters replaced")
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        gen = torch.Generator().manual_seed(9)  # the same values on every rank
        for name, p in model.named_parameters():
            q = ref_params[name]
            value = torch.randn(q.shape, generator=gen) * 0.2
            p.copy_(_rows_like(p, value))
            q.copy_(value)
    agree(f"{case}: forward after to_empty + in-place init", lambda: torch.testing.assert_close(
        model(tokens), ref(tokens), rtol=RTOL, atol=ATOL))
    _mean_losses(model, ref, rank, world, case, steps=2)


def _rows_like(p: torch.Tensor, full: torch.Tensor) -> DTensor:
    """``full`` as a DTensor laid out like the fully_shard parameter ``p`` (its local rows)."""
    record = record_of(p)
    assert record is not None
    return local_rows_dtensor(p, record.row_layout, full)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_conversions_after_wrapping(ranks: RankPools, strategy: str) -> None:
    """``.double()``/``.to(bf16)``/``to_empty(meta)`` raise and change nothing; no-op ``.to``
    works; ``to_empty`` on the buffers' device then an in-place init trains like the
    reference."""
    ranks.run(_conversions, 2, strategy, timeout_s=TIMEOUT_S)
