"""Quantization demo: casts one activation-like tensor with every scaling kind of the core
library and prints the error, the memory footprint and a bit-exactness check against PyTorch.

    python examples/quantize_demo.py [--device cuda] [--rows 4096] [--cols 1024]
"""

from __future__ import annotations

import argparse

import torch

from fusible import _kernels as K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1024)
    args = ap.parse_args()
    torch.manual_seed(0)
    # Heavy-tailed data, like activations with outliers.
    x = (torch.randn(args.rows, args.cols) * torch.rand(args.rows, 1) * 10).to(
        device=args.device, dtype=torch.bfloat16
    )
    ref = x.double()
    print(f"input: {tuple(x.shape)} {x.dtype} on {x.device}, {x.numel() * 2 / 2**20:.1f} MiB")
    print(f"{'scaling':<34}{'rel. error':>12}{'MiB':>8}  notes")

    def report(name: str, y: torch.Tensor, nbytes: int, note: str = "") -> None:
        err = ((y.double() - ref).norm() / ref.norm()).item()
        print(f"{name:<34}{err:>12.2e}{nbytes / 2**20:>8.1f}  {note}")

    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        tag = "E4M3" if fmt == torch.float8_e4m3fn else "E5M2"
        data, data_t, scale, scale_inv, _ = K.quantize_fp8_current(x, fmt, 0, True, True)
        expect = (x.float() * scale).clamp(-K.fp8_max(fmt), K.fp8_max(fmt)).to(fmt)
        bits = expect.view(torch.uint8)
        exact = torch.equal(data.view(torch.uint8), bits)
        exact_t = torch.equal(data_t.view(torch.uint8), bits.t())
        y = K.dequantize_fp8(data, scale_inv, torch.float32)
        note = f"scale={scale.item():.4g}, bits == torch: {exact}, transpose exact: {exact_t}"
        report(f"{tag} current scaling (+transpose)", y, 2 * data.numel() + 8, note)
        d, s, cd, cs = K.quantize_mxfp8(x, fmt, True, True)
        y = K.dequantize_mxfp8(d, s, False, torch.float32)
        yc = K.dequantize_mxfp8(cd, cs, True, torch.float32)
        report(f"MXFP8 {tag} rowwise", y, d.numel() + s.numel(), f"{s.numel()} E8M0 scales")
        report(f"MXFP8 {tag} columnwise", yc, cd.numel() + cs.numel(), f"{cs.numel()} E8M0 scales")
    print(
        f"core library CUDA backend built: {K.has_cuda()} (a CUDA GPU visible: "
        f"{torch.cuda.is_available()})"
    )


if __name__ == "__main__":
    main()
