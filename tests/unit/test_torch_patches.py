"""Every patch of torch lives in ``megatron_fsdp_v2/_torch_patches`` and is undone exactly: the
first ``fully_shard`` replaces the torch objects listed here, ``_registry.reset`` (and
``uninstall_all``) puts the very same objects back, installing twice changes nothing, an untested
torch version is refused before anything changes, and no other module of the package assigns to
a torch module, class or op table."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import megatron_fsdp_v2
from megatron_fsdp_v2.testing import run_distributed

PACKAGE = Path(megatron_fsdp_v2.__file__).parent
PATCHES_DIR = PACKAGE / "_torch_patches"
_ABSENT = "<absent>"


def _torch_objects() -> dict[str, Any]:
    """Every torch object the library patches, read straight from torch (not from the patch
    modules, so a patch that forgets one of its targets still shows here)."""
    import torch.distributed.checkpoint.state_dict as dsd
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad
    from torch.distributed import _state_dict_utils as utils
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dispatch import OpDispatcher

    found: dict[str, Any] = {}
    for name in ("_redistribute", "_api", "_dispatch", "experimental._tp_transform"):
        module = importlib.import_module(f"torch.distributed.tensor.{name}")
        found[f"{name}.redistribute_local_tensor"] = vars(module)["redistribute_local_tensor"]
    found["OpDispatcher.redistribute_local_args"] = vars(OpDispatcher)["redistribute_local_args"]
    aten = torch.ops.aten
    table = DTensor._op_dispatcher._custom_op_handlers
    for op in (aten.copy_.default, aten.normal_.default, aten.uniform_.default,
               aten.bernoulli_.float, aten.exponential_.default, aten.log_normal_.default,
               aten.cauchy_.default, aten.geometric_.default, aten.random_.default,
               getattr(aten.random_, "from"), aten.random_.to):
        found[f"op table {op}"] = table.get(op, _ABSENT)
    found["dsd._get_optim_state_dict"] = dsd._get_optim_state_dict
    found["dsd._load_model_state_dict"] = dsd._load_model_state_dict
    for name in ("_distribute_state_dict", "_distribute_tensors"):
        found[f"_state_dict_utils.{name}"] = vars(utils)[name]
        if name in vars(dsd):  # imported by name there (_distribute_state_dict on 2.14)
            found[f"dsd.{name}"] = vars(dsd)[name]
    found["clip_grad.clip_grad_norm_"] = clip_grad.clip_grad_norm_
    found["nn.utils.clip_grad_norm_"] = nn_utils.clip_grad_norm_
    found["nn.utils.get_total_norm"] = nn_utils.get_total_norm
    return found


def _torch_objects_left_alone() -> dict[str, Any]:
    """torch objects earlier versions of the library patched and that it must now leave as
    torch's (issue 35: the conveniences go through public hooks or go)."""
    return {"Optimizer.zero_grad": vars(torch.optim.Optimizer)["zero_grad"],
            "torch.autograd.grad": torch.autograd.grad}


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if a[k] is not b[k]]


def _patch_lifecycle_worker(rank: int, world_size: int) -> list[str]:
    """Problems found (empty: all good)."""
    import torch.nn as nn

    from megatron_fsdp_v2 import _registry, _torch_patches, fully_shard

    problems: list[str] = []
    original = _torch_objects()
    fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    patched = _torch_objects()
    problems += [f"not patched by fully_shard: {k}" for k in original
                 if patched[k] is original[k]]
    problems += [f"{p.name} not installed" for p in _torch_patches.PATCHES
                 if not p.is_installed()]
    fully_shard(nn.Linear(4, 4))  # a second wrap installs nothing new
    _torch_patches.install_all()
    problems += [f"reinstall replaced {k}" for k in _same(patched, _torch_objects())]
    _registry.reset()
    problems += [f"reset left {k} patched" for k in _same(original, _torch_objects())]
    problems += [f"{p.name} installed after reset" for p in _torch_patches.PATCHES
                 if p.is_installed()]
    _torch_patches.uninstall_all()  # idempotent
    problems += [f"second uninstall changed {k}" for k in _same(original, _torch_objects())]
    _torch_patches.install_all()
    again = _torch_objects()
    problems += [f"not patched by install_all: {k}" for k in original
                 if again[k] is original[k]]
    _torch_patches.uninstall_all()
    problems += [f"uninstall_all left {k} patched" for k in _same(original, _torch_objects())]
    return problems


def test_fully_shard_patches_and_reset_restores_the_originals() -> None:
    assert run_distributed(_patch_lifecycle_worker, 1, timeout_s=120) == [[]]


def _left_alone_worker(rank: int, world_size: int) -> list[str]:
    import torch.nn as nn

    from megatron_fsdp_v2 import _torch_patches, fully_shard

    original = _torch_objects_left_alone()
    model = fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    _torch_patches.install_all()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return [f"replaced: {k}" for k in _same(original, _torch_objects_left_alone())]


def test_fully_shard_leaves_zero_grad_and_autograd_grad_to_torch() -> None:
    """No patch of ``Optimizer.zero_grad``: a wrapped optimizer's ``zero_grad`` is torch's own
    (what it did is taken in without a host read: ``tests/distributed/test_host_syncs.py``).
    No patch of ``torch.autograd.grad``: with respect to our parameters it behaves as under
    FSDP2 (``tests/distributed/test_misuse_errors.py``)."""
    assert run_distributed(_left_alone_worker, 1, timeout_s=120) == [[]]


def test_import_patches_nothing(fresh_python) -> None:
    code = (
        "import tests.unit.test_torch_patches as t\n"
        "before = t._torch_objects()\n"
        "import megatron_fsdp_v2, megatron_fsdp_v2._torch_patches\n"
        "assert not t._same(before, t._torch_objects())\n"
    )
    fresh_python.run(code, cwd=str(PACKAGE.parent))


def test_version_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn as nn

    from megatron_fsdp_v2 import _torch_patches, fully_shard

    monkeypatch.delenv(_torch_patches.ALLOW_UNTESTED_ENV, raising=False)
    original = _torch_objects()
    monkeypatch.setattr(torch, "__version__", "2.16.0+cu130")
    with pytest.raises(RuntimeError) as error:
        _torch_patches.install_all()
    message = str(error.value)
    for part in ("2.16.0+cu130", "2.11.x to 2.15.x", "MEGATRON_FSDP_ALLOW_UNTESTED_TORCH=1",
                 "torch>=2.11,<2.16"):
        assert part in message, (part, message)
    with pytest.raises(RuntimeError, match="2.16.0"):
        _torch_patches.PATCHES[0].install()
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="2.16.0"):  # before any process group is needed
        fully_shard(model)
    assert type(model) is nn.Linear
    assert not _same(original, _torch_objects())
    assert not any(p.is_installed() for p in _torch_patches.PATCHES)

    monkeypatch.setenv(_torch_patches.ALLOW_UNTESTED_ENV, "1")
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            _torch_patches.install_all()
        assert all(p.is_installed() for p in _torch_patches.PATCHES)
    finally:
        _torch_patches.uninstall_all()
    assert not _same(original, _torch_objects())

    monkeypatch.delenv(_torch_patches.ALLOW_UNTESTED_ENV)
    for admitted in ("2.11.0", "2.12.1", "2.13.0+cpu", "2.14.0a0+git1234", "2.15.0+cu130"):
        monkeypatch.setattr(torch, "__version__", admitted)
        _torch_patches.check_torch_version()  # any build of a release in the range passes
    for refused in ("2.10.0", "2.16.0a0+git1234", "3.0.0"):
        monkeypatch.setattr(torch, "__version__", refused)
        with pytest.raises(RuntimeError, match=refused.replace("+", r"\+")):
            _torch_patches.check_torch_version()


# --- the op table changes at install and uninstall only -------------------------------------

class _RecordingTable(dict):
    """DTensor's op table, noting every change made while ``recording``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.recording = False
        self.changes: list[str] = []

    def _note(self, what: str, key: Any) -> None:
        if self.recording:
            self.changes.append(f"{what} {key}")

    def __setitem__(self, key: Any, value: Any) -> None:
        self._note("set", key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._note("del", key)
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self._note("pop", key)
        return super().pop(key, *default)

    def popitem(self) -> Any:
        self._note("popitem", "")
        return super().popitem()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._note("setdefault", key)
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._note("update", "")
        super().update(*args, **kwargs)

    def clear(self) -> None:
        self._note("clear", "")
        super().clear()


def _op_table_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Every op whose handler falls back to DTensor's own path (DTensors on a mesh no unit
    uses): the result is DTensor's, and the table is not changed during the call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from megatron_fsdp_v2 import _torch_patches

    dispatcher = DTensor._op_dispatcher
    original = dispatcher._custom_op_handlers
    table = _RecordingTable(original)
    dispatcher._custom_op_handlers = table
    try:
        _torch_patches.install_all()
        handlers = {str(op): getattr(h, "__name__", "") for op, h in table.items()}
        mesh = init_device_mesh("cpu", (world_size,))
        full = torch.arange(24.0).view(6, 4)
        dst = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
        src = distribute_tensor(full, mesh, [Replicate()])
        noise = distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()])
        table.recording = True
        dst.copy_(src)  # redistributed Replicate -> Shard(0), then a local copy
        torch.manual_seed(0)
        torch.nn.init.uniform_(noise)
        (norm,) = torch._foreach_norm([dst], 2.0)
        table.recording = False
        torch.manual_seed(0)
        return {
            "changes": table.changes,
            "handlers": handlers,
            "copy": torch.equal(dst.full_tensor(), full),
            "uniform": torch.equal(noise.full_tensor(), torch.rand(6, 4)),
            "norm": isinstance(norm, DTensor)
            and torch.allclose(norm.full_tensor(), full.norm()),
        }
    finally:
        _torch_patches.uninstall_all()
        dispatcher._custom_op_handlers = original


def test_op_handlers_do_not_change_the_op_table_on_a_call() -> None:
    """The handlers' fallback to DTensor's own path (``copy_``, a random op and
    ``_foreach_norm`` on DTensors of a mesh no unit uses) gives DTensor's results and leaves
    the table as installed during the call ([Note: falling back to DTensor's own handling of
    an op])."""
    (result,) = run_distributed(_op_table_worker, 1, timeout_s=120)
    assert result["handlers"]["aten.copy_.default"].startswith("megatron_fsdp_v2_"), result
    assert not result["changes"], f"the op table changed during a call: {result['changes']}"
    assert result["copy"] and result["uniform"] and result["norm"], result


# --- no patch of torch outside _torch_patches ------------------------------------------------

def _root_name(node: ast.AST) -> str | None:
    """``a`` of ``a.b.c``, ``a.b[0]``, ``a``; None for anything else (a call, a literal)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _torch_assignments(source: str, filename: str) -> list[str]:
    """Statements of ``source`` that assign, delete or ``setattr``/``delattr``/``__setitem__``
    into an object reached from a name bound to torch: imported from torch, or bound in this
    file to an attribute path, a ``getattr`` or an ``importlib.import_module`` of such a name
    (a tensor computed by a call is not one). Conservative: names only, per file."""
    tree = ast.parse(source, filename)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            bound.update(a.asname or a.name for a in node.names)
    bound.add("importlib")

    def from_torch(value: ast.AST) -> bool:
        if isinstance(value, ast.Call):
            func = value.func
            if isinstance(func, ast.Name) and func.id == "getattr" and value.args:
                return from_torch(value.args[0])
            return isinstance(func, ast.Attribute) and func.attr == "import_module"
        if isinstance(value, (ast.Tuple, ast.List)):
            return any(from_torch(e) for e in value.elts)
        return _root_name(value) in bound

    changed = True
    while changed:  # aliases of aliases
        changed = False
        for node in ast.walk(tree):
            pairs: list[tuple[ast.AST, ast.AST]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, (ast.For, ast.comprehension)):
                pairs = [(node.target, node.iter)]
            for target, value in pairs:
                names = [target] if isinstance(target, ast.Name) else (
                    list(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else [])
                for name in names:
                    if (isinstance(name, ast.Name) and name.id not in bound
                            and from_torch(value)):
                        bound.add(name.id)
                        changed = True

    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args
                    and from_torch(node.args[0])):
                found.append(f"{filename}:{node.lineno}: {func.id}")
            if (isinstance(func, ast.Attribute)
                    and func.attr in ("__setitem__", "__delitem__", "pop", "update",
                                      "setdefault", "clear", "popitem")
                    and from_torch(func.value)):
                found.append(f"{filename}:{node.lineno}: .{func.attr}")
            if isinstance(func, ast.Attribute) and func.attr == "_custom_op_handlers":
                found.append(f"{filename}:{node.lineno}: DTensor op table")
        if isinstance(node, ast.Attribute) and node.attr == "_custom_op_handlers":
            found.append(f"{filename}:{node.lineno}: DTensor op table")
        for target in targets:
            flat = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            for t in flat:
                if isinstance(t, (ast.Attribute, ast.Subscript)) and from_torch(t.value):
                    found.append(f"{filename}:{node.lineno}: {ast.unparse(t)}")
    return found


def test_no_torch_patch_outside_the_patches_package() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PATCHES_DIR in path.parents:
            continue
        found += _torch_assignments(path.read_text(), str(path.relative_to(PACKAGE)))
    assert not found, "torch patched outside _torch_patches/:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.autograd.grad = len\n",
    "import torch.nn.utils as u\nu.clip_grad_norm_ = len\n",
    "from torch.optim import Optimizer\nOptimizer.zero_grad = len\n",
    "from torch.distributed.tensor import DTensor\n"
    "h = DTensor._op_dispatcher\nh.x[1] = 2\n",
    "import importlib\nm = importlib.import_module('torch.x')\nsetattr(m, 'f', len)\n",
    "from torch.distributed.checkpoint import state_dict as dsd\n"
    "for m in (dsd,):\n    del m.f\n",
])
def test_the_scan_finds_patches(snippet: str) -> None:
    assert _torch_assignments(snippet, "snippet.py")


def test_the_scan_ignores_tensor_writes() -> None:
    snippet = ("import torch\nx = torch.zeros(3)\nx[0] = 1\nx.grad = None\n"
               "def f(p):\n    p.data = torch.ones(1)\n")
    assert not _torch_assignments(snippet, "snippet.py")
