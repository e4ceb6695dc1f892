"""fusible: fusible FP8/MXFP8 operations for PyTorch.

``fusible.ops`` (ops, Sequential, fusion registry), ``fusible.recipe`` (recipes),
``fusible.autocast`` (the quantization context), ``fusible.quantization`` (roles, quantizers,
RecipeState), the modules ``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``
(MoE experts), ``MultiheadAttention``, ``TransformerLayer`` (with ``RotaryPositionEmbedding``),
and FP8 weights: ``fusible.quantized_model_init`` (build Linear weights quantized) with
``fusible.optim`` (``MasterWeightOptimizer``: fp32 master weights on the optimizer side), and
``fusible.distributed`` (``fully_shard_fp8``: FSDP2 with an FP8 weight all-gather).
"""

__version__ = "0.1.0"

from fusible import distributed, modules, ops, optim, quantization, recipe
from fusible.modules import *  # noqa: F403  (the modules, in __all__ below)
from fusible.quantization.autocast import autocast
from fusible.quantization.model_init import quantized_model_init
from fusible.quantization.recompute import checkpoint
from fusible.quantization.state import flatten_state_dict, unflatten_state_dict

__all__ = [
    "__version__",
    "autocast",
    "checkpoint",
    "distributed",
    "flatten_state_dict",
    "ops",
    "optim",
    "quantization",
    "quantized_model_init",
    "recipe",
    "unflatten_state_dict",
]
__all__ += modules.__all__
