#!/usr/bin/env bash
# GPU check for megatron_fsdp_v2: one script that proves the most on ONE GPU within 8 minutes,
# build included, and prints a table of what passed (PASS / FAIL / SKIP per step). Run it
# whenever a GPU is at hand; the expected time per step is in README.md ("GPU check").
#
#   environment    one interpreter answers: torch, the GPU, pytest, how to build
#                  (scripts/gpu_checks/env_probe.py)
#   build          the extension with CUDA kernels for this GPU (MFSDP_FORCE_CUDA=1), in place:
#                  `pip install --no-build-isolation --no-deps --no-index -e .` where pip and
#                  setuptools can (nothing is fetched), else `setup.py build_ext --inplace`
#   op tests       pytest -m gpu tests/ops
#   race           world-1 NCCL, a torch.cuda._sleep before every side-stream collective,
#                  overlap on vs off bitwise, every strategy, fp32 and bf16 + trace pool +
#                  buckets + activation checkpointing        (scripts/gpu_checks/race.py)
#   host syncs     set_sync_debug_mode("error") around steady-state steps (sync_audit.py)
#   shared GPU     2 and 3 gloo ranks on cuda:0 against single-process (shared_gpu.py)
#   no backend     init_process_group() with no backend, fully_shard without a mesh
#                  (default_backend.py)
#   profile        one bf16 ZeRO-3 step: communication on side streams overlapping compute,
#                  peak memory within 15% of memory_report (profile_step.py)
#   then the CUDA runtime tests, CPUOffloadPolicy's CUDA path (test_cpu_offload.py -m gpu),
#   examples/train.py on one GPU, the kernel benchmark, HSDP when
#   4 GPUs are visible, and last the race check under TORCH_CUDA_SANITIZER=1 (the slowest:
#   it gets what is left of the budget, never the other steps' time).
#
# Every program runs as `$PYTHON ...` (pytest and torchrun as `$PYTHON -m ...`) with this
# checkout first on PYTHONPATH: the package is imported in place, installed or not.
#
# Dry run: only where no GPU is in sight (nvidia-smi lists none, no /dev/nvidia0, and torch
# sees no CUDA device), or with MFSDP_GPU_CHECK_DRY_RUN=1: the steps that need CUDA print SKIP
# and the check programs run with --device cpu (gloo): the same code, the GPU-only assertions
# reported as not applicable. tests/test_gpu_check.py runs it so. A machine with a GPU never
# falls back to a dry run: a torch that fails to import, fails to reach the GPU, or sees none
# while a GPU is in sight is a FAIL.
#
# pytest is not part of torch: where the interpreter has none, `bash scripts/gpu_deps.sh` (on a
# machine that reaches a package index) fills .gpu_deps/ with pytest, its dependencies,
# pytest-timeout and a ninja binary; carried to the GPU machine, this script puts it on
# PYTHONPATH (and ninja on PATH) when needed. Without pytest the pytest steps FAIL, saying so.
#
# Usage (from anywhere):  bash scripts/gpu_check.sh [--plan]
#   --plan: print the environment and what would run (interpreter, GPU or dry run, build
#   command, pytest, ninja), then stop.
# Env: PYTHON (default: python if on PATH, else python3), MAX_JOBS (default: the CPU count),
# TORCH_CUDA_ARCH_LIST (default: this GPU's compute capability), MFSDP_GPU_CHECK_BUDGET_S
# (default 480 = 8 min), MFSDP_GPU_CHECK_DRY_RUN (1: dry run even with a GPU; 0: fail without
# one; unset: as above), MFSDP_GPU_CHECK_BUILD (pip or setup.py: overrides the choice),
# MFSDP_GPU_DEPS (default .gpu_deps). Every step runs under `timeout`; the whole script stays
# within the budget. Exit status 0 when no step failed.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
PLAN=0
[[ ${1:-} == --plan ]] && PLAN=1
if [[ -z ${PYTHON:-} ]]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
BUDGET_S=${MFSDP_GPU_CHECK_BUDGET_S:-480}
DEADLINE=$(( $(date +%s) + BUDGET_S ))
CHECKS=scripts/gpu_checks
DEPS=${MFSDP_GPU_DEPS:-${ROOT}/.gpu_deps}
ROWS=()     # "RESULT|name|seconds|note", in the order the steps ran
FAILED=0
DRY_RUN=0
DEVICE_NAME="(no device)"

record() {  # record RESULT NAME SECONDS NOTE
  ROWS+=("$1|$2|$3|$4")
  [[ $1 == FAIL ]] && FAILED=1
  return 0
}

# step NAME LIMIT_S CMD...: run CMD under timeout (capped by what is left of the budget).
step() {
  local name=$1 limit=$2
  shift 2
  # --kill-after may add 10 s to a step that ignores SIGTERM: keep them inside the budget.
  local left=$(( DEADLINE - $(date +%s) - 10 ))
  (( limit > left )) && limit=$left
  if (( limit <= 5 )); then
    echo "### ${name}: time budget exhausted"
    record FAIL "${name}" 0 "not run: time budget exhausted"
    return 1
  fi
  echo
  echo "### ${name} (timeout ${limit}s)"
  local start=$SECONDS rc=0
  timeout --kill-after=10 "${limit}" "$@" || rc=$?
  local took=$(( SECONDS - start ))
  if (( rc == 0 )); then
    record PASS "${name}" "${took}" ""
  elif (( rc == 124 || rc == 137 )); then
    echo "### ${name}: TIMED OUT after ${limit}s"
    record FAIL "${name}" "${took}" "timed out after ${limit}s"
  else
    record FAIL "${name}" "${took}" "exit status ${rc}"
  fi
  return "${rc}"
}

# cuda_step NAME LIMIT_S CMD...: a step that needs CUDA (SKIP in the dry run).
cuda_step() {
  if (( DRY_RUN )); then
    record SKIP "$1" 0 "needs CUDA (dry run)"
    return 0
  fi
  step "$@"
}

# pytest_step NAME LIMIT_S PYTEST_ARGS...: `$PYTHON -m pytest ...`, a CUDA step; FAIL (not a
# silent pass) when this interpreter has no pytest.
pytest_step() {
  local name=$1 limit=$2
  shift 2
  if (( DRY_RUN )); then
    record SKIP "${name}" 0 "needs CUDA (dry run)"
    return 0
  fi
  if [[ ${PYTEST_FROM} == missing ]]; then
    echo "### ${name}: FAIL: ${PYTHON} cannot import pytest, and ${DEPS} has none. Fix: run" \
         "\`bash scripts/gpu_deps.sh\` on a machine that reaches a package index and carry" \
         "its .gpu_deps folder here (or install pytest and pytest-timeout)."
    record FAIL "${name}" 0 "pytest not importable: run scripts/gpu_deps.sh, carry .gpu_deps"
    return 1
  fi
  step "${name}" "${limit}" "${PYTHON}" -m pytest "$@"
}

summary() {
  echo
  local mode="on ${DEVICE_NAME}"
  (( DRY_RUN )) && mode="DRY RUN on CPU: steps that need CUDA are SKIPPED; this is no GPU check"
  echo "### gpu_check summary ($(( BUDGET_S - (DEADLINE - $(date +%s)) ))s used of" \
       "${BUDGET_S}s; ${mode})"
  printf '%-4s  %-62s %5s  %s\n' RES STEP TIME NOTE
  local row result name took note
  for row in "${ROWS[@]}"; do
    IFS='|' read -r result name took note <<< "${row}"
    printf '%-4s  %-62s %4ss  %s\n' "${result}" "${name}" "${took}" "${note}"
  done
  (( FAILED == 0 ))
}

# environment_fail REASON: the environment cannot run the check (and it is no dry run).
environment_fail() {
  echo "### environment: FAIL: $1"
  DRY_RUN=0
  DEVICE_NAME="no device: the environment check failed"
  record FAIL "environment (${PYTHON}, torch, GPU)" 0 "$1"
  summary
  exit 1
}

# ---------------------------------------------------------------------------
# 0. Environment: the interpreter, GPU or dry run, pytest, the build command
# ---------------------------------------------------------------------------
# This checkout first: every step imports the package built in place.
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
GPU_LIST=$(nvidia-smi -L 2>/dev/null | grep '^GPU ' || true)
if [[ -z ${GPU_LIST} ]] && compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  # No nvidia-smi (a slim container), but the driver's device nodes are here: a GPU all the same.
  GPU_LIST="device nodes $(compgen -G '/dev/nvidia[0-9]*' | tr '\n' ' ')(nvidia-smi lists none)"
fi
echo "${GPU_LIST:-(no GPU in sight: nvidia-smi lists none, no /dev/nvidia0)}"
declare -A PROBE=()
PROBE_RC=0
PROBE_OUT=$(timeout 120 "${PYTHON}" "${CHECKS}/env_probe.py" --deps "${DEPS}") || PROBE_RC=$?
while IFS='=' read -r key value; do
  [[ ${key} =~ ^[a-z_]+$ ]] && PROBE[${key}]=${value}
done <<< "${PROBE_OUT}"
echo "${PROBE_OUT}"
ARCH=${PROBE[arch]:-}
GPUS=${PROBE[gpus]:-0}
PYTEST_FROM=${PROBE[pytest]:-missing}

case "${MFSDP_GPU_CHECK_DRY_RUN:-auto}" in
  1) DRY_RUN=1 ;;
  0) DRY_RUN=0 ;;
  *) DRY_RUN=0; [[ -z ${ARCH} && -z ${GPU_LIST} && -z ${PROBE[cuda_error]:-} ]] && DRY_RUN=1 ;;
esac
if [[ -z ${PROBE[torch]:-} ]]; then
  # Not even a dry run can go on without torch.
  environment_fail "${PYTHON} cannot run torch (exit status ${PROBE_RC}): ${PROBE[torch_error]:-the probe printed no torch version}"
fi
if (( ! DRY_RUN )); then
  [[ -n ${PROBE[cuda_error]:-} ]] && environment_fail "torch cannot reach the GPU: ${PROBE[cuda_error]}"
  if [[ -z ${ARCH} ]]; then
    if [[ -n ${GPU_LIST} ]]; then
      environment_fail "a GPU is in sight (${GPU_LIST%%$'\n'*}) but torch ${PROBE[torch]} (CUDA ${PROBE[torch_cuda]:-none}) sees none: a CPU-only torch, or CUDA_VISIBLE_DEVICES hides it"
    fi
    environment_fail "torch sees no CUDA device and MFSDP_GPU_CHECK_DRY_RUN=0: nothing to check"
  fi
fi

if [[ ${PYTEST_FROM} == deps ]]; then
  export PYTHONPATH="${ROOT}:${DEPS}${PYTHONPATH#"${ROOT}"}"
fi
if ! command -v ninja >/dev/null 2>&1 && [[ -x ${DEPS}/bin/ninja ]] \
    && "${DEPS}/bin/ninja" --version >/dev/null 2>&1; then
  export PATH="${DEPS}/bin:${PATH}"
fi
NINJA=$(command -v ninja >/dev/null 2>&1 && echo "ninja $(ninja --version 2>/dev/null)" \
        || echo "no ninja: the sources compile one after another")
BUILD=${MFSDP_GPU_CHECK_BUILD:-${PROBE[build]:-setup.py}}
case "${BUILD}" in
  pip) BUILD_CMD=("${PYTHON}" -m pip install --no-build-isolation --no-deps --no-index -e . -q) ;;
  setup.py) BUILD_CMD=("${PYTHON}" setup.py build_ext --inplace) ;;
  *) environment_fail "MFSDP_GPU_CHECK_BUILD=${BUILD}: expected pip or setup.py" ;;
esac

if (( DRY_RUN )); then
  DEVICE=cpu
  DEVICE_NAME=cpu
  echo "### DRY RUN: the check programs run on CPU (gloo); steps that need CUDA are skipped"
  [[ -n ${GPU_LIST} ]] && echo "### (MFSDP_GPU_CHECK_DRY_RUN=1 although nvidia-smi lists a GPU)"
else
  DEVICE=cuda
  DEVICE_NAME=${PROBE[gpu_name]:-GPU}
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${ARCH}}
fi
echo "### interpreter: ${PYTHON} ($(command -v "${PYTHON}" || echo "not on PATH"))," \
     "torch ${PROBE[torch]} (CUDA ${PROBE[torch_cuda]:-none})"
echo "### device: ${DEVICE} (${DEVICE_NAME}, ${GPUS} GPU(s), arch ${ARCH:-none})"
echo "### build command: ${BUILD_CMD[*]} (${MFSDP_GPU_CHECK_BUILD:+MFSDP_GPU_CHECK_BUILD, }${PROBE[build_reason]:-})"
echo "### build tools: ${NINJA}; MAX_JOBS=${MAX_JOBS:-$(nproc)}"
echo "### pytest: ${PYTEST_FROM} (pytest-timeout: ${PROBE[pytest_timeout]:-no})"
echo "### PYTHONPATH=${PYTHONPATH}"
if (( PLAN )); then
  echo "### plan only (--plan): nothing run"
  exit 0
fi

# ---------------------------------------------------------------------------
# 1. Build with CUDA kernels for this GPU (MFSDP_FORCE_CUDA: no silent CPU-only build)
# ---------------------------------------------------------------------------
# A failed build (no nvcc, a compile error) fails the check but does not end it: without the
# extension the library runs its pure-PyTorch reference ops, so the steps that test streams,
# NCCL, host syncs and memory still say something; those that test the kernels are skipped.
BUILT=1
if ! cuda_step "build (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-none}, ${BUILD})" 200 \
    env MFSDP_FORCE_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" "${BUILD_CMD[@]}"; then
  BUILT=0
  echo "### the build FAILED: the steps below run the library's pure-PyTorch reference ops;" \
       "the kernels' steps are skipped"
fi

# needs_kernels NAME: false (and the step recorded SKIP) when the build failed.
needs_kernels() {
  (( BUILT || DRY_RUN )) && return 0
  record SKIP "$1" 0 "needs the kernels: the build failed"
  return 1
}

needs_kernels "build_info reports CUDA kernels" \
  && cuda_step "build_info reports CUDA kernels" 30 "${PYTHON}" -c \
  "import megatron_fsdp_v2.ops as o; info = o.build_info(); print(info); \
assert info['cuda_kernels'] and info['cpu_kernels'], info"

# ---------------------------------------------------------------------------
# 2. CUDA op tests
# ---------------------------------------------------------------------------
needs_kernels "op tests (pytest -m gpu tests/ops)" \
  && pytest_step "op tests (pytest -m gpu tests/ops)" 90 -m gpu tests/ops -q -p no:cacheprovider

# ---------------------------------------------------------------------------
# 3. Stream safety, host syncs, ranks sharing the GPU, default backend, one profiled step
# ---------------------------------------------------------------------------
step "race amplifier: overlap on vs off bitwise" 60 \
  "${PYTHON}" "${CHECKS}/race.py" --device "${DEVICE}"
step "host-sync audit of steady-state steps" 45 \
  "${PYTHON}" "${CHECKS}/sync_audit.py" --device "${DEVICE}"
step "2 and 3 gloo ranks sharing one device vs single-process" 90 \
  "${PYTHON}" "${CHECKS}/shared_gpu.py" --device "${DEVICE}"
step "init_process_group() without backend" 45 \
  "${PYTHON}" "${CHECKS}/default_backend.py" --device "${DEVICE}"
step "profiled bf16 ZeRO-3 step: streams, overlap, memory" 45 \
  "${PYTHON}" "${CHECKS}/profile_step.py" --device "${DEVICE}"

# ---------------------------------------------------------------------------
# 4. CUDA runtime tests, the training example, the kernel benchmark, HSDP, the sanitizer
# ---------------------------------------------------------------------------
# Keep each limit small: the whole script must fit in MFSDP_GPU_CHECK_BUDGET_S.
later_checks() {
  # fully_shard on CUDA/NCCL against a single-GPU reference, overlap vs synchronous, bf16;
  # failed steps with collectives in flight on the side streams recover (bounded event
  # waits) and then train bitwise as if they had not failed.
  pytest_step "CUDA runtime tests (pytest -m gpu tests/distributed)" 90 \
    -m gpu tests/distributed -q -p no:cacheprovider -s \
    --ignore=tests/distributed/test_cpu_offload.py
  # CPUOffloadPolicy's copying path on CUDA (pinned host buffers, non-blocking H2D/D2H copies,
  # the window's event sync) at world 1 and 2 against the run without offload; on CPU its
  # logic is tested through a switch, this is where the CUDA side runs ([Note: host offload]).
  pytest_step "CPUOffloadPolicy CUDA path (pytest -m gpu test_cpu_offload.py)" 60 \
    -m gpu tests/distributed/test_cpu_offload.py -q -p no:cacheprovider -s
  # The training example as torchrun starts it (init_process_group with device_id), one GPU.
  local strategy
  for strategy in optim optim_grads_params; do
    cuda_step "examples/train.py 1 GPU ${strategy}" 40 \
      "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node=1 \
      examples/train.py --strategy "${strategy}" --steps 5
  done
  # torch.optim.Muon on the blocks' matrices (its step on CUDA; one rank: no exchange).
  cuda_step "examples/train.py 1 GPU --optimizer muon" 40 \
    "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node=1 \
    examples/train.py --optimizer muon --steps 5
  # A benchmark, not a check ("plain" = device-to-device copy of the same bytes).
  needs_kernels "bench_kernels --device cuda" \
    && cuda_step "bench_kernels --device cuda" 45 \
    "${PYTHON}" benchmarks/bench_kernels.py --device cuda --iters 20
  hsdp_check
  # Last: the slowest step (a stack trace per kernel launch) takes what is left, no one else's
  # time. It checks ordering, not timing: no sleep needed, fewer steps.
  cuda_step "race check under TORCH_CUDA_SANITIZER=1" 120 \
    env TORCH_CUDA_SANITIZER=1 "${PYTHON}" "${CHECKS}/race.py" --device "${DEVICE}" \
    --steps 2 --sleep-cycles 0
}

# HSDP (2-D mesh, outer no_shard) on NCCL: needs 4 GPUs (a 2 x 2 mesh); skipped otherwise.
hsdp_check() {
  local gpus=${GPUS}
  (( DRY_RUN )) && gpus=0
  if (( gpus < 4 )); then
    record SKIP "HSDP 2x2 checks" 0 "${gpus} GPU(s) visible, a 2x2 HSDP mesh needs 4"
    return 0
  fi
  step "examples/train.py 4 GPUs HSDP --mesh 2,2 optim_grads_params" 90 \
    "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node=4 \
    examples/train.py --mesh 2,2 --strategy optim_grads_params --steps 10
  step "bench_training HSDP 2x2 vs FSDP2 HSDP" 150 \
    "${PYTHON}" benchmarks/bench_training.py --device cuda --world-size 4 --mesh 2,2 \
    --model-size small --systems optim_grads,optim_grads_params,fsdp2_noreshard,fsdp2 \
    --steps 6 --rounds 1 --timeout 120
}
later_checks

summary
