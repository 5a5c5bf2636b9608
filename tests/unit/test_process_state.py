"""Process-wide state lives in ``_registry.py`` (design.md §1 "Process-wide state"), so that one
``_registry.reset()`` forgets all of it: no other module of the package creates, at import, an
empty container or a mutable cell that it fills later."""

from __future__ import annotations

import ast
import pathlib

import megatron_fsdp_v2
from megatron_fsdp_v2 import _registry

PACKAGE = pathlib.Path(megatron_fsdp_v2.__file__).parent

# The registry itself; the patches of torch (_torch_patches/), each of which keeps the
# originals it saved and is undone by the uninstall_all() that _registry.reset() calls; and the
# test harness (testing/), whose configuration (what its fork server preloads) is no library
# state: tests reset the library between cases while the session's pools live on.
EXEMPT = {"_registry.py"}
EXEMPT_PACKAGES = {"_torch_patches", "testing"}
_CONTAINERS = {
    "dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakSet",
    "WeakValueDictionary", "WeakIdKeyDictionary",
}


def _is_mutable_state(value: ast.expr | None) -> bool:
    """An empty container (literal or constructor call) or a one-element list used as a cell."""
    if isinstance(value, ast.Dict):  # (a set literal is never empty: set() is a call)
        return not value.keys
    if isinstance(value, ast.List):
        return len(value.elts) <= 1
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in _CONTAINERS
    return False


def _module_state(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if any(n != "__all__" for n in names) and _is_mutable_state(value):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {', '.join(names)}")
    return found


def test_process_wide_state_lives_in_registry() -> None:
    offenders = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in EXEMPT
        and path.relative_to(PACKAGE).parts[0] not in EXEMPT_PACKAGES
        for line in _module_state(path)
    ]
    assert not offenders, f"module-level state outside _registry.py: {offenders}"


def test_scan_sees_registry_state() -> None:
    """The scan recognizes the kinds of state the registry holds (else the test above proves
    nothing)."""
    found = _module_state(PACKAGE / "_registry.py")
    for name in ("process_groups", "uneven_meshes", "pending_meta_units", "applying_depth",
                 "local_step_swaps", "local_step_restore_hooked", "optimizer_state_dict_hooked"):
        assert any(line.endswith(f" {name}") for line in found), (name, found)


def test_reset_forgets_meta_units_conversions_and_local_step_caches() -> None:
    import torch

    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    _registry.pending_meta_units[module] = object()  # type: ignore[assignment]
    _registry.applying_depth[0] = 2
    _registry.local_step_restore_hooked.add(optimizer)
    _registry.local_step_positions[optimizer] = object()  # type: ignore[assignment]
    _registry.local_step_swaps[optimizer] = object()  # type: ignore[assignment]
    _registry.meta_buffers[0] = True
    _registry.reset()
    assert not _registry.pending_meta_units and _registry.applying_depth == [0]
    assert not _registry.local_step_restore_hooked and not _registry.local_step_positions
    assert not _registry.local_step_swaps and _registry.meta_buffers == [False]
