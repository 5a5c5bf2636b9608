"""How the ``test_no_silent_wrong_*`` cases run: one rank function per case (``_case_*``) returns
its named variants; one pytest function per case, parametrized over the four strategies. All
selected cases of a strategy (from every ``test_no_silent_wrong_*`` file) run in one spawn
(``_run_cases``; four spawns in all), and each (case, strategy) is still a test of its own,
rerunnable by id (then only that case runs). A failing test lists every failing variant and the
ranks it failed on, as ``WRONG RESULT`` (a failed check: which parameter, gradient or output, how
many elements differ, max abs diff; or an expected error that was not raised) or ``EXCEPTION``
(type, message, where it was raised). Each variant wraps with its own collective ``timeout``
(hence its own process group), so a variant that leaves a collective unmatched fails within
seconds without breaking the next ones.
"""

from __future__ import annotations

import importlib
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

import _silent_wrong
import pytest
import torch.distributed as dist
from _silent_wrong import _BASE_TIMEOUT_S, _PASSED_HERE, STRATEGIES, WORLD, Variant

from megatron_fsdp_v2.testing import release_process_groups, run_distributed

from _models import all_ranks_ok


def _compact(text: str) -> str:
    """torch.testing's multi-line mismatch report on one line: elements differing, max abs diff."""
    text = re.sub(r"(Tensor-likes|Scalars) are not close!\s*", "", text)
    text = re.sub(r"\n(Greatest relative|Relative) difference:[^\n]*", "", text)
    text = re.sub(r"Mismatched elements: ([^\n]*)\nGreatest absolute difference: ",
                  r"\1 elements differ, max abs diff ", text)
    return text.replace("\nAbsolute difference: ", ", abs diff ")


def _describe(e: BaseException) -> str:
    if isinstance(e, AssertionError):
        return "WRONG RESULT: " + _compact(str(e))
    frames = traceback.extract_tb(e.__traceback__)
    where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                        for f in reversed(frames[-3:]))
    return f"EXCEPTION {type(e).__name__}: {e}\n        at {where}"


def _run_cases(rank: int, world: int, strategy: str, cases: list[str]) -> dict[str, str | None]:
    """Rank function of one spawn: run every variant of the named cases on every rank and agree
    on the verdicts. Returns (on rank 0) each case's report: None, or every failing variant with
    every rank's message (identical messages merged)."""
    reports: dict[str, str | None] = {}
    index = 0
    for case in cases:
        module, func = case.split(":")
        variants: list[Variant] = getattr(importlib.import_module(module), func)(rank, strategy)
        failures = []
        for name, fn in variants:
            # Own timeout -> own library process group: a variant that leaves a collective
            # unmatched fails after the timeout without breaking the next ones.
            index += 1
            release_process_groups()  # each variant's own group: let them not pile up
            _silent_wrong._variant_timeout_s = _BASE_TIMEOUT_S + 0.25 * index
            if rank == 0:  # progress, shown if the spawn hangs or crashes
                print(f"running {strategy} / {case} / {name}", file=sys.stderr, flush=True)
            try:
                fn()
                msg = None
            except Exception as e:  # noqa: BLE001 - every failure is reported by name
                msg = _describe(e)
            if all_ranks_ok(msg is None):
                continue
            msgs: list[str | None] = [None] * world
            dist.all_gather_object(msgs, msg)
            by_msg: dict[str, list[int]] = {}
            for r, m in enumerate(msgs):
                if m is not None and not m.endswith(_PASSED_HERE):  # report the failing ranks
                    by_msg.setdefault(m, []).append(r)
            lines = [f"    rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}"
                     for m, rs in by_msg.items()]
            failures.append(f"[{strategy} / {name}]\n" + "\n".join(lines))
        reports[case] = (f"{len(failures)} of {len(variants)} variants failed:\n"
                         + "\n".join(failures)
                         if failures else None)
    return reports if rank == 0 else {}


# Reports of the spawns so far: strategy -> case -> report (or the spawn's own error).
_reports: dict[str, dict[str, str | None]] = {}


def _case_test(case: Callable[[int, str], list[Variant]]) -> Callable[[Callable[..., None]], Any]:
    """Decorator of a case's pytest function: parametrized over the strategies; runs ``case``.

    All selected cases of one strategy run in one spawn (the first selected test of that strategy
    starts it; the others read its report), so the file costs four spawns, while each (case,
    strategy) stays a test of its own, rerunnable by id (then only that case runs)."""
    def deco(test: Callable[..., None]) -> Any:
        test.case = f"{case.__module__}:{case.__name__}"  # type: ignore[attr-defined]
        return pytest.mark.parametrize("strategy", STRATEGIES)(test)
    return deco


def _check(request: pytest.FixtureRequest) -> None:
    case = request.function.case
    strategy = request.node.callspec.params["strategy"]
    if case not in _reports.get(strategy, {}):
        selected = [
            item.function.case for item in request.session.items
            if getattr(item, "function", None) is not None and hasattr(item.function, "case")
            and item.callspec.params.get("strategy") == strategy
            and item.function.case not in _reports.get(strategy, {})
        ]
        cases = list(dict.fromkeys([case] + selected))
        try:
            report = run_distributed(_run_cases, WORLD, strategy, cases,
                                     timeout_s=60 + 60 * len(cases))[0]
        except Exception as e:  # noqa: BLE001 - a crash or hang of the spawn fails all its cases
            report = {c: f"the spawn running {cases} failed:\n{e}" for c in cases}
        _reports.setdefault(strategy, {}).update(report)
    report = _reports[strategy][case]
    if report is not None:
        pytest.fail(report, pytrace=False)
