#!/usr/bin/env bash
# Build with the blockwise activation vector path; CUDA tests of it; kernel and block benchmarks.
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call3.txt
echo "# at $(cat .gpu/head)" | tee $L
t0=$(date +%s)
bash scripts/gpu_quick.sh build $OUT || exit 1
echo "# build $(( $(date +%s) - t0 )) s" | tee -a $L
export PYTHONPATH=$PWD/python
F="tests/python/test_kernels_activation.py tests/python/quantization/test_block_scaling.py"
echo "# pytest -n 16 $F -k 'cuda or CUDA'" | tee -a $L
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 16 $F -k "cuda or CUDA" 2>&1 | tail -15 | tee -a $L
K=gelu_fwd_block1d,gelu_fwd_block1d_both,swiglu_fwd_block1d_both,gelu_bwd_dbias_block1d,gelu_bwd_dbias_block1d_both,gelu_fwd_fp8,gelu_bwd_dbias_fp8
echo "# python3 benchmarks/ops_kernels.py --kernels $K --out \$OUT" | tee -a $L
timeout 120 python3 benchmarks/ops_kernels.py --kernels $K --out $OUT 2>&1 | tail -25 | tee -a $L
echo "# python3 .gpu/prof_block.py blockwise" | tee -a $L
timeout 60 python3 .gpu/prof_block.py blockwise 2>&1 | tee -a $L
echo "# python3 benchmarks/block.py --out \$OUT" | tee -a $L
timeout 150 python3 benchmarks/block.py --out $OUT 2>&1 | grep -v Warn | tail -16 | tee -a $L
