"""RecipeState: the quantizers (and scaling state) of one op's forward or backward pass.

``RecipeState.create(recipe, mode, num_quantizers, roles)`` builds one subclass per recipe:

* :class:`DelayedScalingRecipeState` -- ``amax_history`` float32 ``[amax_history_len, n]`` and
  ``scale`` float32 ``[n]`` tensors, one :class:`Float8Quantizer` per slot reading/writing them;
* :class:`Float8CurrentScalingRecipeState`, :class:`MXFP8BlockScalingRecipeState`,
  :class:`Float8BlockScalingRecipeState` -- stateless quantizers;
* :class:`CustomRecipeState` -- ``qfactory(role)`` once per slot (``None`` = high precision); for a
  :class:`RoleRules` factory, slots routed to a recipe share one child state per distinct recipe.

:func:`update_delayed_scaling` updates many delayed-scaling states in one kernel launch per
``(device, algorithm, margin)``, after an optional ``all_reduce(MAX)`` of this step's amaxes.
:func:`recipe_state_to_dict` / :func:`load_recipe_state` (de)serialise a state as plain tensors.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, get_args

import torch

from fusible import _kernels
from fusible._kernels import fp8_max
from fusible.quantization.quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    Quantizer,
    block_quantizer,
)
from fusible.quantization.recipe import (
    AmaxComputeAlgo,
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Recipe,
    RoleRules,
)
from fusible.quantization.roles import QuantizerRole, as_roles

__all__ = [
    "CustomRecipeState",
    "DelayedScalingRecipeState",
    "Float8BlockScalingRecipeState",
    "Float8CurrentScalingRecipeState",
    "MXFP8BlockScalingRecipeState",
    "RecipeState",
    "flatten_state_dict",
    "load_recipe_state",
    "recipe_state_to_dict",
    "unflatten_state_dict",
    "update_delayed_scaling",
]

_MODES = ("forward", "backward")

# DelayedScaling's amax_compute_algo (a Literal in recipe.py) is the core library's table.
if get_args(AmaxComputeAlgo) != _kernels.AMAX_ALGOS:
    raise ImportError(
        f"fusible: DelayedScaling's amax_compute_algo {get_args(AmaxComputeAlgo)} does not match "
        f"the core library's amax algorithms {_kernels.AMAX_ALGOS} (FUS_AMAX_ALGO_TABLE, recipe.h)"
    )


class RecipeState:
    """Quantizers of one pass (``mode``) of one op, built from a recipe; see :meth:`create`.

    Attributes: ``recipe``, ``mode`` (``"forward"`` / ``"backward"``), ``num_quantizers``,
    ``roles`` (tuple of :class:`QuantizerRole`, or None when the op gave none), ``quantizers``
    (list in slot order; ``None`` marks a high-precision slot), ``device``.
    """

    recipe: Recipe

    def __init__(
        self,
        recipe: Recipe,
        mode: str,
        num_quantizers: int,
        roles: tuple[QuantizerRole, ...] | None,
        device: torch.device,
    ) -> None:
        self.recipe = recipe
        self.mode = mode
        self.num_quantizers = num_quantizers
        self.roles = roles
        self.device = device
        self.quantizers: list[Quantizer | None] = []

    # -- construction --------------------------------------------------------------------------

    @staticmethod
    def create(
        recipe: Recipe,
        mode: str = "forward",
        num_quantizers: int = 1,
        roles: Sequence[QuantizerRole | str] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> RecipeState:
        """Build the state of ``recipe`` for ``num_quantizers`` slots of a ``mode`` pass.

        ``roles`` (one per slot, in slot order; strings are parsed) is optional except for
        ``CustomRecipe``. Raises ``TypeError`` for a non-recipe, ``ValueError`` for a bad mode,
        a negative count, malformed roles, a role count different from ``num_quantizers``, or a
        CustomRecipe without roles; a factory returning a non-quantizer raises ``TypeError``
        naming the role. ``device``: where scaling state tensors live (default CPU).
        """
        if not isinstance(recipe, Recipe):
            raise TypeError(
                f"RecipeState.create: 'recipe' must be a fusible.recipe.Recipe, got {recipe!r}"
            )
        if mode not in _MODES:
            raise ValueError(
                f"RecipeState.create: 'mode' must be 'forward' or 'backward', got {mode!r}"
            )
        if (
            isinstance(num_quantizers, bool)
            or not isinstance(num_quantizers, int)
            or (num_quantizers < 0)
        ):
            raise ValueError(
                f"RecipeState.create: 'num_quantizers' must be an int >= 0, got {num_quantizers!r}"
            )
        parsed: tuple[QuantizerRole, ...] | None = None
        if roles is not None:
            try:
                parsed = as_roles(roles)
            except ValueError as e:
                raise ValueError(f"RecipeState.create: {e}") from None
            if len(parsed) != num_quantizers:
                raise ValueError(
                    f"RecipeState.create: got {len(parsed)} roles for num_quantizers="
                    f"{num_quantizers} ({type(recipe).__name__}, mode={mode!r}); the op must emit "
                    "one role per quantizer slot"
                )
        dev = torch.device("cpu") if device is None else torch.device(device)
        cls = _STATE_CLASSES.get(type(recipe))
        if cls is None:
            for base, c in _STATE_CLASSES.items():
                if isinstance(recipe, base):
                    cls = c
                    break
        if cls is None:
            raise TypeError(f"RecipeState.create: no RecipeState for recipe type {type(recipe)}")
        state = cls(recipe, mode, num_quantizers, parsed, dev)
        state._build()
        return state

    def _build(self) -> None:
        raise NotImplementedError

    def _role(self, i: int) -> QuantizerRole | None:
        return None if self.roles is None else self.roles[i]

    # -- scaling state -------------------------------------------------------------------------

    def delayed_states(self) -> list[DelayedScalingRecipeState]:
        """The delayed-scaling states inside this state (itself, children, or none)."""
        return []

    def update(self, reduce_group: Any = None) -> None:
        """Delayed-scaling update of this state (no-op for stateless recipes).

        See :func:`update_delayed_scaling`; the framework calls it through
        :func:`fusible.quantization.end_forward_pass` / ``end_backward_pass``.
        """
        update_delayed_scaling([self], reduce_group)

    def to(self, device: torch.device | str) -> RecipeState:
        """Move the state's tensors to ``device`` (in place; quantizers follow); returns self."""
        self.device = torch.device(device)
        return self

    # -- checkpoints ---------------------------------------------------------------------------

    def _tensor_fields(self) -> dict[str, torch.Tensor]:
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain-tensor snapshot (copies); ``{}`` for stateless recipes."""
        return {k: v.detach().clone() for k, v in self._tensor_fields().items()}

    def load_state_dict(self, state_dict: Mapping[str, Any] | None) -> list[str]:
        """See :func:`load_recipe_state`."""
        return load_recipe_state(self, state_dict)

    def __repr__(self) -> str:
        roles = None if self.roles is None else [r.qualified for r in self.roles]
        return (
            f"{type(self).__name__}(recipe={self.recipe!r}, mode={self.mode!r}, "
            f"num_quantizers={self.num_quantizers}, roles={roles})"
        )


class DelayedScalingRecipeState(RecipeState):
    """Delayed scaling: ``amax_history`` [len, n] (zeros) and ``scale`` [n] (ones), float32."""

    recipe: DelayedScaling

    def _build(self) -> None:
        n, dev = self.num_quantizers, self.device
        self.fp8_dtype = self.recipe.fp8_format.dtype(self.mode)
        self.fp8_max = fp8_max(self.fp8_dtype)
        self.amax_history = torch.zeros(
            self.recipe.amax_history_len, n, dtype=torch.float32, device=dev
        )
        self.scale = torch.ones(n, dtype=torch.float32, device=dev)
        self.quantizers = [
            Float8Quantizer(self, i, self.fp8_dtype, role=self._role(i)) for i in range(n)
        ]

    def delayed_states(self) -> list[DelayedScalingRecipeState]:
        return [self]

    def to(self, device: torch.device | str) -> RecipeState:
        self.amax_history = self.amax_history.to(device)
        self.scale = self.scale.to(device)
        return super().to(device)

    def _tensor_fields(self) -> dict[str, torch.Tensor]:
        return {"amax_history": self.amax_history, "scale": self.scale}


class Float8CurrentScalingRecipeState(RecipeState):
    """Current scaling: one :class:`Float8CurrentScalingQuantizer` per slot; no state."""

    recipe: Float8CurrentScaling

    def _build(self) -> None:
        dtype = self.recipe.fp8_format.dtype(self.mode)
        self.quantizers = [
            Float8CurrentScalingQuantizer(dtype, margin=self.recipe.margin, role=self._role(i))
            for i in range(self.num_quantizers)
        ]


class MXFP8BlockScalingRecipeState(RecipeState):
    """MXFP8: one :class:`MXFP8Quantizer` per slot; no state."""

    recipe: MXFP8BlockScaling

    def _build(self) -> None:
        dtype = self.recipe.fp8_format.dtype(self.mode)
        self.quantizers = [
            MXFP8Quantizer(dtype, role=self._role(i)) for i in range(self.num_quantizers)
        ]
        cap = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        if cap is not None and cap < (10, 0):
            # Not an error (the numerics are MXFP8's, and the memory savings hold), but a user
            # who picked it for speed should hear that it costs more than bf16 here. Python's
            # default filter shows it once per process.
            warnings.warn(
                "fusible: MXFP8BlockScaling on a GPU without MXFP8 tensor cores (compute "
                f"capability {cap[0]}.{cap[1]}"
                " < 10.0): its GEMMs run in high precision on exactly dequantized operands, "
                "slower than training without a recipe. Float8BlockScaling is the fine-grained "
                "FP8 recipe with native GEMMs on Hopper.",
                UserWarning,
                stacklevel=2,
            )


class Float8BlockScalingRecipeState(RecipeState):
    """Blockwise FP8: one :class:`Float8BlockQuantizer` per slot, its block dimension chosen by
    the slot's role (weights ``w_block_scaling_dim``, gradients ``grad_block_scaling_dim``, others
    ``x_block_scaling_dim``; a slot without a role counts as an activation); no state."""

    recipe: Float8BlockScaling

    def _build(self) -> None:
        dtype = self.recipe.fp8_format.dtype(self.mode)
        self.quantizers = [
            block_quantizer(self.recipe, self._role(i), dtype, self.mode)
            for i in range(self.num_quantizers)
        ]


class CustomRecipeState(RecipeState):
    """CustomRecipe: ``qfactory(role)`` once per slot, in slot order.

    With a :class:`RoleRules` factory, each slot is routed by the first matching rule: slots routed
    to the same recipe share one child state (``children``, in first-use order) whose quantizers
    fill those slots; factories are called once per routed slot; None keeps the slot in high
    precision.
    """

    recipe: CustomRecipe

    def _build(self) -> None:
        if self.roles is None:
            raise ValueError(
                f"RecipeState.create: CustomRecipe needs roles (one per quantizer), got roles=None "
                f"for num_quantizers={self.num_quantizers}"
            )
        roles = self.roles
        self.children: list[RecipeState] = []
        self.routes: list[str | None] = [None] * self.num_quantizers
        factory = self.recipe.qfactory
        quantizers: list[Quantizer | None] = [None] * self.num_quantizers
        if isinstance(factory, RoleRules):
            groups: dict[Recipe, list[int]] = {}
            for i, role in enumerate(roles):
                pattern, value = factory.match(role)
                self.routes[i] = pattern
                if value is None:
                    continue
                if isinstance(value, Recipe):
                    groups.setdefault(value, []).append(i)
                else:
                    quantizers[i] = _checked(value(role), role, "rule factory")
            for sub_recipe, slots in groups.items():
                child = RecipeState.create(
                    sub_recipe, self.mode, len(slots), [roles[i] for i in slots],
                    device=self.device,
                )  # fmt: skip
                self.children.append(child)
                for j, i in enumerate(slots):
                    quantizers[i] = child.quantizers[j]
        else:
            assert factory is not None
            for i, role in enumerate(roles):
                quantizers[i] = _checked(factory(role), role, "qfactory")
        self.quantizers = quantizers

    def delayed_states(self) -> list[DelayedScalingRecipeState]:
        return [d for c in self.children for d in c.delayed_states()]

    def to(self, device: torch.device | str) -> RecipeState:
        for c in self.children:
            c.to(device)
        return super().to(device)

    def _tensor_fields(self) -> dict[str, torch.Tensor]:
        return {
            f"children.{i}.{k}": v
            for i, c in enumerate(self.children)
            for k, v in c._tensor_fields().items()
        }


def _checked(q: object, role: QuantizerRole, what: str) -> Quantizer | None:
    if q is None or isinstance(q, Quantizer):
        return q
    raise TypeError(
        f"CustomRecipe: {what} returned {type(q).__name__} for role {role.qualified!r}; expected "
        "a fusible.quantization.Quantizer or None"
    )


_STATE_CLASSES: dict[type, type[RecipeState]] = {
    DelayedScaling: DelayedScalingRecipeState,
    Float8CurrentScaling: Float8CurrentScalingRecipeState,
    MXFP8BlockScaling: MXFP8BlockScalingRecipeState,
    Float8BlockScaling: Float8BlockScalingRecipeState,
    CustomRecipe: CustomRecipeState,
}


# ---- delayed-scaling update ---------------------------------------------------------------------


def _reduce_amax(states: list[DelayedScalingRecipeState], group: Any) -> None:
    import torch.distributed as dist

    if not states:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "update_delayed_scaling: an amax reduction group was given but torch.distributed is "
            "not initialized"
        )
    if dist.get_world_size(group) == 1:
        return
    by_device: dict[torch.device, list[DelayedScalingRecipeState]] = {}
    for s in states:
        by_device.setdefault(s.amax_history.device, []).append(s)
    for ss in by_device.values():
        rows = [s.amax_history[0] for s in ss]
        buf = torch.cat(rows)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
        for row, red in zip(rows, buf.split([r.numel() for r in rows]), strict=True):
            row.copy_(red)


def update_delayed_scaling(states: Sequence[RecipeState], group: Any = None) -> None:
    """Delayed-scaling update of every delayed state inside ``states``, batched.

    1. If ``group`` is not None, this step's amaxes (``amax_history[0]``) of the states whose
       recipe has ``reduce_amax=True`` are concatenated (in the order given) and reduced with
       one ``torch.distributed.all_reduce(MAX)`` over ``group`` per device (skipped for a group of
       size 1). All ranks must pass the same states in the same order.
    2. One ``torch.ops.fusible.delayed_scaling_update`` launch per ``(device, amax_compute_algo,
       margin)`` computes ``scale = fp8_max / amax / 2**margin`` (scale kept when the amax is 0 or
       non-finite) and rolls each history (``cpp/include/fusible/recipe.h``).

    Stateless states are skipped; a state appearing twice is updated once. Traceable by
    ``torch.compile`` (custom op with declared mutations).
    """
    if group is None and not torch.compiler.is_compiling():
        prepared = _prepared_update(states)
        if prepared is not None:
            _run_prepared(prepared)
            return
    flat: list[DelayedScalingRecipeState] = []
    seen: set[int] = set()
    for s in states:
        if not isinstance(s, RecipeState):
            raise TypeError(
                f"update_delayed_scaling: expected RecipeState objects, got {type(s).__name__}"
            )
        for d in s.delayed_states():
            if id(d) not in seen and d.num_quantizers > 0:
                seen.add(id(d))
                flat.append(d)
    if not flat:
        return
    if group is not None:
        _reduce_amax([d for d in flat if d.recipe.reduce_amax], group)
    batches: dict[tuple[torch.device, str, int], list[DelayedScalingRecipeState]] = {}
    for d in flat:
        key = (d.amax_history.device, d.recipe.amax_compute_algo, d.recipe.margin)
        batches.setdefault(key, []).append(d)
    calls = [
        ([d.amax_history for d in ds], [d.scale for d in ds], [d.fp8_max for d in ds], algo, margin)
        for (_, algo, margin), ds in batches.items()
    ]
    with torch.no_grad():  # no gradient flows through the update
        for args in calls:
            _kernels.delayed_scaling_update(*args)
    if group is None and not torch.compiler.is_compiling():
        _remember_update(states, flat, calls)


# Each step updates the same states: their flattening, grouping and the update's argument checks
# are done once (above) and replayed while every state holds the same tensors (a moved state has
# new ones; a loaded one is copied into them). Entries hold the states weakly (a dropped model
# is freed) and are bounded.
_Prepared = tuple[list[Any], list[tuple[Any, torch.Tensor, torch.Tensor]], list[Any]]
_PREPARED: dict[tuple[int, ...], _Prepared] = {}
_MAX_PREPARED = 16


def _remember_update(
    states: Sequence[RecipeState], flat: list[DelayedScalingRecipeState], calls: list[Any]
) -> None:
    if len(_PREPARED) >= _MAX_PREPARED:
        _PREPARED.pop(next(iter(_PREPARED)))
    refs = [weakref.ref(s) for s in states]
    held = [(weakref.ref(d), d.amax_history, d.scale) for d in flat]
    _PREPARED[tuple(map(id, states))] = (refs, held, calls)


def _prepared_update(states: Sequence[RecipeState]) -> _Prepared | None:
    entry = _PREPARED.get(tuple(map(id, states)))
    if entry is None:
        return None
    refs, held, _ = entry
    for r, s in zip(refs, states, strict=True):
        if r() is not s:  # an id reused by another object
            return None
    for r, h, sc in held:
        d = r()
        if d is None or d.amax_history is not h or d.scale is not sc:
            return None
    return entry


def _run_prepared(entry: _Prepared) -> None:
    # torch.no_grad() without its context-manager machinery (a dozen calls per step).
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        for args in entry[2]:
            _kernels.delayed_scaling_update(*args)
    finally:
        torch._C._set_grad_enabled(prev)


# ---- checkpoints --------------------------------------------------------------------------------


def recipe_state_to_dict(state: RecipeState | None) -> dict[str, torch.Tensor]:
    """The state's scaling tensors as a flat dict of plain tensors (copies).

    Delayed scaling: ``{"amax_history": [len, n], "scale": [n]}``; a CustomRecipe with rule
    children: ``{"children.<i>.amax_history": ..., ...}``; stateless recipes and None: ``{}``.
    """
    if state is None:
        return {}
    if not isinstance(state, RecipeState):
        raise TypeError(f"recipe_state_to_dict: expected a RecipeState, got {type(state).__name__}")
    return state.state_dict()


def load_recipe_state(state: RecipeState | None, state_dict: Mapping[str, Any] | None) -> list[str]:
    """Restore ``state`` (in place, bit for bit) from :func:`recipe_state_to_dict` output.

    Tolerant: ``None`` / ``{}`` (a checkpoint without recipe state) leaves the state as is, and a
    ``None`` state (a model without a recipe) ignores the dict. Keys the state does not have
    (e.g. the recipe changed since the checkpoint) are ignored and returned. Malformed input --
    not a mapping, a non-tensor value, a wrong dtype or shape, or only part of a state's tensors
    -- raises ``ValueError`` naming the key and what was expected; nothing is modified then.
    """
    if state_dict is None:
        return []
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            "load_recipe_state: expected a mapping of str to tensors, got "
            f"{type(state_dict).__name__}"
        )
    if state is None:
        return list(state_dict)
    if not isinstance(state, RecipeState):
        raise TypeError(f"load_recipe_state: expected a RecipeState, got {type(state).__name__}")
    fields = state._tensor_fields()
    present = [k for k in fields if k in state_dict]
    if present and len(present) != len(fields):
        missing = sorted(set(fields) - set(present))
        raise ValueError(
            f"load_recipe_state: {type(state).__name__} checkpoint is partial: has {present}, "
            f"missing {missing}"
        )
    for k in present:
        v, cur = state_dict[k], fields[k]
        if not isinstance(v, torch.Tensor):
            raise ValueError(
                f"load_recipe_state: '{k}' must be a torch.Tensor, got {type(v).__name__}"
            )
        if v.dtype != cur.dtype or tuple(v.shape) != tuple(cur.shape):
            raise ValueError(
                f"load_recipe_state: '{k}' must be {cur.dtype} of shape {tuple(cur.shape)} "
                f"({type(state).__name__}, {state.recipe!r}), got {v.dtype} of shape "
                f"{tuple(v.shape)}"
            )
    for k in present:
        fields[k].copy_(state_dict[k])
    return [k for k in state_dict if k not in fields]


# ---- a state_dict as tensors alone (safetensors) ------------------------------------------------

_FIELD = "#"  # between a state_dict key and a field of its ``_extra_state`` dict


def flatten_state_dict(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``state_dict`` with each recipe state (``..._extra_state``: a dict of plain tensors, maybe
    empty) spread into one tensor per field, ``<key>#<field>`` (an empty one as ``<key>#``, a
    0-element tensor): tensors alone, as ``safetensors.torch.save_file`` takes them, which
    refuses the dicts. :func:`unflatten_state_dict` undoes it. Tensors are detached and made
    contiguous (safetensors needs that), not copied where they already are."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if _FIELD in key:
            raise ValueError(f"flatten_state_dict: key {key!r} holds {_FIELD!r}, the separator")
        if isinstance(value, torch.Tensor):
            flat[key] = value.detach().contiguous()
        elif isinstance(value, Mapping):
            if not value:
                flat[key + _FIELD] = torch.empty(0)
            for field, t in value.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(
                        f"flatten_state_dict: {key!r} field {field!r} is a {type(t).__name__}, "
                        "not a tensor"
                    )
                # A clone: safetensors refuses tensors that share storage (history rows).
                flat[f"{key}{_FIELD}{field}"] = t.detach().contiguous().clone()
        else:
            raise TypeError(
                f"flatten_state_dict: {key!r} is a {type(value).__name__}; expected a tensor or "
                "a dict of tensors (a recipe state)"
            )
    return flat


def unflatten_state_dict(flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The ``state_dict`` :func:`flatten_state_dict` made ``flat`` from, for
    ``load_state_dict``."""
    out: dict[str, Any] = {}
    for name, t in flat.items():
        key, sep, field = name.partition(_FIELD)
        if not sep:
            out[key] = t
            continue
        fields = out.setdefault(key, {})
        if field:
            fields[field] = t
    return out
