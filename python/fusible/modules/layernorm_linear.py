"""``fusible.LayerNormLinear``: norm then Linear, as ops (norm + quantize fuses)."""

from __future__ import annotations

import torch

from fusible.modules._common import NormFirst, make_norm, use_te_state_dict_names
from fusible.ops import BasicLinear, Bias

__all__ = ["LayerNormLinear"]


class LayerNormLinear(NormFirst):
    """``Linear(Norm(x))``; roles ``...:layernorm_linear``.

    ``state_dict()`` keys are TransformerEngine's: ``layer_norm_weight``, ``layer_norm_bias``
    (LayerNorm only), ``weight``, ``bias`` and ``_extra_state`` (the Linear's recipe state, and a
    quantized weight's exact data); ``load_state_dict()`` also accepts the positional keys
    (``0.weight``, ``1.weight``, ...). ``named_parameters()`` stays positional.
    """

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
        names = {"0.weight": "layer_norm_weight"}
        if normalization == "LayerNorm":
            names["0.bias"] = "layer_norm_bias"
        names["1.weight"] = "weight"
        if bias:
            names["2.bias"] = "bias"
        use_te_state_dict_names(self, {**names, "1._extra_state": "_extra_state"})

    @property
    def weight(self) -> torch.nn.Parameter:
        return self[1].weight  # type: ignore[return-value]

    @property
    def bias(self) -> torch.nn.Parameter | None:
        # isinstance, not a length check: ops may be appended after the Linear.
        return self[2].bias if len(self) > 2 and isinstance(self[2], Bias) else None  # type: ignore[return-value]
