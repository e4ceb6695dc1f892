#!/usr/bin/env bash
# profile the grouped MLP with FP8 weights against bf16 weights (delayed), steady + kernel table.
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call6.txt
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
cd benchmarks
for fw in "" "--fp8-weights"; do
  echo "# python3 grouped_profile.py --recipe delayed --steps 2 --steady $fw" | tee -a $L
  timeout 200 python3 grouped_profile.py --recipe delayed --steps 2 --steady $fw 2>&1 | grep -v Warn | head -70 | tee -a $L
done
