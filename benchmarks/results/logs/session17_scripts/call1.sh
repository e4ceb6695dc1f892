#!/usr/bin/env bash
set -o pipefail; export PYTHONUNBUFFERED=1
L=$OUT/call1.txt
bash scripts/gpu_quick.sh use .gpu/libs.tar.gz
export PYTHONPATH=$PWD/python
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee $L
python3 .gpu/prof_block.py delayed blockwise 2>&1 | tee -a $L
# (stored here as prof_block.py.txt and lt_probe.cu.txt: not linted as project sources)
