#!/usr/bin/env bash
# Host time per step vs torch eager at the final HEAD (Python-only changes since the libraries).
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call7.txt
echo "# at $(cat .gpu/head) (libraries of .gpu/libs.tar.gz; C++ unchanged since)" | tee $L
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
echo "# python3 benchmarks/overhead.py --modes eager --out \$OUT" | tee -a $L
timeout 150 python3 benchmarks/overhead.py --modes eager --out $OUT 2>&1 | grep -v Warn | tail -20 | tee -a $L
