"""``ops.Linear``: BasicLinear followed by an optional Bias (flattened into the enclosing
Sequential, so the fuser sees both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fusible.ops.basic import BasicLinear, Bias, ReturnBias
from fusible.ops.sequential import Sequential

__all__ = ["Linear"]


class LinearParameters(Sequential):
    """``weight`` and ``bias`` of a Sequential holding a ``BasicLinear`` at ``_linear_index``
    and, where it has one, its ``Bias`` at ``_bias_index`` (shared by ``ops.Linear`` and the
    modules built around a Linear)."""

    _linear_index = 0
    _bias_index = 1

    @property
    def weight(self) -> torch.nn.Parameter:
        return self._forwarded("weight")  # type: ignore[no-any-return]

    @property
    def bias(self) -> torch.nn.Parameter | None:
        return self._forwarded("bias")  # type: ignore[no-any-return]

    def _forwarded_parameter(self, name: str) -> tuple[torch.nn.Module, str] | None:
        if name == "weight":
            return self[self._linear_index], "weight"
        # isinstance, not a length check: ops may be appended (a residual add, a dropout).
        j = self._bias_index
        if name == "bias" and len(self) > j and isinstance(self[j], (Bias, ReturnBias)):
            return self[j], "bias"
        return super()._forwarded_parameter(name)


class Linear(LinearParameters):
    """``y = x @ weight.T + bias``; ``weight`` is ``[out_features, in_features]``.
    ``save_original_input``, ``init_method``: see :class:`~fusible.ops.BasicLinear`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        save_original_input: bool = False,
        init_method: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        ops: list[torch.nn.Module] = [
            BasicLinear(in_features, out_features, device=device, dtype=dtype, name=name,
                        save_original_input=save_original_input, init_method=init_method)
        ]  # fmt: skip
        if bias:
            ops.append(Bias(out_features, device=device, dtype=dtype, name=name))
        super().__init__(*ops)
        self.in_features, self.out_features = in_features, out_features
