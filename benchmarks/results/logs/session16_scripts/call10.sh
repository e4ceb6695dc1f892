#!/usr/bin/env bash
# regression checks after the dups14 binding refactor and the replay change: overhead (eager),
# block.py; a second grouped.py run (its spread).
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call10.txt
echo "# at $(cat .gpu/head) (libraries built at e2287b4)" | tee $L
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
echo "# python3 benchmarks/overhead.py --modes eager --out \$OUT" | tee -a $L
timeout 100 python3 benchmarks/overhead.py --modes eager --out $OUT 2>&1 | grep -v Warn | tail -9 | tee -a $L
echo "# python3 benchmarks/block.py --out \$OUT" | tee -a $L
timeout 150 python3 benchmarks/block.py --out $OUT 2>&1 | grep -v Warn | tail -14 | tee -a $L
echo "# cd benchmarks && python3 grouped.py (second run, no --out)" | tee -a $L
(cd benchmarks && timeout 230 python3 grouped.py 2>&1 | grep -v Warn | sed -n 1,20p | tee -a $L)
