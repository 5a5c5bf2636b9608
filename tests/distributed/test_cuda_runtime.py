"""fully_shard on CUDA with NCCL: the side-stream overlap gives the same numbers as the
synchronous schedule, training matches a single-GPU reference, and a step that fails while
collectives are in flight on the side streams recovers (its event waits bounded by the
collective timeout, [Note: recovery deadline]) and then trains bitwise as if it had not failed.
Skipped without a GPU; the recovery case also runs on CPU (gloo), which checks the test itself."""

from __future__ import annotations

import pytest
import torch

from megatron_fsdp_v2 import MixedPrecisionPolicy, clip_grad_norm_, fully_shard, memory_report
from megatron_fsdp_v2.testing import run_distributed

from _failure_injection import InjectedError, inject_failure
from _models import TinyGPT, assert_close_to_reference, lm_loss, make_batches, reference_copy

has_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_gpu = [pytest.mark.gpu, has_cuda]  # for a parameter; a whole test takes the two marks

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


@pytest.mark.gpu
@has_cuda
def test_cuda_nccl_overlap_and_parity() -> None:
    run_distributed(_cuda_worker, 1, backend="nccl", timeout_s=300)


def _train_through_failures(device: torch.device, strategy: str, fail: bool) -> list[torch.Tensor]:
    """Three steps of two micro-batches, overlap on; with ``fail``, step 1 is first tried twice
    on another batch: a forward that raises in block 1, then a backward that raises in block 0
    (reductions in flight); then the step runs as in the clean run."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=64, layers=3, heads=4).to(device)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy, overlap=True)
    fully_shard(model, sharding_strategy=strategy, overlap=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches("lm", 3, 2, 1, per_rank=4, vocab=64)
    for step in range(3):
        if fail and step == 1:
            for where in ("forward", "backward_late"):
                handle = inject_failure(model, where)
                try:
                    model.set_is_last_backward(True)
                    with pytest.raises(InjectedError):
                        lm_loss(model, batches[0][0][0].to(device)).backward()
                finally:
                    handle.remove()
        for i in range(2):
            model.set_is_last_backward(i == 1)
            (lm_loss(model, batches[step][i][0].to(device)) / 2).backward()
        opt.step()
        opt.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return [p.to_local().detach().cpu() for p in model.parameters()]


def _recovery_worker(rank: int, world: int, device_type: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    for strategy in ("optim", "optim_grads_params"):
        clean = _train_through_failures(device, strategy, fail=False)
        recovered = _train_through_failures(device, strategy, fail=True)
        for a, b in zip(clean, recovered, strict=True):
            assert torch.equal(a, b), f"{strategy}: the recovered run differs from the clean one"


@pytest.mark.parametrize("device_type", [
    pytest.param("cuda", marks=needs_gpu),
    "cpu",  # the same test on gloo: checks the test itself where no GPU is lent
])
def test_failed_steps_recover_and_train_bitwise(device_type: str) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    run_distributed(_recovery_worker, 1, device_type, backend=backend, timeout_s=300)
