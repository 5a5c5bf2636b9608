#!/usr/bin/env bash
# Set up a fresh machine: PyTorch (CUDA build when the machine offers it, so the CUDA kernels are
# compiled even without a GPU), test tools (transformers for the Hugging Face tests, torchao for
# the tensor-subclass tests; the package needs neither at run time), and the extension, built in
# place. Idempotent: a second run only rebuilds what changed.
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
# Test and lint tools. ruff and mypy are pinned (as in pyproject.toml's `lint` extra) so that a new
# release's rules cannot turn CI red on unchanged code. transformers is a test dependency only
# (tests/distributed/test_hf_models.py, examples/train_hf.py; the package never imports it),
# pinned to a release known to work with this torch.
RUFF_VERSION=0.17.6
MYPY_VERSION=2.4.1
TRANSFORMERS_VERSION=5.24.0
# torchao: a test dependency only (tests/distributed/test_subclass_params.py: its float8, NF4 and MX
# tensor-subclass parameters), installed with --no-deps so that it can never change torch.
TORCHAO_VERSION=0.18.0
TEST_DEPS=(pytest pytest-timeout numpy ninja setuptools wheel hypothesis
           "ruff==${RUFF_VERSION}" "mypy==${MYPY_VERSION}" "transformers==${TRANSFORMERS_VERSION}")
RUFF_VERSION=$RUFF_VERSION MYPY_VERSION=$MYPY_VERSION TRANSFORMERS_VERSION=$TRANSFORMERS_VERSION \
    python - <<'PY' || $PIP install "${TEST_DEPS[@]}"
import importlib.metadata as md, os, sys
want = {"pytest": None, "pytest-timeout": None, "numpy": None, "ninja": None, "hypothesis": None,
        "ruff": os.environ["RUFF_VERSION"], "mypy": os.environ["MYPY_VERSION"],
        "transformers": os.environ["TRANSFORMERS_VERSION"]}
def ok(name, version):
    try:
        return version is None or md.version(name) == version
    except md.PackageNotFoundError:
        return False
sys.exit(not all(ok(n, v) for n, v in want.items()))
PY

python -c "import importlib.metadata as md, sys; sys.exit(md.version('torchao') != '${TORCHAO_VERSION}')" \
    2>/dev/null || $PIP install --no-deps "torchao==${TORCHAO_VERSION}"
# spmd_types: a test dependency only (tests/distributed/test_dp_mesh_dims_tp.py: torchtitan's
# SPMD annotations on plain parameters, which fully_shard refuses), pure Python, --no-deps.
SPMD_TYPES_VERSION=0.2.3
python -c "import importlib.metadata as md, sys; sys.exit(md.version('spmd_types') != '${SPMD_TYPES_VERSION}')" \
    2>/dev/null || $PIP install --no-deps "spmd_types==${SPMD_TYPES_VERSION}"

# One CUDA arch keeps the CI build short (setup.py's default builds every arch torch was built
# for, about 6x the nvcc time); its PTX costs no extra nvcc pass (the same compute_90 front end)
# and lets newer GPUs JIT the kernels. An explicit TORCH_CUDA_ARCH_LIST wins.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0+PTX}"
export MAX_JOBS="${MAX_JOBS:-2}"
echo "[install] building megatron_fsdp_v2._C (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}, MAX_JOBS=${MAX_JOBS})"
$PIP install --no-build-isolation --no-deps -e .
python -c "import megatron_fsdp_v2 as m; print('[install] build_info:', m.build_info())"
