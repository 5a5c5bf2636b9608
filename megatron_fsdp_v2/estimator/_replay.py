"""The temporary-memory model of the estimator: the allocate/free sequence of scratch buffers
that the hooks of ``_runtime/_state.py`` and ``_runtime/_context.py`` run over a training
iteration, replayed through the runtime's own ``ScratchAllocator`` on the meta device (accounting
only, nothing allocated) to find the peak. See [Note: estimating with the runtime] in
``_estimate.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._buffers._allocator import ScratchAllocator
from .._buffers._plan import GradPath
from ._fp8 import gathered_dtypes

__all__ = ["replay_temporaries"]

_META = torch.device("meta")


def replay_temporaries(states: list[Any], micro_batches: int) -> int:
    """The high-water mark of scratch buffers over training iterations of the units whose
    ``FSDPState`` objects are ``states`` (in module pre-order), replayed through a
    ``ScratchAllocator`` (on the meta device: accounting only) in the order ``_state.py``
    allocates and frees them with ``overlap=True``:

    * forward, units in module order: a unit's pre-forward gathers its weights
      (``unsharded_model_weight``) and prefetches the next unit's; its post-forward frees its
      own (with ``reshard_after_forward=<n>`` after copying out its ``1/n`` slice,
      ``post_forward_model_weight``, which its pre-backward's gather frees); the root's
      post-forward frees every unit's;
    * backward, in reverse: a unit's pre-backward gathers its weights, prefetches the
      previous unit's and, where gradients go in place on the reduce-each path (a unit with no
      unit below it), allocates its ``staged_grad`` (see [Note: gradients in place]
      in ``_runtime/_grad_staging.py``); its post-backward frees its weights, finishes the
      reduction in flight
      (``max_inflight_reductions = 1``: its scratch buffer is freed) and stages its own
      (``staged_grad`` each micro-batch, or on the last backward the accumulate path's
      ``grad_comm`` when the communication dtype differs); the root's post-backward runs at the
      end of backward, after which everything is freed;
    * HSDP, last backward: a unit's outer reductions are launched when the next post-backward
      (or the final callback) has finished its inner ones, each in an ``outer_comm`` workspace
      when the communication dtype differs, and finished by the drain after that, which frees
      the workspace and outer optim's ``window_grad`` (see [Note: outer reductions in
      backward] in ``_context.py``).
    """
    replay = _Replay(states)
    for micro in range(micro_batches):
        replay.iteration_step(last=micro == micro_batches - 1)
    return replay.alloc.peak_bytes


class _Replay:
    """The allocate/free sequence of one micro-batch's forward and backward (see
    :func:`replay_temporaries`), units numbered in module pre-order (the forward order)."""

    def __init__(self, states: list[Any]) -> None:
        self.states = states
        modules = [s.module for s in states]
        self.children: dict[int | None, list[int]] = {}
        for i, m in enumerate(modules):
            parent = next(  # the nearest enclosing unit (pre-order: listed before it)
                (j for j in range(i - 1, -1, -1) if any(sub is m for sub in modules[j].modules())),
                None,
            )
            self.children.setdefault(parent, []).append(i)
        self.root = self.children[None][0]
        self.alloc = ScratchAllocator()
        # FSDPContext.reducing: (unit, its temporary keys, whether its outer reductions were
        # launched already).
        self.in_flight: list[tuple[int, list[tuple[int, int, str]], bool]] = []
        self.done: set[int] = set()
        self.last = True

    def gather(self, i: int) -> None:
        for k, g in enumerate(self.states[i].groups):
            if g.plan.gathers_weights:  # one scratch buffer per gathered dtype (FP8: 1 byte)
                for j, dtype in enumerate(gathered_dtypes(g)):
                    self.alloc.allocate((i, k, f"w{j}"), g.layout.total_numel, dtype, _META)

    def reshard(self, i: int, after_forward: bool = False) -> None:
        for k, g in enumerate(self.states[i].groups):
            n = g.weights.post_forward_size
            if after_forward and n and self.alloc.is_allocated((i, k, "w0")):
                # reshard_after_forward=<n>: the slice for the group of n is copied out of the
                # gathered weights before they are freed (see [Note: resharding to a smaller
                # group] in _runtime/_compute_weights.py).
                self.alloc.allocate((i, k, "pf"), g.layout.total_numel // n, g.dtypes.model, _META)
            for j in range(len(gathered_dtypes(g))):
                self.alloc.free((i, k, f"w{j}"))

    def take_slices(self, i: int) -> None:
        """A unit's pre-backward waits for its gather, which frees the slices it gathered
        from (the prefetched previous unit's are freed at that unit's own wait)."""
        for k in range(len(self.states[i].groups)):
            self.alloc.free((i, k, "pf"))

    def forward(self, i: int) -> None:
        self.gather(i)
        if i + 1 < len(self.states):
            self.gather(i + 1)  # prefetch the next unit
        for child in self.children.get(i, []):
            self.forward(child)
        self.reshard(i, after_forward=True)
        if i == self.root:
            for j in range(len(self.states)):
                self.reshard(j)

    def backward(self, i: int) -> None:
        self.gather(i)
        self.take_slices(i)
        if i > 0 and i - 1 not in self.done:
            self.gather(i - 1)  # prefetch the previous unit
        for k, g in enumerate(self.states[i].groups):
            if self._in_place_scratch(i, g):  # autograd writes into it from the pre-backward on
                self.alloc.allocate((i, k, "rs"), g.layout.total_numel, g.dtypes.comm, _META)
        for child in reversed(self.children.get(i, [])):
            self.backward(child)
        if i != self.root:  # the root's runs in the final callback
            self.post_backward(i)

    def _in_place_scratch(self, i: int, g: Any) -> bool:
        """A reduce-each group whose gradients autograd writes into ``staged_grad``
        (of a unit with no unit nested below it: ``FSDPState.prepare_gradients``)."""
        return (g.requires_grad and g.plan.grads_in_place and not self.children.get(i)
                and g.plan.grad_path is GradPath.REDUCE_EACH_MICRO_BATCH)

    def drain(self) -> None:
        """``FSDPContext.drain_reductions(0)``: the listed reductions finish, oldest first, then
        the outer reductions of the units whose window ends are launched (listed again when
        they hold a temporary)."""
        finished, self.in_flight = self.in_flight, []
        for _, keys, _ in finished:
            for key in keys:
                self.alloc.free(key)
        for i, _, outer_launched in finished:
            if not self.last or outer_launched:
                continue
            keys = []
            for k, g in enumerate(self.states[i].groups):
                if not g.plan.window_steps or not g.requires_grad:
                    continue
                if g.dtypes.comm != g.dtypes.grad:
                    lo, hi = g.plan.window_grad_span or g.plan.main_weight_span
                    self.alloc.allocate((i, k, "oc"), hi - lo, g.dtypes.comm, _META)
                    keys.append((i, k, "oc"))
                if g.plan.window_grad_span is not None:
                    keys.append((i, k, "wg"))  # freed when the outer reduce-scatter finishes
            if keys:
                self.in_flight.append((i, keys, True))

    def post_backward(self, i: int) -> None:
        self.reshard(i)
        self.drain()  # the older reductions finish first
        keys = []
        for k, g in enumerate(self.states[i].groups):
            if not g.requires_grad:
                continue
            if g.plan.grad_path is GradPath.REDUCE_EACH_MICRO_BATCH:
                numel, key = g.layout.total_numel, (i, k, "rs")
            elif self.last and "grad_comm" in g.plan.temporaries:
                lo, hi = g.plan.main_grad_span
                numel, key = hi - lo, (i, k, "gc")
            else:
                continue
            if not self._in_place_scratch(i, g):  # else allocated by the pre-backward
                self.alloc.allocate(key, numel, g.dtypes.comm, _META)
            keys.append(key)
            if key[2] == "rs" and g.plan.window_grad_span is not None:
                # HSDP outer optim: the inner reductions add into a scratch buffer alive all window.
                lo, hi = g.plan.window_grad_span
                self.alloc.allocate((i, k, "wg"), hi - lo, g.dtypes.grad, _META)
        # Listed to be drained: a temporary held, or a window's end (its outer reduction waits).
        ends_window = self.last and any(
            g.plan.window_steps and g.requires_grad for g in self.states[i].groups)
        if keys or ends_window:
            self.in_flight.append((i, keys, False))
        self.done.add(i)

    def iteration_step(self, last: bool) -> None:
        """One micro-batch: forward, backward, the final callback."""
        self.last, self.done = last, set()
        self.forward(self.root)
        self.backward(self.root)
        self.post_backward(self.root)
        self.drain()  # the final callback's: the root's outer reductions launch
        for _, keys, _ in self.in_flight:  # then everything is waited on and freed
            for key in keys:
                self.alloc.free(key)
        self.in_flight = []
        for j in range(len(self.states)):
            self.reshard(j)
        # (A window that starts on reduced gradients, i.e. without zero_grad, would also hold
        # a ``window_carry``: not replayed.)
