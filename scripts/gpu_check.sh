#!/usr/bin/env bash
# GPU workflow for a machine with a CUDA GPU and torch but no network (e.g. the H200 device):
# build with --no-build-isolation, run CTest and pytest (GPU tests included), compute-sanitizer
# over the C++ GPU tests, then the benchmarks. Everything is logged into OUT_DIR.
#   bash scripts/gpu_check.sh OUT_DIR [--no-bench] [--no-sanitizer]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: gpu_check.sh OUT_DIR}; shift
BENCH=1; SANITIZE=1
for a in "$@"; do
  case $a in --no-bench) BENCH=0 ;; --no-sanitizer) SANITIZE=0 ;; esac
done
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 FUSIBLE_OFFLINE=1 FUSIBLE_CUDA=ON
PY=${PYTHON:-python3}
status=0
step() { echo "== $1"; shift; "$@" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"; local rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "FAILED ($rc): $*" | tee -a "$OUT_DIR/gpu_check.log"; status=1; }; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu_check.log"
step build env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" bash scripts/setup.sh
step ctest-build bash -c "cmake -S . -B build/ctest -G Ninja -DFUSIBLE_BUILD_TESTS=ON -DFUSIBLE_BUILD_PYTHON=OFF -DFUSIBLE_CUDA=ON >/dev/null && cmake --build build/ctest -j$(nproc)"
step ctest ctest --test-dir build/ctest --output-on-failure -j"$(nproc)"
# pytest-xdist, where installed, spreads the tests over the cores (one GPU is plenty for them).
XDIST=(); "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$(( $(nproc) < 14 ? $(nproc) : 14 ))")
step pytest "$PY" -m pytest -q -p no:cacheprovider tests/python "${XDIST[@]}" -rf --junitxml="$OUT_DIR/pytest.xml"
if [ "$SANITIZE" = 1 ]; then
  for t in build/ctest/tests/cpp/test_*; do
    [ -x "$t" ] || continue
    step "memcheck $t" compute-sanitizer --tool memcheck --error-exitcode 9 "$t" --gtest_filter='*Cuda*:*CUDA*:*Gpu*:*GPU*'
    step "racecheck $t" compute-sanitizer --tool racecheck --error-exitcode 9 "$t" --gtest_filter='*Cuda*:*CUDA*:*Gpu*:*GPU*'
  done
fi
if [ "$BENCH" = 1 ]; then
  for b in benchmarks/kernels.py benchmarks/ops_kernels.py benchmarks/gemm.py benchmarks/block.py benchmarks/step.py; do
    step "bench $b" "$PY" "$b" --out "$OUT_DIR"
  done
fi
echo "gpu_check status: $status"
exit $status
