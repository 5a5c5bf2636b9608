"""Build the single C++/CUDA extension ``megatron_fsdp_v2._C``.

This file only decides CPU versus CUDA and collects ``csrc`` sources; metadata
lives in pyproject.toml. Install with ``pip install --no-build-isolation -e .``.

Environment:
  MFSDP_FORCE_CPU=1      build CPU kernels only, even with a CUDA toolchain.
  MFSDP_FORCE_CUDA=1     fail instead of silently building CPU-only.
  TORCH_CUDA_ARCH_LIST   CUDA archs to compile for (default "8.0;9.0").
  MAX_JOBS               parallel compile jobs (honored by BuildExtension).
"""

import glob
import os
import sys

import torch
from setuptools import find_namespace_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _has_cuda_headers(home):
    return bool(home) and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))


def _pin_cuda_home() -> None:
    """torch guesses CUDA_HOME from ``which nvcc``; a wrapper script in /usr/local/bin
    makes that /usr/local, which has no CUDA headers. Pick a home that has them."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    from torch.utils import cpp_extension

    for home in (cpp_extension.CUDA_HOME, "/usr/local/cuda"):
        if _has_cuda_headers(home):
            cpp_extension.CUDA_HOME = home
            os.environ["CUDA_HOME"] = home
            return


FORCE_CPU, FORCE_CUDA = _env_flag("MFSDP_FORCE_CPU"), _env_flag("MFSDP_FORCE_CUDA")
if FORCE_CPU and FORCE_CUDA:
    raise RuntimeError("MFSDP_FORCE_CPU=1 and MFSDP_FORCE_CUDA=1 contradict each other; set one.")
if not FORCE_CPU:
    _pin_cuda_home()

from torch.utils import cpp_extension  # noqa: E402  (after CUDA_HOME is pinned)


def _with_cuda() -> bool:
    if FORCE_CPU:
        return False
    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home or "", "bin", "nvcc")
    ok = torch.version.cuda is not None and _has_cuda_headers(home) and os.path.isfile(nvcc)
    if not ok and FORCE_CUDA:
        raise RuntimeError(
            f"MFSDP_FORCE_CUDA=1 but no usable CUDA toolchain: torch.version.cuda="
            f"{torch.version.cuda!r}, CUDA_HOME={home!r} (needs bin/nvcc, include/cuda_runtime.h)."
        )
    return ok


def _extension():
    with_cuda = _with_cuda()
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    sources += sorted(glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    cxx = ["-O3", "-ffp-contract=off"]  # no FMA contraction: kernels match the reference bitwise
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        cxx.append("-fopenmp")  # at::parallel_for is a header template; without it it runs serially
    macros = [("MFSDP_TORCH_VERSION", torch.__version__)]
    if not with_cuda:
        return cpp_extension.CppExtension(
            "megatron_fsdp_v2._C", sources, include_dirs=[os.path.join(CSRC, "include")],
            define_macros=macros, extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"] if "-fopenmp" in cxx else [],
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    macros.append(("MFSDP_WITH_CUDA", None))
    nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    return cpp_extension.CUDAExtension(
        "megatron_fsdp_v2._C", sources, include_dirs=[os.path.join(CSRC, "include")],
        define_macros=macros, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"] if "-fopenmp" in cxx else [],
    )


setup(
    packages=find_namespace_packages(include=["megatron_fsdp_v2*"], exclude=["*__pycache__*"]),
    # Absolute source paths end up in SOURCES.txt, which include_package_data would reject.
    include_package_data=False,
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
