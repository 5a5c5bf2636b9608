"""scripts/gpu_check.sh, dry-run on CPU: the steps that need CUDA print SKIP, the check programs
of scripts/gpu_checks run with ``--device cpu`` (gloo) and pass; each check program, given a
known defect (``--self-test``), fails; and the trace arithmetic of the profiled step, which only
runs on a GPU, is right on synthetic kernels.

The script's ``PYTHON`` is a stand-in that forks each program from one interpreter that
imported torch and the library once (tests/_forked_programs.py), the script itself unchanged: its
dry run started six interpreters (and the self-tests three) that spent most of their CPU time
importing. One pass of the script, shared by the cases."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "scripts", "gpu_checks")
sys.path.insert(0, CHECKS)

import profile_step  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # the dry run spawns ranks; slow on a loaded machine

# Step names (their start) in the summary table.
NEEDS_CUDA = [
    "build (TORCH_CUDA_ARCH_LIST", "build_info reports CUDA kernels", "op tests",
    "race check under TORCH_CUDA_SANITIZER=1", "CUDA runtime tests",
    "examples/train.py 1 GPU optim ", "examples/train.py 1 GPU optim_grads_params",
    "bench_kernels", "HSDP 2x2 checks",
]
RUNS_ON_CPU = [
    "race amplifier", "host-sync audit", "2 and 3 gloo ranks", "init_process_group() without",
    "profiled bf16 ZeRO-3 step",
]
_ROW = re.compile(r"^(PASS|FAIL|SKIP)  (.+?) +(\d+)s  ?(.*)$")


def _env() -> dict[str, str]:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                PYTHON=sys.executable, MFSDP_GPU_CHECK_DRY_RUN="1")


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An executable that runs like ``python ARGS``, each program forked from one server
    interpreter that imported torch and the library (tests/_forked_programs.py)."""
    folder = tmp_path_factory.mktemp("forked_python")
    server_socket = str(folder / "server.sock")
    forked = os.path.join(ROOT, "tests", "_forked_programs.py")
    server = subprocess.Popen([sys.executable, forked, "serve", server_socket], cwd=ROOT,
                              env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n", \
            "the program server did not start"
        wrapper = folder / "python"
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "
                           f"{shlex.quote(forked)} run {shlex.quote(server_socket)} \"$@\"\n")
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        yield str(wrapper)
    finally:
        server.kill()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def dry_run(python: str) -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[str, str]]]:
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], cwd=ROOT,
                          env=dict(_env(), PYTHON=python), capture_output=True, text=True,
                          timeout=850)
    summary = proc.stdout.split("### gpu_check summary", 1)
    assert len(summary) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in summary[1].splitlines():
        match = _ROW.match(line)
        if match:
            rows[match.group(2).strip() + " "] = (match.group(1), match.group(4))
    return proc, rows


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
    assert len(rows) == len(NEEDS_CUDA) + len(RUNS_ON_CPU), sorted(rows)
    failed = any(result == "FAIL" for result, _ in rows.values())
    assert (proc.returncode != 0) == failed, proc.returncode


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
def self_tests(python: str) -> dict[str, tuple[int, str]]:
    """Each program's ``--self-test`` run: (exit status, stdout + stderr), forked from the
    server that runs the dry run's programs."""
    results = {}
    for program, args, _ in SELF_TESTS:
        proc = subprocess.run([python, os.path.join(CHECKS, program), "--device", "cpu",
                               "--self-test", *args], cwd=ROOT, env=_env(),
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
