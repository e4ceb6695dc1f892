"""``fusible.quantized_model_init``: build Linear weights directly in quantized form (FP8 weights).

Inside ``with fusible.quantized_model_init(recipe):``, every Linear-bearing op built
(``ops.BasicLinear``, hence ``ops.Linear``, ``fusible.Linear``, ``LayerNormLinear``,
``LayerNormMLP``; ``ops.GroupedLinear`` / ``fusible.GroupedLinear``, each expert's weight) stores
its weight as an ``nn.Parameter`` holding a :class:`QuantizedTensor`
(``Float8Tensor`` / ``MXFP8Tensor`` / ``Float8BlockTensor``) whose nominal dtype is the dtype the
op was built with. The
quantizer is the one ``recipe`` gives the op's *weight role* (``weight:linear``, or the module's
role, e.g. ``weight:layernorm_mlp:fc1``), built as at run time (:meth:`RecipeState.create`).
The high-precision weight exists only while the op initialises it.

Supported recipes: ``Float8CurrentScaling``, ``MXFP8BlockScaling``, ``Float8BlockScaling`` and
``CustomRecipe`` whose weight roles give a :class:`Float8CurrentScalingQuantizer`,
:class:`MXFP8Quantizer` or :class:`Float8BlockQuantizer` (``None``: that
weight stays in high precision). ``DelayedScaling`` raises ``ValueError``: a delayed-scaling
weight's scale comes from an amax history, which does not exist at init.

How such weights run, train (``fusible.optim.MasterWeightOptimizer``) and are saved is described in
``docs/quantization.md`` ("FP8 weights").
"""

from __future__ import annotations

import contextlib

import torch

from fusible.quantization.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    Quantizer,
)
from fusible.quantization.recipe import DelayedScaling, Recipe
from fusible.quantization.roles import QuantizerRole
from fusible.quantization.state import RecipeState

__all__ = [
    "get_quantized_model_init_recipe",
    "quantized_model_init",
    "quantized_model_init_keeps_transpose",
    "weight_init_quantizer",
]

_SUPPORTED = (
    "Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, or a CustomRecipe whose weight "
    "roles give a Float8CurrentScalingQuantizer, an MXFP8Quantizer or a Float8BlockQuantizer (or "
    "None: high precision)"
)

# (recipe, keep_transpose) of each entered region (recipe None for enabled=False), innermost
# last.
_stack: list[tuple[Recipe | None, bool]] = []


def get_quantized_model_init_recipe() -> Recipe | None:
    """The recipe of the innermost enabled ``quantized_model_init`` region, or None."""
    return _stack[-1][0] if _stack else None


def quantized_model_init_keeps_transpose() -> bool:
    """The innermost region's ``keep_transpose`` (False outside any)."""
    return _stack[-1][1] if _stack and _stack[-1][0] is not None else False


class quantized_model_init(contextlib.ContextDecorator):
    """Build the Linear weights of ops created inside the region in quantized form.

    ``recipe``: a :mod:`fusible.recipe` recipe (see the module docstring for which are supported);
    ``enabled``: False builds high-precision weights inside (regions nest and restore on exit);
    ``recipe`` may then be None, like ``fusible.autocast(enabled=False)``;
    ``keep_transpose``: a per-tensor FP8 weight also stores its transposed copy, the one the
    dgrad GEMM reads (1 byte per element more: as many bytes as a bf16 weight), so that no
    backward transposes it; the master-weight optimizer then re-quantizes both copies at each
    step. False (the default) stores the rowwise copy only and each backward makes the
    transposed copy by a byte transpose, freed after dgrad. MXFP8 and blockwise weights keep
    both copies either way.

    Only construction is affected: the weights stay quantized afterwards, whatever region is
    active. Quantized weights are used as they are by forward and backward when the autocast
    recipe's weight quantizer asks for the same format (per-tensor FP8 or MXFP8, same FP8
    dtype), otherwise as their exact dequantization (then quantized by the active recipe, or
    not at all without autocast). Train them with ``fusible.optim.MasterWeightOptimizer``.
    """

    def __init__(
        self, recipe: Recipe | None, enabled: bool = True, *, keep_transpose: bool = False
    ) -> None:
        for arg, v in (("enabled", enabled), ("keep_transpose", keep_transpose)):
            if not isinstance(v, bool):
                raise TypeError(f"fusible.quantized_model_init: {arg!r} must be a bool, got {v!r}")
        self.recipe: Recipe | None = None
        self.enabled = enabled
        self.keep_transpose = keep_transpose
        if recipe is None and not enabled:
            return
        if not isinstance(recipe, Recipe):
            raise TypeError(
                "fusible.quantized_model_init: 'recipe' must be a fusible.recipe recipe "
                f"({_SUPPORTED}), got {recipe!r}"
            )
        if isinstance(recipe, DelayedScaling):
            raise ValueError(
                f"fusible.quantized_model_init: recipe {recipe!r} is not supported: a "
                "delayed-scaling weight's scale comes from an amax history, which does not exist "
                f"at init. Supported: {_SUPPORTED}"
            )
        self.recipe = recipe

    def __enter__(self) -> quantized_model_init:
        _stack.append((self.recipe if self.enabled else None, self.keep_transpose))
        return self

    def __exit__(self, *exc_info: object) -> None:
        _stack.pop()  # also on exceptions


def weight_init_quantizer(
    recipe: Recipe, role: QuantizerRole, device: torch.device | str | None = None
) -> Quantizer | None:
    """The quantizer a weight with ``role`` is stored with under ``quantized_model_init(recipe)``
    (None: the weight stays in high precision). Built like the op's run-time weight quantizer,
    by :meth:`RecipeState.create` for that role; ``ValueError`` for an unsupported quantizer."""
    state = RecipeState.create(recipe, mode="forward", num_quantizers=1, roles=[role],
                               device=device)  # fmt: skip
    q = state.quantizers[0]
    if q is None or isinstance(
        q, (Float8CurrentScalingQuantizer, MXFP8Quantizer, Float8BlockQuantizer)
    ):
        return q
    raise ValueError(
        f"fusible.quantized_model_init: recipe {recipe!r} gives weight role "
        f"{role.qualified!r} a {type(q).__name__} ({q.scaling} scaling), which cannot make a "
        f"weight at init. Supported: {_SUPPORTED}"
    )
