#!/usr/bin/env bash
# build; CUDA tests of GroupedLinear FP8 weights + neighbours; DDP at world size 1 (NCCL); grouped.py.
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call5.txt
git log --oneline -1 | tee $L
bash scripts/gpu_quick.sh build $OUT > /dev/null 2>&1 || { tail -30 $OUT/build.log; exit 1; }
rm -f $OUT/build.log
export PYTHONPATH=$PWD/python
F="tests/python/ops/test_grouped_linear_quantized_weights.py tests/python/ops/test_quantized_weights.py tests/python/ops/test_grouped_linear.py"
echo "# pytest -n 16 $F -k cuda" | tee -a $L
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 16 $F -k "cuda" 2>&1 | tail -6 | tee -a $L
echo "# pytest -n 8 tests/python/distributed/test_world1.py -k 'nccl and ddp'" | tee -a $L
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 tests/python/distributed/test_world1.py -k "nccl and ddp" 2>&1 | tail -4 | tee -a $L
echo "# cd benchmarks && python3 grouped.py --out \$OUT" | tee -a $L
(cd benchmarks && timeout 220 python3 grouped.py --out $OUT 2>&1 | grep -v Warn | tee -a $L)
