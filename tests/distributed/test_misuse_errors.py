"""Misuse that used to fail with an unclear error, silently, or with a checkpoint that cannot be
loaded, now a clear error on every rank, naming the problem and the fix:

* ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` inside a unit (sparse
  gradients cannot go into flat buffers): ``ValueError`` at ``fully_shard``, also when only one
  rank builds it sparse;
* ``torch.autograd.grad(loss, model.parameters())``: the library's gradients exist only through
  ``.backward()``, and torch offers no public point to refuse the call earlier (issue 35: no
  patch of ``torch.autograd.grad``), so it behaves exactly as under FSDP2, the control in the
  same test: torch's "appears to not have been used in the graph" error, ``None`` for every
  parameter with ``allow_unused=True``, zeros with ``materialize_grads=True`` (the README says
  so); ``autograd.grad`` with respect to inputs and a later ``loss.backward()`` keep working;
* every rank saving to (or loading from) its own directory (rank 0 used to report success for
  a checkpoint whose other shards were elsewhere): ``ValueError`` before anything is written.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_fsdp_v2 import checkpoint, fully_shard

# private: a refused call leaves no unit state behind (state_of(model) is None)
from megatron_fsdp_v2._registry import state_of

from _models import assert_close_to_reference
from _pool import RankPools

TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(900)
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class Bag(nn.Module):
    def __init__(self, sparse: bool, bag: bool = False) -> None:
        super().__init__()
        self.emb = (nn.EmbeddingBag(11, 4, sparse=sparse) if bag
                    else nn.Embedding(11, 4, sparse=sparse))
        self.out = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def _raised(fn: Any) -> str | None:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------- sparse embeddings

def _sparse_worker(rank: int, world: int, strategy: str, case: str) -> dict[str, Any]:
    torch.manual_seed(0)
    sparse = rank == 1 if case == "rank1_only" else True
    model = Bag(sparse=sparse, bag=case == "embedding_bag")
    params = {n: p for n, p in model.named_parameters()}
    raised = _raised(lambda: fully_shard(model, sharding_strategy=strategy, timeout=30))
    untouched = (type(model) is Bag and state_of(model) is None
                 and all(p is params[n] for n, p in model.named_parameters()))
    # The way out the message names: the embedding's weight in ignored_params.
    torch.manual_seed(0)
    ok_model = Bag(sparse=True)
    fully_shard(ok_model, sharding_strategy=strategy, timeout=30,
                ignored_params=[ok_model.emb.weight])
    ok_model(torch.tensor([[1, 2], [3, 4]])).sum().backward()
    return {"raised": raised, "untouched": untouched,
            "sparse_grad": ok_model.emb.weight.grad is not None
            and ok_model.emb.weight.grad.is_sparse}


@pytest.mark.parametrize("case", ["embedding", "embedding_bag", "rank1_only"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sparse_embedding_is_refused_at_wrap_time(ranks: RankPools, strategy: str,
                                                  case: str) -> None:
    results = ranks.run(_sparse_worker, 2, strategy, case, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["raised"] is not None and r["raised"].startswith("ValueError"), (rank, r)
        assert "'emb.weight'" in r["raised"] and "sparse=True" in r["raised"], r["raised"]
        assert "sparse=False" in r["raised"] and "ignored_params" in r["raised"], r["raised"]
        if case == "rank1_only":
            assert "rank 1" in r["raised"], r["raised"]
        assert r["untouched"], (rank, "the module was changed by the failed call")
        assert r["sparse_grad"], (rank, "the ignored sparse embedding got no sparse gradient")


# ---------------------------------------------------------------------- autograd.grad

NOT_IN_GRAPH = "appears to not have been used in the graph"


def _autograd_outcomes(model: nn.Module, loss: torch.Tensor) -> list[str]:
    """What ``torch.autograd.grad(loss, <the parameters>)`` does, per call form: the error's
    type and whether it is torch's "not used in the graph", or the gradients returned
    (``None``, or ``zeros``/``values`` by their full values). The graph is kept."""
    calls = [
        lambda: torch.autograd.grad(loss, list(model.parameters()), retain_graph=True),
        lambda: torch.autograd.grad(loss, dict(model.named_parameters()), retain_graph=True),
        lambda: torch.autograd.grad(loss, model.out.weight, retain_graph=True),
        lambda: torch.autograd.grad(loss, list(model.parameters()), retain_graph=True,
                                    allow_unused=True),
        lambda: torch.autograd.grad(loss, list(model.parameters()), retain_graph=True,
                                    materialize_grads=True),
    ]
    outcomes = []
    for call in calls:
        try:
            grads = call()
        except Exception as e:  # noqa: BLE001 - the outcome is what is compared
            outcomes.append(f"{type(e).__name__}: "
                            + ("not used in the graph" if NOT_IN_GRAPH in str(e) else str(e)))
            continue
        outcomes.append(" ".join(
            "None" if g is None else "zeros" if not g.full_tensor().any() else "values"
            for g in grads))
    return outcomes


def _autograd_worker(rank: int, world: int, strategy: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch.manual_seed(0)
    model = Bag(sparse=False)
    ref = copy.deepcopy(model)
    fsdp2 = copy.deepcopy(model)
    fully_shard(model.out, sharding_strategy=strategy, timeout=30)
    fully_shard(model, sharding_strategy=strategy, timeout=30)
    fsdp2_fully_shard(fsdp2.out)
    fsdp2_fully_shard(fsdp2)
    idx = torch.tensor([[1, 2], [3, 9]])
    loss, fsdp2_loss = model(idx).square().sum(), fsdp2(idx).square().sum()
    ours, theirs = _autograd_outcomes(model, loss), _autograd_outcomes(fsdp2, fsdp2_loss)
    fsdp2_loss.backward()
    # What works: autograd.grad with respect to a non-parameter tensor, then backward.
    x = torch.randn(2, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(model.out(x).sum(), x)
    ref_x = x.detach().clone().requires_grad_(True)
    (ref_gx,) = torch.autograd.grad(ref.out(ref_x).sum(), ref_x)
    loss.backward()
    ref_loss = ref(idx).square().sum()
    ref_loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.step()
    ref_opt.step()
    assert_close_to_reference(model, ref, rtol=1e-6, atol=1e-7)
    return {"ours": ours, "fsdp2": theirs, "input_grad_ok": torch.allclose(gx, ref_gx),
            "loss_ok": torch.allclose(loss, ref_loss)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_autograd_grad_wrt_parameters_is_torchs(ranks: RankPools, strategy: str) -> None:
    """``torch.autograd.grad`` with respect to our parameters: what FSDP2 does, documented in
    the README ("Coming from FSDP2"): torch's error, ``None`` with ``allow_unused=True``,
    zeros with ``materialize_grads=True``, never this rank's unreduced gradients."""
    results = ranks.run(_autograd_worker, 2, strategy, timeout_s=TIMEOUT_S)
    expected = ["RuntimeError: not used in the graph"] * 3 + ["None None None",
                                                               "zeros zeros zeros"]
    for rank, r in enumerate(results):
        assert r["fsdp2"] == expected, (rank, "FSDP2 (the control) changed", r["fsdp2"])
        assert r["ours"] == expected, (rank, r["ours"])
        assert r["input_grad_ok"] and r["loss_ok"], (rank, r)


# ---------------------------------------------------------------------- per-rank checkpoints

def _per_rank_checkpoint_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Bag(sparse=False)
    fully_shard(model, sharding_strategy="optim_grads_params", timeout=30)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    own = os.path.join(root, f"ckpt_rank{rank}")
    saved = _raised(lambda: checkpoint.save(model, opt, checkpoint_id=own))
    writer = _raised(lambda: checkpoint.save(
        model, opt, storage_writer=torch.distributed.checkpoint.FileSystemWriter(own)))
    dist.barrier()
    left = sorted(os.listdir(root))
    # The same path on every rank saves; loading it from per-rank paths is refused too.
    shared = os.path.join(root, "ckpt")
    checkpoint.save(model, opt, checkpoint_id=shared)
    loaded = _raised(lambda: checkpoint.load(
        model, opt, checkpoint_id=shared if rank == 0 else own))
    checkpoint.load(model, opt, checkpoint_id=shared)
    return {"saved": saved, "writer": writer, "left": left, "loaded": loaded}


def test_each_rank_saving_to_its_own_directory_raises(ranks: RankPools, tmp_path: Any) -> None:
    results = ranks.run(_per_rank_checkpoint_worker, 3, str(tmp_path), timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        for key in ("saved", "writer", "loaded"):
            message = r[key]
            assert message is not None and message.startswith("ValueError"), (rank, key, r)
            assert "different checkpoint paths" in message and "same path" in message, message
            assert "ckpt_rank1" in message, message
        assert r["left"] == [], (rank, "something was written", r["left"])
