"""Modules: thin compositions of ops (one implementation of the math, no second code path)."""

from fusible.modules.grouped_linear import GroupedLinear
from fusible.modules.layernorm_linear import LayerNormLinear
from fusible.modules.layernorm_mlp import LayerNormMLP
from fusible.modules.linear import Linear
from fusible.modules.transformer_layer import (
    MultiheadAttention,
    RotaryPositionEmbedding,
    TransformerLayer,
)

__all__ = [
    "GroupedLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "RotaryPositionEmbedding",
    "TransformerLayer",
]
