"""Why each patch in ``megatron_fsdp_v2/_torch_patches`` exists, shown on the running torch.

design.md ("Patches of torch") gives, for every patch, the reason no extension point of torch
2.14 can do its job. Each test here runs the plain torch path the patch replaces (with every
patch uninstalled) and asserts the behavior or the missing hook that the reason names, on rank 1
of a fake world of 2 (one process, no collective runs). So the table's claims are checked, not
only written, and a torch that gains the extension point fails the test that names the patch
which may then go (the version gate in ``_torch_patches/_version_gate.py`` already refuses an
untested torch; these say where to look first).

The tests assert torch's behavior, not the library's: the library's fixes are tested by
``test_torch_patches.py`` and the distributed DTensor-path, random-init and state-dict tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp_v2 import _torch_patches

# Global shape (6, 4) on a world of 2. torch.chunk gives rank 1 rows [3, 6); a flat-buffer
# layout of the library can give it rows [4, 6) (two rows), as here.
GLOBAL = (6, 4)
OUR_ROWS = (4, 6)


def _may_go(patch: str, what: str) -> str:
    return (f"torch {torch.__version__} now {what}: the '{patch}' patch in "
            "megatron_fsdp_v2/_torch_patches may be removable; re-read its row in design.md "
            "('Patches of torch')")


@pytest.fixture(autouse=True)
def torch_own() -> Iterator[None]:
    """torch's own objects, whatever ran before in this process; the patches installed then are
    put back after."""
    with _torch_patches.suspended():
        yield


def _our_rows(mesh: DeviceMesh, local: torch.Tensor, placement: Shard | None = None) -> DTensor:
    """A DTensor over rows [4, 6) of the (6, 4) global tensor, as the library builds them."""
    return DTensor.from_local(local, mesh, (placement or Shard(0),), run_check=False,
                              shape=GLOBAL, stride=(GLOBAL[1], 1))


class _RowShard(Shard):
    """A placement carrying the true row boundaries, as a first-class uneven placement would."""

    def __init__(self, dim: int, boundaries: tuple[int, ...]) -> None:
        super().__init__(dim)
        self.boundaries = boundaries


# --- _redistribute (and why a placement cannot replace it or the op-table patches) ----------

def test_a_shard_subclass_is_lost_by_sharding_propagation(fake_mesh: DeviceMesh) -> None:
    """Sharding propagation rebuilds ``Shard`` subclasses as plain ``Shard(d)`` (torch 2.14:
    ``_ops/single_dim_strategy.py``, ``_fill_single_dim_strategy_placeholders``; only torch's own
    ``_StridedShard`` is kept), so a placement carrying our rows is gone from tensors derived
    from a parameter: every later ``full_tensor()`` of those would pad and unpad by
    ``torch.chunk`` sizes again. Which derivations lose it differs by release: 2.11 keeps it
    through ``detach``, ``clone``, ``zeros_like`` and ``nn.Parameter``, 2.13 through all but
    ``clone``, 2.14 and 2.15 through none; ``p * 2``, the pointwise path every optimizer update
    takes, loses it on every release in the range. The reason holds while any of them loses
    it."""
    p = _our_rows(fake_mesh, torch.ones(2, 4), _RowShard(0, (0, *OUR_ROWS)))
    assert type(p.placements[0]) is _RowShard
    derivations = {
        "detach": lambda t: t.detach(),
        "clone": lambda t: t.clone(),
        "mul": lambda t: t * 2,
        "zeros_like": torch.zeros_like,
        "nn.Parameter": nn.Parameter,
    }
    lost = sorted(name for name, derive in derivations.items()
                  if type(derive(p).placements[0]) is Shard)
    assert lost, _may_go("redistribute", f"keeps a Shard subclass through {sorted(derivations)}")
    assert "mul" in lost, lost


def test_same_dim_shard_to_shard_between_row_layouts_moves_nothing(fake_mesh: DeviceMesh) -> None:
    """Redistributing between two row layouts of the same tensor dimension is a no-op in
    ``redistribute_local_tensor``: the local rows come back as they are, whatever the target
    placement says."""
    p = _our_rows(fake_mesh, torch.ones(2, 4), _RowShard(0, (0, *OUR_ROWS)))
    moved = p.redistribute(fake_mesh, (_RowShard(0, (0, 3, 6)),))
    assert moved.to_local().data_ptr() == p.to_local().data_ptr(), _may_go(
        "redistribute", "moves rows between two Shard layouts of one dimension")


def test_distribute_tensor_cuts_a_shard_subclass_at_chunk_rows(fake_mesh: DeviceMesh) -> None:
    """``distribute_tensor`` (torch's full-state-dict loads cut with it) splits with
    ``Shard._make_shard_tensor``, a static method, and rebuilds ``Shard(d)``: a placement
    carrying our rows is neither asked nor kept (the fake world moves no data, so only the
    shapes are compared)."""
    from torch.distributed.tensor import distribute_tensor

    cut = distribute_tensor(torch.zeros(GLOBAL), fake_mesh, (_RowShard(0, (0, *OUR_ROWS)),))
    assert type(cut.placements[0]) is Shard and cut.to_local().shape == (3, 4), _may_go(
        "full_state_dict", "distributes by a Shard subclass's own rows")


def test_full_tensor_assumes_torch_chunk_rows(fake_mesh: DeviceMesh) -> None:
    """The local shape and offset DTensor computes for a ``Shard(0)`` rank come from the
    placement and the global shape only (``torch.chunk``): rank 1 of 6 rows is (3, 4) at row 3,
    though this DTensor holds rows [4, 6). Redistribution pads and unpads by these sizes."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    p = _our_rows(fake_mesh, torch.ones(2, 4))
    shape, offset = compute_local_shape_and_global_offset(p.shape, fake_mesh, p.placements)
    assert (tuple(shape), tuple(offset)) == ((3, 4), (3, 0)), _may_go(
        "redistribute", f"computes the local shape {tuple(shape)} at {tuple(offset)}")
    assert p.to_local().shape[0] != shape[0]


# --- _copy_handler -----------------------------------------------------------------------

def test_copy_between_equal_placements_is_local(fake_mesh: DeviceMesh) -> None:
    """``dst.copy_(src)`` with equal placements copies the local tensors, whatever rows each
    holds: one source row is broadcast over three destination rows, silently."""
    dst = _our_rows(fake_mesh, torch.zeros(3, 4))
    src = _our_rows(fake_mesh, torch.arange(4.0).view(1, 4))
    dst.copy_(src)
    assert torch.equal(dst.to_local(), torch.arange(4.0).expand(3, 4)), _may_go(
        "copy_handler", "compares the row layouts of copy_'s operands")


# --- _foreach_norm -----------------------------------------------------------------------

def test_infinity_norm_of_an_empty_local_shard_raises(fake_mesh: DeviceMesh) -> None:
    """DTensor has no ``_foreach_norm`` handler of its own, so the local op runs on each
    rank's rows, and the infinity norm of zero rows raises on that rank only."""
    assert torch.ops.aten._foreach_norm.Scalar not in DTensor._op_dispatcher._custom_op_handlers
    empty = _our_rows(fake_mesh, torch.empty(0, 4))
    with pytest.raises(RuntimeError, match="infinity norm on an empty tensor"):
        torch._foreach_norm([empty], math.inf)


# --- _random_ops ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")
def test_random_init_of_uneven_rows_is_not_the_single_process_draw(fake_mesh: DeviceMesh) -> None:
    """On a CPU fake_mesh DTensor has no offset RNG (``is_rng_supported_mesh`` is false), so
    ``nn.init.normal_`` draws each rank's rows from the start of its own generator; where it has
    one (CUDA) it places draws at ``torch.chunk`` offsets. Neither gives rows [4, 6) of the
    single-process draw."""
    from torch.distributed.tensor._random import is_rng_supported_mesh

    assert not is_rng_supported_mesh(fake_mesh), _may_go("random_ops", "has an RNG for CPU meshes")
    torch.manual_seed(0)
    single_process = torch.empty(GLOBAL).normal_()
    torch.manual_seed(0)
    first_draws = torch.empty(2, 4).normal_()
    p = _our_rows(fake_mesh, torch.empty(2, 4))
    torch.manual_seed(0)
    nn.init.normal_(p)
    assert torch.equal(p.to_local(), first_draws)
    assert not torch.equal(p.to_local(), single_process[OUR_ROWS[0]:OUR_ROWS[1]])


# --- _optim_state_dict: the optimizer's hooks -----------------------------------------------

def test_optimizer_hooks_cannot_see_state_dict_options(fake_mesh: DeviceMesh) -> None:
    """The optimizer's state-dict hooks receive the optimizer only, so inside
    ``get_optimizer_state_dict`` nothing tells them ``full_state_dict=True`` (where the
    cross-rank check must run before torch's first gather)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[tuple[Any, ...]] = []
    optimizer.register_state_dict_pre_hook(lambda *args: calls.append(args))
    get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    assert calls and all(args == (optimizer,) for args in calls), _may_go(
        "optim_state_dict", "passes more than the optimizer to its state-dict hooks")


# --- _full_state_dict ---------------------------------------------------------------------

def test_full_state_dict_load_cuts_at_chunk_rows_before_any_hook(fake_mesh: DeviceMesh) -> None:
    """``set_model_state_dict(..., full_state_dict=True)`` cuts each full tensor at
    ``torch.chunk`` rows (``distribute_tensor``) before the module's load hooks run: the entry
    the pre-hook sees holds the three rows [3, 6), not the parameter's two, [4, 6) (the fake
    world moves no data, so only the shape is compared)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = nn.Linear(4, 6, bias=False)
    model.weight = nn.Parameter(_our_rows(fake_mesh, torch.zeros(2, 4)))
    seen: list[torch.Tensor] = []

    def pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        seen.append(state_dict[prefix + "weight"].to_local())

    model._register_load_state_dict_pre_hook(pre_hook, with_module=True)
    full = torch.arange(24.0).view(GLOBAL)
    with pytest.raises(RuntimeError, match="size of tensor"):
        set_model_state_dict(model, {"weight": full},
                             options=StateDictOptions(full_state_dict=True))
    assert len(seen) == 1 and seen[0].shape == full[3:6].shape, _may_go(
        "full_state_dict", "hands the load hooks something other than torch.chunk rows")


# --- _clip_grad: plain functions with no dispatch point -------------------------------------

class _Recorder(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` notes every function it is offered."""

    offered: list[str] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.offered.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_clip_grad_norm_offers_no_dispatch_point() -> None:
    """``clip_grad_norm_`` and ``get_total_norm`` are plain functions: a gradient's
    ``__torch_function__`` sees the ops inside them, never the call itself, and ``None``
    gradients are dropped before any op (a rank whose gradient is ``None`` issues fewer
    collectives than the others)."""
    _Recorder.offered.clear()
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    used.grad = torch.full((3,), 2.0).as_subclass(_Recorder)
    total = torch.nn.utils.clip_grad_norm_([used, unused], max_norm=1e9)
    assert math.isclose(float(total), math.sqrt(12.0), rel_tol=1e-6)
    offered = set(_Recorder.offered)
    assert offered and not offered & {"clip_grad_norm_", "get_total_norm"}, _may_go(
        "clip_grad_norm", "dispatches clip_grad_norm_/get_total_norm to tensor subclasses")
