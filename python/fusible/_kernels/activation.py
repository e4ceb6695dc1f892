"""The activation family (cpp/include/fusible/activation.h, cpp/bindings/ops_activation.cpp); the
quantized outputs are described in ``fusible._kernels``.

``act_fwd(x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, power_2_scale=True,
amax_epsilon=0.0) -> (y, *quantized, amax)``
    ``kind`` in :data:`ACTIVATIONS`; the gated kinds read ``x = [a | b]`` and halve the last
    dimension.
``act_bwd(grad, x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, with_dbias,
power_2_scale=True, amax_epsilon=0.0) -> (dx, *quantized, amax, dbias)``
    ``dx = grad * act'(x)``; ``dbias`` = column sums of ``dx`` (dtype ``out_dtype`` or
    ``grad.dtype``). For a gated kind, an MXFP8 rowwise copy needs H % 32 == 0.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from fusible._kernels._common import (
    _LIBRARY,
    _accumulated,
    _c_names,
    _check_devices,
    _check_fused_choices,
    _fake,
    _fused_outputs,
    _ops,
)

act_fwd: Any = _ops.act_fwd.default
act_bwd: Any = _ops.act_bwd.default


def _activation_table(library: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """The activation kinds in ``fus_activation`` order and the gated ones, read from the core
    library's one table (``FUS_ACTIVATION_TABLE``, activation.h) through its C API."""
    kinds = _c_names(library, "fus_activation_name")
    lib = ctypes.CDLL(library)
    lib.fus_activation_is_gated.argtypes = [ctypes.c_int]
    lib.fus_activation_is_gated.restype = ctypes.c_int
    gated = frozenset(k for i, k in enumerate(kinds) if lib.fus_activation_is_gated(i))
    return kinds, gated


# The activation kinds (the torch operators' ``kind``) and the gated ones ([a | b] -> H columns).
ACTIVATIONS, GATED_ACTIVATIONS = _activation_table(_LIBRARY)


def _act_out_shape(op: str, x: torch.Tensor, kind: str) -> tuple[int, ...]:
    """Forward output shape: x's, with the last dimension halved for the gated kinds."""
    if x.dim() == 0:
        raise ValueError(f"fusible.{op}: argument 'x' must have at least one dimension")
    k = x.shape[-1]
    if kind in GATED_ACTIVATIONS:
        if k % 2 or k == 0:
            raise ValueError(
                f"fusible.{op}: argument 'x' must have an even, non-zero last dimension for "
                f"kind={kind!r} ([a | b] = 2H), got {k}"
            )
        return (*x.shape[:-1], k // 2)
    return tuple(x.shape)


def _act_fwd_outputs(
    x: torch.Tensor,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, ...]:
    shape = _act_out_shape("act_fwd", x, kind)
    return _fused_outputs(
        shape, x.device, out_dtype, x.dtype, quant, fp8_dtype, rowwise, columnwise
    )


def _act_bwd_outputs(
    grad: torch.Tensor,
    x: torch.Tensor,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    with_dbias: bool,
) -> tuple[torch.Tensor, ...]:
    dev = x.device
    dt = out_dtype if out_dtype is not None else grad.dtype
    dxq = _fused_outputs(x.shape, dev, out_dtype, dt, quant, fp8_dtype, rowwise, columnwise)
    dbias = torch.empty(x.shape[-1] if with_dbias else 0, dtype=dt, device=dev)
    return (*dxq, dbias)


@_fake("act_fwd")
def _act_fwd_fake(x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise,
                  power_2_scale=True, amax_epsilon=0.0, amax_into=None):  # fmt: skip
    _check_devices("act_fwd", x.device, (("scale", scale), ("amax_into", amax_into)))
    _check_fused_choices("act_fwd", kind, ACTIVATIONS, quant)
    outs = _act_fwd_outputs(x, kind, out_dtype, quant, fp8_dtype, rowwise, columnwise)
    return _accumulated("act_fwd", outs, 5, quant, amax_into)


@_fake("act_bwd")
def _act_bwd_fake(
    grad, x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, with_dbias,
    power_2_scale=True, amax_epsilon=0.0, amax_into=None,
):  # fmt: skip
    _check_devices("act_bwd", grad.device, (("x", x), ("scale", scale), ("amax_into", amax_into)))
    _check_fused_choices("act_bwd", kind, ACTIVATIONS, quant)
    outs = _act_bwd_outputs(grad, x, out_dtype, quant, fp8_dtype, rowwise, columnwise, with_dbias)
    return _accumulated("act_bwd", outs, 5, quant, amax_into)
