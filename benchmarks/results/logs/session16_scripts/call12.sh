#!/usr/bin/env bash
# Python-only fixes after review: CUDA cases of the quantized-weight tests (libraries of e2287b4).
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call12.txt
echo "# at $(cat .gpu/head) (libraries built at e2287b4; only Python changed in these paths since)" | tee $L
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
F="tests/python/ops/test_grouped_linear_quantized_weights.py tests/python/ops/test_quantized_weights.py"
echo "# pytest -n 16 $F -k cuda" | tee -a $L
timeout 90 python3 -m pytest -q -p no:cacheprovider -n 16 $F -k cuda 2>&1 | tail -2 | tee -a $L
