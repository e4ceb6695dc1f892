"""Shared pieces of the ops tests: recipes, pre-quantized inputs, FP64 references, counting the
weight quantizations."""

from __future__ import annotations

import io
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


# ---- counting weight quantizations --------------------------------------------------------------

QUANTIZE_OPS = ("quantize_fp8", "quantize_fp8_current", "quantize_mxfp8", "quantize_fp8_block",
                "grouped_quantize_fp8")  # fmt: skip


class CountingOps:
    """Stands in for ``torch.ops.fusible`` inside quantizers.py (or for ``fusible._kernels`` in a
    module that calls them): quantize calls whose input is one of ``weights()`` (same storage and
    shape) are recorded in ``calls`` as the weight's index. A grouped cast takes a list; an input
    of an expert it skips (``m_splits`` 0) is not recorded."""

    def __init__(self, real, weights):
        self._real, self._weights, self.calls = real, weights, []

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name not in QUANTIZE_OPS:
            return fn

        def counted(x, *args, **kwargs):
            ts = x if isinstance(x, list) else [x]  # the grouped cast takes a list
            if isinstance(x, list) and len(x) > 1 and args and len(args[0]) == len(x):
                ts = [t for t, m in zip(x, args[0], strict=True) if m]  # m_splits 0: skipped
            for t in ts:
                for i, w in enumerate(self._weights()):
                    if t.data_ptr() == w.data_ptr() and t.shape == w.shape:
                        self.calls.append(i)
            return fn(x, *args, **kwargs)

        return counted

    def take(self) -> list[int]:
        """Indices of the weights quantized since the last call, in call order."""
        out, self.calls = self.calls, []
        return out


def weight_init_recipes(other: str) -> dict[str, recipe.Recipe]:
    """The recipes ``quantized_model_init`` supports, by name: "custom" gives the weights whose
    role names ``other`` (a role pattern's name part) MXFP8 and the rest per-tensor FP8;
    "custom_hp" keeps those weights in high precision."""
    rule = f"weight:*:{other}"
    current = recipe.Float8CurrentScaling()
    return {
        "current": current,
        "mxfp8": recipe.MXFP8BlockScaling(),
        "blockwise": recipe.Float8BlockScaling(),
        "custom": recipe.CustomRecipe.from_rules({rule: recipe.MXFP8BlockScaling(), "*": current}),
        "custom_hp": recipe.CustomRecipe.from_rules({rule: None, "*": current}),
    }


def save_load(obj: Any) -> Any:
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same_results(got: dict[str, Any], want: dict[str, Any], device: str, what: str = ""):
    """Two steps' results (name -> tensor) agree: bit for bit on CPU; on a GPU within 1e-6
    relative (same operands and kernels; the GEMM algorithm cuBLASLt picks may differ)."""
    assert got.keys() == want.keys()
    for k in got:
        a, b = got[k], want[k]
        assert type(a) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape, (what, k)
        if device == "cpu":
            assert torch.equal(a, b), f"{what}: {k} differs"
        else:
            assert rel_err(a, b) <= 1e-6, f"{what}: {k} differs"
