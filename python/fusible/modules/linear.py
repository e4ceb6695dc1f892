"""``fusible.Linear``."""

from __future__ import annotations

import torch

from fusible.modules._common import use_te_state_dict_names
from fusible.ops.linear import Linear as _OpsLinear

__all__ = ["Linear"]


class Linear(_OpsLinear):
    """``y = x @ weight.T + bias`` as a module: the ops ``BasicLinear`` (+ ``Bias``), roles
    ``{input,weight,output,grad_output,grad_input}:linear``. Call as ``m(x)`` or
    ``m(x, is_first_microbatch=True|False|None)`` to use the quantized weight cache.

    ``state_dict()`` keys are TransformerEngine's: ``weight``, ``bias`` and ``_extra_state`` (the
    Linear's recipe state, and a quantized weight's exact data); ``load_state_dict()`` also
    accepts the positional keys (``0.weight``, ``1.bias``, ``0._extra_state``).
    ``named_parameters()`` stays positional (``0.weight``, ``1.bias``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype, name=name)
        names = {"0.weight": "weight"}
        if bias:
            names["1.bias"] = "bias"
        use_te_state_dict_names(self, {**names, "0._extra_state": "_extra_state"})
