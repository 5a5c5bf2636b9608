"""Load the native extension ``megatron_fsdp_v2._C`` and record what it provides.

Importing ``_C`` runs the static ``TORCH_LIBRARY`` registrations, after which the
kernels are reachable as ``torch.ops.megatron_fsdp_v2.*``. Three outcomes:

* ``_C`` is not built (pure-Python checkout): ``HAS_EXTENSION`` is False and the
  public wrappers use the pure-PyTorch reference ops.
* ``_C`` was built against another torch (version mismatch, undefined symbol,
  missing torch library): one ImportError telling how to rebuild. Running stale
  binary code against a different torch ABI is never silently tolerated.
* ``_C`` loads: ``HAS_EXTENSION`` is True and ``HAS_CUDA_KERNELS`` says whether
  the CUDA kernels were compiled in.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = ["HAS_CUDA_KERNELS", "HAS_EXTENSION", "USE_REFERENCE_OPS", "build_info"]

_REBUILD = "pip install --no-build-isolation -e ."
_OP_NAMES = ("pack_", "multi_tensor_sum_of_squares", "fp8_quantize_")  # csrc/ops.cpp's schemas


def _import_extension() -> ModuleType | None:
    try:
        _C = importlib.import_module("megatron_fsdp_v2._C")
    except ModuleNotFoundError as e:
        if e.name == "megatron_fsdp_v2._C":
            return None  # not built: the reference ops take over
        raise
    except (ImportError, OSError) as e:
        reason = "undefined symbol" if "undefined symbol" in str(e) else "load error"
        raise ImportError(
            f"megatron_fsdp_v2._C failed to load ({reason}: {e}); it was most likely built "
            f"against a different torch than the installed {torch.__version__}, so rebuild it "
            f"with `{_REBUILD}` in this environment."
        ) from e
    built = _C.torch_version_built()
    if built != str(torch.__version__):
        raise ImportError(
            f"megatron_fsdp_v2._C was built against torch {built} but torch "
            f"{torch.__version__} is installed; rebuild it with `{_REBUILD}` in this environment."
        )
    return _C


_C = _import_extension()

HAS_EXTENSION: bool = _C is not None
"""The compiled extension loaded and registered ``torch.ops.megatron_fsdp_v2``."""

HAS_CUDA_KERNELS: bool = bool(_C is not None and _C.cuda_kernels_compiled())
"""CUDA kernels are registered (the build found a CUDA torch and nvcc)."""

USE_REFERENCE_OPS: bool = os.environ.get("MFSDP_USE_REFERENCE_OPS", "0") == "1"
"""``MFSDP_USE_REFERENCE_OPS=1``: the wrappers call the pure-PyTorch reference ops."""


def build_info() -> dict[str, Any]:
    """What the native extension was built with, next to the running torch.

    Returns a dict with ``torch_built`` (``torch.__version__`` at build time, or
    None without the extension), ``torch_runtime``, ``cuda_built`` (CUDA toolkit
    version string, or None for a CPU-only build), ``cpu_kernels``,
    ``cuda_kernels`` and ``extension`` (bools).
    """
    return {
        "torch_built": _C.torch_version_built() if _C is not None else None,
        "torch_runtime": torch.__version__,
        "cuda_built": _C.cuda_version_built() if _C is not None else None,
        "cpu_kernels": bool(_C is not None and _C.cpu_kernels_compiled()),
        "cuda_kernels": HAS_CUDA_KERNELS,
        "extension": HAS_EXTENSION,
    }


def _register_missing_cuda_kernels() -> torch.library.Library | None:
    """On a CPU-only build, CUDA tensors would otherwise hit a dispatcher error that
    does not say what to do; register CUDA kernels that say it in one sentence."""
    if not HAS_EXTENSION or HAS_CUDA_KERNELS:
        return None
    lib = torch.library.Library("megatron_fsdp_v2", "IMPL")

    def _make(name: str) -> Callable[..., None]:
        def _no_cuda_kernel(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                f"megatron_fsdp_v2::{name}: this build of megatron_fsdp_v2 has no CUDA kernels; "
                f"rebuild with `MFSDP_FORCE_CUDA=1 {_REBUILD}` on a machine with a CUDA torch "
                f"and nvcc, or set MFSDP_USE_REFERENCE_OPS=1."
            )

        return _no_cuda_kernel

    for name in _OP_NAMES:
        lib.impl(name, _make(name), "CUDA")
    return lib


_MISSING_CUDA_LIB = _register_missing_cuda_kernels()
