"""Ending accumulation windows outside a backward: FSDP2's manual backward finalization
(``set_manual_backward_finalization`` / ``finalize_backward``) and the end of a
``torch.distributed.pipelining`` step.

[Note: manual backward finalization]
FSDP2 (torch 2.15) lets the caller end a backward iteration itself. After
``set_manual_backward_finalization(True)`` on the root, no backward ends an accumulation window:
while the autograd engine runs, every unit of the tree reads ``is_last_backward`` as ``False``
(``UnitState.is_last_backward``), so the final callback of each backward leaves the windows
open whatever ``set_requires_gradient_sync`` says. ``finalize_backward()`` (:func:`finalize`)
then does, outside any backward, what the final callback of a backward marked last would do,
under the settings in force *when it is called* (``set_requires_gradient_sync``,
``set_requires_all_reduce``, ``set_reshard_after_backward``):

* the post-backwards a zero-bubble schedule's input-gradient passes deferred run (see [Note:
  pipeline schedules over fully_shard units] in ``_frontend/_pipelining.py``);
* each window that ends (units whose ``is_last_backward`` holds: synchronization on, HSDP's
  outer reduction not held back) reduces what is still accumulated (``no_shard``/``optim``'s
  one collective), waits for the per-micro-batch reductions and launches HSDP's outer one
  (``GroupGrads.end_window``); a unit with synchronization off keeps its window open;
* then, in :meth:`~megatron_fsdp_v2.FSDPModule.finalize_backward`'s handle (``async_op=True``)
  or at once: the window ends waited on and the gradients installed, gathered weights freed
  as the post-backward of a backward would free them (a window that ends always frees them;
  one that stays open keeps them with ``reshard_after_backward=False``: see [Note: keeping
  gathered weights]) and the sharded parameters registered.

The collectives are the strategy contract's: per group and step one all-reduce (``no_shard``)
or reduce-scatter (``optim``) at finalization, the per-micro-batch reduce-scatters of
``optim_grads``/``optim_grads_params`` during the backwards. An asynchronous finalization is
finished once, by whoever needs the gradients first: the handle's ``wait()``, an optimizer
step over the groups (``finalize_unsynchronized``, through ``FlatParamGroup.finalization``) or the
root's next pre-forward; the others then find nothing to do.

torch 2.15's pipeline stages end every step through this pair (``start_gradient_reduction`` /
``wait_for_gradient_reduction``); torch 2.14's reach ``fully_shard.state(module)`` instead, and
:class:`~megatron_fsdp_v2._frontend._pipelining.PipelineStepEnd` answers with the same
:func:`finalize`, synchronously. The methods are the library's on every supported torch, not
only where torch's ``FSDPModule`` declares them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._issuer import Deferred

if TYPE_CHECKING:
    from ._state import FSDPState

__all__ = ["finalize"]


def finalize(states: list[FSDPState], async_op: bool) -> Deferred:
    """Launch the end of the accumulation windows of ``states`` (a tree's units, root first)
    that end under the current settings, outside a backward (see [Note: manual backward
    finalization]). The returned handle's ``finish()`` waits for them, installs the gradients,
    frees (or keeps) gathered weights and registers the sharded parameters; ``async_op=False``
    launches the collectives without overlap. The same groups in the same order on every rank
    of the data-parallel mesh, so the collectives match."""
    for state in states:
        state.split_backward_step = False  # a zero-bubble step's weight passes are done
    deferred = [state for state in states if state.deferred_post_backward]
    for state in reversed(deferred):  # backward order, as their hooks would have run
        state.deferred_post_backward = False
        state.run_post_backward()
    ctx = states[0].ctx if states else None
    if deferred and ctx is not None:
        if ctx.coalescer is not None:
            ctx.coalescer.flush()
        ctx.drain_reductions(0)
        ctx.reducing.clear()
        for state in deferred:
            for group in state.groups:
                group.finish_reductions()
    # Decided now, under the settings of this call (not those at the handle's wait).
    ending = [state.is_last_backward for state in states]
    resharding = [state.reshard_after_backward or ends for state, ends in zip(states, ending)]
    ended = [group for state, ends in zip(states, ending) if ends
             for group in state.groups if group.pending_install]
    windows = [group.end_window(async_op=async_op) for group in ended]

    def finish() -> None:
        for group in ended:
            group.finalization = None
        if ctx is not None and ctx.finalization is finalization:
            ctx.finalization = None
        for window in windows:
            window.finish()
        for state, reshards in zip(states, resharding):
            if reshards:
                state.reshard()
            else:
                state.keep_gathered()
            state.register_dist_params()

    finalization = Deferred("backward finalization: windows ended, weights resharded", finish)
    # Whoever needs the gradients first finishes it: the handle's wait(), the optimizer step
    # (finalize_unsynchronized), or the root's next pre-forward.
    for group in ended:
        group.finalization = finalization
    return finalization
