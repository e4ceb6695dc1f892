#!/usr/bin/env bash
# Short GPU rounds for a lent machine with a few minutes per command (the H200 device):
#   bash scripts/gpu_quick.sh build OUT_DIR    build, and keep the compiled operator library
#                                              (libfusible_torch.so) as OUT_DIR/libs.tar.gz
#   bash scripts/gpu_quick.sh use LIBS_TGZ     use libraries built earlier (no rebuild):
#                                              python/ is then the package (PYTHONPATH)
# Afterwards run the tests and benchmarks as usual. Python changes need no rebuild with `use`.
set -euo pipefail
cd "$(dirname "$0")/.."
export FUSIBLE_OFFLINE=1 FUSIBLE_CUDA=ON
case ${1:?build or use} in
  build)
    out=${2:?OUT_DIR}
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" bash scripts/setup.sh > "$out/build.log" 2>&1 \
      || { tail -40 "$out/build.log"; exit 1; }
    pkg=$(python3 -c "import fusible, os; print(os.path.dirname(fusible.__file__))")
    (cd "$pkg" && tar czf "$out/libs.tar.gz" libfusible_torch*.so)
    ;;
  use)
    tar xzf "${2:?LIBS_TGZ}" -C python/fusible
    ;;
esac
