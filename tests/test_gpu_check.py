"""scripts/gpu_check.sh, dry-run on CPU: the steps that need CUDA print SKIP, the check programs
of scripts/gpu_checks run with ``--device cpu`` (gloo) and pass; each check program, given a
known defect (``--self-test``), fails; and the trace arithmetic of the profiled step, which only
runs on a GPU, is right on synthetic kernels.

The dry run imitates the lent GPU machine: ``python3`` is the only Python on ``PATH`` (no
``python``, no ``PYTHON``), no package index (``PIP_NO_INDEX=1``), torchao not importable, no
carried .gpu_deps. That ``python3`` is a stand-in that forks each program from one interpreter
that imported torch and the library once (tests/_forked_programs.py), the script itself
unchanged: its dry run started six interpreters (and the self-tests three) that spent most of
their CPU time importing. One pass of the script, shared by the cases.

The GPU side of the script (which build command, GPU or dry run, pytest missing, the order of
the steps, the environment every program gets) runs here too, against a fake ``python3`` and
``nvidia-smi`` that answer scripts/gpu_checks/env_probe.py as a machine would and log every
other call: a second each."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "scripts", "gpu_checks")
sys.path.insert(0, CHECKS)

import profile_step  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # the dry run spawns ranks; slow on a loaded machine

# Step names (their start) in the summary table, in the order they run: the sanitizer last.
STEPS = [
    "build (TORCH_CUDA_ARCH_LIST", "build_info reports CUDA kernels", "op tests",
    "race amplifier", "host-sync audit", "2 and 3 gloo ranks", "init_process_group() without",
    "profiled bf16 ZeRO-3 step", "CUDA runtime tests", "CPUOffloadPolicy CUDA path",
    "examples/train.py 1 GPU optim ",
    "examples/train.py 1 GPU optim_grads_params", "examples/train.py 1 GPU --optimizer muon",
    "bench_kernels", "HSDP 2x2 checks",
    "race check under TORCH_CUDA_SANITIZER=1",
]
RUNS_ON_CPU = [
    "race amplifier", "host-sync audit", "2 and 3 gloo ranks", "init_process_group() without",
    "profiled bf16 ZeRO-3 step",
]
NEEDS_CUDA = [name for name in STEPS if name not in RUNS_ON_CPU]
PYTEST_STEPS = ["op tests", "CUDA runtime tests", "CPUOffloadPolicy CUDA path"]
_ROW = re.compile(r"^(PASS|FAIL|SKIP)  (.+?) +(\d+)s  ?(.*)$")
_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def _hidden(name: str) -> bool:
    return bool(_PYTHON_NAME.match(name)) or name == "ninja"


def _path_without_python(folder: Path, first: Path) -> str:
    """``first`` then this machine's PATH, each folder that holds a ``python``/``python3*`` (or
    ``ninja``: nobody knows whether the GPU machine has one) as a copy (links) without those:
    the lent machine's ``python3`` is the only Python found."""
    dirs = [str(first)]
    for i, entry in enumerate(os.environ.get("PATH", "").split(os.pathsep)):
        if not os.path.isdir(entry):
            continue
        names = os.listdir(entry)
        if not any(_hidden(n) for n in names):
            dirs.append(entry)
            continue
        mirror = folder / f"path{i}"
        mirror.mkdir()
        for name in names:
            if not _hidden(name):
                (mirror / name).symlink_to(os.path.join(entry, name))
        dirs.append(str(mirror))
    return os.pathsep.join(dirs)


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture(scope="module")
def lent_machine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of the lent GPU machine, less its GPU and its ``python3`` (each test puts
    its own first on PATH): no ``python``, no index, no torchao, nothing carried."""
    folder = tmp_path_factory.mktemp("lent_machine")
    stub = folder / "no_torchao" / "torchao"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "raise ImportError('torchao is not installed on the GPU machine (imitated by "
        "tests/test_gpu_check.py)')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON", "MFSDP_GPU_CHECK_DRY_RUN", "MFSDP_GPU_CHECK_BUILD")}
    env.update(PIP_NO_INDEX="1", PYTHONPATH=str(stub.parent), OMP_NUM_THREADS="1",
               MFSDP_GPU_DEPS=str(folder / "no_gpu_deps"))
    env["PATH"] = _path_without_python(folder, folder / "bin")
    (folder / "bin").mkdir()
    return env


def _env(lent_machine: dict[str, str]) -> dict[str, str]:
    return dict(lent_machine, CUDA_VISIBLE_DEVICES="", MFSDP_GPU_CHECK_DRY_RUN="1")


@pytest.fixture(scope="module")
def python(lent_machine: dict[str, str]) -> Iterator[str]:
    """The lent machine's ``python3``, first on its PATH: an executable that runs like ``python
    ARGS``, each program forked from one server interpreter that imported torch and the library
    (tests/_forked_programs.py), started in the dry run's environment."""
    folder = Path(lent_machine["PATH"].split(os.pathsep)[0])
    server_socket = str(folder.parent / "server.sock")
    forked = os.path.join(ROOT, "tests", "_forked_programs.py")
    server = subprocess.Popen([sys.executable, forked, "serve", server_socket], cwd=ROOT,
                              env=_env(lent_machine), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n", \
            "the program server did not start"
        wrapper = folder / "python3"
        _executable(wrapper, f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "
                             f"{shlex.quote(forked)} run {shlex.quote(server_socket)} \"$@\"\n")
        yield str(wrapper)
    finally:
        server.kill()
        server.wait(timeout=30)


def _rows(stdout: str, stderr: str = "") -> dict[str, tuple[str, str]]:
    """The summary table: step name (with a trailing space) -> (result, note), in order."""
    summary = stdout.split("### gpu_check summary", 1)
    assert len(summary) == 2, stdout[-3000:] + stderr[-3000:]
    rows = {}
    for line in summary[1].splitlines():
        match = _ROW.match(line)
        if match:
            rows[match.group(2).strip() + " "] = (match.group(1), match.group(4))
    return rows


@pytest.fixture(scope="module")
def dry_run(python: str, lent_machine: dict[str, str]
            ) -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[str, str]]]:
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=_env(lent_machine),
                          capture_output=True, text=True, timeout=850)
    return proc, _rows(proc.stdout, proc.stderr)


def _row(rows: dict[str, tuple[str, str]], start: str) -> tuple[str, str]:
    found = [row for name, row in rows.items() if name.startswith(start)]
    assert len(found) == 1, f"expected one step starting with {start!r}, got {sorted(rows)}"
    return found[0]


def _section(stdout: str, start: str) -> str:
    """The step's own output (between its '### <name>' header and the next one)."""
    parts = stdout.split("\n### ")
    mine = [p for p in parts if p.startswith(start)]
    return mine[0][-4000:] if mine else "(no output)"


def test_dry_run_lists_every_step(dry_run) -> None:
    proc, rows = dry_run
    assert "DRY RUN" in proc.stdout
    assert [_row_name(rows, start) for start in STEPS] == list(rows), list(rows)
    failed = any(result == "FAIL" for result, _ in rows.values())
    assert (proc.returncode != 0) == failed, proc.returncode


def test_dry_run_on_the_lent_machines_python(dry_run, python: str) -> None:
    """No ``python`` on PATH: the script took ``python3`` (the stand-in), imported the package
    from this checkout, and chose a build command that fetches nothing."""
    proc, _ = dry_run
    assert f"### interpreter: python3 ({python})" in proc.stdout, proc.stdout[:3000]
    assert f"### PYTHONPATH={ROOT}:" in proc.stdout, proc.stdout[:3000]
    build = re.search(r"^### build command: (.*)$", proc.stdout, re.M)
    assert build is not None, proc.stdout[:3000]
    assert build.group(1).startswith((
        "python3 -m pip install --no-build-isolation --no-deps --no-index -e . -q (",
        "python3 setup.py build_ext --inplace (")), build.group(1)


def test_torchao_is_not_importable_in_the_dry_run(python: str,
                                                  lent_machine: dict[str, str]) -> None:
    """The imitation holds for the script's programs: torchao is absent, as on the GPU machine."""
    proc = subprocess.run([python, "-c", "import torchao"], cwd=ROOT, env=_env(lent_machine),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "not installed on the GPU machine" in proc.stderr, proc


def _row_name(rows: dict[str, tuple[str, str]], start: str) -> str:
    found = [name for name in rows if name.startswith(start)]
    assert len(found) == 1, f"expected one step starting with {start!r}, got {list(rows)}"
    return found[0]


@pytest.mark.parametrize("step", NEEDS_CUDA)
def test_dry_run_skips_steps_that_need_cuda(dry_run, step: str) -> None:
    _, rows = dry_run
    result, note = _row(rows, step)
    assert result == "SKIP", (result, note)


@pytest.mark.parametrize("step", RUNS_ON_CPU)
def test_dry_run_passes_check_programs_on_cpu(dry_run, step: str) -> None:
    proc, rows = dry_run
    result, note = _row(rows, step)
    assert result == "PASS", f"{note}\n{_section(proc.stdout, step)}\n{proc.stderr[-2000:]}"


SELF_TESTS = [
    ("race.py", ["--strategies", "optim_grads"], "differs bitwise"),
    ("sync_audit.py", ["--strategies", "optim_grads", "--warmup", "1", "--steps", "1"],
     "host syncs: _local_scalar_dense at"),
    ("profile_step.py", [], "off memory_report's"),
]


@pytest.fixture(scope="module")
def self_tests(python: str, lent_machine: dict[str, str]) -> dict[str, tuple[int, str]]:
    """Each program's ``--self-test`` run: (exit status, stdout + stderr), forked from the
    server that runs the dry run's programs."""
    results = {}
    for program, args, _ in SELF_TESTS:
        proc = subprocess.run([python, os.path.join(CHECKS, program), "--device", "cpu",
                               "--self-test", *args], cwd=ROOT, env=_env(lent_machine),
                              capture_output=True, text=True, timeout=300)
        results[program] = (proc.returncode, proc.stdout + proc.stderr)
    return results


@pytest.mark.parametrize("program,args,expected", SELF_TESTS)
def test_check_programs_fail_on_an_injected_defect(self_tests: dict[str, tuple[int, str]],
                                                   program: str, args: list[str],
                                                   expected: str) -> None:
    """``--self-test`` plants the defect each check exists for (a lost collective, a host sync
    in the step, memory the library does not report): the check must fail, naming it."""
    code, output = self_tests[program]
    assert code == 1, output[-6000:]
    assert expected in output, output[-6000:]


def _k(name: str, stream: int, start: float, end: float) -> profile_step.Kernel:
    return profile_step.Kernel(name, stream, start, end)


def test_overlap_report_on_synthetic_kernels() -> None:
    """Stream 7 computes (most kernel time); an injected sleep on stream 20 runs 50 us, 30 of
    them while compute kernels run (two kernels overlapping each other count once); an NCCL
    kernel on stream 30 overlaps nothing."""
    kernels = [
        _k("ampere_bf16_gemm", 7, 0, 40), _k("elementwise", 7, 30, 60),
        _k("at::cuda::spin_kernel(long)", 20, 30, 80),  # compute covers 30-60: 30 us
        _k("ncclDevKernel_AllGather_RING_LL", 30, 100, 110),
        _k("Memcpy DtoD (Device -> Device)", 30, 110, 200),  # copies never pick the stream
    ]
    report = profile_step.overlap_report(kernels)
    assert report.compute_stream == 7
    assert report.communication_streams == {20, 30}
    assert report.communication_us == pytest.approx(60)
    assert report.overlapped_us == pytest.approx(30)
    assert report.fraction == pytest.approx(0.5)
    assert report.on_compute_stream == []


def test_overlap_report_flags_communication_on_the_compute_stream() -> None:
    kernels = [_k("gemm", 7, 0, 100), _k("at::cuda::spin_kernel(long)", 7, 100, 150)]
    report = profile_step.overlap_report(kernels)
    assert report.compute_stream == 7
    assert report.on_compute_stream == ["at::cuda::spin_kernel(long)"]
    assert report.overlapped_us == 0


# ------------------------------------------------------------------------------------------
# The GPU side, on a fake machine: fake `python3` and `nvidia-smi`, every program call logged
# ------------------------------------------------------------------------------------------

_FAKE_PYTHON = """#!/usr/bin/env bash
# tests/test_gpu_check.py's interpreter: answers env_probe.py with FAKE_PROBE; logs any other
# call (its name, arguments and the environment the script gives it) and succeeds.
case "${1:-}" in
  */env_probe.py) printf '%b' "${FAKE_PROBE}"; exit 0 ;;
esac
status=0
# shellcheck disable=SC2254
case "$*" in ${FAKE_FAIL:-"-"}) status=1 ;; esac
{
  printf '%s' "$(basename "$0")"
  for arg in "$@"; do printf '\\037%s' "${arg}"; done
  printf '\\036PYTHONPATH=%s' "${PYTHONPATH:-}"
  printf '\\036PATH1=%s' "${PATH%%:*}"
  printf '\\036MFSDP_FORCE_CUDA=%s' "${MFSDP_FORCE_CUDA:-}"
  printf '\\036TORCH_CUDA_ARCH_LIST=%s' "${TORCH_CUDA_ARCH_LIST:-}"
  printf '\\036TORCH_CUDA_SANITIZER=%s\\n' "${TORCH_CUDA_SANITIZER:-}"
} >> "${FAKE_LOG}"
exit "${status}"
"""
_FAKE_NVIDIA_SMI = """#!/bin/sh
if [ -n "${FAKE_GPU:-}" ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-fake)"; exit 0; fi
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
exit 9
"""
# What env_probe.py says on the lent machine (torch sees its H200; pip and pytest are there).
_LENT_PROBE = {"build": "pip", "build_reason": "pip and setuptools 80.9.0", "pytest": "site",
               "pytest_timeout": "yes", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
               "arch": "9.0", "gpu_name": "NVIDIA H200", "gpus": "1"}


class Call:
    """One logged program call: the name it was called by, its arguments, its environment."""

    def __init__(self, line: str) -> None:
        command, *env = line.split("\x1e")
        self.name, *self.argv = command.split("\x1f")
        self.env = dict(item.split("=", 1) for item in env)


def _fake_run(tmp_path: Path, lent_machine: dict[str, str], *args: str, gpu: bool = True,
              names: tuple[str, ...] = ("python3",), fail: str = "-", **probe: str | None
              ) -> tuple[subprocess.CompletedProcess[str], list[Call]]:
    """gpu_check.sh on the fake machine: ``probe`` changes the lent machine's probe answers
    (None: no such line); calls whose arguments match the glob ``fail`` exit 1; the calls the
    script made, in order."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        _executable(bin_dir / name, _FAKE_PYTHON)
    _executable(bin_dir / "nvidia-smi", _FAKE_NVIDIA_SMI)
    answers = {k: v for k, v in {**_LENT_PROBE, **probe}.items() if v is not None}
    log = tmp_path / "calls.log"
    log.touch()
    env = dict(lent_machine, FAKE_PROBE="".join(f"{k}={v}\\n" for k, v in answers.items()),
               FAKE_LOG=str(log), FAKE_FAIL=fail, MFSDP_GPU_DEPS=str(tmp_path / "gpu_deps"))
    env["PATH"] = os.pathsep.join([str(bin_dir), *lent_machine["PATH"].split(os.pathsep)[1:]])
    if gpu:
        env["FAKE_GPU"] = "1"
    proc = subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    # split("\n"), not splitlines(): that also ends a line at the \\x1e separators
    return proc, [Call(line) for line in log.read_text().split("\n") if line]


def test_gpu_run_builds_with_pip_and_runs_every_step_through_python3(
        tmp_path: Path, lent_machine: dict[str, str]) -> None:
    proc, calls = _fake_run(tmp_path, lent_machine)
    rows = _rows(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "DRY RUN" not in proc.stdout
    assert [_row_name(rows, start) for start in STEPS] == list(rows), list(rows)
    assert {name: result for name, (result, _) in rows.items() if result != "PASS"} == {
        _row_name(rows, "HSDP 2x2 checks"): "SKIP"}, rows
    build = calls[0]
    assert build.argv == ["-m", "pip", "install", "--no-build-isolation", "--no-deps",
                          "--no-index", "-e", ".", "-q"], build.argv
    assert build.env["MFSDP_FORCE_CUDA"] == "1" and build.env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert {call.name for call in calls} == {"python3"}
    assert all(call.env["PYTHONPATH"].split(os.pathsep)[0] == ROOT for call in calls)
    assert all("cpu" not in call.argv for call in calls)
    modules = [call.argv[1] for call in calls if call.argv[0] == "-m"]
    assert modules == ["pip", "pytest", "pytest", "pytest", "torch.distributed.run",
                       "torch.distributed.run", "torch.distributed.run"], modules
    assert calls[-1].env["TORCH_CUDA_SANITIZER"] == "1" and calls[-1].argv[0].endswith("race.py")
    assert [call for call in calls if call.env["TORCH_CUDA_SANITIZER"]] == calls[-1:]


def test_gpu_run_without_pip_or_pytest(tmp_path: Path, lent_machine: dict[str, str]) -> None:
    """No pip: ``setup.py build_ext --inplace``. No pytest (none carried): its steps FAIL,
    saying how to carry it; every other step still runs on the GPU."""
    proc, calls = _fake_run(tmp_path, lent_machine, build="setup.py", build_reason="no pip",
                            pytest="missing", pytest_timeout="no")
    rows = _rows(proc.stdout, proc.stderr)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert calls[0].argv == ["setup.py", "build_ext", "--inplace"], calls[0].argv
    assert calls[0].env["MFSDP_FORCE_CUDA"] == "1"
    for start in PYTEST_STEPS:
        result, note = _row(rows, start)
        assert (result, note) == ("FAIL", "pytest not importable: run scripts/gpu_deps.sh, "
                                          "carry .gpu_deps"), (start, result, note)
    assert "bash scripts/gpu_deps.sh" in proc.stdout
    assert not [call for call in calls if call.argv[:2] == ["-m", "pytest"]]
    passed = [name for name, (result, _) in rows.items() if result == "PASS"]
    assert len(passed) == len(STEPS) - len(PYTEST_STEPS) - 1, rows  # all but HSDP (1 GPU)


def test_gpu_run_with_carried_pytest_and_ninja(tmp_path: Path,
                                               lent_machine: dict[str, str]) -> None:
    """pytest found only in the carried folder, no ninja on PATH: the folder goes on
    PYTHONPATH after this checkout, its ninja first on PATH (the build compiles in parallel)."""
    deps = tmp_path / "gpu_deps"
    (deps / "bin").mkdir(parents=True)
    _executable(deps / "bin" / "ninja", "#!/bin/sh\necho 1.13.0\n")
    proc, calls = _fake_run(tmp_path, lent_machine, pytest="deps")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "### build tools: ninja 1.13.0;" in proc.stdout, proc.stdout[:3000]
    assert all(call.env["PYTHONPATH"].split(os.pathsep)[:2] == [ROOT, str(deps)]
               for call in calls)
    assert all(call.env["PATH1"] == str(deps / "bin") for call in calls)


def test_a_failed_build_fails_the_check_and_the_rest_runs_on_the_reference_ops(
        tmp_path: Path, lent_machine: dict[str, str]) -> None:
    """No nvcc (say): the build FAILs, the kernels' steps are skipped, every other step still
    runs on the GPU (the library then runs its pure-PyTorch reference ops)."""
    proc, calls = _fake_run(tmp_path, lent_machine, fail="*build_ext*", build="setup.py")
    rows = _rows(proc.stdout, proc.stderr)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert [_row_name(rows, start) for start in STEPS] == list(rows), list(rows)
    assert _row(rows, "build (TORCH_CUDA_ARCH_LIST")[0] == "FAIL"
    for start in ("build_info", "op tests", "bench_kernels"):
        assert _row(rows, start) == ("SKIP", "needs the kernels: the build failed"), start
    passed = [name for name, (result, _) in rows.items() if result == "PASS"]
    assert len(passed) == len(STEPS) - 5, rows  # all but the build, the 3 above and HSDP
    assert "### the build FAILED" in proc.stdout
    assert calls[-1].env["TORCH_CUDA_SANITIZER"] == "1"


@pytest.mark.parametrize("probe, message", [
    ({"torch": None, "torch_cuda": None, "arch": None, "gpu_name": None, "gpus": None,
      "torch_error": "ImportError: libcudart.so.13: cannot open shared object file"},
     "python3 cannot run torch (exit status 0): ImportError: libcudart.so.13"),
    ({"arch": None, "gpu_name": None, "gpus": "0", "torch": "2.11.0+cpu", "torch_cuda": "None"},
     "a GPU is in sight (GPU 0: NVIDIA H200 (UUID: GPU-fake)) but torch 2.11.0+cpu (CUDA None) "
     "sees none"),
    ({"arch": None, "gpu_name": None, "gpus": None,
      "cuda_error": "RuntimeError: The NVIDIA driver on your system is too old"},
     "torch cannot reach the GPU: RuntimeError: The NVIDIA driver on your system is too old"),
], ids=["torch-does-not-import", "cpu-only-torch", "driver-too-old"])
def test_a_machine_with_a_gpu_never_turns_into_a_dry_run(
        tmp_path: Path, lent_machine: dict[str, str], probe: dict[str, str | None],
        message: str) -> None:
    """nvidia-smi lists a GPU, torch cannot use it: one FAIL naming why, nothing else run."""
    proc, calls = _fake_run(tmp_path, lent_machine, **probe)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "DRY RUN" not in proc.stdout and calls == []
    [(result, note)] = _rows(proc.stdout, proc.stderr).values()
    assert result == "FAIL" and note.startswith(message), note


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a GPU is in sight here")
def test_no_gpu_in_sight_is_a_dry_run(tmp_path: Path, lent_machine: dict[str, str]) -> None:
    proc, calls = _fake_run(tmp_path, lent_machine, "--plan", gpu=False, arch=None,
                            gpu_name=None, gpus="0")
    assert proc.returncode == 0 and calls == [], proc.stdout
    assert "### DRY RUN" in proc.stdout and "### plan only" in proc.stdout


def test_python_is_preferred_when_on_path(tmp_path: Path, lent_machine: dict[str, str]) -> None:
    proc, _ = _fake_run(tmp_path, lent_machine, "--plan", names=("python", "python3"))
    assert proc.returncode == 0, proc.stdout
    assert f"### interpreter: python ({tmp_path / 'bin' / 'python'})" in proc.stdout, proc.stdout


def test_env_probe_on_a_bare_interpreter(tmp_path: Path) -> None:
    """The real probe on an interpreter with nothing installed (a venv without pip or site
    packages): no pip so ``setup.py``, pytest only from the carried folder, torch's import
    error as the answer; the script then fails on the environment, naming it, runs nothing."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    deps = tmp_path / "gpu_deps"
    deps.mkdir()
    (deps / "pytest.py").write_text("")  # what an unpacked pytest wheel offers to `import`
    bare = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHON")}
    probe = subprocess.run([bare, os.path.join(CHECKS, "env_probe.py"), "--deps", str(deps)],
                           env=env, capture_output=True, text=True, timeout=120)
    answers = dict(line.split("=", 1) for line in probe.stdout.splitlines())
    assert probe.returncode == 0, probe
    assert answers["build"] == "setup.py" and answers["pytest"] == "deps", answers
    assert answers["pytest_timeout"] == "no", answers
    assert answers["torch_error"] == "ModuleNotFoundError: No module named 'torch'", answers
    assert "torch" not in answers and "arch" not in answers, answers
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=dict(env, PYTHON=bare,
                          MFSDP_GPU_DEPS=str(deps)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]
    [(result, note)] = _rows(proc.stdout, proc.stderr).values()
    assert result == "FAIL" and note.endswith("No module named 'torch'"), note
