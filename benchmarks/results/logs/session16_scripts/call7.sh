#!/usr/bin/env bash
# rebuild (dups14 binding changes, replay of quantized weights); CUDA tests of the touched
# families; the grouped MLP steady A/B with FP8 weights (now replayed).
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call7.txt
echo "# at e2287b4 (main)" | tee $L
bash scripts/gpu_quick.sh build $OUT > /dev/null 2>&1 || { tail -30 $OUT/build.log; exit 1; }
rm -f $OUT/build.log
export PYTHONPATH=$PWD/python
F="tests/python/test_kernels_quantize.py tests/python/test_kernels_activation.py tests/python/test_kernels_normalization.py tests/python/test_kernels_grouped.py tests/python/ops/test_replay.py tests/python/ops/test_grouped_linear_quantized_weights.py tests/python/ops/test_quantized_weights.py tests/python/modules/test_transformer_layer.py"
echo "# pytest -n 16 $F -k 'cuda or CUDA'" | tee -a $L
timeout 230 python3 -m pytest -q -p no:cacheprovider -n 16 $F -k "cuda or CUDA" 2>&1 | tail -4 | tee -a $L
cd benchmarks
for fw in "--fp8-weights" ""; do
  echo "# python3 grouped_profile.py --recipe delayed --steps 2 --steady $fw" | tee -a $L
  timeout 100 python3 grouped_profile.py --recipe delayed --steps 2 --steady $fw 2>&1 | grep -E "eager|GPU span|transpose_fp8  " | tee -a $L
done
