"""Basic operations."""

from fusible.ops.basic.activation import GEGLU, GELU, ReLU, SiLU, SwiGLU
from fusible.ops.basic.bias import ReturnBias
from fusible.ops.basic.comm import AllGather, AllReduce, ReduceScatter
from fusible.ops.basic.grouped_linear import GroupedLinear
from fusible.ops.basic.linear import BasicLinear, Bias
from fusible.ops.basic.misc import (
    AddExtraInput,
    ConstantScale,
    Dropout,
    Identity,
    MakeExtraOutput,
    Quantize,
    Reshape,
)
from fusible.ops.basic.normalization import LayerNorm, RMSNorm

__all__ = [
    "GEGLU",
    "GELU",
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicLinear",
    "Bias",
    "ConstantScale",
    "Dropout",
    "GroupedLinear",
    "Identity",
    "LayerNorm",
    "MakeExtraOutput",
    "Quantize",
    "RMSNorm",
    "ReLU",
    "ReduceScatter",
    "Reshape",
    "ReturnBias",
    "SiLU",
    "SwiGLU",
]
