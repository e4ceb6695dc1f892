"""Fusible operations: basic ops, fused ops, the fuser and ``Sequential``."""

from fusible.ops import fused as _fused  # noqa: F401  (registers the built-in fusions)
from fusible.ops.basic import (
    GEGLU,
    GELU,
    AddExtraInput,
    AllGather,
    AllReduce,
    BasicLinear,
    Bias,
    ConstantScale,
    Dropout,
    GroupedLinear,
    Identity,
    LayerNorm,
    MakeExtraOutput,
    Quantize,
    ReduceScatter,
    ReLU,
    Reshape,
    RMSNorm,
    SiLU,
    SwiGLU,
)
from fusible.ops.linear import Linear
from fusible.ops.op import BasicOperation, FusedOperation, OpContext
from fusible.ops.registry import (
    FusionRule,
    fusion_disabled,
    register_fusion,
    unregister_fusion,
)
from fusible.ops.sequential import Sequential

__all__ = [
    "GEGLU",
    "GELU",
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicLinear",
    "BasicOperation",
    "Bias",
    "ConstantScale",
    "Dropout",
    "FusedOperation",
    "FusionRule",
    "GroupedLinear",
    "Identity",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "OpContext",
    "Quantize",
    "RMSNorm",
    "ReLU",
    "ReduceScatter",
    "Reshape",
    "Sequential",
    "SiLU",
    "SwiGLU",
    "fusion_disabled",
    "register_fusion",
    "unregister_fusion",
]
