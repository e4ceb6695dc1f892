"""fusible: fusible FP8/MXFP8 operations for PyTorch.

``fusible.ops`` (ops, Sequential, fusion registry), ``fusible.recipe`` (recipes),
``fusible.autocast`` (the quantization context), ``fusible.quantization`` (roles, quantizers,
RecipeState), and the modules ``Linear``, ``LayerNormLinear``, ``LayerNormMLP``.
"""

__version__ = "0.1.0"

from fusible import ops, quantization, recipe
from fusible.modules import LayerNormLinear, LayerNormMLP, Linear
from fusible.quantization.autocast import autocast

__all__ = [
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "__version__",
    "autocast",
    "ops",
    "quantization",
    "recipe",
]
