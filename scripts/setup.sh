#!/usr/bin/env bash
# Installs everything fusible needs and builds it into the current Python environment.
# Idempotent. Works on a fresh CPU machine (installs torch==2.13.0, the CPU wheel served locally)
# and on a GPU machine that already has torch (uses it, never reinstalls it). Set FUSIBLE_OFFLINE=1
# on a machine without network (build tools must then be present already).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if ! "$PY" -c "import torch" 2>/dev/null; then
  # A bare `pip install torch` would pull a multi-GB CUDA build; this version is a local CPU wheel.
  "${PIP[@]}" "torch==2.13.0"
fi
if [ "${FUSIBLE_OFFLINE:-0}" != 1 ]; then
  missing=$("$PY" - <<'PYEOF'
import importlib.util as u
need = {"scikit_build_core": "scikit-build-core>=0.10",
        "pytest": "pytest>=8", "hypothesis": "hypothesis>=6", "numpy": "numpy",
        "ruff": "ruff>=0.6", "mypy": "mypy>=1.10", "tqdm": "tqdm",
        "clang_format": "clang-format==23.1.5",
        "matplotlib": "matplotlib", "safetensors": "safetensors"}  # the last two: examples
print(" ".join(v for k, v in need.items() if u.find_spec(k) is None))
PYEOF
)
  if [ -n "$missing" ]; then "${PIP[@]}" $missing; fi
  # Compiling the CUDA backend (when nvcc exists) needs cuBLASLt headers; CUDA toolkits without
  # them get the nvidia-cublas wheel.
  if command -v nvcc >/dev/null && ! ls "$(dirname "$(dirname "$(command -v nvcc)")")"/include/cublasLt.h >/dev/null 2>&1 \
     && [ ! -f /usr/local/cuda/include/cublasLt.h ] \
     && ! "$PY" -c "import nvidia.cu13, os, sys; sys.exit(0 if os.path.exists(os.path.join(nvidia.cu13.__path__[0], 'include', 'cublasLt.h')) else 1)" 2>/dev/null; then
    "${PIP[@]}" "nvidia-cublas==13.0.2.14"  # the version the build was verified with
  fi
fi
# --no-build-isolation: build with the torch-free toolchain installed above (works offline too).
"${PIP[@]}" --no-build-isolation --no-deps .
