"""FP8 GEMM benchmark: fusible.gemm (cuBLASLt) vs torch._scaled_mm at the same shapes, same run.

python benchmarks/gemm.py [--sizes 8192,4096] [--out DIR]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from _common import environment, print_table, time_ms, write_json
from fusible import _kernels as K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="8192,4096")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gemm.py needs a CUDA GPU")
    rows: list[dict[str, Any]] = []
    for s in (int(v) for v in args.sizes.split(",")):
        a = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)  # [N, K]: the NT form
        one = torch.ones(1, device="cuda")
        flops = 2 * s**3
        ours = time_ms(lambda: K.gemm(a, b, False, True, one, one, torch.bfloat16, None, "none",
                                      None, None, 1.0, 0.0, None, False))  # fmt: skip
        ref = time_ms(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
        ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
        bf16 = time_ms(lambda: ab @ bb.t())
        rows.append({"M=N=K": s, "fusible_ms": ours, "fusible_TFLOP/s": flops / ours / 1e9,
                     "scaled_mm_TFLOP/s": flops / ref / 1e9, "ratio_vs_scaled_mm": ref / ours,
                     "bf16_TFLOP/s": flops / bf16 / 1e9})  # fmt: skip
    print_table(rows, list(rows[0]))
    print(f"wrote {write_json('gemm', {'env': environment(), 'results': rows}, args.out)}")


if __name__ == "__main__":
    main()
