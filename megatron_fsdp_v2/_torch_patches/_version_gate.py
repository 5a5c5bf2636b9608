"""The torch versions the patches were written against, and the gate every ``install`` passes
first: the patches rebind private torch functions and op-table entries whose names, signatures
and call sites change between torch releases, so on another version they could fail, or worse,
be silently skipped or wrong."""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["ALLOW_UNTESTED_ENV", "TESTED_TORCH", "check_torch_version"]

# Major.minor releases whose private torch code the patches were read against, each tested: the
# full suite on the install default (2.14), the compatibility subset on the oldest and newest in
# CI (scripts/compat_torch.sh), 2.12 and 2.13 by hand when the range was set. pyproject.toml's
# torch requirement says the same range.
TESTED_TORCH: tuple[str, ...] = ("2.11", "2.12", "2.13", "2.14", "2.15")
ALLOW_UNTESTED_ENV = "MEGATRON_FSDP_ALLOW_UNTESTED_TORCH"

_warned: list[str] = []


def _release(version: str) -> str:
    """``major.minor`` of a torch version string (``"2.14.1+cu130"`` -> ``"2.14"``)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _next_release(release: str) -> str:
    """The ``major.minor`` after ``release`` (``"2.15"`` -> ``"2.16"``)."""
    major, minor = release.split(".")
    return f"{major}.{int(minor) + 1}"


def check_torch_version() -> None:
    """Nothing on a tested torch; else ``RuntimeError`` naming the fix, unless the user opted in
    with ``MEGATRON_FSDP_ALLOW_UNTESTED_TORCH=1`` (then one warning per process)."""
    running = str(torch.__version__)
    if _release(running) in TESTED_TORCH:
        return
    tested = f"{TESTED_TORCH[0]}.x to {TESTED_TORCH[-1]}.x"
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        if running not in _warned:
            _warned.append(running)
            warnings.warn(
                f"megatron_fsdp_v2 is patching torch {running}, which it was not tested with "
                f"(tested: torch {tested}), because {ALLOW_UNTESTED_ENV}=1: DTensor paths, "
                "state dicts and random init of fully_shard parameters may be wrong",
                RuntimeWarning, stacklevel=3,
            )
        return
    raise RuntimeError(
        f"megatron_fsdp_v2.fully_shard patches private torch internals (DTensor "
        f"redistribution, op handlers, state-dict helpers; see design.md, 'Patches of torch') "
        f"that were written and tested against torch {tested}, but this is torch {running}; "
        f"nothing was patched. Install a tested torch (e.g. pip install 'torch>="
        f"{TESTED_TORCH[0]},<{_next_release(TESTED_TORCH[-1])}'), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to patch this version anyway, at your own risk"
    )
