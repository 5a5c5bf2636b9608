"""The package's layers, read from its imports (design.md §1, "Layers").

Every module's imports are parsed with ``ast``: module-level ones and those inside functions
(``if TYPE_CHECKING:`` blocks aside, they run in no process). Three rules are checked against
them, and design.md's diagram against the same layer order:

(a) imports point down the layers, never up, but for the exceptions listed in
    ``UPWARD_EXCEPTIONS``, each with its reason;
(b) no cycle of imports (one closed only by a function-level import is still a cycle: the
    modules on it cannot be read or tested apart);
(c) ``_registry`` (process-wide state) is imported only by the entry points that own state
    (``REGISTRY_IMPORTERS``); the layers below them take the values they need as arguments.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
from collections import defaultdict
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "megatron_fsdp_v2"
PACKAGE = "megatron_fsdp_v2"

# The layers, top first: a module may import its own layer's modules and those of the layers
# below it. Each entry names the package's top-level folders and modules of that layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("public", ("__init__", "optim", "utils", "checkpoint", "estimator", "testing")),
    ("frontend", ("_frontend",)),
    ("patches", ("_torch_patches",)),
    ("runtime", ("_runtime",)),
    ("init", ("_init",)),
    ("dtensor", ("_dtensor",)),
    ("buffers", ("_buffers",)),
    ("comm", ("_comm",)),
    ("ops", ("ops",)),
    ("base", ("api", "_registry", "_profiling")),
)

# (importer, imported) -> why this import points up. Module names are relative to the package.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}

# Imports that close a cycle, allowed for now: (importer, imported) -> why.
CYCLE_EXCEPTIONS: dict[tuple[str, str], str] = {}

# The modules that may import ``_registry``: entry points, each called by the user or by torch
# (an API function, a hook, an optimizer step hook), that own the process-wide state they read.
REGISTRY_IMPORTERS: frozenset[str] = frozenset({
    "utils", "testing._pool", "_torch_patches._patch",
    "checkpoint", "checkpoint._experts", "checkpoint._full_state_dict", "checkpoint._process_group",
    "checkpoint._streaming",
    "estimator._estimate",
    "_frontend._fsdp2_compat", "_frontend._fsdp2_surface", "_frontend._fsdp_module",
    "_frontend._module_lists", "_frontend._param_classes", "_frontend._pipelining",
    "_frontend._wiring", "_frontend._wrap_checks", "_frontend._wrap_options",
    "_runtime._expert_names", "_runtime._lazy_init", "_runtime._memory",
    "_runtime._module_tree", "_runtime._muon", "_runtime._optimizer_hooks",
    "_runtime._optimizer_local", "_runtime._state_dict_hooks", "_runtime._whole_matrices",
    "_runtime._optim_state_check", "_runtime._torch_full_state_dict", "_runtime._clipping",
    "_runtime._clip_route",
})

# Importers of ``_registry`` below the entry points, each with why it cannot be handed its value
# (yet): module -> reason. Most own one piece of process-wide state, kept in the registry so
# that ``reset()`` forgets it; the others read what changes after wrapping, at hook time.
REGISTRY_EXCEPTIONS: dict[str, str] = {
    "_runtime._registered_params": (
        "its checks at each hook read which modules a unit owns and which parameters are "
        "managed, which change as the user wraps more modules (owned_modules, record_of)"
    ),
    "_runtime._subclass_gather": (
        "an all-gather extension's (FP8) gather rebuilds a compute parameter object and "
        "registers it as its record's new compute face"
    ),
    "_init._materialize": (
        "owns the meta-device units waiting for values (adopted at wrap time, materialized by "
        "the units' state-dict hooks or the first forward)"
    ),
    "_init._conversions": "owns the depth of .to()/.to_empty() conversions in progress",
    "_dtensor._uneven_meshes": (
        "owns the meshes of units (the frontend registers them; torch's patched DTensor paths "
        "ask this module, the one reader of that list)"
    ),
    "_comm._process_groups": (
        "owns the cache of the library's process groups and default meshes (one per process)"
    ),
    "_comm._collectives": "owns the cache of CUDA side streams, one set per device",
    "_comm._arrival": (
        "owns the arrival counts of calls (kept across reset: torch's store keys outlive it)"
    ),
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    in_function: bool
    line: int


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             modules: dict[str, pathlib.Path]) -> list[str]:
    """The package's modules an import statement reads (``from x import name`` reads
    ``x.name`` when that is a module, else ``x``)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = ([PACKAGE] + importer.split(".")) if importer != "__init__" else [PACKAGE]
            if not is_package:
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        for alias in node.names:
            candidate = f"{module}.{alias.name}"
            names.append(candidate if _relative(candidate) in modules else module)
    found = []
    for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            relative = _relative(name)
            while relative not in modules and "." in relative:
                relative = relative.rsplit(".", 1)[0]
            if relative in modules:
                found.append(relative)
    return found


def _relative(name: str) -> str:
    return "__init__" if name == PACKAGE else name.removeprefix(PACKAGE + ".")


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(sources: dict[str, str] | None = None) -> list[Import]:
    """Every import of the package's modules (or of ``sources``: module name -> text)."""
    if sources is None:
        return list(_package_imports())
    return _parse(sources)


@functools.lru_cache(maxsize=1)
def _package_imports() -> tuple[Import, ...]:
    return tuple(_parse(None))


def _parse(sources: dict[str, str] | None) -> list[Import]:
    modules = _modules()
    found: list[Import] = []
    for name, path in modules.items():
        if sources is not None and name not in sources:
            continue
        text = sources[name] if sources is not None else path.read_text()
        tree = ast.parse(text, str(path))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool, importer: str = name,
                  is_package: bool = is_package) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for orelse in child.orelse:
                        visit(ast.Module(body=[orelse], type_ignores=[]), in_function)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, importer, is_package, modules):
                        if target != importer:
                            found.append(Import(importer, target, in_function, child.lineno))
                visit(child, in_function or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
    return found


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for index, (_, members) in enumerate(LAYERS):
        if top in members:
            return index
    raise AssertionError(f"module {module!r} is in no layer of LAYERS; add its folder")


def test_every_module_has_a_layer() -> None:
    for module in _modules():
        _layer(module)


def test_imports_point_down() -> None:
    upward = set()
    for imp in _imports():
        if _layer(imp.imported) < _layer(imp.importer):
            upward.add((imp.importer, imp.imported))
    unexpected = sorted(upward - UPWARD_EXCEPTIONS.keys())
    assert not unexpected, (
        f"imports pointing up the layers (design.md §1): {unexpected}; pass the value down as "
        "an argument instead, or move the code to the layer it belongs to"
    )
    stale = sorted(UPWARD_EXCEPTIONS.keys() - upward)
    assert not stale, f"listed upward imports that no longer exist (remove them): {stale}"


def _cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in edges:
        graph[imp.importer].add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(_modules()):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_no_import_cycle() -> None:
    imports = _imports()
    present = {(i.importer, i.imported) for i in imports}
    stale = sorted(CYCLE_EXCEPTIONS.keys() - present)
    assert not stale, f"listed cycle-closing imports that no longer exist (remove them): {stale}"
    cycles = _cycles([i for i in imports if (i.importer, i.imported) not in CYCLE_EXCEPTIONS])
    assert not cycles, (
        "modules that import each other (through function-level imports too): "
        f"{cycles}; break the cycle by passing a value down or by moving code"
    )


def test_cycle_finder_finds_a_cycle() -> None:
    # The checker itself: a closed chain through a function-level import is found.
    edges = [Import("_registry", "_torch_patches", True, 1),
             Import("_torch_patches", "_dtensor._copy_rows", True, 1),
             Import("_dtensor._copy_rows", "_registry", False, 1)]
    assert _cycles(edges) == [["_dtensor._copy_rows", "_registry", "_torch_patches"]]


def test_registry_imported_by_entry_points_only() -> None:
    importers = {imp.importer for imp in _imports() if imp.imported == "_registry"}
    unexpected = sorted(importers - REGISTRY_IMPORTERS - REGISTRY_EXCEPTIONS.keys())
    assert not unexpected, (
        f"modules below the entry points importing _registry: {unexpected}; take the value as "
        "an argument from the entry point that owns the state"
    )
    stale = sorted(REGISTRY_EXCEPTIONS.keys() - importers)
    assert not stale, f"listed registry importers that no longer import it (remove them): {stale}"


def _diagram() -> str:
    text = (ROOT / "design.md").read_text()
    start = text.index("## 1. Layers")
    begin = text.index("```", start) + 3
    return text[begin:text.index("```", begin)]


def test_design_diagram_lists_the_layers_in_order() -> None:
    # Entries at the diagram's left margin name top-level folders and modules, top layer first.
    order = []
    for line in _diagram().splitlines():
        if not line or line[0] == " ":
            continue
        for entry in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)(?:\.py|/)", line.split("  ")[0]):
            layer = _layer(entry)
            if not order or order[-1] != layer:
                order.append(layer)
    assert order == sorted(set(order)) == list(range(len(LAYERS))), (
        "design.md's diagram (§1) should list the layers top first, as tests/unit/"
        f"test_layers.py's LAYERS: got {[LAYERS[i][0] for i in order]}"
    )


_CORE_FOLDERS = ("_frontend", "_runtime", "_init", "_dtensor", "_buffers", "_comm")


def test_design_diagram_names_every_core_module() -> None:
    diagram = _diagram()
    named = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\.py", diagram))
    missing = sorted(
        module for module, path in _modules().items()
        if module.split(".")[0] in _CORE_FOLDERS
        and path.name != "__init__.py" and path.stem not in named
    )
    assert not missing, f"modules design.md's diagram (§1) does not name: {missing}"


def test_reads_function_level_and_skips_type_checking() -> None:
    # The parser itself: relative and absolute forms, imports inside functions, and
    # TYPE_CHECKING blocks skipped.
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .. import _registry\n"
        "from .._comm._collectives import broadcast_from_first\n"
        "import megatron_fsdp_v2.api\n"
        "if TYPE_CHECKING:\n"
        "    from .._runtime._flat_param_group import FlatParamGroup\n"
        "def f():\n"
        "    from .._frontend import _module_lists\n"
    )
    found = {(i.imported, i.in_function) for i in _imports({"_init._materialize": source})}
    assert found == {("_registry", False), ("_comm._collectives", False), ("api", False),
                     ("_frontend._module_lists", True)}
