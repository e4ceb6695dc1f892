#!/usr/bin/env bash
# rebuild after the cu14 merge (.cu dedupe); CUDA cases of the kernel families it touched.
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call11.txt
echo "# at $(cat .gpu/head) (cu14 merged)" | tee $L
bash scripts/gpu_quick.sh build $OUT > /dev/null 2>&1 || { tail -30 $OUT/build.log; exit 1; }
rm -f $OUT/build.log $OUT/libs.tar.gz
export PYTHONPATH=$PWD/python
F="tests/python/test_kernels_normalization.py tests/python/test_kernels_activation.py tests/python/test_kernels_quantize.py tests/python/test_kernels_grouped.py tests/python/ops/test_grouped_linear.py tests/python/quantization/test_block_scaling.py tests/python/quantization/test_quantization_cuda.py"
echo "# pytest -n 16 $F -k 'cuda or CUDA'" | tee -a $L
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 16 $F -k "cuda or CUDA" 2>&1 | tail -4 | tee -a $L
