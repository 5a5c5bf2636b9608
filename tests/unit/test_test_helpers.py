"""The distributed tests share their helpers (issue 39, item 4): one ``_models.py`` for the model
classes and one ``_training.py`` for the training loops; a test file that defines its own
``_train`` loop or its own ``Block`` / ``Net`` model again, or that imports a private module of
the package without saying which private invariant it checks, fails here.

The files are read as text (``ast``), not imported: nothing of the package or torch runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DISTRIBUTED = Path(__file__).resolve().parents[1] / "distributed"
SHARED = {"_models.py", "_training.py"}  # where the models and loops live
COPIED_CLASSES = {"Block", "Net"}
COPIED_FUNCTIONS = {"_train"}
MARK = "# private:"

# Files whose training loop is not yet a call of ``_training.train_steps``, each with why. The
# list only shrinks: a listed file that no longer defines ``_train`` fails too (remove it here).
NOT_MIGRATED: dict[str, str] = {
    "_fsdp2_api.py": "lockstep loop with per-step collective counts and a between-micro-batch "
                     "callback; shared by four FSDP2-API test files already",
    "_silent_wrong.py": "lockstep loop comparing every step's forward outputs; shared by the "
                        "no-silent-wrong and hostile test files already",
    "test_cuda_runtime.py": "CUDA only: cannot be run on the CPU machine to prove the numbers "
                            "unchanged",
    "test_hostile_ep_checkpoint.py": "calls the MoE example's own train_step (the example's "
                                     "loop is what it tests)",
    "test_muon.py": "the optimizer step is what it tests: each step the single-process copy "
                    "and FSDP2 are handed ours' full gradients (they do not train on data), "
                    "ours' Muon step runs under a collective spy, and with closure=True inside "
                    "opt.step(closure) re-running forward and backward; train_steps steps "
                    "each model on its own batches",
    "test_pipeline_parallel.py": "the pipeline schedule's step is what it tests: "
                                 "sched.step(x, target=...) splits the batch into micro-batches "
                                 "and runs every stage's forward and backward itself (no "
                                 "forward/backward loop of the test's to hand to train_steps)",
}


# Files another engineer was changing when the comments were added (uncommitted or new): their
# owners add the comments. Like NOT_MIGRATED, the list only shrinks.
PRIVATE_IMPORTS_PENDING: dict[str, str] = {}


def copies_in(source: str) -> list[str]:
    """Module-level ``class Block`` / ``class Net`` / ``def _train`` definitions in ``source``."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in COPIED_CLASSES:
            found.append(f"class {node.name} (line {node.lineno})")
        elif isinstance(node, ast.FunctionDef) and node.name in COPIED_FUNCTIONS:
            found.append(f"def {node.name} (line {node.lineno})")
    return found


def _is_private(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return node.module.startswith("megatron_fsdp_v2._") or (
            node.module == "megatron_fsdp_v2"
            and any(alias.name.startswith("_") for alias in node.names))
    if isinstance(node, ast.Import):
        return any(alias.name.startswith("megatron_fsdp_v2._") for alias in node.names)
    return False


def unexplained_private_imports(source: str) -> list[str]:
    """Imports of a private module (``megatron_fsdp_v2._x``, or ``_x`` from the package) with no
    ``# private: <invariant>`` comment on the import's lines or in the comment lines right
    above it. Imports inside strings (a script a test runs) are not imports: not counted."""
    lines = source.splitlines()
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not _is_private(node):
            continue
        assert isinstance(node, (ast.Import, ast.ImportFrom))
        own = lines[node.lineno - 1:node.end_lineno]
        above = []
        i = node.lineno - 2
        while i >= 0 and lines[i].lstrip().startswith("#"):
            above.append(lines[i])
            i -= 1
        if not any(MARK in line for line in own + above):
            bad.append(f"line {node.lineno}: {lines[node.lineno - 1].strip()}")
    return bad


def _test_files() -> list[Path]:
    return sorted(p for p in DISTRIBUTED.glob("*.py") if p.name not in SHARED)


def test_no_private_copies_of_the_shared_models_and_loops() -> None:
    problems = []
    for path in _test_files():
        copies = copies_in(path.read_text())
        if copies and path.name not in NOT_MIGRATED:
            problems.append(f"{path.name} defines {', '.join(copies)}: use _models.py's models "
                            "and _training.py's train_steps instead")
        if not copies and path.name in NOT_MIGRATED:
            problems.append(f"{path.name} has no copy any more: remove it from NOT_MIGRATED")
    assert not problems, "\n".join(problems)


def test_private_imports_say_which_invariant() -> None:
    shared = [DISTRIBUTED / name for name in sorted(SHARED) if (DISTRIBUTED / name).exists()]
    problems = []
    for path in _test_files() + shared:
        unexplained = unexplained_private_imports(path.read_text())
        if path.name in PRIVATE_IMPORTS_PENDING:
            if not unexplained:
                problems.append(f"{path.name}: all explained now: remove it from "
                                "PRIVATE_IMPORTS_PENDING")
            continue
        problems += [f"{path.name} {line}" for line in unexplained]
    assert not problems, (
        "private imports without a '# private: <the invariant it checks>' comment (use the "
        "public API where it offers the same thing):\n" + "\n".join(problems))


# The checks themselves, on small texts: they find what they must and nothing else.

@pytest.mark.parametrize("source, found", [
    ("class Block(nn.Module):\n    pass\n", ["class Block (line 1)"]),
    ("import torch\n\ndef _train(model):\n    pass\n", ["def _train (line 3)"]),
    ("class Net:\n    pass\nclass Other:\n    pass\n", ["class Net (line 1)"]),
    ("def _train_reference(ref):\n    pass\nclass MLPBlock:\n    pass\n", []),
    ("def helper():\n    def _train():\n        pass\n", []),
])
def test_copies_in(source: str, found: list[str]) -> None:
    assert copies_in(source) == found


@pytest.mark.parametrize("source, unexplained", [
    ("from megatron_fsdp_v2._registry import state_of\n", 1),
    ("import megatron_fsdp_v2._comm._collectives as c\n", 1),
    ("from megatron_fsdp_v2 import _registry, fully_shard\n", 1),
    ("# private: reads the unit's groups\nfrom megatron_fsdp_v2._registry import state_of\n", 0),
    ("# private: a long reason\n#   continued\nfrom megatron_fsdp_v2._registry import state_of\n",
     0),
    ("from megatron_fsdp_v2._registry import state_of  # private: the groups\n", 0),
    ("def f():\n    # private: the groups\n    from megatron_fsdp_v2._registry import state_of\n",
     0),
    ("# private: the groups\n\nfrom megatron_fsdp_v2._registry import state_of\n", 1),
    ("from megatron_fsdp_v2 import fully_shard\nfrom megatron_fsdp_v2.testing import RankPools\n",
     0),
    ("SCRIPT = 'from megatron_fsdp_v2._registry import state_of'\n", 0),
])
def test_unexplained_private_imports(source: str, unexplained: int) -> None:
    assert len(unexplained_private_imports(source)) == unexplained
