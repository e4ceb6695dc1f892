"""FP8 GEMM benchmark: fusible.gemm (cuBLASLt) vs torch._scaled_mm at the same shapes, same run.

Per-tensor FP8 at M = N = K = each size and at the MLP block's GEMM shapes
(``--mlp tokens,hidden,ffn``); then blockwise FP8 (Float8BlockScaling, ``fusible.gemm_block``)
at the same shapes with the block scales the recipe gives each GEMM (1x128 x 128x128 for fprop
and dgrad, 1x128 x 1x128 for wgrad, whose operands are the activation's and the gradient's
columnwise copies), against torch._scaled_mm with blockwise scales where the installed torch
accepts them and agrees with fusible's result (else that column says so).

python benchmarks/gemm.py [--sizes 8192,4096] [--mlp 16384,4096,16384] [--out DIR]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from _common import environment, print_table, time_ms, write_json
from fusible import _kernels as K


def _scaled_mm_blockwise(a: Any, b: Any, want: torch.Tensor) -> Any:
    """torch._scaled_mm with a's 1x128 scales and b's (1x128 or 128x128), or None when this torch
    has no such path or its result differs from ``want`` (fusible's). torch wants 1x128 scales
    outer-dimension-major ([M, K/128] with stride (1, M)): our stored [K/128, M] transposed, no
    copy; b's 1x128 scales are tried that way and as stored ([K/128, N])."""
    sa = a.scale_inv.t()  # [M, K/128] (M-major)
    sbs = [b.scale_inv.t()] if b.block_dim == 2 else [b.scale_inv.t(), b.scale_inv]
    for sb in sbs:
        try:
            got = torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=torch.bfloat16)
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            continue
        if (got.float() - want.float()).norm() <= 1e-2 * want.float().norm():
            return lambda sb=sb: torch._scaled_mm(a.data, b.data.t(), sa, sb,
                                                  out_dtype=torch.bfloat16)  # fmt: skip
    return None


def blockwise_rows(shapes: list[tuple[str, int, int, int]]) -> list[dict[str, Any]]:
    """fusible.gemm_block (cuBLASLt VEC128 x BLK128x128, or VEC128 x VEC128 for wgrad) vs
    torch._scaled_mm blockwise and bf16."""
    from fusible.quantization import Float8BlockQuantizer

    qa = Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=1)
    rows: list[dict[str, Any]] = []
    for name, m, n, k in shapes:
        b_dim = 1 if name.endswith("wgrad") else 2
        qb = Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=b_dim)
        a = qa.quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), columnwise=False)
        b = qb.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), columnwise=False)
        flops = 2 * m * n * k

        def ours_fn() -> torch.Tensor:
            return K.gemm_block(a.data, a.scale_inv, 1, b.data, b.scale_inv, b_dim,
                                torch.bfloat16, None, 1.0, 0.0)  # fmt: skip

        ours = time_ms(ours_fn)
        ref_fn = _scaled_mm_blockwise(a, b, ours_fn())
        ref = time_ms(ref_fn) if ref_fn is not None else float("nan")
        ab, bb = a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16)
        bf16 = time_ms(lambda: ab @ bb.t())
        rows.append({"gemm": name, "scales": f"1x128 x {'1x128' if b_dim == 1 else '128x128'}",
                     "MxNxK": f"{m}x{n}x{k}", "fusible_ms": ours,
                     "fusible_TFLOP/s": flops / ours / 1e9,
                     "scaled_mm_blockwise_TFLOP/s": flops / ref / 1e9 if ref_fn else "unsupported",
                     "ratio_vs_scaled_mm": ref / ours if ref_fn else "n/a",
                     "bf16_TFLOP/s": flops / bf16 / 1e9})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="8192,4096")
    ap.add_argument("--mlp", default="16384,4096,16384", help="tokens,hidden,ffn of the MLP block")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gemm.py needs a CUDA GPU")
    t, h, f = (int(v) for v in args.mlp.split(","))
    shapes = [(f"square {s}", s, s, s) for s in (int(v) for v in args.sizes.split(","))]
    shapes += [("mlp fc1 fprop", t, f, h), ("mlp fc2 fprop", t, h, f), ("mlp fc2 dgrad", t, f, h),
               ("mlp fc1 wgrad", f, h, t), ("mlp fc2 wgrad", h, f, t)]  # fmt: skip
    rows: list[dict[str, Any]] = []
    one = torch.ones(1, device="cuda")
    for name, m, n, k in shapes:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)  # [N, K]: the NT form
        flops = 2 * m * n * k
        ours = time_ms(lambda: K.gemm(a, b, False, True, one, one, torch.bfloat16, None, "none",
                                      None, None, 1.0, 0.0, None, False))  # fmt: skip
        ref = time_ms(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
        ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
        bf16 = time_ms(lambda: ab @ bb.t())
        rows.append({"gemm": name, "MxNxK": f"{m}x{n}x{k}", "fusible_ms": ours,
                     "fusible_TFLOP/s": flops / ours / 1e9,
                     "scaled_mm_TFLOP/s": flops / ref / 1e9, "ratio_vs_scaled_mm": ref / ours,
                     "bf16_TFLOP/s": flops / bf16 / 1e9})  # fmt: skip
    print_table(rows, list(rows[0]))
    block = blockwise_rows(shapes)
    print_table(block, list(block[0]))
    data = {"env": environment(), "results": rows, "blockwise": block}
    print(f"wrote {write_json('gemm', data, args.out)}")


if __name__ == "__main__":
    main()
