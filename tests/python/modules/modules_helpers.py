"""Shared pieces of the module tests (the ops tests' helpers live in another folder, which pytest
does not put on the import path of this one): recipes and error measures."""

from __future__ import annotations

from typing import Any

import torch

from fusible import recipe
from fusible.quantization import Float8CurrentScalingQuantizer, QuantizerRole

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _mirror_current(role: QuantizerRole) -> Float8CurrentScalingQuantizer:
    return Float8CurrentScalingQuantizer(E5M2 if role.is_gradient else E4M3)


# Same recipes as tests/python/ops/ops_helpers.py.
RECIPES: dict[str, Any] = {
    "none": None,
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "mxfp8": recipe.MXFP8BlockScaling(),
    "blockwise": recipe.Float8BlockScaling(),
    "custom": recipe.CustomRecipe(qfactory=_mirror_current),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tol(dtype: torch.dtype) -> float:
    """Relative tolerance of one rounding to ``dtype`` plus fp32 accumulation."""
    return {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
