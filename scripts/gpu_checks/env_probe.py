"""What scripts/gpu_check.sh needs to know about this machine, asked in one interpreter start
(each start imports torch: seconds on the GPU machine, out of an 8-minute budget).

    python scripts/gpu_checks/env_probe.py [--deps DIR]

Prints ``key=value`` lines, each flushed as soon as it is known, so that a torch that crashes
at import still leaves the earlier answers:

    build=pip|setup.py       how to build the extension here, and ``build_reason=`` why:
                             ``pip install --no-build-isolation --no-deps --no-index -e .``
                             needs pip, a setuptools that builds PEP 660 editable installs
                             without fetching anything (64+, and the ``wheel`` package below
                             70.1), a writable site-packages and a Python that is not
                             "externally managed" (PEP 668: a distribution's python3);
                             otherwise ``setup.py build_ext --inplace``.
    pytest=site|deps|missing where ``import pytest`` works: as installed, only with DIR (the
                             folder scripts/gpu_deps.sh fills) on the path, or nowhere;
                             ``pytest_timeout=yes|no`` the same for pytest-timeout.
    torch=VERSION            then ``torch_cuda=``, and with a CUDA device ``arch=X.Y``,
                             ``gpu_name=``, ``gpus=N`` (``gpus=0`` without one); or
                             ``torch_error=`` / ``cuda_error=`` with the exception.

Only the standard library before torch; the pytest question runs in a child interpreter, so a
broken pytest cannot break this one. Exit status 0 unless the interpreter itself fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
import warnings


def say(key: str, value: object) -> None:
    print(f"{key}={' '.join(str(value).split())}", flush=True)


def build_method() -> tuple[str, str]:
    """``("pip" | "setup.py", reason)``: an editable pip install needs nothing from an index."""
    # setuptools first: looking pip up makes setuptools' distutils shim hand `distutils` to the
    # standard library (as pip wants), after which setuptools no longer imports on 3.11.
    try:
        with warnings.catch_warnings():  # "Setuptools is replacing distutils": noise here
            warnings.simplefilter("ignore")
            import setuptools
    except Exception as e:  # noqa: BLE001 - reported; setup.py will then fail and say more
        return "setup.py", f"setuptools does not import: {type(e).__name__}: {e}"
    if importlib.util.find_spec("pip") is None:
        return "setup.py", "no pip module"
    # A distribution's own Python (PEP 668, e.g. Ubuntu's python3): pip refuses to install into
    # it; and pip cannot write an editable install where site-packages is read-only.
    in_venv = sys.prefix != sys.base_prefix
    marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
    if not in_venv and os.path.isfile(marker) and not os.environ.get("PIP_BREAK_SYSTEM_PACKAGES"):
        return "setup.py", f"pip refuses to install into an externally managed Python ({marker})"
    purelib = sysconfig.get_path("purelib")
    if not os.access(purelib, os.W_OK):
        return "setup.py", f"{purelib} is not writable"
    version = tuple(int(part) for part in re.findall(r"\d+", setuptools.__version__)[:2])
    if version < (64, 0):
        return "setup.py", f"setuptools {setuptools.__version__} builds no PEP 660 editable install"
    if version < (70, 1) and importlib.util.find_spec("wheel") is None:
        return "setup.py", (f"setuptools {setuptools.__version__} needs the wheel package for an "
                            "editable install")
    return "pip", f"pip and setuptools {setuptools.__version__}"


def _imports(module: str, extra_path: str | None) -> bool:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    try:
        return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, timeout=60,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def pytest_location(deps: str | None) -> tuple[str, bool]:
    """(``site`` | ``deps`` | ``missing``, whether pytest-timeout imports from there too)."""
    if _imports("pytest", None):
        return "site", _imports("pytest_timeout", None)
    if deps and os.path.isdir(deps) and _imports("pytest", deps):
        return "deps", _imports("pytest_timeout", deps)
    return "missing", False


def torch_facts() -> None:
    try:
        import torch
    except BaseException as e:  # noqa: BLE001 - the answer is the exception
        say("torch_error", f"{type(e).__name__}: {e}")
        return
    say("torch", torch.__version__)
    say("torch_cuda", torch.version.cuda)
    try:
        if not torch.cuda.is_available():
            say("gpus", 0)
            return
        major, minor = torch.cuda.get_device_capability(0)
        say("arch", f"{major}.{minor}")
        say("gpu_name", torch.cuda.get_device_name(0))
        say("gpus", torch.cuda.device_count())
    except BaseException as e:  # noqa: BLE001 - a driver/runtime mismatch, say
        say("cuda_error", f"{type(e).__name__}: {e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deps", help="the folder scripts/gpu_deps.sh fills (.gpu_deps)")
    args = parser.parse_args()
    method, reason = build_method()
    say("build", method)
    say("build_reason", reason)
    where, timeout_plugin = pytest_location(args.deps)
    say("pytest", where)
    say("pytest_timeout", "yes" if timeout_plugin else "no")
    torch_facts()
    return 0


if __name__ == "__main__":
    sys.exit(main())
