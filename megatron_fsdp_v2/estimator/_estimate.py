"""``estimate``: a run's per-rank memory and per-iteration collectives, before renting the GPUs.

[Note: estimating with the runtime]
The estimate runs the library's own wrapping code (``fully_shard``: layouts, padding splits,
buffer plans) on a model built under ``torch.device("meta")``, in one process, under PyTorch's
fake process group backend (``"fake"``: every collective is a no-op) at the requested world
size and rank. Inside ``meta_buffers()`` (see [Note: meta buffers] in ``_registry``) the flat
buffers go on the meta device, so nothing is allocated and no forward is run. The answers come
from the objects the runtime itself executes, not from a second copy of their math:

* persistent memory: ``memory_report`` of the wrapped model (each group's ``memory_bytes``);
* collectives: each group's ``BufferPlan`` steps (``gather_steps``, ``reduce_steps``,
  ``refresh_steps``, ``window_steps``) times how often the schedule runs them per iteration,
  over the group's own buffer sizes;
* the temporary peak: the plan's ``temporaries``, replayed through a ``BucketAllocator`` (the
  accounting ``memory_report`` reads) in the order the hooks of ``_state.py`` allocate and free
  them in a training iteration (see :func:`_replay_temporaries`).

What the estimate assumes: a training loop of ``micro_batches`` forward/backward passes marked
with ``set_is_last_backward`` (only the last is last), every unit running once per micro-batch
in module order (a decoder stack), ``overlap=True`` and the other defaults of ``fully_shard``,
``zero_grad`` between iterations, no gradient clipping (``clip_grad_norm_`` adds one all-reduce
of the squared norm when gradients are sharded), and the iterations after the first (the first
has no refresh to do). Activations and the model's own non-parameter buffers are not modelled.
The command line (``python -m megatron_fsdp_v2.estimator``, package ``estimator``) is
:func:`main`.

A process that already has a default process group cannot host the fake one: ``estimate``
raises ``RuntimeError`` there (run it before ``init_process_group``, or in another process).
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _registry
from .._buffers._allocator import BucketAllocator
from .._buffers._plan import Collective, GradPath
from .._frontend._fully_shard import fully_shard
from .._runtime._flat_param_group import FlatParamGroup
from .._runtime._memory import MemoryReport, memory_report
from ..api import MixedPrecisionPolicy, ShardingStrategy

__all__ = ["Estimate", "estimate", "meta_buffers", "optimizer_state_bytes"]

_KIND = {
    Collective.ALL_GATHER: "all_gather",
    Collective.REDUCE_SCATTER: "reduce_scatter",
    Collective.ALL_REDUCE: "all_reduce",
}
OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")


@dataclass
class GroupShard:
    """Where one group's buffers sit in its flat layout on the estimated rank."""

    unit: str
    index: int
    total_numel: int
    model_weight_span: tuple[int, int]
    main_weight_span: tuple[int, int]
    main_grad_span: tuple[int, int]


@dataclass
class Estimate:
    """The answer of :func:`estimate` for one rank of one configuration."""

    memory: MemoryReport
    """What ``memory_report(model, optimizer)`` gives on this rank after an iteration's last
    backward, before ``optimizer.step()`` (``optimizer_state``: the chosen optimizer's)."""
    collectives: dict[str, tuple[int, int]]
    """Per iteration: kind -> (count, payload bytes: the full buffer each collective covers, as
    ``examples/comm_counter.py`` counts it)."""
    padding_ratio: float
    optimizer_state: dict[str, int]
    """Bytes of optimizer state on this rank for each of ``OPTIMIZERS``."""
    wire_bytes: dict[str, float] = field(default_factory=dict)
    """Per iteration: kind -> bytes one rank sends under ring algorithms (``2 (n-1)/n`` of the
    payload for an all-reduce over ``n`` ranks, ``(n-1)/n`` otherwise; ``comm_counter.py``'s
    convention): the number to compare strategies by."""
    shards: list[GroupShard] = field(default_factory=list)
    world_size: int = 1
    rank: int = 0

    @property
    def bytes_communicated(self) -> float:
        """Wire bytes per iteration, all kinds together."""
        return sum(self.wire_bytes.values())


@contextlib.contextmanager
def meta_buffers() -> Iterator[None]:
    """Groups built from meta parameters put their flat buffers on the meta device (no
    storage); see [Note: meta buffers] in ``_registry``. For the estimator only: such a model
    cannot run."""
    previous = _registry.meta_buffers[0]
    _registry.meta_buffers[0] = True
    try:
        yield
    finally:
        _registry.meta_buffers[0] = previous


def _check_args(world_size: int, rank: int, micro_batches: int, optimizer: str,
                mesh_shape: tuple[int, int] | None) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if mesh_shape is not None:
        if (len(mesh_shape) != 2 or any(not isinstance(d, int) or d < 1 for d in mesh_shape)
                or mesh_shape[0] * mesh_shape[1] != world_size):
            raise ValueError(
                f"mesh_shape must be (R, S) with R * S == world_size ({world_size}), got "
                f"{mesh_shape!r}"
            )
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "estimate() runs the library under a fake process group of its own, and this "
            "process already has a default process group; call estimate() before "
            "init_process_group, or in a separate process (e.g. python -m "
            "megatron_fsdp_v2.estimate)"
        )


def _unit_selector(wrap: Any) -> Callable[[nn.Module], bool]:
    if isinstance(wrap, tuple) and all(isinstance(c, type) for c in wrap):
        return lambda m: isinstance(m, wrap)
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    raise TypeError(
        f"wrap must be a tuple of module classes or a predicate module -> bool, got {wrap!r}"
    )


def estimate(
    model_fn: Callable[[], nn.Module],
    *,
    world_size: int,
    wrap: tuple[type, ...] | Callable[[nn.Module], bool] = (),
    micro_batches: int = 1,
    sharding_strategy: ShardingStrategy | str | int = "optim_grads_params",
    mp_policy: MixedPrecisionPolicy | None = None,
    mesh_shape: tuple[int, int] | None = None,
    outer_dp_sharding_strategy: ShardingStrategy | str | int = "no_shard",
    rank: int = 0,
    optimizer: str = "adamw",
    max_padding_ratio: float = 0.01,
) -> Estimate:
    """Estimate ``rank``'s memory and the collectives of one training iteration when the model
    ``model_fn()`` builds is wrapped with ``fully_shard`` (each module ``wrap`` selects, then the
    root) over ``world_size`` ranks. See [Note: estimating with the runtime] for what is assumed
    and what is not modelled (activations).

    ``model_fn`` is called under ``torch.device("meta")``; no forward runs, so the model need not
    be runnable. ``wrap``: a tuple of module classes or a predicate. ``mesh_shape``: ``(R, S)``
    for HSDP (``outer_dp_sharding_strategy`` along R). ``optimizer``: whose state
    ``memory.optimizer_state`` reports (``"adamw"``: two moments of the main weights plus a
    4-byte step per parameter; ``"sgd"``: none; ``"sgd_momentum"``: one buffer); every one of
    them is in ``optimizer_state``. Leaves no process group and no library state behind.
    """
    _check_args(world_size, rank, micro_batches, optimizer, mesh_shape)
    selects = _unit_selector(wrap)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        if mesh_shape is None:
            mesh = init_device_mesh("cpu", (world_size,))
        else:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        with torch.device("meta"):
            model = model_fn()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
        placed = next((n for n, p in model.named_parameters() if p.device.type != "meta"), None)
        if placed is not None:
            raise ValueError(
                f"model_fn built parameter {placed!r} on a real device; estimate calls it under "
                "torch.device('meta') so that nothing is allocated: do not pass device=... or "
                "move the model inside model_fn"
            )
        units = [m for m in model.modules() if m is not model and selects(m)]
        options: dict[str, Any] = dict(
            mesh=mesh, sharding_strategy=sharding_strategy, mp_policy=mp_policy,
            check_ranks=False, sync_module_states=False, max_padding_ratio=max_padding_ratio,
            outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        )
        with meta_buffers():
            for unit in reversed(units):  # children before their parents
                fully_shard(unit, **options)
            fully_shard(model, **options)
        return _measure(model, micro_batches, optimizer, world_size, rank)
    finally:
        _registry.reset()
        dist.destroy_process_group()


def _states(model: nn.Module) -> list[tuple[str, Any]]:
    return [(name or "<root>", s) for name, m in model.named_modules()
            if (s := _registry.state_of(m)) is not None]


def _measure(model: nn.Module, micro_batches: int, optimizer: str, world_size: int,
             rank: int) -> Estimate:
    states = _states(model)
    report = memory_report(model)
    report.temporary_peak = _replay_temporaries(model, micro_batches)
    groups = [g for _, s in states for g in s.groups]
    state_bytes = {name: optimizer_state_bytes(groups, name) for name in OPTIMIZERS}
    report.optimizer_state = state_bytes[optimizer]
    shards = [
        GroupShard(name, i, g.layout.total_numel, g.plan.model_weight_span,
                   g.plan.main_weight_span, g.plan.main_grad_span)
        for name, s in states for i, g in enumerate(s.groups)
    ]
    collectives, wire = _collectives(groups, micro_batches)
    return Estimate(report, collectives, report.padding_ratio, state_bytes, wire, shards,
                    world_size, rank)


def optimizer_state_bytes(groups: list[FlatParamGroup], optimizer: str) -> int:
    """Bytes of ``optimizer``'s state for the parameters of ``groups`` on this rank once it has
    stepped: per trainable parameter with rows on this rank, ``k`` tensors shaped like its local
    main-weight shard (AdamW: 2 and a float32 ``step`` scalar; SGD with momentum: 1; plain SGD:
    none)."""
    per_param = {"adamw": 2, "sgd": 0, "sgd_momentum": 1}[optimizer]
    total = 0
    for group in groups:
        if not group.requires_grad:
            continue
        for param in group.dist_params:
            local = param.to_local()  # type: ignore[attr-defined]
            if local.numel() == 0:
                continue  # no rows on this rank: no gradient, so the optimizer skips it
            total += per_param * local.numel() * local.element_size()
            if optimizer == "adamw":
                total += torch.tensor(0.0).element_size()  # the step count (float32)
    return total


def _collectives(groups: list[FlatParamGroup], micro_batches: int
                 ) -> tuple[dict[str, tuple[int, int]], dict[str, float]]:
    """Each group's plan steps, times how often an iteration of ``micro_batches`` runs them,
    over the buffers they cover (payload: the full buffer of the step's process group), and the
    wire bytes of the same collectives."""
    totals = {kind: [0, 0] for kind in _KIND.values()}
    wire = dict.fromkeys(_KIND.values(), 0.0)

    def add(op: Collective, count: int, numel: int, dtype: torch.dtype, axis: str = "shard"
            ) -> None:
        kind = _KIND[op]
        payload = count * numel * dtype.itemsize
        totals[kind][0] += count
        totals[kind][1] += payload
        n = dist.get_world_size(group.axis_groups[axis])
        factor = (2.0 if op is Collective.ALL_REDUCE else 1.0) * (n - 1) / n
        wire[kind] += payload * factor

    for group in groups:
        plan, dtypes, full = group.plan, group.dtypes, group.layout.total_numel
        inner_shard = plan.shard_span[1] - plan.shard_span[0]
        for step in plan.gather_steps:  # before forward and before backward, each micro-batch
            add(step.op, 2 * micro_batches, full, dtypes.model)
        for step in plan.refresh_steps:  # once, after the optimizer step
            add(step.op, 1, full if step.axis == "shard" else inner_shard, dtypes.model,
                step.axis)
        if not group.requires_grad:
            continue
        per_window = plan.grad_path is GradPath.ACCUMULATE_THEN_REDUCE
        for step in plan.reduce_steps:
            add(step.op, 1 if per_window else micro_batches, full, dtypes.comm)
        for step in plan.window_steps:
            if plan.window_grad_span is not None:
                lo, hi = plan.window_grad_span
            else:
                lo, hi = plan.main_weight_span
            add(step.op, 1, hi - lo, dtypes.comm, step.axis)
    return {kind: (c, b) for kind, (c, b) in totals.items()}, wire


def _replay_temporaries(model: nn.Module, micro_batches: int) -> int:
    """The high-water mark of temporary buckets over training iterations, replayed through a
    ``BucketAllocator`` (on the meta device: accounting only) in the order ``_state.py``
    allocates and frees them with ``overlap=True``:

    * forward, units in module order: a unit's pre-forward gathers its weights
      (``unsharded_model_weight``) and prefetches the next unit's; its post-forward frees its
      own; the root's post-forward frees every unit's;
    * backward, in reverse: a unit's pre-backward gathers its weights, prefetches the
      previous unit's and, where gradients go in place on the reduce-each path (a unit with no
      unit below it), allocates its ``reduce_scatter_input`` (see [Note: gradients in place]
      in ``_grads.py``); its post-backward frees its weights, finishes the reduction in flight
      (``max_inflight_reductions = 1``: its bucket is freed) and stages its own
      (``reduce_scatter_input`` each micro-batch, or on the last backward the accumulate path's
      ``grad_comm`` when the communication dtype differs); the root's post-backward runs at the
      end of backward, after which everything is freed;
    * HSDP, last backward: a unit's outer reductions are launched when the next post-backward
      (or the final callback) has finished its inner ones, each in an ``outer_comm`` workspace
      when the communication dtype differs, and finished by the drain after that, which frees
      the workspace and outer optim's ``window_grad`` (see [Note: outer reductions in
      backward] in ``_context.py``).
    """
    replay = _Replay([s for _, s in _states(model)])
    for micro in range(micro_batches):
        replay.iteration_step(last=micro == micro_batches - 1)
    return replay.alloc.peak_bytes


class _Replay:
    """The allocate/free sequence of one micro-batch's forward and backward (see
    :func:`_replay_temporaries`), units numbered in module pre-order (the forward order)."""

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
        self.alloc = BucketAllocator()
        # FSDPContext.reducing: (unit, its temporary keys, whether its outer reductions were
        # launched already).
        self.in_flight: list[tuple[int, list[tuple[int, int, str]], bool]] = []
        self.done: set[int] = set()
        self.last = True

    def gather(self, i: int) -> None:
        for k, g in enumerate(self.states[i].groups):
            if g.plan.gathers_weights:
                self.alloc.allocate((i, k, "w"), g.layout.total_numel, g.dtypes.model, _META)

    def reshard(self, i: int) -> None:
        for k in range(len(self.states[i].groups)):
            self.alloc.free((i, k, "w"))

    def forward(self, i: int) -> None:
        self.gather(i)
        if i + 1 < len(self.states):
            self.gather(i + 1)  # prefetch the next unit
        for child in self.children.get(i, []):
            self.forward(child)
        self.reshard(i)
        if i == self.root:
            for j in range(len(self.states)):
                self.reshard(j)

    def backward(self, i: int) -> None:
        self.gather(i)
        if i > 0 and i - 1 not in self.done:
            self.gather(i - 1)  # prefetch the previous unit
        for k, g in enumerate(self.states[i].groups):
            if self._in_place_bucket(i, g):  # autograd writes into it from the pre-backward on
                self.alloc.allocate((i, k, "rs"), g.layout.total_numel, g.dtypes.comm, _META)
        for child in reversed(self.children.get(i, [])):
            self.backward(child)
        if i != self.root:  # the root's runs in the final callback
            self.post_backward(i)

    def _in_place_bucket(self, i: int, g: Any) -> bool:
        """A reduce-each group whose gradients autograd writes into ``reduce_scatter_input``
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
            if not self._in_place_bucket(i, g):  # else allocated by the pre-backward
                self.alloc.allocate(key, numel, g.dtypes.comm, _META)
            keys.append(key)
            if key[2] == "rs" and g.plan.window_grad_span is not None:
                # HSDP outer optim: the inner reductions add into a bucket alive all window.
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


_META = torch.device("meta")


# ---------------------------------------------------------------------- command line

STRATEGIES = tuple(s.value for s in ShardingStrategy)  # every strategy, in code order
_GIB = float(1 << 30)


def _parse_mesh(text: str) -> tuple[int, int]:
    try:
        r, s = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes RxS (e.g. 8x128), got {text!r}") from None
    return r, s


def table(rows: list[tuple[str, Estimate]], budget_gib: float | None) -> str:
    """The side-by-side table the command line prints; ``*`` marks the configuration with the
    fewest wire bytes communicated among those whose total fits ``budget_gib``."""
    fits = [(label, e) for label, e in rows
            if budget_gib is None or e.memory.total <= budget_gib * _GIB]
    best = min(fits, key=lambda r: r[1].bytes_communicated)[0] if fits else None
    head = (f"{'':2}{'configuration':<40}{'model':>9}{'main':>9}{'grads':>9}{'temp':>9}"
            f"{'optim':>9}{'total':>9}  {'AG n/GiB':>13}{'RS n/GiB':>13}{'AR n/GiB':>13}"
            f"{'wire GiB':>10}{'pad':>8}")
    lines = [head, "-" * len(head)]
    for label, e in rows:
        m = e.memory
        cols = [m.model_weights, m.main_weights, m.main_grads, m.temporary_peak,
                m.optimizer_state, m.total]
        comm = [e.collectives[k] for k in ("all_gather", "reduce_scatter", "all_reduce")]
        lines.append(
            f"{'*' if label == best else ' ':2}{label:<40}"
            + "".join(f"{c / _GIB:>9.2f}" for c in cols) + "  "
            + "".join(f"{f'{n}/{b / _GIB:.1f}':>13}" for n, b in comm)
            + f"{e.bytes_communicated / _GIB:>10.1f}{e.padding_ratio:>8.3%}"
        )
    lines.append("memory in GiB per rank (optim: AdamW state); collectives per iteration: count/"
                 "GiB of full buffers, and GiB one rank sends (ring); * = fewest sent that fits "
                 "the budget"
                 + (f" ({budget_gib} GiB)" if budget_gib is not None else ""))
    if best is None:
        lines.append(f"nothing fits {budget_gib} GiB")
    lines.append("not modelled: activations (and their recomputation), the model's non-parameter "
                 "buffers, framework/allocator overhead, gradient clipping's all-reduce")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from ._presets import PRESETS, build_preset

    parser = argparse.ArgumentParser(
        prog="python -m megatron_fsdp_v2.estimator",
        description="Per-rank memory and per-iteration collectives of every strategy, from the "
                    "library's own wrapping code under a fake process group (no GPU, no "
                    "allocation).")
    parser.add_argument("--model", choices=sorted(PRESETS), default="llama")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048, help="GPT position embeddings")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16",
                        help="compute dtype (main weights and gradients stay fp32)")
    parser.add_argument("--mesh", type=_parse_mesh, action="append", default=[],
                        help="also estimate HSDP on an RxS mesh (repeatable)")
    parser.add_argument("--budget-gib", type=float, default=None)
    args = parser.parse_args(argv)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32)
          if args.param_dtype == "bf16" else None)
    model_fn, block = build_preset(args)
    rows: list[tuple[str, Estimate]] = []
    common: dict[str, Any] = dict(world_size=args.world_size, wrap=(block,), mp_policy=mp,
                                  micro_batches=args.micro_batches, rank=args.rank)
    configs: list[tuple[str, tuple[int, int] | None, str]] = [
        (s, None, "no_shard") for s in STRATEGIES
    ]
    for mesh in args.mesh:  # outer no_shard under each inner strategy, then outer optim
        configs += [(s, mesh, "no_shard") for s in STRATEGIES]
        configs.append(("optim_grads_params", mesh, "optim"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # fully_shard's padding warnings: summarized below
        for strategy, mesh, outer in configs:
            est = estimate(model_fn, sharding_strategy=strategy, mesh_shape=mesh,
                           outer_dp_sharding_strategy=outer, **common)
            label = strategy
            if mesh is not None:
                label = f"hsdp {mesh[0]}x{mesh[1]} {strategy}"
                label += " +outer optim" if outer == "optim" else ""
            rows.append((label, est))
    params = sum(p.numel() for p in _count_model(model_fn))
    print(f"{args.model}: {params / 1e9:.2f}B parameters, world size {args.world_size}, "
          f"{args.micro_batches} micro-batch(es), {args.param_dtype} compute, rank {args.rank}")
    print(table(rows, args.budget_gib))
    padded = {str(w.message).split("'")[1] for w in caught if "padded" in str(w.message)}
    if padded:
        print(f"padding above max_padding_ratio in {len(padded)} parameter(s), e.g. "
              f"{sorted(padded)[0]!r}: rows too wide to shard evenly (see the pad column)")


def _count_model(model_fn: Callable[[], nn.Module]) -> list[torch.Tensor]:
    with torch.device("meta"):
        return list(model_fn().parameters())


if __name__ == "__main__":
    main()
