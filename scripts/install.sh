#!/usr/bin/env bash
# Set up a fresh machine: PyTorch (CUDA build when the machine offers it, so the CUDA kernels are
# compiled even without a GPU), test tools, and the extension, built in place. Idempotent: a
# second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${MFSDP_TORCH_VERSION:-2.14.1}"
PIP="python -m pip --disable-pip-version-check -q"

if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${TORCH_VERSION}')" 2>/dev/null; then
    echo "[install] torch==${TORCH_VERSION}"
    if ! $PIP install "torch==${TORCH_VERSION}"; then
        # The CPU build (still compiles the CPU kernels; CUDA sources get an nvcc syntax check).
        echo "[install] torch==${TORCH_VERSION} unavailable; falling back to torch==2.13.0 (CPU build)"
        $PIP install "torch==2.13.0"
    fi
fi
python - <<'PY' || $PIP install pytest pytest-timeout numpy ninja setuptools wheel
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in ("pytest", "pytest_timeout", "numpy", "ninja")))
PY

# One CUDA arch keeps the CI build short; an explicit TORCH_CUDA_ARCH_LIST wins.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
echo "[install] building megatron_fsdp_v2._C (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}, MAX_JOBS=${MAX_JOBS})"
$PIP install --no-build-isolation --no-deps -e .
python -c "import megatron_fsdp_v2 as m; print('[install] build_info:', m.build_info())"
