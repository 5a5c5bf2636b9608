#!/usr/bin/env bash
# GPU check for megatron_fsdp_v2, for a machine with an NVIDIA GPU and its own torch:
#   1. build the extension with CUDA kernels for this GPU's architecture,
#   2. run the CUDA op tests (pytest -m gpu tests/ops),
#   3. benchmark the kernels on cuda against FSDP2's ATen ops and against the
#      measured device-to-device copy bandwidth (the benchmark's "plain" column).
# Later training / overlap checks go in later_checks() below.
#
# Usage (from anywhere):  bash scripts/gpu_check.sh
# Env: PYTHON (default python), MAX_JOBS (default 8), TORCH_CUDA_ARCH_LIST (default:
# this GPU's compute capability), MFSDP_GPU_CHECK_BUDGET_S (default 480 = 8 min).
# Every step runs under `timeout`; the whole script stays within the budget.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON=${PYTHON:-python}
BUDGET_S=${MFSDP_GPU_CHECK_BUDGET_S:-480}
DEADLINE=$(( $(date +%s) + BUDGET_S ))
PASSED=()
FAILED=()

# step NAME LIMIT_S CMD...: run CMD under timeout (capped by what is left of the budget).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  (( limit > left )) && limit=$left
  if (( limit <= 5 )); then
    echo "### SKIP ${name}: time budget exhausted"
    FAILED+=("${name} (no time left)")
    return 1
  fi
  echo
  echo "### ${name} (timeout ${limit}s)"
  local start=$SECONDS rc=0
  timeout --kill-after=10 "${limit}" "$@" || rc=$?
  if (( rc == 0 )); then
    PASSED+=("${name} ($(( SECONDS - start ))s)")
  else
    (( rc == 124 || rc == 137 )) && echo "### ${name}: TIMED OUT after ${limit}s"
    FAILED+=("${name} (rc=${rc})")
  fi
  return "${rc}"
}

summary() {
  echo
  echo "### gpu_check summary ($(( BUDGET_S - (DEADLINE - $(date +%s)) ))s used of ${BUDGET_S}s)"
  local item
  for item in "${PASSED[@]}"; do echo "PASS  ${item}"; done
  for item in "${FAILED[@]}"; do echo "FAIL  ${item}"; done
  (( ${#FAILED[@]} == 0 ))
}

# ---------------------------------------------------------------------------
# 0. Environment
# ---------------------------------------------------------------------------
nvidia-smi -L 2>/dev/null || echo "(nvidia-smi not found)"
if ! ARCH=$(timeout 120 "${PYTHON}" -c \
    "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'; \
print('%d.%d' % torch.cuda.get_device_capability())"); then
  echo "### torch sees no CUDA device; nothing to check"
  exit 1
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${ARCH}}
"${PYTHON}" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name(), 'arch', '${TORCH_CUDA_ARCH_LIST}')"

# ---------------------------------------------------------------------------
# 1. Build with CUDA kernels for this GPU (MFSDP_FORCE_CUDA: no silent CPU-only build)
# ---------------------------------------------------------------------------
if ! step "build (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST})" 240 \
    env MFSDP_FORCE_CUDA=1 MAX_JOBS="${MAX_JOBS:-8}" \
    "${PYTHON}" -m pip install --no-build-isolation --no-deps -e . -q; then
  summary
  exit 1
fi
step "build_info reports CUDA kernels" 60 "${PYTHON}" -c \
  "import megatron_fsdp_v2.ops as o; info = o.build_info(); print(info); \
assert info['cuda_kernels'] and info['cpu_kernels'], info"

# ---------------------------------------------------------------------------
# 2. CUDA op tests
# ---------------------------------------------------------------------------
step "pytest -m gpu tests/ops" 150 "${PYTHON}" -m pytest -m gpu tests/ops -q -p no:cacheprovider

# ---------------------------------------------------------------------------
# 3. Kernel benchmark on cuda ("plain" = device-to-device copy of the same bytes)
# ---------------------------------------------------------------------------
step "bench_kernels --device cuda" 120 \
  "${PYTHON}" benchmarks/bench_kernels.py --device cuda --iters 20

# ---------------------------------------------------------------------------
# 4. EXTENSION POINT: later training / overlap checks
# ---------------------------------------------------------------------------
# Keep each limit small: the whole script must fit in MFSDP_GPU_CHECK_BUDGET_S.
later_checks() {
  # fully_shard on CUDA/NCCL: side-stream overlap == synchronous schedule, parity, bf16.
  step "pytest -m gpu tests/distributed (CUDA streams)" 150 \
    "${PYTHON}" -m pytest -m gpu tests/distributed -q -p no:cacheprovider -s
  # The training example on one GPU (NCCL), every strategy.
  local strategy
  for strategy in no_shard optim optim_grads optim_grads_params; do
    step "examples/train.py 1 GPU ${strategy}" 60 \
      "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node=1 \
      examples/train.py --strategy "${strategy}" --steps 10
  done
  hsdp_check
}

# HSDP (2-D mesh, outer no_shard) on NCCL: needs 4 GPUs (a 2 x 2 mesh); skipped otherwise.
hsdp_check() {
  local gpus
  gpus=$(timeout 60 "${PYTHON}" -c "import torch; print(torch.cuda.device_count())" || echo 0)
  if (( gpus < 4 )); then
    echo
    echo "### SKIP HSDP checks: ${gpus} GPU(s) visible, a 2x2 HSDP mesh needs 4"
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
