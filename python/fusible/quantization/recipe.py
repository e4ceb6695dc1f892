"""Recipes: frozen, validated descriptions of how to quantize.

A recipe says *how* tensors are quantized; a :class:`~fusible.quantization.RecipeState` built
from it (per op, per pass) holds the quantizers and any scaling state. Recipes are immutable and
hashable, so ops can cache on them. Construction validates every field and raises ``ValueError``
naming the class and the field. No environment variable changes a default.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

import torch

from fusible.quantization.roles import QuantizerRole, as_role

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "Recipe",
    "RoleRules",
]


class Format(enum.Enum):
    """FP8 format of a recipe: which FP8 dtype forward and backward tensors use.

    * ``E4M3``: E4M3 everywhere (max 448).
    * ``HYBRID``: E4M3 in forward (inputs, weights, outputs), E5M2 (max 57344) for gradients.
    * ``E5M2``: E5M2 everywhere.
    """

    E4M3 = "E4M3"
    HYBRID = "HYBRID"
    E5M2 = "E5M2"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2

    def dtype(self, mode: str) -> torch.dtype:
        """FP8 dtype for a ``"forward"`` or ``"backward"`` RecipeState."""
        if mode == "forward":
            return self.fwd_dtype
        if mode == "backward":
            return self.bwd_dtype
        raise ValueError(f"Format.dtype: mode must be 'forward' or 'backward', got {mode!r}")


# The amax algorithms of DelayedScaling, spelled as a Literal for type checkers: the core
# library's (FUS_AMAX_ALGO_TABLE in recipe.h, K.AMAX_ALGOS), which state.py checks it against at
# import (this module is below the kernels: roles only).
AmaxComputeAlgo = Literal["max", "most_recent"]
# "'max' or 'most_recent'" (the choices, for messages).
_AMAX_ALGOS = get_args(AmaxComputeAlgo)
_AMAX_ALGO_CHOICES = " or ".join(
    filter(None, (", ".join(map(repr, _AMAX_ALGOS[:-1])), repr(_AMAX_ALGOS[-1])))
)


def _fail(cls: object, fld: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{type(cls).__name__}: '{fld}' must be {expected}, got {got!r}")


def _check_format(obj: object, value: object) -> None:
    if not isinstance(value, Format):
        raise _fail(obj, "fp8_format", "a fusible.recipe.Format (E4M3, HYBRID or E5M2)", value)


def _check_margin(obj: object, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(obj, "margin", "an int >= 0", value)


class Recipe:
    """Base class of all recipes.

    Every recipe gets a short string :attr:`key` when it is built, equal for equal recipes.
    Where Python bookkeeping runs at ``torch.compile`` trace time (plans, recipe states), the
    key stands in for the recipe: some torch versions cannot reconstruct a frozen dataclass as
    an ``assume_constant_result`` argument ("can't reconstruct arbitrary frozen dataclass
    instances", torch 2.11), and an int attribute that changes between compiles is made a
    SymInt by automatic dynamic shapes; a string stays a guarded constant.
    """

    key: ClassVar[str]  # set per instance by _register_recipe (not a dataclass field)

    # Pickles and copies carry the fields only; the copy is keyed in this process.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "key"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        _register_recipe(self)

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def custom(self) -> bool:
        return isinstance(self, CustomRecipe)


# Weak on both sides: a recipe nobody holds is forgotten (with whatever its factory captured);
# keys come from a counter, so a later recipe never reuses a dead one's key.
_RECIPE_BY_KEY: weakref.WeakValueDictionary[str, Recipe] = weakref.WeakValueDictionary()
_KEY_BY_RECIPE: weakref.WeakKeyDictionary[Recipe, str] = weakref.WeakKeyDictionary()
_NEXT_KEY = itertools.count()


def _register_recipe(recipe: Recipe) -> None:
    """Give ``recipe`` its key: the key of an equal live recipe registered before, else a new
    one (unhashable recipes, e.g. with an unhashable factory, always get a new one)."""
    try:
        key = _KEY_BY_RECIPE.get(recipe)
    except TypeError:
        key = None
        hashable = False
    else:
        hashable = True
    if key is None:
        key = f"{type(recipe).__name__}#{next(_NEXT_KEY)}"
        _RECIPE_BY_KEY[key] = recipe
        if hashable:
            _KEY_BY_RECIPE[recipe] = key
    object.__setattr__(recipe, "key", key)


def recipe_from_key(key: str | None) -> Recipe | None:
    """The recipe registered under ``key`` (None for None); see :class:`Recipe`."""
    return None if key is None else _RECIPE_BY_KEY[key]


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 scaling from the amax *history* of previous steps.

    Each quantizer casts with the scale held in its RecipeState and records the tensor's amax
    (a running max, so a quantizer used several times in one step records the largest).
    At the update point (see ``docs/quantization.md``), for every quantizer::

        amax  = max(amax_history)          (amax_compute_algo="max")
              = amax_history[0]            (amax_compute_algo="most_recent", this step's amax)
        scale = fp8_max / amax / 2**margin (scale unchanged if amax is 0, inf or NaN)

    then the history rolls by one step. ``reduce_amax``: reduce this step's amaxes with
    ``all_reduce(MAX)`` over ``autocast(amax_reduction_group=...)`` before the update.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        _check_margin(self, self.margin)
        _check_format(self, self.fp8_format)
        h = self.amax_history_len
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise _fail(self, "amax_history_len", "an int >= 1", h)
        if self.amax_compute_algo not in _AMAX_ALGOS:
            raise _fail(self, "amax_compute_algo", _AMAX_ALGO_CHOICES, self.amax_compute_algo)
        if not isinstance(self.reduce_amax, bool):
            raise _fail(self, "reduce_amax", "a bool", self.reduce_amax)
        _register_recipe(self)


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 scaling from the tensor itself: ``scale = fp8_max / amax(x) / 2**margin``
    (scale 1 if the amax is 0 or non-finite). Two passes over the input; no state."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0

    def __post_init__(self) -> None:
        _check_format(self, self.fp8_format)
        _check_margin(self, self.margin)
        _register_recipe(self)


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (OCP MX v1.0): one E8M0 power-of-two scale per 32-element block, rowwise and
    columnwise copies. The block rule is documented in ``docs/quantization.md``. No state.

    GPUs below compute capability 10.0 (Hopper and older) have no MXFP8 tensor cores: the GEMMs
    run in high precision on exactly dequantized operands (same numerics, no speed-up; a
    ``UserWarning`` says so once). ``Float8BlockScaling`` is Hopper's fine-grained recipe."""

    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        _check_format(self, self.fp8_format)
        _register_recipe(self)


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """Blockwise FP8 (DeepSeek-V3): one fp32 scale per block, blocks of 1x128 or 128x128 elements,
    rowwise and columnwise copies (the columnwise copy is the transpose; its 1x128 blocks run
    along the other dimension). Per block ``b`` with ``amax_b = max |x|`` over it::

        scale_b = fp8_max / max(amax_b, amax_epsilon)   (1 if that amax is 0, inf or NaN)
        scale_b = 2**floor(log2(scale_b))              (power_2_scale)

    Exact rule, layouts and partial edge blocks: ``docs/quantization.md``. No state. GEMMs run on
    cuBLASLt's block-scaled FP8 kernels on Hopper (CUDA 12.9+), on the exactly dequantized
    operands on the CPU. Each GEMM pairs two operands, and cuBLASLt has no 128x128 x 128x128
    kernel, so no two of the three tensors (x, w, grad) may both be 2D.

    * ``fp8_format`` (default ``E4M3``): ``E4M3`` everywhere, as DeepSeek-V3 trains (fine-grained
      scales leave little need for E5M2's range); ``HYBRID`` (E5M2 gradients) is accepted;
      ``E5M2`` is not (fprop would pair two E5M2 operands, which cuBLASLt cannot multiply).
    * ``x_block_scaling_dim`` (default 1): activations (input / output roles) in 1x128 blocks,
      one scale per token per 128 features, so an outlier token cannot flush the others.
    * ``w_block_scaling_dim`` (default 2): weights in 128x128 tiles; a tile scale serves both
      copies (rowwise for fprop, columnwise for dgrad) with the same bits, so the weight needs no
      second quantization pass.
    * ``grad_block_scaling_dim`` (default 1): gradients in 1x128 blocks, like activations.
    * ``power_2_scale`` (default True): scales rounded down to powers of two, so scaling and
      dequantization are exact and the scale of a block is stable under small amax changes
      (TransformerEngine's default for this recipe); False keeps the exact fp32 ratio.
    * ``amax_epsilon`` (default 0.0): floor of each block's amax, which bounds the scale of
      nearly-zero blocks.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        _check_format(self, self.fp8_format)
        if self.fp8_format is Format.E5M2:
            raise _fail(
                self, "fp8_format", "Format.E4M3 or Format.HYBRID (E5M2 x E5M2 GEMMs do not exist)",
                self.fp8_format,
            )  # fmt: skip
        dims = {}
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or v not in (1, 2):
                raise _fail(self, name, "1 (1x128 blocks) or 2 (128x128 blocks)", v)
            dims[name[: name.index("_")]] = v
        for a, b in (("x", "w"), ("grad", "w"), ("grad", "x")):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(
                    f"Float8BlockScaling: '{a}_block_scaling_dim' and '{b}_block_scaling_dim' "
                    "must not both be 2: a GEMM multiplies them, and cuBLASLt has no 128x128 x "
                    "128x128 block-scaled kernel"
                )
        if not isinstance(self.power_2_scale, bool):
            raise _fail(self, "power_2_scale", "a bool", self.power_2_scale)
        e = self.amax_epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not (0.0 <= e < float("inf")):
            raise _fail(self, "amax_epsilon", "a finite float >= 0", e)
        object.__setattr__(self, "amax_epsilon", float(e))
        _register_recipe(self)

    def block_dim(self, role: QuantizerRole) -> int:
        """The block dimension of ``role``'s tensor: weights ``w_block_scaling_dim``, gradients
        ``grad_block_scaling_dim``, everything else ``x_block_scaling_dim``."""
        if role.bucket == "weight":
            return self.w_block_scaling_dim
        if role.is_gradient:
            return self.grad_block_scaling_dim
        return self.x_block_scaling_dim


#: What a rule maps a role to: a recipe, a quantizer factory ``role -> quantizer | None``, or
#: None (high precision).
RuleValue = Any


@dataclass(frozen=True)
class RoleRules:
    """Ordered glob rules routing roles to recipes / factories / high precision.

    ``rules`` maps fnmatch patterns to values; a pattern is matched (case-sensitively) against
    ``str(role)`` (``"bucket:scope"``) and against ``role.qualified`` (``"bucket:scope:name"``);
    the first matching rule wins. A value is

    * a :class:`Recipe` -- the role gets that recipe's quantizer (slots routed to one recipe share
      one sub-RecipeState, so a ``DelayedScaling`` value keeps its amax history and is updated
      with the parent state),
    * a callable ``factory(role) -> quantizer | None`` -- called once per routed slot,
    * ``None`` -- the slot stays in high precision.

    A role that matches no rule raises ``ValueError`` (add ``"*": None`` for a catch-all).
    Accepts a mapping (insertion order) or a sequence of ``(pattern, value)`` pairs.
    """

    rules: tuple[tuple[str, RuleValue], ...] = field(default=())

    def __init__(
        self, rules: Mapping[str, RuleValue] | Iterable[tuple[str, RuleValue]] = ()
    ) -> None:
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        checked = []
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(
                    f"RoleRules: rules[{i}] must be a (pattern, value) pair, got {item!r}"
                )
            pattern, value = item
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(
                    f"RoleRules: pattern of rules[{i}] must be a non-empty glob string, "
                    f"got {pattern!r}"
                )
            if not (value is None or isinstance(value, Recipe) or callable(value)):
                raise ValueError(
                    f"RoleRules: value of rule {pattern!r} must be a Recipe, a quantizer factory "
                    f"(callable role -> quantizer | None) or None, got {value!r}"
                )
            checked.append((pattern, value))
        if not checked:
            raise ValueError("RoleRules: 'rules' must hold at least one (pattern, value) rule")
        object.__setattr__(self, "rules", tuple(checked))

    def match(self, role: QuantizerRole | str) -> tuple[str, RuleValue]:
        """The first ``(pattern, value)`` rule matching ``role``; ``ValueError`` if none does."""
        role = as_role(role)
        for pattern, value in self.rules:
            if role.matches(pattern):
                return pattern, value
        patterns = ", ".join(repr(p) for p, _ in self.rules)
        raise ValueError(
            f"RoleRules: no rule matches role {role.qualified!r} (patterns: {patterns}); "
            "add a catch-all rule such as '*': None"
        )


@dataclass(frozen=True)
class CustomRecipe(Recipe):
    """A recipe defined by a quantizer factory called once per quantizer slot.

    ``qfactory(role) -> quantizer | None`` receives the slot's :class:`QuantizerRole` and returns a
    quantizer (a :class:`fusible.quantization.Quantizer`) or None to keep that slot in high
    precision. ``qfactory`` may also be a :class:`RoleRules`; see :meth:`from_rules`.
    """

    qfactory: Callable[[QuantizerRole], Any] | RoleRules | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.qfactory, RoleRules) or callable(self.qfactory)):
            raise _fail(
                self, "qfactory", "a callable role -> quantizer | None (or a RoleRules)",
                self.qfactory,
            )  # fmt: skip
        _register_recipe(self)

    @classmethod
    def from_rules(
        cls, rules: Mapping[str, RuleValue] | Iterable[tuple[str, RuleValue]] | RoleRules
    ) -> CustomRecipe:
        """A CustomRecipe routing roles by ordered glob rules (see :class:`RoleRules`), e.g.::

        CustomRecipe.from_rules({
            "*:*:fc2": None,            # the op named fc2 stays in high precision (first:
                                        # the first matching rule wins)
            "weight:*": MXFP8BlockScaling(),
            "grad_*:*": Float8CurrentScaling(fp8_format=Format.E5M2),
            "*": Float8CurrentScaling(),
        })
        """
        return cls(qfactory=rules if isinstance(rules, RoleRules) else RoleRules(rules))
