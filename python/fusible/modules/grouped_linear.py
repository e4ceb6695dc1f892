"""``fusible.GroupedLinear``: the MoE expert linears, as the op ``ops.GroupedLinear``."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from fusible.modules._common import check_bias, resolve_params_dtype, use_te_state_dict_names
from fusible.modules._tp import TensorParallel
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

    Tensor parallelism (TransformerEngine's ``tp_group``, ``parallel_mode``): ``"column"``
    splits every expert's ``out_features`` (``weight<i>`` ``[out / tp_size, in]``, its bias
    likewise; the input is replicated, its gradient summed over the group by an
    ``AllReduce("backward")`` before the op), ``"row"`` every expert's ``in_features``
    (``weight<i>`` ``[out, in / tp_size]``; the input is this rank's features, the partial
    outputs are summed by an ``AllReduce`` after the op; ``bias=False`` only: a per-expert bias
    would have to be added once after the sum). ``sequence_parallel=True`` is refused: the rows
    are grouped by expert on each rank (``m_splits``), so an all-gather along them would
    interleave the ranks' groups (MoE token dispatch is the caller's, as in Megatron-LM).

    ``init_method``: every expert's weight initialiser, as :class:`fusible.Linear`'s.
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
        params_dtype: torch.dtype | None = None,
        name: str | None = None,
        tp_group: Any = None,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        init_method: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        dtype = resolve_params_dtype("GroupedLinear", dtype, params_dtype)
        check_bias("GroupedLinear", bias)
        tp = TensorParallel.resolve("GroupedLinear", tp_group, parallel_mode, sequence_parallel)
        if tp.sequence_parallel:
            raise ValueError(
                "GroupedLinear: sequence_parallel must be False, got True (the rows are grouped "
                "by expert on each rank, m_splits; an all-gather along them would interleave "
                "the ranks' groups)"
            )
        if tp.active and tp.mode == "row" and bias:
            raise ValueError(
                "GroupedLinear: parallel_mode='row' needs bias=False, got bias=True (a "
                "per-expert bias must be added once, after the sum over tp_group: not "
                "implemented)"
            )
        k, n = tp.local_features(in_features, out_features)
        op = _GroupedLinearOp(num_gemms, k, n, bias, device=device, dtype=dtype, name=name,
                              init_method=init_method)  # fmt: skip
        pre = tp.before_column() if tp.mode == "column" else []
        post = tp.after_row() if tp.mode == "row" else []
        super().__init__(*pre, op, *post)
        self._op_index = i = len(pre)
        self.tp = tp
        self.tp_size, self.parallel_mode, self.sequence_parallel = tp.size, tp.mode, False
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bool(bias)
        names = {f"{i}.weight{j}": f"weight{j}" for j in range(num_gemms)}
        if bias:
            names.update({f"{i}.bias{j}": f"bias{j}" for j in range(num_gemms)})
        use_te_state_dict_names(self, {**names, f"{i}._extra_state": "_extra_state"})

    def forward(  # type: ignore[override]
        self,
        inp: torch.Tensor,
        m_splits: list[int] | tuple[int, ...] | torch.Tensor,
        is_first_microbatch: bool | None = None,
    ) -> Any:
        return super().forward(inp, is_first_microbatch=is_first_microbatch, m_splits=m_splits)

    @property
    def op(self) -> _GroupedLinearOp:
        return self[self._op_index]  # type: ignore[return-value]

    def _forwarded_parameter(self, name: str) -> tuple[torch.nn.Module, str] | None:
        if _PARAM.match(name) and name in self.op._parameters:
            return self.op, name
        return super()._forwarded_parameter(name)

    def __getattr__(self, name: str) -> Any:
        if _PARAM.match(name):
            key = str(self.__dict__.get("_op_index", 0))
            op = self.__dict__.get("_modules", {}).get(key)
            if op is not None and name in op._parameters:
                return op._parameters[name]
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}"
        )
