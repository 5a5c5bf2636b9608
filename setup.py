"""Build the single C++/CUDA extension ``megatron_fsdp_v2._C``.

This file only decides CPU versus CUDA and collects ``csrc`` sources; metadata
lives in pyproject.toml. Install with ``pip install --no-build-isolation -e .``.

Environment:
  MFSDP_FORCE_CPU=1      build CPU kernels only, even with a CUDA toolchain.
  MFSDP_FORCE_CUDA=1     fail instead of silently building CPU-only.
  TORCH_CUDA_ARCH_LIST   CUDA archs to compile for (default: those torch was built for
                         that nvcc can compile, plus PTX of the newest; see cuda_arch_list).
  MAX_JOBS               parallel compile jobs (honored by BuildExtension).
  CC, CXX                the compilers (torch's BuildExtension uses them); a CXX that links
                         libstdc++ statically is replaced, see shared_libstdcxx_compiler.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Collection, Sequence

import torch
from setuptools import find_namespace_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


# nvcc flags besides the architectures. None may mention "arch": torch then drops the -gencode
# flags it derives from TORCH_CUDA_ARCH_LIST (cpp_extension._get_cuda_arch_flags).
NVCC_FLAGS = ("-O3", "-lineinfo", "--expt-relaxed-constexpr")

# Used when torch does not say which architectures it was built for: Turing to Blackwell.
FALLBACK_CUDA_ARCHS = ("7.5", "8.0", "8.6", "9.0", "10.0", "12.0")


def cuda_arch_list(
    explicit: str | None, torch_archs: Sequence[str], nvcc_archs: Collection[str] | None
) -> str:
    """The ``TORCH_CUDA_ARCH_LIST`` to build with: ``explicit`` (the environment's) when set,
    as given; else every architecture torch was built for (``torch_archs``, as
    ``torch.cuda.get_arch_list()`` names them: ``"sm_75"``, ..., ``"sm_120"``) that nvcc can
    compile (``nvcc_archs`` as ``"X.Y"``; ``None``: unknown, no filter), ``FALLBACK_CUDA_ARCHS``
    when torch names none, and PTX of the newest (``"+PTX"``), so a GPU newer than every
    compiled one JIT-compiles the kernels instead of failing with "no kernel image is
    available". Arch-specific variants (``sm_90a``) are left out: the kernels use no
    arch-specific feature, and the plain ``sm_90`` build covers those GPUs."""
    if explicit and explicit.strip():
        return explicit.strip()
    archs = []
    for name in torch_archs:
        match = re.fullmatch(r"sm_(\d+)(\d)", name)
        if match:
            archs.append(f"{match.group(1)}.{match.group(2)}")
    if not archs:
        archs = list(FALLBACK_CUDA_ARCHS)
    if nvcc_archs is not None:
        archs = [a for a in archs if a in nvcc_archs] or archs  # nvcc unreadable: keep all
    archs = sorted(set(archs), key=lambda a: tuple(int(part) for part in a.split(".")))
    archs[-1] += "+PTX"
    return ";".join(archs)


def _nvcc_archs(home):
    """The virtual architectures ``nvcc --list-gpu-arch`` names, as ``"X.Y"``; ``None`` when it
    cannot say (an old nvcc, or none)."""
    nvcc = os.path.join(home or "", "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = {f"{m.group(1)}.{m.group(2)}" for m in re.finditer(r"compute_(\d+)(\d)\b", out)}
    return found or None


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


def _with_cuda(force_cpu: bool, force_cuda: bool) -> bool:
    from torch.utils import cpp_extension

    if force_cpu:
        return False
    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home or "", "bin", "nvcc")
    ok = torch.version.cuda is not None and _has_cuda_headers(home) and os.path.isfile(nvcc)
    if not ok and force_cuda:
        raise RuntimeError(
            f"MFSDP_FORCE_CUDA=1 but no usable CUDA toolchain: torch.version.cuda="
            f"{torch.version.cuda!r}, CUDA_HOME={home!r} (needs bin/nvcc, include/cuda_runtime.h)."
        )
    return ok


def _links_libstdcxx_statically(cxx: str) -> bool | None:
    """Whether ``cxx -shared`` leaves libstdc++ out of a shared library's dependencies: a
    toolchain wrapper that adds ``-static-libstdc++``. ``None`` when ``cxx`` cannot link a probe
    (then the real build says what is wrong).

    Such an extension carries a second libstdc++ into a process whose torch uses the system's;
    the copy's iostreams were never initialized, so the first ``c10::str`` (every op's argument
    checks) segfaults. Seen on a GPU machine whose environment sets
    ``CXX=/opt/gcc/bin/g++``, a wrapper of the system g++ 13.3 that links it statically."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write("#include <sstream>\n#include <string>\n"
                    "std::string probe(int i) { std::ostringstream s; s << i; return s.str(); }\n")
        try:
            subprocess.run([*shlex.split(cxx), "-shared", "-fPIC", src, "-o", out],
                           capture_output=True, timeout=120, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        try:
            needed = subprocess.run(["readelf", "-d", out], capture_output=True, text=True,
                                    timeout=60, check=True).stdout
            return "libstdc++.so" not in needed
        except (OSError, subprocess.SubprocessError):
            with open(out, "rb") as f:  # no binutils: the NEEDED name is in the string table
                return b"libstdc++.so" not in f.read()


def shared_libstdcxx_compiler(cxx: str | None, candidates: Sequence[str] = ("c++", "g++")
                              ) -> tuple[str, str] | None:
    """``(CC, CXX)`` to build with instead of ``cxx`` (the environment's ``CXX``) when it links
    libstdc++ statically (see :func:`_links_libstdcxx_statically`): the first of
    ``candidates`` on PATH that links it dynamically, with its C driver beside it. ``None`` when
    ``cxx`` is unset or fine. Raises ``RuntimeError`` naming the fix when no candidate is."""
    if not cxx or not _links_libstdcxx_statically(cxx):
        return None
    for name in candidates:
        found = shutil.which(name)
        if found and os.path.realpath(found) != os.path.realpath(shutil.which(cxx) or cxx) \
                and _links_libstdcxx_statically(found) is False:
            driver = {"c++": "cc", "g++": "gcc", "clang++": "clang"}.get(name, "cc")
            return shutil.which(driver) or driver, found
    raise RuntimeError(
        f"CXX={cxx} links libstdc++ statically into shared libraries, and no other C++ compiler "
        f"on PATH ({', '.join(candidates)}) links the system's: the extension would carry a "
        "second libstdc++ into a process whose torch uses the system's, and segfault in its "
        "first argument check. Set CXX (and CC) to a compiler that links libstdc++ dynamically"
    )


def _extension(force_cpu: bool, force_cuda: bool):
    from torch.utils import cpp_extension

    with_cuda = _with_cuda(force_cpu, force_cuda)
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
    # BuildExtension turns this variable into -gencode flags (cpp_extension._get_cuda_arch_flags;
    # unset, it would build only for the GPUs visible now, and fail with none visible).
    os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list(
        os.environ.get("TORCH_CUDA_ARCH_LIST"), torch.cuda.get_arch_list(),
        _nvcc_archs(cpp_extension.CUDA_HOME),
    )
    print(f"megatron_fsdp_v2: TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}",
          file=sys.stderr)
    sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    macros.append(("MFSDP_WITH_CUDA", None))
    nvcc = list(NVCC_FLAGS)
    return cpp_extension.CUDAExtension(
        "megatron_fsdp_v2._C", sources, include_dirs=[os.path.join(CSRC, "include")],
        define_macros=macros, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"] if "-fopenmp" in cxx else [],
    )


def main() -> None:
    force_cpu, force_cuda = _env_flag("MFSDP_FORCE_CPU"), _env_flag("MFSDP_FORCE_CUDA")
    if force_cpu and force_cuda:
        raise RuntimeError(
            "MFSDP_FORCE_CPU=1 and MFSDP_FORCE_CUDA=1 contradict each other; set one."
        )
    if not force_cpu:
        _pin_cuda_home()
    replacement = shared_libstdcxx_compiler(os.environ.get("CXX"))
    if replacement is not None:
        print(f"megatron_fsdp_v2: CXX={os.environ['CXX']} links libstdc++ statically (a second "
              f"libstdc++ in torch's process crashes); building with CC={replacement[0]} "
              f"CXX={replacement[1]}", file=sys.stderr)
        os.environ["CC"], os.environ["CXX"] = replacement
    from torch.utils import cpp_extension

    setup(
        packages=find_namespace_packages(include=["megatron_fsdp_v2*"],
                                         exclude=["*__pycache__*"]),
        # Absolute source paths end up in SOURCES.txt, which include_package_data would reject.
        include_package_data=False,
        ext_modules=[_extension(force_cpu, force_cuda)],
        cmdclass={"build_ext": cpp_extension.BuildExtension},
    )


# setuptools runs this file as __main__ (pip's build backend too); importing it, as
# tests/unit/test_setup_arch.py does, only defines the functions above.
if __name__ == "__main__":
    main()
