#!/usr/bin/env bash
# Runs the pytest suite on the CPU against another torch release than CI's (for the H200's torch
# 2.11 while CI runs 2.13): a virtual environment with that torch from PyPI (its CUDA build: the
# nvidia-* wheels come along, about 3 GB, and run on the CPU), fusible built into it CPU-only from
# a clone of this checkout's HEAD, then pytest. Not part of CI (the download); run it when a
# change touches torch.compile, autograd or torch.distributed.
#   bash scripts/test_torch_version.sh 2.11.0 [pytest args...]   (default: tests/python)
# Session 23 found with it a torch-2.11-only compile bug (docs/executor.md, "Under torch.compile").
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: test_torch_version.sh TORCH_VERSION [pytest args...]}; shift
ROOT=${FUSIBLE_TORCH_VERSION_DIR:-/tmp/fusible-torch-$VERSION}
if [ ! -x "$ROOT/venv/bin/python" ]; then
  python3 -m venv "$ROOT/venv"
  "$ROOT/venv/bin/pip" install -q "torch==$VERSION" numpy pytest pytest-xdist hypothesis \
    safetensors tqdm matplotlib scikit-build-core cmake ninja pybind11
fi
rm -rf "$ROOT/src" && git clone -q . "$ROOT/src"
(cd "$ROOT/src" && FUSIBLE_CUDA=OFF "$ROOT/venv/bin/pip" install -q --no-build-isolation --no-deps .)
# The installed package, not the clone's python/ (which has no library built for this torch).
cd "$ROOT/src"
if [ $# -eq 0 ]; then set -- tests/python; fi
"$ROOT/venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 -rf "$@"
