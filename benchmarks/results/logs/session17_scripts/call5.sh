#!/usr/bin/env bash
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call5.txt
echo "# at $(cat .gpu/head) (libraries of .gpu/libs.tar.gz)" | tee $L
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
timeout 200 python3 .gpu/step_gaps.py delayed current 2>&1 | tee -a $L
