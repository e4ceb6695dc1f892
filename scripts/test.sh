#!/usr/bin/env bash
# Sets everything up and runs all tests: lint, CTest (GoogleTest) and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
if [ ! -f /usr/include/gtest/gtest.h ] && [ "${FUSIBLE_OFFLINE:-0}" != 1 ]; then
  (apt-get update -qq && apt-get install -y -qq libgtest-dev) >/dev/null
fi

echo "== lint"
"$PY" -m ruff check python tests benchmarks examples
"$PY" -m ruff format --check python tests benchmarks examples
"$PY" -m mypy
if command -v clang-format >/dev/null; then  # the GPU machine (offline) may not have it
  git ls-files -z '*.cpp' '*.h' '*.cu' '*.cuh' | xargs -0 clang-format --dry-run --Werror
fi

echo "== ctest"
BUILD=${FUSIBLE_TEST_BUILD_DIR:-build/ctest}
# Without a GPU the CUDA cases of CTest cannot run, and setup.sh's package build has compiled
# the CUDA sources already (with nvcc present): the test build then skips CUDA, which halves
# the time of CI on a 2-core machine. A GPU machine builds and runs them (FUSIBLE_CUDA=ON|OFF
# forces either).
CTEST_CUDA=${FUSIBLE_CUDA:-AUTO}
if [ "$CTEST_CUDA" = AUTO ] && ! nvidia-smi -L >/dev/null 2>&1; then CTEST_CUDA=OFF; fi
cmake -S . -B "$BUILD" -DFUSIBLE_BUILD_TESTS=ON -DFUSIBLE_BUILD_PYTHON=OFF \
  -DFUSIBLE_CUDA="$CTEST_CUDA" >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"

echo "== pytest"
# The installed package (with its compiled operator library) is imported, not python/.
"$PY" -m pytest -q -p no:cacheprovider tests/python "$@"

echo "== Python calls per step (benchmarks/overhead.py --calls-only)"
"$PY" benchmarks/overhead.py --calls-only
