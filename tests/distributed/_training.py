"""The training loops the distributed tests share.

One loop, :func:`train_steps`, runs every "N steps of forward / backward / optimizer step, with
optional micro-batches" a test needs, on a ``fully_shard`` model (this rank's slice of each
micro-batch) or on the single-process reference (the whole global micro-batch). Tests that used
to carry their own copy of this loop call it with the options their copy had; the options only
add calls around the ones a plain step makes, never reorder them, so a test keeps the numbers
(losses, parameters, the library's collective counts) its copy produced: each migration was
checked bitwise against its copy on the same ranks and input. Data is drawn by the caller
(``make_batches`` or the test's own generator) before the loop, in the order the copy drew it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn

from megatron_fsdp_v2 import clip_grad_norm_

from _models import agree, assert_close_to_reference, cat_batch, local_detached

# How a micro-batch is marked before its backward (the wrapped model only):
#   "last_backward": ``set_is_last_backward(i == last)`` (this library's and FSDP2's flag);
#   "never_last": ``set_is_last_backward(False)`` on every micro-batch (the optimizer step
#       ends the window: a test of that path);
#   "gradient_sync": ``set_requires_gradient_sync(i == last)`` (FSDP2's no_sync-style flag);
#   None: not marked (one micro-batch per step, or a test of the unmarked default).
MARKS = ("last_backward", "never_last", "gradient_sync", None)


def rank_slice(parts: Any, rank: int | None) -> Any:
    """``parts[rank]`` of a ``make_batches`` micro-batch; the concatenation of every rank's
    part (the single-process global batch) for ``rank`` None."""
    if rank is None:
        return cat_batch("mlp" if isinstance(parts[0], tuple) else "lm", parts)
    return parts[rank]


def train_steps(model: nn.Module, opt: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                batches: Sequence[Sequence[Any]],
                loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, rank: int | None,
                select: Callable[[Any, int | None], Any] = rank_slice,
                mark: str | None = "last_backward", divide_by_micro: bool = True,
                backward_twice: bool = False, retain_graph: bool = False,
                clip_norm: float | None = None,
                set_to_none: bool = True, keep_grads_after: Container[int] = (),
                clear: Callable[[int], None] | None = None,
                before_step: Callable[[int], None] | None = None,
                around_step: Callable[[int], AbstractContextManager[Any]] | None = None,
                around_backwards: Callable[[int], AbstractContextManager[Any]] | None = None,
                before_optimizer: Callable[[int], None] | None = None,
                after_step: Callable[[int], None] | None = None) -> list[list[torch.Tensor]]:
    """Train one step per entry of ``batches`` (``batches[step][micro]``); returns each step's
    micro-batch losses (detached copies of the value backward ran on). ``opt``: one optimizer,
    or several (each stepped in order, then each cleared).

    ``rank``: this rank's slice of each micro-batch (``select(parts, rank)``; default
    ``parts[rank]``), or None for the single-process reference on the global batch (never
    marked). ``divide_by_micro``: each micro-batch's loss divided by the step's micro-batch
    count (so the step's gradient is the mean's). ``backward_twice``: each loss's backward runs
    twice (``retain_graph=True``, then plain), so the gradient doubles. ``retain_graph``: each
    backward keeps its graph (for a hook that backwards a loss again). ``clip_norm``: the
    gradient norm clipped before the step (this library's ``clip_grad_norm_`` for a wrapped
    model, torch's for the reference). ``keep_grads_after``: steps after which the gradients are
    not cleared (the next step steps on the sum). ``clear(step)``: clears the gradients instead
    of ``zero_grad(set_to_none=set_to_none)`` (a test of how they are cleared).

    Hooks, each called with the step's index: ``before_step`` runs before the step's first
    forward; ``around_step`` is a context around its forwards, backwards, optimizer step and
    clearing (a collective counter); ``around_backwards`` a context around its forwards and
    backwards only; ``before_optimizer`` runs after the last backward, before clipping and the
    optimizer step (reading or clipping the gradients, a backward of its own);
    ``after_step`` runs after the step.
    """
    if mark not in MARKS:
        raise ValueError(f"mark={mark!r}: expected one of {MARKS}")
    opts = [opt] if isinstance(opt, torch.optim.Optimizer) else list(opt)
    losses: list[list[torch.Tensor]] = []
    for step, micro_batches in enumerate(batches):
        if before_step is not None:
            before_step(step)
        count = len(micro_batches)
        step_losses: list[torch.Tensor] = []
        with around_step(step) if around_step is not None else contextlib.nullcontext():
            with (around_backwards(step) if around_backwards is not None
                  else contextlib.nullcontext()):
                for i, parts in enumerate(micro_batches):
                    if rank is not None and mark == "last_backward":
                        model.set_is_last_backward(i == count - 1)  # type: ignore[operator]
                    elif rank is not None and mark == "never_last":
                        model.set_is_last_backward(False)  # type: ignore[operator]
                    elif rank is not None and mark == "gradient_sync":
                        model.set_requires_gradient_sync(i == count - 1)  # type: ignore[operator]
                    loss = loss_fn(model, select(parts, rank))
                    if divide_by_micro:
                        loss = loss / count
                    if backward_twice:
                        loss.backward(retain_graph=True)
                    loss.backward(retain_graph=retain_graph)
                    step_losses.append(loss.detach().clone())
            if before_optimizer is not None:
                before_optimizer(step)
            if clip_norm is not None:
                clip = clip_grad_norm_ if rank is not None else torch.nn.utils.clip_grad_norm_
                clip(model.parameters(), clip_norm)
            for o in opts:
                o.step()
            if clear is not None:
                clear(step)
            elif step not in keep_grads_after:
                for o in opts:
                    o.zero_grad(set_to_none=set_to_none)
        losses.append(step_losses)
        if after_step is not None:
            after_step(step)
    return losses


def final_params(model: nn.Module) -> list[torch.Tensor]:
    """This rank's rows of every parameter (a plain tensor's whole value), detached copies."""
    return [local_detached(p).clone() for p in model.parameters()]


def train_against_reference(model: nn.Module, ref: nn.Module,
                            make_opt: Callable[[Any], torch.optim.Optimizer],
                            batches: Sequence[Sequence[Any]],
                            loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, rank: int,
                            what: str, rtol: float, atol: float, **options: Any
                            ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Train the wrapped ``model`` on this rank's slices and the unwrapped ``ref`` (a copy taken
    before wrapping) on the global batches, each with its own ``make_opt(parameters)`` and the
    same :func:`train_steps` ``options``; then this rank's rows of every parameter must match
    the reference's (checked on every rank together). Returns both loss lists."""
    losses = train_steps(model, make_opt(model.parameters()), batches, loss_fn, rank=rank,
                         **options)
    ref_losses = train_steps(ref, make_opt(ref.parameters()), batches, loss_fn, rank=None,
                             **options)
    agree(what, lambda: assert_close_to_reference(model, ref, rtol=rtol, atol=atol))
    return losses, ref_losses
