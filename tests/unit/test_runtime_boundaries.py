"""The schedule talks to a flat group, never to its parts: the hooks (``_state.py``,
``_unit_state.py``, ``_lazy_init.py``) and the tree's callbacks (``_context.py``) call
``FlatParamGroup`` methods (end of window, finish reductions, gather and free, what it holds),
and the group talks to its components, ``GroupGrads`` and ``ComputeWeights``. A reach into
``group.grads`` or ``group.weights`` from there would tie the schedule to a component's
internals again."""

from __future__ import annotations

import ast
import pathlib

import megatron_fsdp_v2

RUNTIME = pathlib.Path(megatron_fsdp_v2.__file__).parent / "_runtime"
SCHEDULE = ("_context.py", "_state.py", "_unit_state.py", "_lazy_init.py")


COMPONENTS = frozenset({"grads", "weights"})  # FlatParamGroup's


def _reaches_into_components(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in COMPONENTS:
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_schedule_talks_only_to_flat_groups() -> None:
    reaches = [line for name in SCHEDULE for line in _reaches_into_components(RUNTIME / name)]
    assert not reaches, (
        "the schedule reaches into a group's GroupGrads or ComputeWeights; give FlatParamGroup "
        f"the method instead: {reaches}")
