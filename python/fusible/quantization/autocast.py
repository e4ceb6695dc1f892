"""``fusible.autocast`` and the delayed-scaling update points.

``autocast(enabled=True, recipe=None, amax_reduction_group=None)`` sets the quantization state ops
read with :func:`get_autocast_state` / :func:`is_fp8_enabled` / :func:`get_recipe`. The state is a
plain, immutable Python object held in a module global: ``torch.compile`` reads it at trace time
(and guards on it), and regions nest and restore on exit, exceptions included. The state is
process-global, not thread-local.

Delayed-scaling updates (see ``docs/quantization.md`` for the full contract):

* the framework calls :func:`end_forward_pass` with an op container's *forward* states at the end
  of each of its forward passes, and :func:`end_backward_pass` with its *backward* states at the
  end of each of its backward passes;
* in eager mode these calls only *register* the states: forward states are updated together when
  the outermost autocast region exits normally (one batched update, one amax all-reduce per
  reduction group), backward states when the whole autograd backward pass finishes (a callback
  queued on the autograd engine). Every state is thus updated once per step, after all of that
  step's uses, whatever order modules ran in;
* while tracing (``torch.compile``, ``make_fx``) or when no region / backward pass is running,
  the states are updated immediately, inside the traced graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode as _get_proxy_mode

from fusible.quantization.quantizers import _log_stack, replaying_scales
from fusible.quantization.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe
from fusible.quantization.state import RecipeState, update_delayed_scaling

__all__ = [
    "DEFAULT_GROUP",
    "DEFAULT_RECIPE",
    "AutocastState",
    "autocast",
    "end_backward_pass",
    "end_forward_pass",
    "get_amax_reduction_group",
    "get_autocast_state",
    "get_recipe",
    "is_fp8_enabled",
    "pending_recipe_states",
    "restored_state",
]

#: The recipe of ``autocast(recipe=None)``.
DEFAULT_RECIPE: Recipe = DelayedScaling()
# The recipes whose fp8_format is checked when a region starts (no call: a class lookup).
_PER_TENSOR = (DelayedScaling, Float8CurrentScaling)


@dataclass(frozen=True)
class AutocastState:
    """What ops read: ``enabled``, ``recipe`` (None when disabled), ``amax_reduction_group``,
    ``depth`` (number of enclosing autocast regions, 0 outside any)."""

    enabled: bool = False
    recipe: Recipe | None = None
    amax_reduction_group: Any = None
    depth: int = 0


_OUTSIDE = AutocastState()
_state: AutocastState = _OUTSIDE
#: amax_reduction_group of the most recently entered enabled region (backward default).
_last_group: Any = None


class _Default:
    def __repr__(self) -> str:
        return "<default>"


#: Default of ``group`` in end_forward_pass / end_backward_pass (see there).
DEFAULT_GROUP: Any = _Default()


class _Pending:
    """States registered for a deferred update, keyed by identity (a state object hashes by
    identity), in registration order. The step's hot path (issue 11): no call per state."""

    def __init__(self) -> None:
        self.items: dict[RecipeState, Any] = {}

    def add(self, states: Sequence[RecipeState], group: Any) -> None:
        for s in states:
            if s.delayed_states():
                self.add_delayed(s, group)

    def add_delayed(self, s: RecipeState, group: Any) -> None:
        """``add`` of one state known to hold delayed-scaling state."""
        items = self.items
        if s not in items:
            items[s] = group

    def flush(self) -> None:
        items, self.items = self.items, {}
        if not items:
            return
        first: Any = None
        one = True
        for s in items:
            g = items[s]
            if first is None:
                first = g
            elif g is not first:
                one = False
        if one:  # every state of one reduction group (the usual case): one update
            update_delayed_scaling(list(items), first)
            return
        by_group: dict[int, tuple[Any, list[RecipeState]]] = {}
        for s, g in items.items():
            by_group.setdefault(id(g), (g, []))[1].append(s)
        for g, ss in by_group.values():
            update_delayed_scaling(ss, g)

    def clear(self) -> None:
        self.items = {}


_pending_forward = _Pending()
_pending_backward = _Pending()
_queued_backward_task: list[int] = []  # graph task id whose end-of-backward callback is queued


def get_autocast_state() -> AutocastState:
    """The innermost active autocast state (a disabled state outside any region)."""
    return _state


def is_fp8_enabled() -> bool:
    """True inside an enabled ``fusible.autocast`` region."""
    return _state.enabled


def get_recipe() -> Recipe | None:
    """The active recipe, or None when quantization is not enabled."""
    return _state.recipe if _state.enabled else None


def get_amax_reduction_group() -> Any:
    """The active region's amax reduction group (None: no reduction)."""
    return _state.amax_reduction_group if _state.enabled else None


def _check_states(
    fn: str, states: Sequence[RecipeState | None] | RecipeState | None
) -> list[RecipeState]:
    if states is None:
        return []
    if isinstance(states, RecipeState):
        return [states]
    out = []
    for s in states:
        if s is None:
            continue
        if not isinstance(s, RecipeState):
            raise TypeError(f"{fn}: expected RecipeState objects or None, got {type(s).__name__}")
        out.append(s)
    return out


_dispatch_depth = torch._C._len_torch_dispatch_stack
_key_included = torch._C._dispatch_tls_is_dispatch_key_included
_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def _tracing() -> bool:
    if torch.compiler.is_compiling():
        return True
    # A proxy mode is on the dispatch mode stack (which counts the infra modes) or on the
    # pre-dispatch one (which includes the PreDispatch key while it holds a mode): two C checks
    # before looking it up (the step's hot path).
    if not _dispatch_depth() and not _key_included(_PRE_DISPATCH):
        return False
    return _get_proxy_mode() is not None


def end_forward_pass_of_plan(states: Sequence[RecipeState]) -> None:
    """:func:`end_forward_pass` for a plan's forward states (RecipeStates holding delayed-scaling
    state, no None: chosen when the plan was built) with the default group, without
    re-validating them at every step."""
    if _log_stack and replaying_scales():
        return
    st = _state
    group = st.amax_reduction_group if st.enabled else None
    if st.depth > 0 and not _tracing():
        items = _pending_forward.items  # _Pending.add_delayed, inline
        for s in states:
            if s not in items:
                items[s] = group
    else:
        update_delayed_scaling(states, group)


def end_backward_pass_of_plan(states: Sequence[RecipeState]) -> None:
    """:func:`end_backward_pass` for a plan's backward states (as for
    :func:`end_forward_pass_of_plan`) with the default group and deferral."""
    if _tracing():
        update_delayed_scaling(states, _last_group)
        return
    task = torch._C._current_graph_task_id()
    if task == -1:
        update_delayed_scaling(states, _last_group)
        return
    items = _pending_backward.items  # _Pending.add_delayed, inline
    for s in states:
        if s not in items:
            items[s] = _last_group
    if _queued_backward_task != [task]:
        _queued_backward_task[:] = [task]
        torch.autograd.Variable._execution_engine.queue_callback(_flush_backward)


def end_forward_pass(
    states: Sequence[RecipeState | None] | RecipeState | None,
    group: Any = DEFAULT_GROUP,
    *,
    defer: bool | None = None,
) -> None:
    """Called by the framework at the end of each forward pass with that pass's forward states.

    ``states``: RecipeStates (None entries and stateless states are skipped). ``group``: the amax
    reduction group; by default the active region's ``amax_reduction_group`` (None: no
    reduction). Deferred (eager, inside an autocast region; the default there): the states are
    registered and updated when the outermost region exits without an exception. Immediate
    (tracing, or outside any region, or ``defer=False``): :func:`update_delayed_scaling` now.
    """
    ss = _check_states("end_forward_pass", states)
    if replaying_scales():
        return  # a checkpoint recomputation: its forward already registered these states
    if group is DEFAULT_GROUP:
        group = get_amax_reduction_group()
    if defer is None:
        defer = _state.depth > 0 and not _tracing()
    if defer:
        _pending_forward.add(ss, group)
    else:
        update_delayed_scaling(ss, group)


def _flush_backward() -> None:
    _queued_backward_task.clear()
    _pending_backward.flush()


def end_backward_pass(
    states: Sequence[RecipeState | None] | RecipeState | None,
    group: Any = DEFAULT_GROUP,
    *,
    defer: bool | None = None,
) -> None:
    """Called by the framework at the end of each backward pass with that pass's backward states.

    ``states``: as for :func:`end_forward_pass`. ``group``: the amax reduction group; by default
    the ``amax_reduction_group`` of the most recently entered enabled autocast region (backward
    usually runs after the region has exited; pass the group saved at forward time to be
    explicit, None for no reduction). Deferred (eager, called from inside an autograd backward;
    the default there): the states are registered and updated once when the whole backward pass
    (the autograd graph task) finishes. Immediate (tracing, outside a backward pass, or
    ``defer=False``): updated now.
    """
    ss = _check_states("end_backward_pass", states)
    if group is DEFAULT_GROUP:
        group = _last_group
    if defer is None:
        defer = not _tracing() and torch._C._current_graph_task_id() != -1
    if not defer:
        update_delayed_scaling(ss, group)
        return
    task = torch._C._current_graph_task_id()
    if task == -1:
        raise RuntimeError("end_backward_pass: defer=True needs a running autograd backward pass")
    _pending_backward.add(ss, group)
    if _queued_backward_task != [task]:
        _queued_backward_task[:] = [task]
        torch.autograd.Variable._execution_engine.queue_callback(_flush_backward)


def pending_recipe_states(mode: str) -> list[RecipeState]:
    """States registered and not yet updated (``mode``: ``"forward"`` or ``"backward"``)."""
    if mode not in ("forward", "backward"):
        raise ValueError(
            f"pending_recipe_states: mode must be 'forward' or 'backward', got {mode!r}"
        )
    pending = _pending_forward if mode == "forward" else _pending_backward
    return list(pending.items)


@contextlib.contextmanager
def restored_state(state: AutocastState) -> Iterator[None]:
    """Make ``state`` (captured with :func:`get_autocast_state`) the active one for the region,
    without the enter/exit side effects of :class:`autocast` (no update on exit): how a
    checkpoint recomputation sees its forward's quantization settings."""
    global _state
    prev = _state
    _state = state
    try:
        yield
    finally:
        _state = prev


class autocast(contextlib.ContextDecorator):
    """Enable FP8/MXFP8 quantization for ops run inside the region.

    ``enabled``: False disables quantization inside (e.g. a high-precision sub-block);
    ``recipe``: a :mod:`fusible.recipe` recipe (None: ``DelayedScaling()``);
    ``amax_reduction_group``: a ``torch.distributed`` process group over which delayed-scaling
    amaxes are max-reduced at each update (None: no reduction).

    Regions nest; leaving one restores the enclosing state, also on exceptions. When the
    outermost region exits normally, the forward delayed-scaling states registered inside it are
    updated (see :func:`end_forward_pass`); after an exception they are discarded un-updated
    (their amaxes stay recorded and join the next step's). Usable as a decorator.
    """

    def __init__(
        self,
        enabled: bool = True,
        recipe: Recipe | None = None,
        amax_reduction_group: Any = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"fusible.autocast: 'enabled' must be a bool, got {enabled!r}")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(
                "fusible.autocast: 'recipe' must be a fusible.recipe recipe (DelayedScaling, "
                "Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, CustomRecipe) or "
                f"None, got {recipe!r}"
            )
        if recipe.__class__ in _PER_TENSOR and recipe.fp8_format is Format.E5M2:  # type: ignore[union-attr]
            # A building block of a CustomRecipe (E5M2 gradient roles) may be pure E5M2; the
            # whole recipe may not: every forward GEMM would pair two E5M2 operands, which no
            # FP8 GEMM multiplies (TransformerEngine refuses pure E5M2 too).
            raise ValueError(
                f"fusible.autocast: recipe {type(recipe).__name__}(fp8_format=Format.E5M2) "
                "casts inputs and weights to E5M2 too, and no FP8 GEMM multiplies two E5M2 "
                "operands; use Format.HYBRID (E4M3 forward, E5M2 gradients) or Format.E4M3, or "
                "route E5M2 to the gradient roles only in a CustomRecipe"
            )
        if isinstance(amax_reduction_group, (bool, int, float, str)):
            raise TypeError(
                "fusible.autocast: 'amax_reduction_group' must be a torch.distributed process "
                f"group or None, got {amax_reduction_group!r}"
            )
        self.enabled = enabled
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        self._saved: list[AutocastState] = []

    def __enter__(self) -> autocast:
        global _state, _last_group
        prev = _state
        recipe = self.recipe
        if recipe is None and self.enabled:
            recipe = DEFAULT_RECIPE
        self._saved.append(prev)
        if self.enabled:
            _last_group = self.amax_reduction_group
        _state = AutocastState(
            enabled=self.enabled,
            recipe=recipe if self.enabled else None,
            amax_reduction_group=self.amax_reduction_group if self.enabled else None,
            depth=prev.depth + 1,
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _state
        _state = self._saved.pop()
        if _state.depth == 0:
            if exc_type is None:
                _pending_forward.flush()
            else:
                _pending_forward.clear()
