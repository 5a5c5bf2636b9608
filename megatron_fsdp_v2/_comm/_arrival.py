"""Arrival check for collectives the library issues outside the training step (full state
dicts, full gathers): every rank records that it reached the call before any of them enters a
collective, so a rank that never calls is named, instead of the others waiting in the
transport until its timeout and raising its "Timed out waiting ... for send".

[Note: arrival check]
A collective that some rank of its group never issues cannot fail by itself before the
transport's timeout, and then says nothing of who is missing (gloo: "Timed out waiting
15000ms for send operation to complete"). A call the user makes on every rank (e.g.
``checkpoint.get_full_state_dict``) that some rank skips (it runs only under ``if rank ==
0:``: a documented misuse) is the common way to get there. So before such a call's first
collective, each rank sets one key in the default group's store, ``<prefix>/<call>/<n>/<rank>``
(``n``: how many times this process reached that call on that group), and waits for the keys
of every rank of the group (``Store.wait``: one blocking request, no polling). When they are
all there, every rank is at the same call and its collectives pair up. When the wait runs out,
the keys that are missing name the ranks that did not arrive, and the call raises a
``RuntimeError`` saying which ranks did not reach which call, before this rank enters any
collective (so no transport wait follows, and the group stays usable).

The wait is the group's own collective timeout (``fully_shard``'s ``timeout``): a rank that is
merely slower (still evaluating, logging) is waited for exactly as long as the transport would,
never less; only the message changes. ``MFSDP_ARRIVAL_TIMEOUT_S`` (seconds) shortens it, to
fail faster where ranks are known to arrive together.

Cost: one ``set``, one ``wait`` and one ``delete_key`` on the store per call (each a round trip
to the store's server; measured in tests/distributed/test_hostile_errors.py), nothing on the
training step's hot path: the step's collectives are never checked this way (they are matched
by every rank running the same forwards and backwards; see ``MFSDP_DEBUG_COLLECTIVES``).

Keys are removed as they stop being needed: at its ``n``-th arrival a rank deletes its key of
arrival ``n - 2`` (every rank finished waiting for arrival ``n - 2`` before any rank could pass
arrival ``n - 1``), and a rank that gave up deletes its own key of that arrival, so a rank that
arrives later does not pass alone: it waits, then names the rank that left.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from .. import _registry
from ._backends import group_timeout

__all__ = ["ARRIVAL_TIMEOUT_ENV", "arrival_wait", "await_every_rank"]

ARRIVAL_TIMEOUT_ENV = "MFSDP_ARRIVAL_TIMEOUT_S"
_PREFIX = "megatron_fsdp_v2/arrival"



def arrival_wait(process_group: dist.ProcessGroup | None) -> timedelta:
    """How long :func:`await_every_rank` waits: ``MFSDP_ARRIVAL_TIMEOUT_S`` when set, else the
    group's collective timeout (the default group's when it cannot be read)."""
    value = os.environ.get(ARRIVAL_TIMEOUT_ENV)
    if value:
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds < float("inf"):
            raise ValueError(
                f"{ARRIVAL_TIMEOUT_ENV} must be a positive number of seconds, got {value!r}"
            )
        return timedelta(seconds=seconds)
    timeout = group_timeout(process_group if process_group is not None else _world())
    return timeout if timeout is not None else timedelta(minutes=5)


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None  # callers checked that the default group is initialized
    return world


def await_every_rank(
    call: str, process_group: dist.ProcessGroup | None, wait: timedelta | None = None
) -> None:
    """Return once every rank of ``process_group`` (``None``: the default group) reached
    ``call`` as often as this one; raise ``RuntimeError`` naming the ranks that did not within
    ``wait`` (default :func:`arrival_wait`), before any collective. A no-op on one rank or
    without an initialized default group. See [Note: arrival check]."""
    if not dist.is_available() or not dist.is_initialized():
        return
    group = process_group if process_group is not None else _world()
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) <= 1:
        return
    wait = wait if wait is not None else arrival_wait(group)
    me = dist.get_rank()
    key = (call, ranks)
    n = _registry.arrival_counts.get(key, 0) + 1
    _registry.arrival_counts[key] = n
    base = f"{_PREFIX}/{call}/{','.join(map(str, ranks))}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{base}/{n}/{me}", "1")
    try:
        store.wait([f"{base}/{n}/{r}" for r in ranks], wait)
    except RuntimeError as e:  # DistStoreError: the wait ran out
        missing = [r for r in ranks if r != me and not store.check([f"{base}/{n}/{r}"])]
        if not missing:  # they arrived just now: go on
            _forget(store, base, me, n)
            return
        store.delete_key(f"{base}/{n}/{me}")  # who arrives later must not pass alone
        who = ", ".join(map(str, missing))
        raise RuntimeError(
            f"{call}: rank{'s' if len(missing) > 1 else ''} {who} of its group (ranks "
            f"{list(ranks)}) did not call it within {wait.total_seconds():g}s (this rank's "
            f"call #{n} of it on this group); every rank of the group must call {call}, in "
            "the same order (e.g. not under `if rank == 0:`; with rank0_only=True only the "
            "first rank keeps the result, but every rank takes part). No collective was "
            f"issued. Set {ARRIVAL_TIMEOUT_ENV} to wait longer or shorter"
        ) from e
    _forget(store, base, me, n)


def _forget(store: dist.Store, base: str, me: int, n: int) -> None:
    if n > 2:
        store.delete_key(f"{base}/{n - 2}/{me}")

