"""Quantize-family kernel benchmark: achieved bandwidth vs device copy bandwidth, vs torch.

For each shape (bf16 input) and each kernel, measures device time (CUDA-graph replay, so Python
dispatch is excluded for every contender alike) of fusible, of PyTorch eager doing the same work,
and of torch.compile of that eager code. Bytes are the minimum each kernel must move: every input
read once and every output written once.

    python benchmarks/kernels.py [--shapes 16384x4096,16384x16384] [--out DIR]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from _common import (
    bandwidth_parser,
    bandwidth_row,
    bandwidth_table,
    copy_bandwidth_gbs,
    environment,
    parse_shapes,
    write_json,
)
from fusible import _kernels as K

E4M3 = torch.float8_e4m3fn


# ---- plain-torch versions of the same work ------------------------------------------------------


def torch_cast_transpose(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    amax = x.abs().amax().float()
    q = (x.float() * scale).clamp(-448, 448).to(E4M3)
    return q, q.t().contiguous(), amax, scale.reciprocal()


def torch_current_cast_transpose(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    amax = x.abs().amax().float()
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    q = (x.float() * scale).clamp(-448, 448).to(E4M3)
    return q, q.t().contiguous(), scale, amax


def _mx_blocks(xb: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    amax = xb.abs().amax(dim, keepdim=True)
    e = torch.floor(torch.log2(amax)) - 8
    s = torch.clamp(e + 127, 0, 254)
    q = (xb * torch.exp2(127 - s)).clamp(-448, 448).to(E4M3)
    return q, s.to(torch.uint8)


def torch_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    r, c = x.shape
    xf = x.float()
    q_row, s_row = _mx_blocks(xf.view(r, c // 32, 32), 2)
    q_col, s_col = _mx_blocks(xf.view(r // 32, 32, c), 1)
    return q_row.view(r, c), s_row, q_col.view(r, c), s_col


def _block_1d(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 blocks along the rows of xf [r, c] (c % 128 == 0), power-of-two scales."""
    r, c = xf.shape
    amax = xf.view(r, c // 128, 128).abs().amax(-1, keepdim=True).clamp_min(1e-30)
    s = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    q = (xf.view(r, c // 128, 128) * s).clamp(-448, 448).to(E4M3).view(r, c)
    return q, (1.0 / s).view(r, c // 128).t()


def torch_block_1d(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The blockwise 1x128 cast in torch: both copies (the columnwise one transposed)."""
    xf = x.float()
    q, s = _block_1d(xf)
    qt, st = _block_1d(xf.t().contiguous())
    return q, s, qt, st


# ---- the benchmark ------------------------------------------------------------------------------


def run(shapes: list[tuple[int, int]]) -> tuple[list[dict[str, Any]], float]:
    dev = "cuda"
    copy_gbs = copy_bandwidth_gbs(dev)
    rows_out: list[dict[str, Any]] = []
    compiled_ct = torch.compile(torch_cast_transpose)
    compiled_cur = torch.compile(torch_current_cast_transpose)
    compiled_mx = torch.compile(torch_mxfp8)
    compiled_tr = torch.compile(lambda m: m.t().contiguous())
    compiled_blk = torch.compile(torch_block_1d)
    for r, c in shapes:
        x = torch.randn(r, c, device=dev, dtype=torch.bfloat16)
        scale = torch.tensor([2.0], device=dev)
        n = r * c
        cases: list[tuple[str, int, dict[str, Callable[[], Any]]]] = [
            (
                "fp8_cast_amax_transpose",
                2 * n + n + n,
                {
                    "fusible": lambda: K.quantize_fp8(x, scale, E4M3, True, True),
                    "torch_eager": lambda: torch_cast_transpose(x, scale),
                    "torch_compile": lambda: compiled_ct(x, scale),
                },
            ),
            (
                "fp8_cast_amax_rowwise",
                2 * n + n,
                {"fusible": lambda: K.quantize_fp8(x, scale, E4M3, True, False)},
            ),
            (
                "fp8_current_scaling_transpose",
                2 * n + n + n,
                {
                    "fusible": lambda: K.quantize_fp8_current(x, E4M3, 0, True, True),
                    "torch_eager": lambda: torch_current_cast_transpose(x),
                    "torch_compile": lambda: compiled_cur(x),
                },
            ),
            (
                "mxfp8_rowwise_columnwise",
                2 * n + 2 * n + 2 * (n // 32),
                {
                    "fusible": lambda: K.quantize_mxfp8(x, E4M3, True, True),
                    "torch_eager": lambda: torch_mxfp8(x),
                    "torch_compile": lambda: compiled_mx(x),
                },
            ),
            (
                # Blockwise FP8 (Float8BlockScaling): both copies from one read of the input.
                "block_1x128_rowwise_columnwise",
                2 * n + 2 * n + 2 * 4 * (n // 128),
                {
                    "fusible": lambda: K.quantize_fp8_block(x, E4M3, 1, True, 0.0, True, True),
                    "torch_eager": lambda: torch_block_1d(x),
                    "torch_compile": lambda: compiled_blk(x),
                },
            ),
            (
                "block_128x128_rowwise_columnwise",
                2 * n + 2 * n + 2 * 4 * (n // 128 // 128),
                {"fusible": lambda: K.quantize_fp8_block(x, E4M3, 2, True, 0.0, True, True)},
            ),
        ]
        q = K.quantize_fp8(x, scale, E4M3, True, False)
        mx = K.quantize_mxfp8(x, E4M3, True, False)
        bq = K.quantize_fp8_block(x, E4M3, 1, True, 0.0, True, False)
        cases += [
            (
                "fp8_transpose",
                2 * n,
                {
                    "fusible": lambda: K.transpose_fp8(q[0]),
                    "torch_eager": lambda: q[0].view(torch.uint8).t().contiguous(),
                    "torch_compile": lambda: compiled_tr(q[0].view(torch.uint8)),
                },
            ),
            (
                "fp8_dequantize",
                n + 2 * n,
                {"fusible": lambda: K.dequantize_fp8(q[0], q[2], torch.bfloat16)},
            ),
            (
                "block_1x128_dequantize",
                n + 4 * (n // 128) + 2 * n,
                {"fusible": lambda: K.dequantize_fp8_block(bq[0], bq[1], 1, torch.bfloat16)},
            ),
            (
                "mxfp8_dequantize",
                n + n // 32 + 2 * n,
                {"fusible": lambda: K.dequantize_mxfp8(mx[0], mx[1], False, torch.bfloat16)},
            ),
        ]
        for name, nbytes, contenders in cases:
            rows_out.append(bandwidth_row(name, f"{r}x{c}", nbytes, contenders, copy_gbs))

        torch.cuda.empty_cache()
    return rows_out, copy_gbs


def main() -> None:
    args = bandwidth_parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    shapes = parse_shapes(args.shapes)
    rows, copy_gbs = run(shapes)
    bandwidth_table(rows, copy_gbs, ["torch_eager_ms", "torch_compile_ms",
                                     "speedup_vs_torch_compile"])  # fmt: skip
    path = write_json(
        "kernels", {"env": environment(), "copy_GBps": copy_gbs, "results": rows}, args.out
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
