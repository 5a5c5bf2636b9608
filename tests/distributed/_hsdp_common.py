"""What the HSDP test files share: training a wrapped model and a single-process reference on
the same global batches, and checks that fail on every rank together."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_fsdp_v2 import clip_grad_norm_

from _models import all_ranks_ok, assert_close_to_reference, cat_batch, lm_loss, make_batches


def check(ok: bool, message: str) -> None:
    """Raise on every rank when any rank failed (no rank left waiting in a collective)."""
    if not all_ranks_ok(ok):
        raise AssertionError(message if not ok else f"{message} (on another rank)")


def train_against_reference(
    model: nn.Module, ref: nn.Module, *, rank: int, world: int, case: str, steps: int,
    micro: int, mark: bool | str, zero_grad: bool, retain_graph: bool, rtol: float, atol: float,
) -> None:
    """AdamW steps on ``model`` (this rank's micro-batches) and ``ref`` (the global batch): the
    gradient norm, the loss of every step and the final parameters must match. ``mark``:
    ``True`` marks the last micro-batch, ``False`` leaves every backward "last", ``"never"``
    marks none (reduced late at the step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    batches = make_batches("lm", steps, micro, world, per_rank=2)
    backwards = 2 if retain_graph else 1
    for step in range(steps):
        total = torch.zeros(())
        ref_total = torch.zeros(())
        for i in range(micro):
            if mark == "never":
                model.set_is_last_backward(False)
            elif mark:
                model.set_is_last_backward(i == micro - 1)
            loss = lm_loss(model, batches[step][i][rank]) / micro
            ref_loss = lm_loss(ref, cat_batch("lm", batches[step][i])) / micro
            for b in range(backwards):
                keep = b + 1 < backwards
                loss.backward(retain_graph=keep)
                ref_loss.backward(retain_graph=keep)
            total += loss.detach()
            ref_total += ref_loss.detach()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "clip_grad_norm_ found gradients that were never")
            norm = clip_grad_norm_(model.parameters(), 1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        check(abs(norm.item() - ref_norm.item()) <= 1e-5 * max(1.0, ref_norm.item()),
               f"{case} step {step}: gradient norm {norm.item()} vs reference {ref_norm.item()}")
        opt.step()
        ref_opt.step()
        if zero_grad:
            opt.zero_grad()
            ref_opt.zero_grad()
        dist.all_reduce(total)
        total /= world
        check(abs(total.item() - ref_total.item()) <= 1e-5 * max(1.0, abs(ref_total.item())),
               f"{case} step {step}: loss {total.item()} vs reference {ref_total.item()}")
    try:
        assert_close_to_reference(model, ref, rtol=rtol, atol=atol)
        ok, err = True, ""
    except AssertionError as e:
        ok, err = False, str(e)
    check(ok, f"{case}: parameters differ: {err}")
