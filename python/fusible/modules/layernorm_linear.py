"""``fusible.LayerNormLinear``: norm then Linear, as ops (norm + quantize fuses)."""

from __future__ import annotations

import torch

from fusible.modules._common import make_norm
from fusible.ops import BasicLinear, Bias, Sequential

__all__ = ["LayerNormLinear"]


class LayerNormLinear(Sequential):
    """``Linear(Norm(x))``; roles ``...:layernorm_linear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        eps: float = 1e-5,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> None:
        norm = make_norm(normalization, in_features, eps, zero_centered_gamma, device, dtype,
                         "LayerNormLinear")  # fmt: skip
        linear = BasicLinear(in_features, out_features, device=device, dtype=dtype, name=name,
                             scope="layernorm_linear")  # fmt: skip
        ops: list[torch.nn.Module] = [norm, linear]
        if bias:
            ops.append(Bias(out_features, device=device, dtype=dtype))
        super().__init__(*ops)
        self.in_features, self.out_features = in_features, out_features

    @property
    def layer_norm_weight(self) -> torch.nn.Parameter:
        return self[0].weight  # type: ignore[return-value]

    @property
    def weight(self) -> torch.nn.Parameter:
        return self[1].weight  # type: ignore[return-value]

    @property
    def bias(self) -> torch.nn.Parameter | None:
        return self[2].bias if len(self) > 2 else None  # type: ignore[return-value]
