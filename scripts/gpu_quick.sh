#!/usr/bin/env bash
# Short GPU rounds for a lent machine with a few minutes per command (the H200 device):
#   bash scripts/gpu_quick.sh build OUT_DIR    build, and keep the core library as OUT_DIR/_C.so.gz
#   bash scripts/gpu_quick.sh use SO_GZ        use a core library built earlier (no rebuild):
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
    so=$(python3 -c "import fusible, glob, os; print(glob.glob(os.path.dirname(fusible.__file__) + '/_C*.so')[0])")
    gzip -c "$so" > "$out/_C.so.gz"
    ;;
  use)
    so=${2:?SO_GZ}
    name=$(python3 -c "import sysconfig; print('_C' + sysconfig.get_config_var('EXT_SUFFIX'))")
    gunzip -c "$so" > "python/fusible/$name"
    ;;
esac
