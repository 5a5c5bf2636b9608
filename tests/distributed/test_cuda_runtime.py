"""fully_shard on CUDA with NCCL: the side-stream overlap gives the same numbers as the
synchronous schedule, and training matches a single-GPU reference. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from megatron_fsdp_v2 import MixedPrecisionPolicy, clip_grad_norm_, fully_shard, memory_report
from megatron_fsdp_v2.testing import run_distributed

from _models import TinyGPT, assert_close_to_reference, lm_loss, make_batches, reference_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _train(rank: int, strategy: str, overlap: bool, mp: MixedPrecisionPolicy | None,
           steps: int = 4, micro: int = 2) -> tuple[torch.nn.Module, torch.nn.Module, list]:
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=64, layers=3, heads=4).to(device)
    ref = reference_copy(model)
    kw = {"mp_policy": mp} if mp else {}
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy, overlap=overlap, **kw)
    fully_shard(model, sharding_strategy=strategy, overlap=overlap, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    batches = make_batches("lm", steps, micro, 1, per_rank=4, vocab=64)
    losses = []
    for step in range(steps):
        for i in range(micro):
            model.set_is_last_backward(i == micro - 1)
            tokens = batches[step][i][0].to(device)
            loss = lm_loss(model, tokens) / micro
            loss.backward()
            (lm_loss(ref, tokens) / micro).backward()
            losses.append(loss.item())
        clip_grad_norm_(model.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    torch.cuda.synchronize()
    return model, ref, losses


def _cuda_worker(rank: int, world: int) -> None:
    torch.cuda.set_device(rank)
    for strategy in STRATEGIES:
        sync, ref, sync_losses = _train(rank, strategy, overlap=False, mp=None)
        overlapped, _, losses = _train(rank, strategy, overlap=True, mp=None)
        assert losses == sync_losses, f"{strategy}: overlap changed the losses"
        for a, b in zip(sync.parameters(), overlapped.parameters()):
            assert torch.equal(a.to_local(), b.to_local()), f"{strategy}: overlap changed params"
        assert_close_to_reference(overlapped, ref, rtol=1e-4, atol=1e-5)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)
        model, _, _ = _train(rank, strategy, overlap=True, mp=mp)
        print(f"[cuda] {strategy}: ok; bf16 {memory_report(model)}")


def test_cuda_nccl_overlap_and_parity() -> None:
    run_distributed(_cuda_worker, 1, backend="nccl", timeout_s=300)
