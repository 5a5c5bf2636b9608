"""Every patch of torch the library makes, in one place: what is replaced, why, and how it is
undone. See design.md, "Patches of torch", for why each cannot use an extension point of torch
2.14.

Each patch module exposes ``install()`` (idempotent), ``uninstall()`` (puts the exact original
objects back; idempotent) and ``is_installed()``; :data:`PATCHES` lists them with a one-line
reason each. ``fully_shard`` calls :func:`install_all` (each wrap; only the first changes
anything); each installed patch registers its ``uninstall`` with ``_registry.reset`` (in
``_registry.reset_undos``). Nothing is patched at import time.

Before anything is changed, every install passes the torch-version gate
(``_version_gate.check_torch_version``): the patches rebind private torch functions and
op-table entries read on torch 2.14.x, so any other torch raises one ``RuntimeError`` naming the
running and tested versions and the fix (pin torch, or opt in with
``MEGATRON_FSDP_ALLOW_UNTESTED_TORCH=1``).

Dependency direction: this package holds only the mechanics (finding the targets, saving the
originals, rebinding, restoring; ``_patch.py``, ``_targets.py``, ``_op_handlers.py``). What a
replacement does lives with the layer it belongs to (``_dtensor/`` for DTensor and state-dict
paths, ``_runtime/`` for those that read records and for the clipping route) as plain
functions that take torch's original as their first argument. The patch modules import that
logic (at install time) and pass the originals in; the logic never imports this package and
holds no torch original of its own. So: ``_frontend._fully_shard`` ->
``_torch_patches`` -> replacement logic -> torch, and ``_registry.reset`` runs the undo each
installed patch registered with it (the registry sits below everything and imports nothing).

No other module of the package may assign to a torch module, class or op table
(``tests/unit/test_torch_patches.py`` scans the sources for it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import (
    _clip_grad,
    _copy_handler,
    _foreach_norm,
    _full_state_dict,
    _optim_state_dict,
    _random_ops,
    _redistribute,
)
from ._patch import Patch
from ._version_gate import ALLOW_UNTESTED_ENV, TESTED_TORCH, check_torch_version

__all__ = [
    "ALLOW_UNTESTED_ENV", "PATCHES", "TESTED_TORCH", "check_torch_version", "install_all",
    "suspended", "uninstall_all",
]

# Every patch, in install order (each has ``.name`` and ``.reason``, a one-line why).
PATCHES: tuple[Patch, ...] = (
    _redistribute.PATCH,  # redistribute_local_tensor (4 modules), OpDispatcher's local args
    _copy_handler.PATCH,  # DTensor op table: aten.copy_
    _foreach_norm.PATCH,  # DTensor op table: aten._foreach_norm.Scalar
    _random_ops.PATCH,  # DTensor op table: 10 in-place random ops
    _optim_state_dict.PATCH,  # checkpoint.state_dict._get_optim_state_dict
    _full_state_dict.PATCH,  # _state_dict_utils._distribute_state_dict / _distribute_tensors
    _clip_grad.PATCH,  # torch.nn.utils.clip_grad_norm_ (x2) / get_total_norm
)


def install_all() -> None:
    """Install every patch (those installed already stay as they are). The version gate runs
    once first, so an untested torch raises before anything is changed."""
    check_torch_version()
    for patch in PATCHES:
        patch.install()


def uninstall_all() -> None:
    """Put back every object any patch replaced, in reverse install order."""
    for patch in reversed(PATCHES):
        patch.uninstall()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """torch's own objects inside the block, whatever was installed before, which is put back
    after: what torch alone does, as a control beside the library (the tests' reference for the
    tensors the patches leave to torch)."""
    installed = [patch for patch in PATCHES if patch.is_installed()]
    uninstall_all()
    try:
        yield
    finally:
        for patch in installed:
            patch.install()
