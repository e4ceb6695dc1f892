"""``fusible.Linear``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fusible.modules._common import (
    bias_op,
    check_bias,
    check_return_bias,
    linear_te_names,
    resolve_params_dtype,
    use_te_state_dict_names,
)
from fusible.modules._tp import TensorParallel, reduce_grad_over
from fusible.ops import BasicLinear
from fusible.ops.linear import Linear as _OpsLinear
from fusible.ops.sequential import Sequential

__all__ = ["Linear"]


class Linear(_OpsLinear):
    """``y = x @ weight.T + bias`` as a module: the ops ``BasicLinear`` (+ ``Bias``), roles
    ``{input,weight,output,grad_output,grad_input}:linear``. Call as ``m(x)`` or
    ``m(x, is_first_microbatch=True|False|None)`` to use the quantized weight cache.

    Tensor parallelism (TransformerEngine's arguments, see docs/distributed.md): ``tp_group``
    (a ``torch.distributed`` process group; its size is ``tp_size``), ``parallel_mode``
    (``"column"``: ``weight`` is ``[out_features / tp_size, in_features]``, the output is this
    rank's features; ``"row"``: ``weight`` is ``[out_features, in_features / tp_size]``, the
    input is this rank's features and the partial outputs are summed; None: no split) and
    ``sequence_parallel`` (the input of a column-parallel / output of a row-parallel Linear is
    split along its first dimension: all-gathered before / reduce-scattered after the GEMM). The
    layer is then a Sequential of communication ops and the Linear's ops.

    ``state_dict()`` keys are TransformerEngine's: ``weight``, ``bias`` and ``_extra_state`` (the
    Linear's recipe state, and a quantized weight's exact data); ``load_state_dict()`` also
    accepts the positional keys (``0.weight``, ``1.bias``, ``0._extra_state``).
    ``named_parameters()`` stays positional (``0.weight``, ``1.bias``; shifted by the
    communication ops of a tensor-parallel layer).

    ``save_original_input`` (TransformerEngine's): under an FP8 recipe, backward keeps the
    high-precision input for wgrad (no FP8 copy of it) and quantizes it again, the same bits;
    for a Linear whose input something else keeps anyway, e.g. an attention output projection
    (attention keeps its output for its own backward). See ``ops.BasicLinear``.

    ``init_method`` (TransformerEngine's): ``init_method(weight)`` initialises the weight in
    place (None: kaiming-uniform, as ``torch.nn.Linear``); ``reset_parameters()`` runs it again.
    Under tensor parallelism it initialises this rank's shard (TE initialises the full weight
    and splits it, with its RNG tracker).

    ``return_bias=True`` (TransformerEngine's): the bias is not added; ``forward`` returns
    ``(y, bias)`` (the bias in ``y``'s dtype, its gradient flowing back from wherever the caller
    adds it), e.g. to fuse it with a dropout and a residual add, or to add it once after a
    row-parallel reduction. The bias is then a ``ReturnBias`` op, under the same names."""

    def __init__(
        self,
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
        save_original_input: bool = False,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        return_bias: bool = False,
    ) -> None:
        dtype = resolve_params_dtype("Linear", dtype, params_dtype)
        check_bias("Linear", bias)
        check_return_bias("Linear", bias, return_bias)
        tp = TensorParallel.resolve("Linear", tp_group, parallel_mode, sequence_parallel)
        if not tp.active:
            super().__init__(in_features, out_features, bias and not return_bias, device=device,
                             dtype=dtype, name=name, save_original_input=save_original_input,
                             init_method=init_method)  # fmt: skip
            if return_bias:
                self.append(bias_op("Linear", out_features, return_bias, device=device,
                                    dtype=dtype, name=name))  # fmt: skip
        else:
            col = tp.mode == "column"
            k, n = tp.local_features(in_features, out_features)
            lin = BasicLinear(k, n, device=device, dtype=dtype, name=name,
                              save_original_input=save_original_input,
                              init_method=init_method)  # fmt: skip
            pre, post = (tp.before_column(), []) if col else ([], tp.after_row())
            ops: list[torch.nn.Module] = [*pre, lin, *post]
            bias_index = len(ops)
            if bias:
                b = bias_op("Linear", n, return_bias, device=device, dtype=dtype, name=name)
                if not col and tp.sequence_parallel:
                    reduce_grad_over(b, "bias", tp.group)  # added to this rank's tokens only
                ops.append(b)
            Sequential.__init__(self, *ops)
            self._linear_index, self._bias_index = len(pre), bias_index
            self.in_features, self.out_features = in_features, out_features
        self.tp = tp
        self.tp_size, self.parallel_mode = tp.size, tp.mode
        self.sequence_parallel = sequence_parallel
        i, j = self._linear_index, self._bias_index
        names = linear_te_names(i, j if bias else None)
        use_te_state_dict_names(self, {**names, f"{i}._extra_state": "_extra_state"})
