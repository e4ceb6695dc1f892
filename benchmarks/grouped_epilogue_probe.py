"""What an FP8 output from fc1's epilogue would save in the MoE expert MLP (issue 15, a decision
probe; CUDA only): fc1's grouped FP8 GEMMs with the bias + GELU (+ aux) epilogue writing bf16 and
then the grouped FP8 cast of their output (both copies: what the fused forward runs today),
against the same GEMMs writing E4M3 straight from the epilogue (one GEMM per expert with a given
scale, as delayed scaling knows it) plus each expert's FP8 transpose; and each GEMM alone. At the
shape and token split of ``benchmarks/grouped.py``; weights and inputs quantized beforehand.

    python benchmarks/grouped_epilogue_probe.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from _common import time_ms
from fusible import _kernels as K
from grouped import make_splits

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("grouped_epilogue_probe.py needs CUDA")
    torch.manual_seed(0)
    dev, e, n, h, f = "cuda", 8, 16384, 4096, 14336
    splits = make_splits(n, e, 0.5)
    x = torch.randn(n, h, device=dev, dtype=BF16)
    w = [torch.randn(f, h, device=dev, dtype=BF16) * 0.02 for _ in splits]
    b = [torch.randn(f, device=dev, dtype=BF16) for _ in splits]
    ones = torch.ones(e, device=dev)
    xd, _, xs, _, _ = K.grouped_quantize_fp8([x], splits, ones, E4M3, 0, True, False)
    wd, _, ws, _, _ = K.grouped_quantize_fp8(w, [], ones, E4M3, 0, True, False)
    idx = [i for i in range(e) if splits[i]]
    scales = torch.full((e,), 4.0, device=dev)

    def gemm_bf16() -> list[torch.Tensor]:
        return K.grouped_gemm([xd[i] for i in idx], [wd[i] for i in idx], [],
                              [xs[i] for i in idx], [ws[i] for i in idx], BF16,
                              [b[i] for i in idx], True, True, "bias_gelu_aux")  # fmt: skip

    def today() -> None:
        y, _ = gemm_bf16()
        K.grouped_quantize_fp8([y], [splits[i] for i in idx], scales[: len(idx)], E4M3, 0, True,
                               True)  # fmt: skip

    def gemm_fp8() -> list[torch.Tensor]:
        return [
            K.gemm(xd[i], wd[i], False, True, xs[i], ws[i], E4M3, b[i], "bias_gelu_aux", None,
                   None, 1.0, 0.0, scales[j : j + 1], True, fast_accum=True)[0]
            for j, i in enumerate(idx)
        ]  # fmt: skip

    def fp8_out() -> None:
        for d in gemm_fp8():
            K.transpose_fp8(d)

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("bf16 out + grouped cast (today)", today),
        ("FP8 out + transposes", fp8_out),
        ("GEMMs alone, bf16 out", gemm_bf16),
        ("GEMMs alone, FP8 out", gemm_fp8),
    ]
    for rnd in range(2):  # twice: the spread between rounds is the noise
        for name, fn in cases:
            print(f"round {rnd}  {name:34s} {time_ms(fn):.3f} ms")


if __name__ == "__main__":
    main()
