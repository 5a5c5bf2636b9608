#!/usr/bin/env bash
# Lint and type check, configured in pyproject.toml: ruff over the repository ([tool.ruff]) and
# mypy over the package ([tool.mypy]). Runs both, so one run lists every finding; exits non-zero
# if either found something. Run it locally before pushing: `bash .ci/lint.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()
echo "CI: ruff check . ($(python -m ruff --version))"
python -m ruff check --output-format=concise . || failed+=("ruff")
echo "CI: mypy megatron_fsdp_v2 ($(python -m mypy --version))"
python -m mypy megatron_fsdp_v2 || failed+=("mypy")
if [ "${#failed[@]}" -gt 0 ]; then
    echo "CI: lint/type check FAILED: ${failed[*]} (see above; 'ruff check --fix .' sorts imports)"
    exit 1
fi
echo "CI: ruff and mypy clean"
