#!/usr/bin/env bash
# Short GPU rounds for a lent machine with a few minutes per command (the H200 device):
#   bash scripts/gpu_quick.sh build OUT_DIR    build, and keep the compiled operator library
#                                              (libfusible_torch.so) as OUT_DIR/libs.tar.gz
#                                              (also unpacked into python/fusible)
#   bash scripts/gpu_quick.sh use LIBS_TGZ     use libraries built earlier (no rebuild):
#                                              python/ is then the package (PYTHONPATH)
# Afterwards run the tests and benchmarks as usual. Python changes need no rebuild with `use`.
set -euo pipefail
cd "$(dirname "$0")/.."
export FUSIBLE_OFFLINE=1 FUSIBLE_CUDA=ON
case ${1:?build or use} in
  build)
    out=${2:?OUT_DIR}
    # On a Hopper machine build its machine code only (sm_90a, no compute_90 PTX for later GPUs):
    # 157 s instead of 276 s on the H200's 16 cores. CMAKE_ARGS set by the caller wins.
    if [ -z "${CMAKE_ARGS:-}" ] && [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)" = "9.0" ]; then
      export CMAKE_ARGS="-DFUSIBLE_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a"
    fi
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" bash scripts/setup.sh > "$out/build.log" 2>&1 \
      || { tail -40 "$out/build.log"; exit 1; }
    # The installed package (PYTHONPATH cleared: a caller's PYTHONPATH=python would find the
    # source tree, which has no library yet), then its library into python/ too, so the tests
    # run either way.
    pkg=$(PYTHONPATH= python3 -c "import fusible, os; print(os.path.dirname(fusible.__file__))")
    (cd "$pkg" && tar czf "$out/libs.tar.gz" libfusible_torch*.so)
    tar xzf "$out/libs.tar.gz" -C python/fusible
    ;;
  use)
    tar xzf "${2:?LIBS_TGZ}" -C python/fusible
    ;;
esac
