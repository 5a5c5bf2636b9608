"""Host-sync audit: no steady-state training step waits for the GPU on the host.

After warm-up steps (the first forward records the prefetch order, the trace pool plans at the
second step's boundary), two more steps run under ``torch.cuda.set_sync_debug_mode("error")``:
any operation that makes the CPU wait for the GPU (``.item()``, ``bool(tensor)``,
``.tolist()``, ``.cpu()``, ``nonzero``, a stream or device synchronize) raises there. Every
strategy, plain fp32 and bf16 + trace pool + buckets + activation checkpointing, after
``zero_grad(set_to_none=True)`` and after ``zero_grad(set_to_none=False)``. The step itself
makes no host sync either (losses stay on the device).

On CPU (the dry run) nothing synchronizes, so a ``TorchDispatchMode`` counts the operations that
would on CUDA (``_local_scalar_dense``: ``.item()``, ``bool()``, ``int()``; ``nonzero``,
``equal``, ...), except on the optimizer's ``step`` counters, which stay on the CPU under CUDA
too (AdamW without ``capturable``).

    python scripts/gpu_checks/sync_audit.py --device cuda
    python scripts/gpu_checks/sync_audit.py --device cpu
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import _common as c
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Operators whose CUDA kernels copy a device value to the host and wait for it.
_SYNCING = {
    aten._local_scalar_dense, aten.nonzero, aten.equal, aten.is_nonzero, aten.masked_select,
    aten._unique2, aten.unique_consecutive, aten.unique_dim, aten.repeat_interleave,
}
_LIBRARY = os.sep + "megatron_fsdp_v2" + os.sep


def _where() -> str:
    """The innermost library frame of the current stack (else the innermost frame)."""
    frames = traceback.extract_stack()[:-2]
    for frame in reversed(frames):
        if _LIBRARY in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"


class HostSyncCounter(TorchDispatchMode):
    """Records every operator call that would synchronize on CUDA, with where it came from."""

    def __init__(self, exempt: set[int]) -> None:
        super().__init__()
        self.exempt = exempt  # data_ptrs of CPU-resident scalars (optimizer step counters)
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func.overloadpacket in _SYNCING:
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and first.data_ptr() in self.exempt):
                self.found.append(f"{func.overloadpacket.__name__} at {_where()}")
        return func(*args, **(kwargs or {}))


def _step_counters(optimizer: torch.optim.Optimizer) -> set[int]:
    ptrs = set()
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            local = step.to_local() if hasattr(step, "to_local") else step
            ptrs.add(local.data_ptr())
    return ptrs


@contextmanager
def _audited(device: torch.device, optimizer: torch.optim.Optimizer) -> Iterator[list[str]]:
    """Yield a list that holds, afterwards, every host sync found inside the block."""
    found: list[str] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield found
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            found.append(f"{str(e).splitlines()[0]} at {_where_from(e)}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        counter = HostSyncCounter(_step_counters(optimizer))
        with counter:
            yield found
        found += counter.found


def _where_from(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if _LIBRARY in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "(no library frame)"


def main() -> None:
    args = c.parse_args(__doc__ or "", [
        ("--warmup", {"type": int, "default": 3}),
        ("--steps", {"type": int, "default": 2}),
        ("--strategies", {"default": ",".join(c.STRATEGIES)}),
        ("--self-test", {"action": "store_true",
                         "help": "inject a bool(tensor) into every collective launch: must fail"}),
    ])
    device = c.setup_device(args.device)
    failures: list[str] = []
    with c.single_rank_group(device):
        if args.self_test:
            _inject_sync()
        for strategy in args.strategies.split(","):
            for config in c.CONFIGS:
                for set_to_none in (True, False):
                    label = f"{strategy} {config.name} zero_grad(set_to_none={set_to_none})"
                    try:
                        found = _audit(strategy, config, device, set_to_none, args)
                    except Exception as e:  # noqa: BLE001 - one line per failing case
                        found = [f"{type(e).__name__}: {e}"]
                    if found:
                        unique = sorted(set(found))
                        failures.append(f"{label}: {len(found)} host syncs: {'; '.join(unique)}")
                        print(f"[sync_audit] {label}: FAILED, {len(found)} host syncs")
                    else:
                        print(f"[sync_audit] {label}: no host sync in {args.steps} steps")
    c.finish("sync_audit", failures)


def _audit(strategy: str, config: c.Config, device: torch.device, set_to_none: bool,
           args: Any) -> list[str]:
    model, _ = c.build(strategy, config, device)
    optimizer = c.make_optimizer(model)
    batches = c.make_batches(args.warmup + args.steps, 2, 1, device)
    for step in batches[:args.warmup]:
        c.train_step(model, optimizer, [m[0] for m in step], set_to_none=set_to_none)
    with _audited(device, optimizer) as found:
        for step in batches[args.warmup:]:
            c.train_step(model, optimizer, [m[0] for m in step], set_to_none=set_to_none)
    c.synchronize(device)
    return found


def _inject_sync() -> None:
    """Self-test: a host sync inside the library's step (what the audit exists to catch)."""
    from megatron_fsdp_v2._runtime import _issuer

    original = _issuer.GroupIssuer.launch

    def launch(self, collective, *a, **k):  # type: ignore[no-untyped-def]
        bool(collective.full.any())
        return original(self, collective, *a, **k)

    _issuer.GroupIssuer.launch = launch  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
