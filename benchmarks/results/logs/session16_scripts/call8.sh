#!/usr/bin/env bash
# libraries of call 7 (no C++ change since); CUDA tests of keep_transpose + replay; grouped.py;
# compute-sanitizer over the activation walk (forced two rows) backward tests.
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call8.txt
echo "# at $(cat .gpu/head) (libraries built at e2287b4)" | tee $L
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
F="tests/python/ops/test_grouped_linear_quantized_weights.py tests/python/ops/test_replay.py tests/python/ops/test_quantized_weights.py"
echo "# pytest -n 16 $F -k cuda" | tee -a $L
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 16 $F -k "cuda" 2>&1 | tail -2 | tee -a $L
echo "# cd benchmarks && python3 grouped.py --out \$OUT" | tee -a $L
(cd benchmarks && timeout 300 python3 grouped.py --out $OUT 2>&1 | grep -v Warn | tee -a $L)
echo "# FUSIBLE_ACT_WALK=2 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/python/test_kernels_activation.py -k 'test_cuda_matches_cpu and gelu'" | tee -a $L
FUSIBLE_ACT_WALK=2 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x tests/python/test_kernels_activation.py -k "test_cuda_matches_cpu and gelu" > $OUT/sanitizer.txt 2>&1; echo "rc=$?" | tee -a $L
tail -4 $OUT/sanitizer.txt | tee -a $L
