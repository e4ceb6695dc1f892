"""Shared pieces of the ops tests: recipes, pre-quantized inputs, FP64 references."""

from __future__ import annotations

from typing import Any

import torch

from fusible import recipe
from fusible.quantization import Float8CurrentScalingQuantizer, QuantizerRole

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _mirror_current(role: QuantizerRole) -> Float8CurrentScalingQuantizer:
    return Float8CurrentScalingQuantizer(E5M2 if role.is_gradient else E4M3)


RECIPES: dict[str, Any] = {
    "none": None,
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "mxfp8": recipe.MXFP8BlockScaling(),
    "blockwise": recipe.Float8BlockScaling(),
    "custom": recipe.CustomRecipe(qfactory=_mirror_current),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def prequantized(shape: tuple[int, ...], fmt: torch.dtype = E4M3, seed: int = 0) -> torch.Tensor:
    """fp32 values exactly representable in ``fmt`` whose quantization under every recipe is
    exact: the per-tensor amax is the format's max (scale 1), and every 32-block along rows and
    down columns holds a value whose exponent is the format's emax (E8M0 scale 1)."""
    g = torch.Generator().manual_seed(seed)
    fmax = 448.0 if fmt == E4M3 else 57344.0
    x = (torch.randn(shape, generator=g) * fmax / 8).clamp(-fmax, fmax).to(fmt).float()
    m = x.reshape(-1, shape[-1])
    r = torch.arange(m.shape[0]).unsqueeze(1)
    c = torch.arange(m.shape[1]).unsqueeze(0)
    m[(r % 32) == (c % 32)] = fmax
    return m.reshape(shape)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tol(dtype: torch.dtype) -> float:
    """Relative tolerance of one rounding to ``dtype`` plus fp32 accumulation."""
    return {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
