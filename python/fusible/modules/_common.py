"""Helpers shared by the modules."""

from __future__ import annotations

import torch

from fusible.ops import GEGLU, GELU, LayerNorm, ReLU, RMSNorm, SiLU, SwiGLU
from fusible.ops.op import BasicOperation

ACTIVATIONS: dict[str, type[BasicOperation]] = {
    "gelu": GELU,
    "relu": ReLU,
    "silu": SiLU,
    "swiglu": SwiGLU,
    "geglu": GEGLU,
}
GLU = {"swiglu", "geglu"}


def make_norm(
    normalization: str,
    features: int,
    eps: float,
    zero_centered_gamma: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    owner: str,
) -> BasicOperation:
    kinds = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
    if normalization not in kinds:
        raise ValueError(
            f"{owner}: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}"
        )
    return kinds[normalization](
        features, eps=eps, zero_centered_gamma=zero_centered_gamma, device=device, dtype=dtype
    )


def make_activation(activation: str, owner: str) -> BasicOperation:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{owner}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        )
    return ACTIVATIONS[activation]()
