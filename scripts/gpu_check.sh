#!/usr/bin/env bash
# GPU check for megatron_fsdp_v2: one script that proves the most on ONE GPU within 8 minutes
# and prints a table of what passed (PASS / FAIL / SKIP per step). Run it whenever a GPU is at
# hand; the expected time per step is in README.md ("GPU check").
#
#   build          the extension with CUDA kernels for this GPU (MFSDP_FORCE_CUDA)
#   op tests       pytest -m gpu tests/ops
#   race           world-1 NCCL, a torch.cuda._sleep before every side-stream collective,
#                  overlap on vs off bitwise, every strategy, fp32 and bf16 + trace pool +
#                  buckets + activation checkpointing        (scripts/gpu_checks/race.py)
#   sanitizer      the same under TORCH_CUDA_SANITIZER=1 (torch's stream race detector)
#   host syncs     set_sync_debug_mode("error") around steady-state steps (sync_audit.py)
#   shared GPU     2 and 3 gloo ranks on cuda:0 against single-process (shared_gpu.py)
#   no backend     init_process_group() with no backend, fully_shard without a mesh
#                  (default_backend.py)
#   profile        one bf16 ZeRO-3 step: communication on side streams overlapping compute,
#                  peak memory within 15% of memory_report (profile_step.py)
#   then the CUDA runtime tests, examples/train.py on one GPU, the kernel benchmark, and HSDP
#   when 4 GPUs are visible.
#
# Dry run: without a CUDA device visible to torch (or with MFSDP_GPU_CHECK_DRY_RUN=1) the steps
# that need CUDA print SKIP and the check programs run with --device cpu (gloo): the same code,
# the GPU-only assertions reported as not applicable. tests/test_gpu_check.py runs it so.
#
# Usage (from anywhere):  bash scripts/gpu_check.sh
# Env: PYTHON (default python), MAX_JOBS (default 8), TORCH_CUDA_ARCH_LIST (default: this GPU's
# compute capability), MFSDP_GPU_CHECK_BUDGET_S (default 480 = 8 min),
# MFSDP_GPU_CHECK_DRY_RUN (1: dry run even with a GPU; 0: fail without one; unset: dry run
# when torch sees no CUDA device). Every step runs under `timeout`; the whole script stays
# within the budget. Exit status 0 when no step failed.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON=${PYTHON:-python}
BUDGET_S=${MFSDP_GPU_CHECK_BUDGET_S:-480}
DEADLINE=$(( $(date +%s) + BUDGET_S ))
CHECKS=scripts/gpu_checks
ROWS=()     # "RESULT|name|seconds|note", in the order the steps ran
FAILED=0

record() {  # record RESULT NAME SECONDS NOTE
  ROWS+=("$1|$2|$3|$4")
  [[ $1 == FAIL ]] && FAILED=1
  return 0
}

# step NAME LIMIT_S CMD...: run CMD under timeout (capped by what is left of the budget).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) ))
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

# ---------------------------------------------------------------------------
# 0. Environment: GPU or dry run
# ---------------------------------------------------------------------------
nvidia-smi -L 2>/dev/null || echo "(nvidia-smi not found)"
ARCH=$(timeout 120 "${PYTHON}" -c "import torch; print('%d.%d' % \
torch.cuda.get_device_capability() if torch.cuda.is_available() else '')" 2>/dev/null || true)
case "${MFSDP_GPU_CHECK_DRY_RUN:-auto}" in
  1) DRY_RUN=1 ;;
  0) DRY_RUN=0
     if [[ -z ${ARCH} ]]; then
       echo "### torch sees no CUDA device and MFSDP_GPU_CHECK_DRY_RUN=0: nothing to check"
       exit 1
     fi ;;
  *) DRY_RUN=0; [[ -z ${ARCH} ]] && DRY_RUN=1 ;;
esac
if (( DRY_RUN )); then
  DEVICE=cpu
  DEVICE_NAME=cpu
  echo "### DRY RUN: the check programs run on CPU (gloo); steps that need CUDA are skipped"
else
  DEVICE=cuda
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${ARCH}}
  DEVICE_NAME=$("${PYTHON}" -c "import torch; print(torch.cuda.get_device_name())")
  "${PYTHON}" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name(), 'arch', '${TORCH_CUDA_ARCH_LIST}')"
fi

# ---------------------------------------------------------------------------
# 1. Build with CUDA kernels for this GPU (MFSDP_FORCE_CUDA: no silent CPU-only build)
# ---------------------------------------------------------------------------
if ! cuda_step "build (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-none})" 240 \
    env MFSDP_FORCE_CUDA=1 MAX_JOBS="${MAX_JOBS:-8}" \
    "${PYTHON}" -m pip install --no-build-isolation --no-deps -e . -q; then
  summary
  exit 1
fi
cuda_step "build_info reports CUDA kernels" 30 "${PYTHON}" -c \
  "import megatron_fsdp_v2.ops as o; info = o.build_info(); print(info); \
assert info['cuda_kernels'] and info['cpu_kernels'], info"

# ---------------------------------------------------------------------------
# 2. CUDA op tests
# ---------------------------------------------------------------------------
cuda_step "op tests (pytest -m gpu tests/ops)" 120 \
  "${PYTHON}" -m pytest -m gpu tests/ops -q -p no:cacheprovider

# ---------------------------------------------------------------------------
# 3. Stream safety, host syncs, ranks sharing the GPU, default backend, one profiled step
# ---------------------------------------------------------------------------
step "race amplifier: overlap on vs off bitwise" 90 \
  "${PYTHON}" "${CHECKS}/race.py" --device "${DEVICE}"
# The sanitizer checks ordering, not timing: no sleep needed, fewer steps (it is slow).
cuda_step "race check under TORCH_CUDA_SANITIZER=1" 120 \
  env TORCH_CUDA_SANITIZER=1 "${PYTHON}" "${CHECKS}/race.py" --device "${DEVICE}" \
  --steps 2 --sleep-cycles 0
step "host-sync audit of steady-state steps" 60 \
  "${PYTHON}" "${CHECKS}/sync_audit.py" --device "${DEVICE}"
step "2 and 3 gloo ranks sharing one device vs single-process" 120 \
  "${PYTHON}" "${CHECKS}/shared_gpu.py" --device "${DEVICE}"
step "init_process_group() without backend" 60 \
  "${PYTHON}" "${CHECKS}/default_backend.py" --device "${DEVICE}"
step "profiled bf16 ZeRO-3 step: streams, overlap, memory" 60 \
  "${PYTHON}" "${CHECKS}/profile_step.py" --device "${DEVICE}"

# ---------------------------------------------------------------------------
# 4. CUDA runtime tests, the training example, the kernel benchmark, HSDP
# ---------------------------------------------------------------------------
# Keep each limit small: the whole script must fit in MFSDP_GPU_CHECK_BUDGET_S.
later_checks() {
  # fully_shard on CUDA/NCCL against a single-GPU reference, overlap vs synchronous, bf16;
  # failed steps with collectives in flight on the side streams recover (bounded event
  # waits) and then train bitwise as if they had not failed.
  cuda_step "CUDA runtime tests (pytest -m gpu tests/distributed)" 90 \
    "${PYTHON}" -m pytest -m gpu tests/distributed -q -p no:cacheprovider -s
  # The training example as torchrun starts it (init_process_group with device_id), one GPU.
  local strategy
  for strategy in optim optim_grads_params; do
    cuda_step "examples/train.py 1 GPU ${strategy}" 45 \
      "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node=1 \
      examples/train.py --strategy "${strategy}" --steps 5
  done
  # Last: a benchmark, not a check ("plain" = device-to-device copy of the same bytes).
  cuda_step "bench_kernels --device cuda" 60 \
    "${PYTHON}" benchmarks/bench_kernels.py --device cuda --iters 20
  hsdp_check
}

# HSDP (2-D mesh, outer no_shard) on NCCL: needs 4 GPUs (a 2 x 2 mesh); skipped otherwise.
hsdp_check() {
  local gpus=0
  (( DRY_RUN )) || gpus=$(timeout 60 "${PYTHON}" -c \
    "import torch; print(torch.cuda.device_count())" || echo 0)
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
