"""``fusible.LayerNormLinear``: norm then Linear, as ops (norm + quantize fuses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fusible.modules._common import (
    NormFirst,
    bias_op,
    check_bias,
    check_return_bias,
    linear_te_names,
    make_norm,
    norm_te_names,
    resolve_params_dtype,
    use_te_state_dict_names,
)
from fusible.modules._tp import TensorParallel, reduce_grad_over
from fusible.ops import BasicLinear
from fusible.ops.linear import LinearParameters

__all__ = ["LayerNormLinear"]


class LayerNormLinear(NormFirst, LinearParameters):
    """``Linear(Norm(x))``; roles ``...:layernorm_linear``.

    ``state_dict()`` keys are TransformerEngine's: ``layer_norm_weight``, ``layer_norm_bias``
    (LayerNorm only), ``weight``, ``bias`` and ``_extra_state`` (the Linear's recipe state, and a
    quantized weight's exact data); ``load_state_dict()`` also accepts the positional keys
    (``0.weight``, ``1.weight``, ...). ``named_parameters()`` stays positional.

    Tensor parallelism: ``tp_group``, ``parallel_mode="column"`` (``weight`` is
    ``[out_features / tp_size, in_features]``; the norm is replicated) or None, and
    ``sequence_parallel`` (the norm runs on this rank's tokens, then the normalised input is
    all-gathered; the norm's parameter gradients are summed over ``tp_group``), as
    :class:`fusible.Linear`. ``parallel_mode="row"`` is refused: the norm needs whole rows of
    features, which a row-parallel input splits.

    ``init_method``: the weight's initialiser; ``return_bias=True``: the bias is returned, not
    added (``forward`` returns ``(y, bias)``); both as :class:`fusible.Linear`'s.
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
        params_dtype: torch.dtype | None = None,
        name: str | None = None,
        tp_group: Any = None,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        return_bias: bool = False,
    ) -> None:
        dtype = resolve_params_dtype("LayerNormLinear", dtype, params_dtype)
        check_bias("LayerNormLinear", bias, "eps")
        check_return_bias("LayerNormLinear", bias, return_bias)
        tp = TensorParallel.resolve("LayerNormLinear", tp_group, parallel_mode, sequence_parallel)
        if tp.mode == "row":
            raise ValueError(
                "LayerNormLinear: parallel_mode must be 'column' or None, got 'row' (the norm "
                "needs whole rows of features, which a row-parallel input splits)"
            )
        norm = make_norm(normalization, in_features, eps, zero_centered_gamma, device, dtype,
                         "LayerNormLinear")  # fmt: skip
        n = tp.local("out_features", out_features) if tp.active else out_features
        linear = BasicLinear(in_features, n, device=device, dtype=dtype, name=name,
                             scope="layernorm_linear", init_method=init_method)  # fmt: skip
        pre = tp.before_column()
        ops: list[torch.nn.Module] = [norm, *pre, linear]
        if bias:
            ops.append(bias_op("LayerNormLinear", n, return_bias, device=device, dtype=dtype))
        if tp.sequence_parallel:
            for pname, _ in norm.named_parameters(recurse=False):
                reduce_grad_over(norm, pname, tp.group)  # the norm saw this rank's tokens only
        super().__init__(*ops)
        self.in_features, self.out_features = in_features, out_features
        self.tp = tp
        self.tp_size, self.parallel_mode = tp.size, tp.mode
        self.sequence_parallel = sequence_parallel
        i = self._linear_index = 1 + len(pre)
        self._bias_index = i + 1  # the bias property checks it is one
        names = {**norm_te_names(normalization), **linear_te_names(i, i + 1 if bias else None)}
        use_te_state_dict_names(self, {**names, f"{i}._extra_state": "_extra_state"})
