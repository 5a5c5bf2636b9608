"""setup.py's choice of CUDA architectures (issue 23, item 2): an explicit TORCH_CUDA_ARCH_LIST
wins; by default every architecture torch was built for (Turing to Blackwell for torch 2.14's
wheels) plus PTX of the newest, so B200/GB200 (sm_100), RTX 50 (sm_120) and T4 (sm_75) get a
kernel image and newer GPUs JIT the PTX; and torch's BuildExtension turns that list into the
matching -gencode flags. setup.py is imported without running setup() (it only runs as
__main__, which is how setuptools runs it)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
from types import ModuleType

import pytest
import torch
from torch.utils import cpp_extension

ROOT = pathlib.Path(__file__).resolve().parents[2]

TORCH_214_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
NVCC_130_ARCHS = {"7.5", "8.0", "8.6", "8.7", "8.8", "8.9", "9.0", "10.0", "10.3", "11.0",
                  "12.0", "12.1"}


@pytest.fixture(scope="module")
def setup_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mfsdp_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: __name__ is not "__main__"
    return module


def test_default_is_torch_archs_plus_ptx(setup_py: ModuleType) -> None:
    chosen = setup_py.cuda_arch_list(None, TORCH_214_ARCHS, NVCC_130_ARCHS)
    assert chosen == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"


@pytest.mark.parametrize("explicit", ["9.0", "8.0;9.0", "9.0+PTX", "native", " 8.6 "])
def test_explicit_wins(setup_py: ModuleType, explicit: str) -> None:
    assert setup_py.cuda_arch_list(explicit, TORCH_214_ARCHS, NVCC_130_ARCHS) == explicit.strip()


def test_empty_explicit_means_default(setup_py: ModuleType) -> None:
    assert setup_py.cuda_arch_list("", TORCH_214_ARCHS, None) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"


def test_older_nvcc_drops_what_it_cannot_compile(setup_py: ModuleType) -> None:
    """A CUDA 12.4 toolkit has no sm_100/sm_120: the newest it has gets the PTX."""
    nvcc_124 = {"5.0", "5.2", "6.0", "6.1", "7.0", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0"}
    assert setup_py.cuda_arch_list(None, TORCH_214_ARCHS, nvcc_124) == "7.5;8.0;8.6;9.0+PTX"


def test_arch_specific_and_unknown_entries(setup_py: ModuleType) -> None:
    """sm_90a and non-sm entries are skipped; order is numeric (10.0 after 9.0); an empty torch
    list falls back to Turing..Blackwell."""
    assert setup_py.cuda_arch_list(None, ["sm_100", "sm_90a", "compute_90", "sm_90"],
                                   None) == "9.0;10.0+PTX"
    fallback = setup_py.cuda_arch_list(None, [], None)
    assert fallback == ";".join(setup_py.FALLBACK_CUDA_ARCHS) + "+PTX"
    assert fallback.startswith("7.5;") and fallback.endswith("12.0+PTX")


def test_unreadable_nvcc_list_keeps_everything(setup_py: ModuleType) -> None:
    assert setup_py.cuda_arch_list(None, ["sm_80", "sm_90"], {"3.5"}) == "8.0;9.0+PTX"


def test_nvcc_query_without_nvcc(setup_py: ModuleType, tmp_path: pathlib.Path) -> None:
    assert setup_py._nvcc_archs(str(tmp_path)) is None


def test_torch_builds_what_the_list_names(setup_py: ModuleType,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """cpp_extension._get_cuda_arch_flags (what BuildExtension passes to nvcc) honours the list
    with setup.py's own nvcc flags: SASS for every architecture, PTX for the newest."""
    chosen = setup_py.cuda_arch_list(None, TORCH_214_ARCHS, NVCC_130_ARCHS)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", chosen)
    flags = cpp_extension._get_cuda_arch_flags(list(setup_py.NVCC_FLAGS))
    expected = {f"-gencode=arch=compute_{n},code=sm_{n}" for n in (75, 80, 86, 90, 100, 120)}
    expected.add("-gencode=arch=compute_120,code=compute_120")
    assert set(flags) == expected


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch names no archs")
def test_installed_torch_gives_a_valid_list(setup_py: ModuleType,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = setup_py.cuda_arch_list(None, torch.cuda.get_arch_list(), None)
    assert chosen.endswith("+PTX")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", chosen)
    assert cpp_extension._get_cuda_arch_flags(list(setup_py.NVCC_FLAGS))  # no ValueError


# --- a compiler that links libstdc++ statically (the lent GPU machine's CXX) ----------------

def _static_wrapper(folder: pathlib.Path, name: str) -> str:
    """A compiler named ``name`` that links libstdc++ statically, as ``/opt/gcc/bin/g++`` on
    the lent GPU machine does (a wrapper of the system g++)."""
    real = shutil.which("g++")
    assert real is not None
    path = folder / name
    path.write_text(f'#!/bin/sh\nexec {real} -static-libstdc++ "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_compiler_linking_libstdcxx_statically_is_replaced(
    setup_py: ModuleType, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such an extension segfaulted in its first argument check on the H200 (its own, never
    initialized iostreams); setup.py builds with a compiler on PATH that links the system's."""
    assert setup_py._links_libstdcxx_statically("g++") is False
    static = _static_wrapper(tmp_path, "g++")
    assert setup_py._links_libstdcxx_statically(static) is True
    assert setup_py._links_libstdcxx_statically(str(tmp_path / "missing")) is None
    assert setup_py.shared_libstdcxx_compiler("g++") is None
    assert setup_py.shared_libstdcxx_compiler(None) is None

    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")  # the wrapper is "g++" now
    cc, cxx = setup_py.shared_libstdcxx_compiler(static)
    assert os.path.realpath(cxx) != os.path.realpath(static)
    assert setup_py._links_libstdcxx_statically(cxx) is False
    assert os.path.basename(cc) in ("cc", "gcc")

    # No other compiler among the candidates (the wrapper shadows g++ on PATH): a clear error.
    with pytest.raises(RuntimeError, match="links libstdc\\+\\+ statically"):
        setup_py.shared_libstdcxx_compiler(static, candidates=("g++",))
