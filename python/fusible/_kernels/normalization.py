"""The normalization family (cpp/include/fusible/normalization.h,
cpp/bindings/ops_normalization.cpp); the quantized outputs are described in ``fusible._kernels``.

``norm_fwd(x, gamma, beta, eps, kind, zero_centered_gamma, out_dtype, quant, fp8_dtype, scale,
rowwise, columnwise, power_2_scale=True, amax_epsilon=0.0) -> (y, *quantized, amax, mean, rstd)``
    LayerNorm / RMSNorm over the last dimension (``w = 1 + gamma`` if ``zero_centered_gamma``);
    ``y`` empty if ``out_dtype`` is None; ``mean`` empty for RMSNorm.
``norm_bwd(dy, x, mean, rstd, gamma, kind, zero_centered_gamma) -> (dx, dgamma, dbeta)``
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fusible._kernels._common import (
    _LIBRARY,
    _accumulated,
    _c_names,
    _check_choice,
    _check_devices,
    _check_fused_choices,
    _fake,
    _fused_outputs,
    _ops,
)

norm_fwd: Any = _ops.norm_fwd.default
norm_bwd: Any = _ops.norm_bwd.default

# The choices of ``kind``, in the C enum's order: read from the core library's table
# (FUS_NORM_KIND_TABLE, normalization.h), which ops_normalization.cpp reads too.
NORM_KINDS = _c_names(_LIBRARY, "fus_norm_kind_name")
# The kind with a mean and a bias (beta / dbeta); the others have neither (RMSNorm).
_WITH_MEAN = "layernorm"
if _WITH_MEAN not in NORM_KINDS:
    raise ImportError(
        f"fusible: the core library's normalization kinds {NORM_KINDS} (FUS_NORM_KIND_TABLE, "
        f"normalization.h) lack {_WITH_MEAN!r}, which fusible._kernels.normalization expects"
    )


def _norm_fwd_outputs(
    x: torch.Tensor,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, ...]:
    rows = math.prod(x.shape[:-1])
    dev = x.device
    yq = _fused_outputs(x.shape, dev, out_dtype, x.dtype, quant, fp8_dtype, rowwise, columnwise)
    mean = torch.empty(rows if kind == _WITH_MEAN else 0, dtype=torch.float32, device=dev)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev)
    return (*yq, mean, rstd)


def _norm_bwd_outputs(
    dy: torch.Tensor, gamma: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    dgamma = torch.empty(gamma.shape, dtype=gamma.dtype, device=dy.device)
    dbeta = torch.empty(
        gamma.shape if kind == _WITH_MEAN else (0,), dtype=gamma.dtype, device=dy.device
    )
    return dx, dgamma, dbeta


@_fake("norm_fwd")
def _norm_fwd_fake(
    x,
    gamma,
    beta,
    eps,
    kind,
    zero_centered_gamma,
    out_dtype,
    quant,
    fp8_dtype,
    scale,
    rowwise,
    columnwise,
    power_2_scale=True,
    amax_epsilon=0.0,
    amax_into=None,
):
    _check_devices("norm_fwd", x.device, (("gamma", gamma), ("beta", beta), ("scale", scale),
                                          ("amax_into", amax_into)))  # fmt: skip
    _check_fused_choices("norm_fwd", kind, NORM_KINDS, quant)
    outs = _norm_fwd_outputs(x, kind, out_dtype, quant, fp8_dtype, rowwise, columnwise)
    return _accumulated("norm_fwd", outs, 5, quant, amax_into)


@_fake("norm_bwd")
def _norm_bwd_fake(dy, x, mean, rstd, gamma, kind, zero_centered_gamma):
    _check_devices("norm_bwd", dy.device, (("x", x), ("mean", mean), ("rstd", rstd),
                                           ("gamma", gamma)))  # fmt: skip
    _check_choice("norm_bwd", "kind", kind, NORM_KINDS)
    return _norm_bwd_outputs(dy, gamma, kind)
