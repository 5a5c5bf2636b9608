#!/usr/bin/env bash
# The compatibility subset on another torch release, in a virtual environment of its own.
#
#   bash scripts/compat_torch.sh 2.15.0          # or 2.11.0, 2.12.1, 2.13.0, ...
#
# Creates (once) a virtual environment with that torch and the test tools, copies the working
# tree (tracked and untracked, not ignored files) into a build folder beside it, builds the
# extension there with CPU kernels only (the install default's build compiles the CUDA ones; a
# second in-place build would replace this checkout's `_C` with one for another torch), then runs
# the compatibility subset from that copy: the example, the torch-version reasons of the patches,
# unit and op tests, and the distributed tests of the DTensor paths, torch's and our state-dict
# and checkpoint APIs, parity per strategy, HSDP, meta init, tensor parallel, FP8, FSDP2's
# methods (manual finalization included), pipeline parallel and the hostile cases
# (test_hostile_*.py: checkpoint safety, errors, training semantics). The same tests as the
# full suite, not a lighter variant; the full suite runs on the install default.
#
# Where the machine caps torch through a pip constraints file (PIP_CONSTRAINT or pip's config),
# the cap is lifted for this environment only (PIP_CONSTRAINT=/dev/null for its pip calls).
#
# Env: MFSDP_COMPAT_DIR (default /tmp/mfsdp-compat): where the environments and build folders go.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: bash scripts/compat_torch.sh TORCH_VERSION (e.g. 2.15.0)}
ROOT=${MFSDP_COMPAT_DIR:-/tmp/mfsdp-compat}
VENV="${ROOT}/venv-torch-${VERSION}"
TREE="${ROOT}/tree-torch-${VERSION}"
PYTHON="${VENV}/bin/python"
# The versions scripts/install.sh pins (torchao without its dependencies: it must not change torch).
TORCHAO_VERSION=0.18.0
SPMD_TYPES_VERSION=0.2.3

mkdir -p "${ROOT}"
if ! "${PYTHON}" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${VERSION}')" \
    2>/dev/null; then
  echo "[compat ${VERSION}] creating ${VENV}"
  rm -rf "${VENV}"
  python -m venv "${VENV}"
  PIP_CONSTRAINT=/dev/null "${PYTHON}" -m pip install --disable-pip-version-check -q \
    "torch==${VERSION}" pytest pytest-timeout numpy ninja setuptools wheel hypothesis
fi
"${PYTHON}" -c "import importlib.metadata as md, sys; sys.exit(md.version('torchao') != \
'${TORCHAO_VERSION}' or md.version('spmd_types') != '${SPMD_TYPES_VERSION}')" 2>/dev/null \
  || PIP_CONSTRAINT=/dev/null "${PYTHON}" -m pip install --disable-pip-version-check -q --no-deps \
       "torchao==${TORCHAO_VERSION}" "spmd_types==${SPMD_TYPES_VERSION}"

# A fresh copy of the tree each run (the build output of the last run is kept: an unchanged
# source is not recompiled).
mkdir -p "${TREE}"
git ls-files -z --cached --others --exclude-standard \
  | tar --null --files-from=- --ignore-failed-read -cf - | tar -xf - -C "${TREE}"
cd "${TREE}"
echo "[compat ${VERSION}] building the extension (CPU kernels) in ${TREE}"
# MFSDP_FORCE_CPU stays set for the tests too: they expect CUDA kernels from a CUDA torch
# otherwise (tests/ops: test_build_info).
export MFSDP_FORCE_CPU=1
MAX_JOBS="${MAX_JOBS:-2}" "${PYTHON}" -m pip install --disable-pip-version-check \
  -q --no-build-isolation --no-deps -e .
"${PYTHON}" -c "import megatron_fsdp_v2 as m; print('[compat] build_info:', m.build_info())"

# The example as the README's first command runs it (fewer steps), with no environment variable.
"${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node=2 examples/train.py \
  --strategy optim_grads --steps 4

exec "${PYTHON}" -m pytest -q -p no:cacheprovider \
  tests/unit tests/ops \
  tests/distributed/test_dtensor_paths.py \
  tests/distributed/test_spmd_activations.py \
  tests/distributed/test_parity.py \
  tests/distributed/test_torch_state_dict.py \
  tests/distributed/test_torch_full_state_dict.py \
  tests/distributed/test_checkpoint.py \
  tests/distributed/test_checkpoint_state_dicts.py \
  tests/distributed/test_hsdp.py \
  tests/distributed/test_hsdp_checkpoint.py \
  tests/distributed/test_meta_init.py \
  tests/distributed/test_random_init.py \
  tests/distributed/test_fsdp_tp.py \
  tests/distributed/test_fsdp_tp_checkpoint.py \
  tests/distributed/test_fp8_params.py \
  tests/distributed/test_comm_groups.py \
  tests/distributed/test_fsdp2_surface.py \
  tests/distributed/test_manual_finalization.py \
  tests/distributed/test_pipeline_parallel.py \
  tests/distributed/test_hostile_checkpoint.py \
  tests/distributed/test_hostile_errors.py \
  tests/distributed/test_hostile_training.py
