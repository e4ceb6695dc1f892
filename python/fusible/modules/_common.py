"""Helpers shared by the modules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fusible.ops import LayerNorm, RMSNorm, Sequential
from fusible.ops import basic as ops_basic
from fusible.ops.basic.activation import ACTIVATIONS
from fusible.ops.op import BasicOperation

# The modules' ``activation=`` choices (ops.basic.activation.ACTIVATIONS: each kind offered there)
# and the gated ones among them (fc1 then has twice the FFN width).
MODULE_ACTIVATIONS = tuple(k for k, a in ACTIVATIONS.items() if a.in_modules)
GLU = frozenset(k for k in MODULE_ACTIVATIONS if ACTIVATIONS[k].gated)


class NormFirst(Sequential):
    """A module whose first op is its norm, with TransformerEngine's names for the norm's
    parameters."""

    @property
    def layer_norm_weight(self) -> torch.nn.Parameter:
        return self._forwarded("layer_norm_weight")  # type: ignore[no-any-return]

    @property
    def layer_norm_bias(self) -> torch.nn.Parameter | None:
        """The norm's bias (None for RMSNorm)."""
        return self._forwarded("layer_norm_bias")  # type: ignore[no-any-return]

    def _forwarded_parameter(self, name: str) -> tuple[torch.nn.Module, str] | None:
        if name == "layer_norm_weight" or (
            name == "layer_norm_bias" and getattr(self[0], "bias", None) is not None
        ):
            return self[0], name[len("layer_norm_") :]
        return super()._forwarded_parameter(name)


def make_norm(
    normalization: str,
    features: int,
    eps: float,
    zero_centered_gamma: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    owner: str,
) -> BasicOperation:
    kinds = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
    if normalization not in kinds:
        raise ValueError(
            f"{owner}: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}"
        )
    return kinds[normalization](
        features, eps=eps, zero_centered_gamma=zero_centered_gamma, device=device, dtype=dtype
    )


def make_activation(activation: str, owner: str) -> BasicOperation:
    if activation not in MODULE_ACTIVATIONS:
        raise ValueError(
            f"{owner}: activation must be one of {sorted(MODULE_ACTIVATIONS)}, got {activation!r}"
        )
    return ACTIVATIONS[activation].make()


# ---- TransformerEngine state_dict names ---------------------------------------------------------
#
# A module is an ``ops.Sequential``: its parameters live on its ops, so ``nn.Module`` would name
# them by position (``0.weight``, ``4.weight``). The hooks below rename them on save to the names
# TransformerEngine uses for the same module (``layer_norm_weight``, ``fc1_weight``, ...) and
# accept both spellings on load. ``names`` maps each positional key (relative to the module) to
# its TE name, in the order ``state_dict()`` emits them. The ``_extra_state`` of an op that has
# no name there (norm, bias, activation: ops without quantizers, whose extra state is always
# ``{}``) is left out when empty; loading does not need it.

_EXTRA = "_extra_state"


def norm_te_names(normalization: str) -> dict[str, str]:
    """The TE names of a module's norm (its op 0): ``layer_norm_weight`` (and, for a LayerNorm,
    ``layer_norm_bias``)."""
    names = {"0.weight": "layer_norm_weight"}
    if normalization == "LayerNorm":
        names["0.bias"] = "layer_norm_bias"
    return names


def linear_te_names(i: int, bias_index: int | None, prefix: str = "") -> dict[str, str]:
    """The TE names of a Linear's parameters: ``<prefix>weight`` (op ``i``) and, where there is
    a bias (op ``bias_index``), ``<prefix>bias``."""
    names = {f"{i}.weight": f"{prefix}weight"}
    if bias_index is not None:
        names[f"{bias_index}.bias"] = f"{prefix}bias"
    return names


def use_te_state_dict_names(module: torch.nn.Module, names: dict[str, str]) -> None:
    """Give ``module``'s ``state_dict()`` the TE names ``names`` (positional key -> TE key)."""
    # Plain attributes (set through object.__setattr__: nn.Module's only types tensors and
    # modules); _te_load is (prefix, error_msgs, len(error_msgs)) during a load.
    object.__setattr__(module, "_te_names", dict(names))
    object.__setattr__(module, "_te_load", None)
    # The private spellings exist in every supported torch (>= 2.4); module-level functions
    # keep the module picklable and deep-copyable.
    module._register_state_dict_hook(_save_te_names)
    module._register_load_state_dict_pre_hook(_load_te_names, with_module=True)
    module.register_load_state_dict_post_hook(_report_te_names)


def _save_te_names(module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
    # Only this module's own keys are looked at (state_dict holds the whole model's so far).
    names: dict[str, str] = module._te_names
    found = {rel: state_dict.pop(prefix + rel) for rel in names if prefix + rel in state_dict}
    for i in range(len(module)):
        key = f"{prefix}{i}.{_EXTRA}"
        if f"{i}.{_EXTRA}" not in names and _is_empty(state_dict.get(key)):
            del state_dict[key]
    for rel, te in names.items():
        if rel in found:
            state_dict[prefix + te] = found[rel]


def _is_empty(value: Any) -> bool:
    return isinstance(value, Mapping) and not value


def _load_te_names(
    module: Any,
    state_dict: Any,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    # Remembered for _report_te_names, which torch calls without the prefix.
    module._te_load = (prefix, error_msgs, len(error_msgs))
    for rel, te in module._te_names.items():
        if prefix + te not in state_dict:
            continue
        if prefix + rel in state_dict:
            error_msgs.append(
                f"{type(module).__name__}: the checkpoint holds both {prefix + te!r} and its "
                f"positional spelling {prefix + rel!r}; keep one"
            )
            continue
        state_dict[prefix + rel] = state_dict.pop(prefix + te)


def _report_te_names(module: Any, incompatible_keys: Any) -> None:
    """Missing / unexpected keys and error messages name the TE keys."""
    if module._te_load is None:
        return
    prefix, error_msgs, start = module._te_load
    module._te_load = None
    te = {prefix + rel: prefix + name for rel, name in module._te_names.items()}
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [te.get(k, k) for k in keys]
    for i in range(start, len(error_msgs)):
        for old, new in te.items():
            error_msgs[i] = error_msgs[i].replace(f"for {old}:", f"for {new}:")


def resolve_params_dtype(
    module: str, dtype: torch.dtype | None, params_dtype: torch.dtype | None
) -> torch.dtype | None:
    """``dtype``, or TransformerEngine's name for it, ``params_dtype`` (so a TE module's
    arguments carry over); both may be given when they agree."""
    if params_dtype is None:
        return dtype
    if dtype is not None and dtype != params_dtype:
        raise ValueError(
            f"{module}: 'dtype' ({dtype}) and 'params_dtype' ({params_dtype}) disagree; give one "
            "('params_dtype' is TransformerEngine's name for 'dtype')"
        )
    return params_dtype


def bias_op(
    module: str, features: int, return_bias: object, **kw: Any
) -> ops_basic.Bias | ops_basic.ReturnBias:
    """The op holding a Linear's bias: ``Bias`` (added), or with TransformerEngine's
    ``return_bias=True`` a ``ReturnBias`` (not added: the module returns ``(y, bias)``)."""
    if not isinstance(return_bias, bool):
        raise TypeError(f"{module}: return_bias must be a bool, got {return_bias!r}")
    return (ops_basic.ReturnBias if return_bias else ops_basic.Bias)(features, **kw)


def check_return_bias(module: str, bias: object, return_bias: object) -> None:
    """``return_bias=True`` needs a bias to return (TransformerEngine returns an empty tensor
    there; a caller that adds it gains nothing, so it is refused rather than imitated)."""
    if return_bias is True and not bias:
        raise ValueError(f"{module}: return_bias=True needs bias=True (there is no bias to return)")


def check_bias(module: str, bias: object, te_third: str | None = None) -> None:
    """``bias`` must be a bool (or 0 / 1). ``te_third``: the name of TransformerEngine's third
    positional argument where it is not ``bias`` (``eps`` for ``LayerNormLinear`` /
    ``LayerNormMLP``), so ``LayerNormMLP(1024, 4096, 1e-6)`` written for TE is refused instead
    of turning the bias on and keeping the default epsilon."""
    if isinstance(bias, bool) or (type(bias) is int and bias in (0, 1)):
        return
    hint = (
        f"; TransformerEngine's third positional argument is '{te_third}', pass it by keyword "
        f"({te_third}={bias!r})"
        if te_third is not None
        else ""
    )
    raise TypeError(f"{module}: bias must be a bool, got {bias!r} ({type(bias).__name__}){hint}")
