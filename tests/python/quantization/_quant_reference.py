"""Plain-PyTorch reference implementations of the quantization numerics (the tests' oracle).

Written from the documented semantics (cpp/include/fusible/quantize.h and recipe.h), independently
of the kernels.
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_NORMAL_EXP = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}
EMAX_ELEM = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
FLT_MAX = torch.finfo(torch.float32).max


def cast_fp8(x: torch.Tensor, scale: torch.Tensor | float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp8(float(x) * scale): RNE, saturating (inf too), NaN stays NaN."""
    m = FP8_MAX[fp8_dtype]
    y = x.float() * scale
    return y.clamp(-m, m).to(fp8_dtype)


def scale_from_amax(
    amax: torch.Tensor, fp8_max: float, margin: int, fallback: torch.Tensor
) -> torch.Tensor:
    """scale = ldexp(fp8_max / amax, -margin) (FLT_MAX on overflow) if amax finite > 0."""
    amax = amax.float()
    s = torch.ldexp(torch.tensor(fp8_max, dtype=torch.float32) / amax, torch.tensor(-margin))
    s = torch.where(torch.isinf(s), torch.tensor(FLT_MAX), s)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, s, fallback.float())


def current_scaling(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0):
    """(data, scale, scale_inv) of per-tensor current scaling."""
    amax = x.float().abs().amax().reshape(1) if x.numel() else torch.zeros(1)
    if torch.isnan(x).any():
        amax = torch.full((1,), float("nan"))
    scale = scale_from_amax(amax, FP8_MAX[fp8_dtype], margin, torch.ones(1))
    return cast_fp8(x, scale, fp8_dtype), scale, 1.0 / scale


def delayed_update(
    hist: torch.Tensor, scale: torch.Tensor, fp8_max: float, algo: str, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling update of a [L, n] history and [n] scales (returns new tensors)."""
    amax = hist.amax(0) if algo == "max" else hist[0].clone()
    new_scale = scale_from_amax(amax, fp8_max, margin, scale)
    new_hist = torch.cat([hist[1:], hist[:1]])
    new_hist[0] = 0
    return new_hist, new_scale


def mxfp8_rowwise(x2d: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX rowwise cast of a [rows, k] matrix: (data [rows, k], E8M0 scales [rows, k/32])."""
    rows, k = x2d.shape
    nb = (k + 31) // 32
    xf = x2d.float()
    pad = torch.zeros(rows, nb * 32)
    pad[:, :k] = xf
    blocks = pad.reshape(rows, nb, 32)
    amax = blocks.abs().amax(-1)
    amax = torch.where(blocks.isnan().any(-1), torch.tensor(float("nan")), amax)
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1)
    e = exp.to(torch.int32) - 1 - EMAX_ELEM[fp8_dtype]
    byte = (e + 127).clamp(0, 254)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    byte = torch.where(~torch.isfinite(amax), torch.full_like(byte, 255), byte)
    e_used = (byte - 127).clamp(max=127).to(torch.float32)
    mult = torch.exp2(-e_used).repeat_interleave(32, dim=1)[:, :k]
    data = cast_fp8(xf * mult, 1.0, fp8_dtype)
    return data, byte.to(torch.uint8)


def mxfp8_dequantize_rowwise(data: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    k = data.shape[1]
    s = torch.exp2(byte.float() - 127)
    s = torch.where(byte == 255, torch.tensor(float("nan")), s)
    return data.float() * s.repeat_interleave(32, dim=1)[:, :k]
