"""``fusible.GroupedLinear``: the MoE expert linears, as the op ``ops.GroupedLinear``."""

from __future__ import annotations

import re
from typing import Any

import torch

from fusible.modules._common import use_te_state_dict_names
from fusible.ops import GroupedLinear as _GroupedLinearOp
from fusible.ops import Sequential

__all__ = ["GroupedLinear"]

_PARAM = re.compile(r"(weight|bias)\d+\Z")


class GroupedLinear(Sequential):
    """``num_gemms`` linears over consecutive row groups (tokens grouped by expert), as in
    TransformerEngine: ``m(x, m_splits, is_first_microbatch=None)`` with ``x`` of shape
    ``(sum(m_splits), in_features)`` and ``m_splits`` a list of ``num_gemms`` ints >= 0 (zeros
    allowed; a 1-D integer tensor is accepted and read with ``.tolist()``, a host sync). One op,
    ``ops.GroupedLinear`` (its docstring has the details: split sizes as a per-call constant,
    roles, per-expert weight workspaces), in a ``Sequential``: same roles, same scope
    (``{input,weight,output}:grouped_linear`` per GEMM forward, ``{grad_output,grad_input}``
    backward, named ``gemm<i>`` or ``<name>_gemm<i>``).

    Parameters are attributes under TransformerEngine's names (``m.weight0``, ``m.bias3``), and
    ``state_dict()`` keys are ``weight0 .. weight{n-1}``, ``bias0 .. bias{n-1}`` and
    ``_extra_state`` (the recipe state of every expert); ``load_state_dict()`` also accepts the
    positional keys (``0.weight0``, ...). ``named_parameters()`` stays positional.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> None:
        op = _GroupedLinearOp(
            num_gemms, in_features, out_features, bias, device=device, dtype=dtype, name=name
        )
        super().__init__(op)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bool(bias)
        names = {f"0.weight{i}": f"weight{i}" for i in range(num_gemms)}
        if bias:
            names.update({f"0.bias{i}": f"bias{i}" for i in range(num_gemms)})
        use_te_state_dict_names(self, {**names, "0._extra_state": "_extra_state"})

    def forward(  # type: ignore[override]
        self,
        inp: torch.Tensor,
        m_splits: list[int] | tuple[int, ...] | torch.Tensor,
        is_first_microbatch: bool | None = None,
    ) -> Any:
        return super().forward(inp, is_first_microbatch=is_first_microbatch, m_splits=m_splits)

    @property
    def op(self) -> _GroupedLinearOp:
        return self[0]  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        if _PARAM.match(name):
            op = self.__dict__.get("_modules", {}).get("0")
            if op is not None and name in op._parameters:
                return op._parameters[name]
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}"
        )
