"""``fusible.LayerNormMLP``: norm, fc1, activation, fc2, as ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fusible.modules._common import (
    GLU,
    NormFirst,
    bias_op,
    check_bias,
    check_return_bias,
    linear_te_names,
    make_activation,
    make_norm,
    norm_te_names,
    resolve_params_dtype,
    use_te_state_dict_names,
)
from fusible.modules._tp import TensorParallel, reduce_grad_over
from fusible.ops import BasicLinear, Bias, ReturnBias

__all__ = ["LayerNormMLP"]


class LayerNormMLP(NormFirst):
    """``fc2(act(fc1(Norm(x))))``; roles ``...:layernorm_mlp`` with names ``fc1`` / ``fc2``.

    ``activation``: ``gelu`` (tanh), ``relu``, ``silu``, ``swiglu`` or ``geglu`` (gated: fc1
    produces ``2 * ffn_hidden_size`` features). ``name``: a label for ``repr`` and error notes
    (as ``TransformerLayer``'s); the Linears' role names stay ``fc1`` / ``fc2``.

    ``state_dict()`` keys are TransformerEngine's: ``layer_norm_weight``, ``layer_norm_bias``
    (LayerNorm only), ``fc1_weight``, ``fc1_bias``, ``fc2_weight``, ``fc2_bias``, then each
    Linear's recipe state (and quantized weight's exact data) as ``fc1._extra_state`` and
    ``fc2._extra_state``; ``load_state_dict()`` also accepts the positional keys (``0.weight``,
    ``1.weight``, ``4.weight``, ...). ``named_parameters()`` stays positional. The TE names are
    also attributes (``m.fc1_weight is m.fc1.weight``).

    Tensor parallelism (``tp_group``, ``sequence_parallel``; see docs/distributed.md): fc1 is
    column-parallel (``fc1_weight`` ``[fc1_out / tp_size, hidden_size]``; for a gated activation
    each rank holds its block of both halves, as TransformerEngine), fc2 row-parallel
    (``fc2_weight`` ``[hidden_size, ffn_hidden_size / tp_size]``): one all-gather (or, without
    sequence parallelism, a backward all-reduce) before fc1 and one reduce-scatter (all-reduce)
    after fc2. With sequence parallelism the norm's parameters and fc2's bias see this rank's
    tokens only; their gradients are summed over ``tp_group``.

    ``init_method`` / ``output_layer_init_method`` (TransformerEngine's): fc1's / fc2's weight
    initialiser, as :class:`fusible.Linear`'s ``init_method``. ``return_bias=True``: fc2's bias
    is not added, ``forward`` returns ``(y, fc2_bias)`` (see :class:`fusible.Linear`).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        *,
        activation: str = "gelu",
        eps: float = 1e-5,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        name: str | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        output_layer_init_method: Callable[[torch.Tensor], Any] | None = None,
        return_bias: bool = False,
    ) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(
                f"LayerNormMLP: 'name' must be a str or None, got {type(name).__name__}"
            )
        dtype = resolve_params_dtype("LayerNormMLP", dtype, params_dtype)
        check_bias("LayerNormMLP", bias, "eps")
        check_return_bias("LayerNormMLP", bias, return_bias)
        mode = None if tp_group is None else "column"  # fc1's; fc2 is row-parallel
        tp = TensorParallel.resolve("LayerNormMLP", tp_group, mode, sequence_parallel)
        norm = make_norm(normalization, hidden_size, eps, zero_centered_gamma, device, dtype,
                         "LayerNormMLP")  # fmt: skip
        act = make_activation(activation, "LayerNormMLP")
        fc1_out = 2 * ffn_hidden_size if activation in GLU else ffn_hidden_size
        # Scope and name at construction: a weight built inside quantized_model_init is
        # quantized with its final role.
        ffn_local = tp.local("ffn_hidden_size", ffn_hidden_size) if tp.active else ffn_hidden_size
        fc1_out = fc1_out // ffn_hidden_size * ffn_local
        fc1 = BasicLinear(hidden_size, fc1_out, device=device, dtype=dtype, name="fc1",
                          scope="layernorm_mlp", init_method=init_method)  # fmt: skip
        fc2 = BasicLinear(ffn_local, hidden_size, device=device, dtype=dtype, name="fc2",
                          scope="layernorm_mlp", init_method=output_layer_init_method)  # fmt: skip
        pre, post = tp.before_column(), tp.after_row()
        ops: list[torch.nn.Module] = [norm, *pre, fc1]
        if bias:
            ops.append(Bias(fc1_out, device=device, dtype=dtype))
        ops += [act, fc2, *post]
        if bias:
            ops.append(bias_op("LayerNormMLP", hidden_size, return_bias, device=device,
                               dtype=dtype))  # fmt: skip
        if tp.sequence_parallel:
            # Replicated parameters applied to this rank's tokens only.
            for owner in (norm, ops[-1]) if bias else (norm,):
                for pname, _ in owner.named_parameters(recurse=False):
                    reduce_grad_over(owner, pname, tp.group)
        super().__init__(*ops)
        self.tp, self.name = tp, name
        self.tp_size, self.sequence_parallel = tp.size, sequence_parallel
        self.hidden_size, self.ffn_hidden_size, self.activation = (
            hidden_size, ffn_hidden_size, activation,
        )  # fmt: skip
        # Indices, not attributes: assigning a module attribute would register it twice.
        self._fc1_index = 1 + len(pre)
        self._fc2_index = len(ops) - len(post) - (2 if bias else 1)
        self._fc2_bias_index = self._fc2_index + 1 + len(post)
        i1, i2 = self._fc1_index, self._fc2_index
        use_te_state_dict_names(self, {
            **norm_te_names(normalization),
            **linear_te_names(i1, i1 + 1 if bias else None, "fc1_"),
            **linear_te_names(i2, self._fc2_bias_index if bias else None, "fc2_"),
            f"{i1}._extra_state": "fc1._extra_state",
            f"{i2}._extra_state": "fc2._extra_state",
        })  # fmt: skip

    @property
    def fc1(self) -> BasicLinear:
        return self[self._fc1_index]  # type: ignore[return-value]

    @property
    def fc2(self) -> BasicLinear:
        return self[self._fc2_index]  # type: ignore[return-value]

    @property
    def fc1_weight(self) -> torch.nn.Parameter:
        return self._forwarded("fc1_weight")  # type: ignore[no-any-return]

    @property
    def fc1_bias(self) -> torch.nn.Parameter | None:
        return self._forwarded("fc1_bias")  # type: ignore[no-any-return]

    @property
    def fc2_weight(self) -> torch.nn.Parameter:
        return self._forwarded("fc2_weight")  # type: ignore[no-any-return]

    @property
    def fc2_bias(self) -> torch.nn.Parameter | None:
        return self._forwarded("fc2_bias")  # type: ignore[no-any-return]

    def _forwarded_parameter(self, name: str) -> tuple[torch.nn.Module, str] | None:
        if name in ("fc1_weight", "fc2_weight"):
            return (self.fc1 if name == "fc1_weight" else self.fc2), "weight"
        if name in ("fc1_bias", "fc2_bias"):
            # isinstance, not a length check: ops appended after fc2 (a residual add) are not
            # a bias.
            i = self._fc1_index + 1 if name == "fc1_bias" else self._fc2_bias_index
            if i < len(self) and isinstance(self[i], (Bias, ReturnBias)):
                return self[i], "bias"
        return super()._forwarded_parameter(name)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation!r}" + (f", name={self.name!r}" if self.name else "")
        )
