"""Built-in fused operations. Every built-in fusion rule is registered here, in one place."""

from typing import Any

from fusible.ops import registry
from fusible.ops.basic import (
    AddExtraInput,
    AllGather,
    BasicLinear,
    Bias,
    GroupedLinear,
    MakeExtraOutput,
    ReduceScatter,
)
from fusible.ops.basic.activation import ACTIVATIONS
from fusible.ops.fused import (
    backward_activation_bias,
    backward_grouped_linear_activation,
    backward_linear_add,
    comm_linear,
    forward_grouped_linear_activation,
    forward_linear_bias_activation,
    forward_linear_bias_add,
)
from fusible.ops.fused.backward_activation_bias import BackwardActivationBias
from fusible.ops.fused.backward_grouped_linear_activation import BackwardGroupedLinearActivation
from fusible.ops.fused.backward_linear_add import BackwardLinearAdd
from fusible.ops.fused.comm_linear import BackwardLinearFP8GradAllGather, ForwardFP8AllGatherLinear
from fusible.ops.fused.forward_grouped_linear_activation import ForwardGroupedLinearActivation
from fusible.ops.fused.forward_linear_bias_activation import ForwardLinearBiasActivation
from fusible.ops.fused.forward_linear_bias_add import ForwardLinearBiasAdd

__all__ = [
    "BackwardActivationBias",
    "BackwardGroupedLinearActivation",
    "BackwardLinearAdd",
    "BackwardLinearFP8GradAllGather",
    "ForwardFP8AllGatherLinear",
    "ForwardGroupedLinearActivation",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
]

# The activation op classes, in ACTIVATIONS order (one class may serve several kinds): those with
# a kind that a GEMM epilogue computes fuse into Linear + Bias (the rule checks the op's kind), and
# every one fuses its backward with the bias gradient.
_ACTS = tuple(dict.fromkeys(a.op for a in ACTIVATIONS.values()))
_EPILOGUE_ACTS = tuple(dict.fromkeys(a.op for a in ACTIVATIONS.values() if a.gemm_epilogue))

# Longer patterns first: at each position the first accepted rule wins.
_BUILTIN_RULES = [
    *(
        (
            (BasicLinear, Bias, act),
            ForwardLinearBiasActivation,
            forward_linear_bias_activation.accepts,
            True,
            False,
        )
        for act in _EPILOGUE_ACTS
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
        for act in _ACTS
    ),
    ((MakeExtraOutput, BasicLinear), BackwardLinearAdd, backward_linear_add.accepts, False, True),
    # MoE expert MLP: fc1's grouped GEMMs with the GELU epilogue; backward, the activation's
    # kernel writes fc1's FP8 output gradient and bias gradient per expert. (Not fc2's FP8 dgrad
    # with cuBLASLt's dgelu epilogue: slower on the H200, see GroupedLinear._backward_grouped.)
    *(
        (
            (GroupedLinear, act),
            ForwardGroupedLinearActivation,
            forward_grouped_linear_activation.accepts,
            True,
            False,
        )
        for act in _EPILOGUE_ACTS
    ),
    *(
        (
            (GroupedLinear, act),
            BackwardGroupedLinearActivation,
            backward_grouped_linear_activation.accepts,
            False,
            True,
        )
        for act in _ACTS
    ),
]

# FP8 all-gather (sequence parallelism): AllGather + each forward Linear fusion above (the
# quantize moves before the gather), then AllGather + BasicLinear alone; and, backward,
# BasicLinear + ReduceScatter (the output gradient's all-gather in FP8).
_FP8_GATHER_RULES: list[tuple[Any, ...]] = [
    (
        (AllGather, *_p),
        comm_linear.forward_rule(_c),
        comm_linear.accepts_forward(_a),
        True,
        False,
    )
    for _p, _c, _a, _f, _b in _BUILTIN_RULES
    if _f and _p[0] is BasicLinear
]
_FP8_GATHER_RULES += [
    (
        (AllGather, BasicLinear),
        comm_linear.forward_rule(None),
        comm_linear.accepts_forward(None),
        True,
        False,
    ),
    (
        (BasicLinear, ReduceScatter),
        BackwardLinearFP8GradAllGather,
        comm_linear.accepts_recipe,
        False,
        True,
    ),
]
_BUILTIN_RULES = _FP8_GATHER_RULES + _BUILTIN_RULES

for _pattern, _cls, _pred, _fwd, _bwd in _BUILTIN_RULES:
    registry.register_fusion(
        _pattern, _cls, name=_cls.name, predicate=_pred, forward=_fwd, backward=_bwd, builtin=True
    )
