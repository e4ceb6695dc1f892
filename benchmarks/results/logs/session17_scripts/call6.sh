#!/usr/bin/env bash
# Python-only changes since the libraries of .gpu/libs.tar.gz: CUDA cases of modules and ops.
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call6.txt
echo "# at $(cat .gpu/head) (libraries of .gpu/libs.tar.gz; C++ unchanged since)" | tee $L
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
echo "# pytest -n 16 tests/python/modules tests/python/ops -k 'cuda or CUDA'" | tee -a $L
timeout 140 python3 -m pytest -q -p no:cacheprovider -n 16 tests/python/modules tests/python/ops -k "cuda or CUDA" 2>&1 | tail -4 | tee -a $L
