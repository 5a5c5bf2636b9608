#!/usr/bin/env bash
# Fill .gpu_deps/ with what scripts/gpu_check.sh needs on a GPU machine that has torch but no
# package index to install from (the lent GPU machine: Python 3.12, torch preinstalled, maybe no
# pytest and no ninja):
#   .gpu_deps/<packages>  pytest, its dependencies and pytest-timeout: pure-Python wheels,
#                         unpacked, importable with .gpu_deps on PYTHONPATH (dist-info kept:
#                         pytest finds the pytest-timeout plugin through its entry point)
#   .gpu_deps/bin/ninja   the ninja binary of the ninja wheel: with it the extension's sources
#                         compile in parallel (MAX_JOBS), without it one after another
# Run it HERE, where pip reaches a package index, then carry the folder with the checkout (the
# device tool: carry [".gpu_deps"]); gpu_check.sh uses it only for what the machine lacks.
# About 8 MB. Env: PYTHON (default: python if on PATH, else python3), MFSDP_GPU_DEPS (the
# folder, default .gpu_deps), MFSDP_GPU_DEPS_PYTHON (the GPU machine's Python, default 3.12),
# MFSDP_GPU_DEPS_PLATFORM (its platform, for ninja; default manylinux2014_x86_64).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z ${PYTHON:-} ]]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
OUT=${MFSDP_GPU_DEPS:-.gpu_deps}
TARGET_PYTHON=${MFSDP_GPU_DEPS_PYTHON:-3.12}
PLATFORM=${MFSDP_GPU_DEPS_PLATFORM:-manylinux2014_x86_64}
# Pinned: the versions the suite runs with here (pytest 9 needs Python 3.10+).
PURE=(pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 packaging==26.2 pygments==2.20.0
      pytest-timeout==2.4.0)
NINJA=ninja==1.13.0

WHEELS=$(mktemp -d)
trap 'rm -rf "${WHEELS}"' EXIT
echo "[gpu_deps] downloading ${PURE[*]} ${NINJA} (Python ${TARGET_PYTHON}, ${PLATFORM})"
"${PYTHON}" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "${TARGET_PYTHON}" --platform "${PLATFORM}" --dest "${WHEELS}" \
  "${PURE[@]}" "${NINJA}"

rm -rf "${OUT}"
mkdir -p "${OUT}/bin"
"${PYTHON}" - "${WHEELS}" "${OUT}" <<'PY'
import glob, os, stat, sys, zipfile

wheels, out = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    with zipfile.ZipFile(path) as wheel:
        if os.path.basename(path).startswith("ninja-"):
            # Only the binary: the ninja Python package is not needed (torch runs `ninja`).
            [binary] = [n for n in wheel.namelist() if n.endswith(".data/scripts/ninja")]
            target = os.path.join(out, "bin", "ninja")
            with wheel.open(binary) as src, open(target, "wb") as dst:
                dst.write(src.read())
            os.chmod(target, os.stat(target).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        else:
            wheel.extractall(out)
    print(f"[gpu_deps] {os.path.basename(path)}")
PY

# What gpu_check.sh will rely on: pytest with its timeout plugin, and ninja, from this folder.
PYTHONPATH="${OUT}" "${PYTHON}" -c "import pytest, pytest_timeout; print('[gpu_deps] pytest', pytest.__version__)"
"${OUT}/bin/ninja" --version >/dev/null 2>&1 \
  && echo "[gpu_deps] ninja $("${OUT}/bin/ninja" --version)" \
  || echo "[gpu_deps] (this ninja binary does not run here: built for ${PLATFORM})"
echo "[gpu_deps] ${OUT}: $(du -sh "${OUT}" | cut -f1); carry it with the checkout, then run" \
     "bash scripts/gpu_check.sh there"
