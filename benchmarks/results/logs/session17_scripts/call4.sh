#!/usr/bin/env bash
# No rebuild (C++ unchanged since the libraries of .gpu/libs.tar.gz): gemm.py with the blockwise
# wgrad rows; the world-1 NCCL suite (tp, tp2, fsdp, ddp one-rank cases, GroupedLinear FSDP2).
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call4.txt
echo "# at $(cat .gpu/head) (libraries of .gpu/libs.tar.gz; C++ unchanged since)" | tee $L
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
echo "# python3 benchmarks/gemm.py --out \$OUT" | tee -a $L
timeout 200 python3 benchmarks/gemm.py --out $OUT 2>&1 | grep -v Warn | tee -a $L
echo "# pytest -n 8 tests/python/distributed/test_world1.py -k nccl" | tee -a $L
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/python/distributed/test_world1.py -k nccl 2>&1 | tail -8 | tee -a $L
