#!/usr/bin/env bash
set -o pipefail
L=$OUT/call2.txt
nvcc -arch=sm_90a -O2 -o /tmp/lt_probe .gpu/lt_probe.cu -lcublasLt 2>&1 | tail -5
for s in "16384 4096 16384 1 1" "4096 16384 16384 1 1" "16384 4096 16384 1 2" "16384 16384 4096 1 2" "8192 8192 8192 1 1"; do
  /tmp/lt_probe $s 24 2>&1 | tee -a $L
done
