"""Built-in fused operations. Every built-in fusion rule is registered here, in one place."""

from fusible.ops import registry
from fusible.ops.basic import (
    GEGLU,
    GELU,
    AddExtraInput,
    BasicLinear,
    Bias,
    MakeExtraOutput,
    ReLU,
    SiLU,
    SwiGLU,
)
from fusible.ops.fused import (
    backward_activation_bias,
    backward_linear_add,
    forward_linear_bias_activation,
    forward_linear_bias_add,
)
from fusible.ops.fused.backward_activation_bias import BackwardActivationBias
from fusible.ops.fused.backward_linear_add import BackwardLinearAdd
from fusible.ops.fused.forward_linear_bias_activation import ForwardLinearBiasActivation
from fusible.ops.fused.forward_linear_bias_add import ForwardLinearBiasAdd

__all__ = [
    "BackwardActivationBias",
    "BackwardLinearAdd",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
]

# Longer patterns first: at each position the first accepted rule wins.
_BUILTIN_RULES = [
    (
        (BasicLinear, Bias, GELU),
        ForwardLinearBiasActivation,
        forward_linear_bias_activation.accepts,
        True,
        False,
    ),
    (
        (BasicLinear, Bias, AddExtraInput),
        ForwardLinearBiasAdd,
        forward_linear_bias_add.accepts,
        True,
        False,
    ),
    (
        (BasicLinear, AddExtraInput),
        ForwardLinearBiasAdd,
        forward_linear_bias_add.accepts,
        True,
        False,
    ),
    (
        (BasicLinear, Bias),
        ForwardLinearBiasActivation,
        forward_linear_bias_activation.accepts,
        True,
        False,
    ),
    *(
        ((Bias, act), BackwardActivationBias, backward_activation_bias.accepts, False, True)
        for act in (GELU, ReLU, SiLU, SwiGLU, GEGLU)
    ),
    ((MakeExtraOutput, BasicLinear), BackwardLinearAdd, backward_linear_add.accepts, False, True),
]

for _pattern, _cls, _pred, _fwd, _bwd in _BUILTIN_RULES:
    registry.register_fusion(
        _pattern, _cls, name=_cls.name, predicate=_pred, forward=_fwd, backward=_bwd, builtin=True
    )
