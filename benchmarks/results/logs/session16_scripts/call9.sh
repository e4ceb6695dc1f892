#!/usr/bin/env bash
set -o pipefail; export PYTHONUNBUFFERED=1
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
echo "# python3 .gpu/cache_probe.py" | tee $OUT/call9.txt
timeout 200 python3 .gpu/cache_probe.py 2>&1 | grep -v Warn | tee -a $OUT/call9.txt
