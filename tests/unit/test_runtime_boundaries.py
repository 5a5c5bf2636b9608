"""The schedule talks to a flat group, never to its parts: the hooks (``_state.py``,
``_unit_state.py``, ``_lazy_init.py``) and the tree's callbacks (``_context.py``,
``_finalize.py``) call
``FlatParamGroup`` methods (end of window, finish reductions, gather and free, what it holds),
and the group talks to its components, ``GroupGrads`` and ``ComputeWeights``. A reach into
``group.grads`` or ``group.weights`` from there would tie the schedule to a component's
internals again."""

from __future__ import annotations

import ast
import pathlib

import megatron_fsdp_v2

RUNTIME = pathlib.Path(megatron_fsdp_v2.__file__).parent / "_runtime"
SCHEDULE = ("_context.py", "_state.py", "_unit_state.py", "_lazy_init.py", "_finalize.py")


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


# The runtime's big objects, each one concept whose fields are read in one place: its
# ``__init__`` (issue 39). FSDPState is the hooks over UnitState's fields: it adds none.
ONE_PLACE = {
    "FlatParamGroup": ("_flat_param_group.py", None),
    "ComputeWeights": ("_compute_weights.py", None),
    "GroupGrads": ("_grads.py", None),
    "GradStaging": ("_grad_staging.py", None),
    "OptimizerGradViews": ("_grad_views.py", None),
    "UnitState": ("_unit_state.py", None),
    "FSDPState": ("_state.py", "UnitState"),
    "FSDPContext": ("_context.py", None),
}


def _class(name: str) -> ast.ClassDef:
    tree = ast.parse((RUNTIME / ONE_PLACE[name][0]).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _assigned_on_self(node: ast.AST) -> set[str]:
    found = set()
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            for leaf in ast.walk(target):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == "self"):
                    found.add(leaf.attr)
    return found


def _fields_and_members(name: str) -> tuple[set[str], set[str]]:
    """What ``__init__`` assigns on ``self`` (with the base's), and every name the class and
    its base define (methods, properties)."""
    cls = _class(name)
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    fields = _assigned_on_self(methods["__init__"]) if "__init__" in methods else set()
    members = set(methods)
    base = ONE_PLACE[name][1]
    if base is not None:
        base_fields, base_members = _fields_and_members(base)
        fields, members = fields | base_fields, members | base_members
    return fields, members


def test_fields_are_created_in_init() -> None:
    """No method creates a field its ``__init__`` does not, and nothing reads one that the class
    (or its one base) does not define: no mixin reaching for its host's fields."""
    problems = []
    for name in ONE_PLACE:
        fields, members = _fields_and_members(name)
        cls = _class(name)
        for method in cls.body:
            if isinstance(method, ast.FunctionDef) and method.name != "__init__":
                for attr in sorted(_assigned_on_self(method) - fields - members):
                    problems.append(f"{name}.{method.name} sets self.{attr}")
        for sub in ast.walk(cls):
            if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self" and sub.attr not in fields | members):
                problems.append(f"{name} reads self.{sub.attr}, defined elsewhere")
    assert not problems, problems
