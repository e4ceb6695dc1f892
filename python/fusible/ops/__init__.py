"""Fusible operations: basic ops, fused ops, the fuser and ``Sequential``."""

from fusible.ops import basic
from fusible.ops import fused as _fused  # noqa: F401  (registers the built-in fusions)
from fusible.ops.basic import *  # noqa: F403  (the basic ops, in __all__ below)
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
    "BasicOperation",
    "FusedOperation",
    "FusionRule",
    "Linear",
    "OpContext",
    "Sequential",
    "fusion_disabled",
    "register_fusion",
    "unregister_fusion",
]
__all__ += basic.__all__
