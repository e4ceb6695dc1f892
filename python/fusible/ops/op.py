"""Operation base classes: BasicOperation (owns parameters and quantizers) and FusedOperation.

Execution model. A ``Sequential`` hands runs of operations to the fuser, which builds a forward
plan and a backward plan: lists of units, each a basic op or a fused op covering adjacent basic ops.
One autograd function runs a plan. Every basic op gets its own ``OpContext`` per call, filled by
whichever unit ran it forward, so forward and backward plans may group ops differently.

Data between units is a tensor or, when a unit quantized its output for the next op (quantizer
hand-off), a ``QuantizedData`` value (plain tensors plus metadata, never a tensor subclass).
Parameters reach ops as arguments (``params``), never through ``self``, so the autograd function
only ever sees tensors and constants.
"""

from __future__ import annotations

import io
import itertools
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fusible.quantization import (
    QuantizerRole,
    RecipeState,
    load_recipe_state,
    recipe_state_to_dict,
)
from fusible.quantization.quantizers import Quantizer

__all__ = ["BasicOperation", "FusedOperation", "OpContext"]


class OpContext:
    """Per-call state of one basic op between its forward and its backward.

    ``saved``: what backward reads (tensors, quantized containers, None), passed through
    ``save_for_backward``; ``attrs``: constants; ``params_requires_grad`` /
    ``input_requires_grad``: which params need gradients, and whether the op's input does.
    Forward only (never saved): ``workspace`` (the cached weight workspace handed in),
    ``cache_weight`` (whether to produce a new one) and ``new_workspace`` (the one produced; see
    ops/workspace.py) -- for an op with several workspaces (:meth:`BasicOperation.workspace_specs`
    with keys), dicts keyed by the workspace key (``workspace``: the keys handed in;
    ``cache_weight``: key -> bool; ``new_workspace``: the op fills one entry per key to cache);
    ``call``: the op's per-call constant (:meth:`BasicOperation.prepare_call`, e.g. the split
    sizes of ``GroupedLinear``; None for ops without call keywords); ``prep``: what the op
    resolved once for the plan running it (:meth:`BasicOperation.prepare`; None for a context
    made outside a plan, where the op resolves it per call). A plain class with slots: one is
    made per op per call (and reused by the plan's backward eagerly)."""

    __slots__ = (
        "attrs", "cache_weight", "call", "input_requires_grad", "new_workspace",
        "params_requires_grad", "prep", "saved", "workspace",
    )  # fmt: skip

    def __init__(
        self,
        params_requires_grad: tuple[bool, ...] = (),
        input_requires_grad: bool = True,
        saved: list[Any] | None = None,
        attrs: dict[str, Any] | None = None,
        prep: Any = None,
    ) -> None:
        self.params_requires_grad = params_requires_grad
        self.input_requires_grad = input_requires_grad
        self.saved: list[Any] = [] if saved is None else saved
        self.attrs: dict[str, Any] = {} if attrs is None else attrs
        self.workspace: Any = None
        self.cache_weight: Any = False
        self.new_workspace: Any = None
        self.call: Any = None
        self.prep: Any = prep


_UIDS = itertools.count()
# uid -> op, so cached plans can be found from plain constants (see fuser.plan_key_for).
OPS_BY_UID: weakref.WeakValueDictionary[int, BasicOperation] = weakref.WeakValueDictionary()
#: Generations of recipe states: an op takes a new one whenever it builds new states (new
#: quantizer objects); plans resolve their quantizers when built, so plan caches key on their
#: ops' generations. Stashing and restoring a state (a run without a recipe between runs with
#: one) keeps the quantizer objects and the generation.
_STATE_GENS = itertools.count(1)

#: The namespace, in an op's ``_extra_state``, of state that belongs to its weights' wrappers and
#: not to the op: ``fusible.distributed.fully_shard_fp8``'s delayed-scaling all-gather state
#: (``gather.<weight>.amax_history`` / ``.scale``). ``set_extra_state`` skips it, so such a
#: checkpoint loads into a model without the wrapper (plain ``fully_shard``).
GATHER_KEY = "gather"

#: (major, minor) of the installed torch, for the version gates of the ops.
TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
#: Bumped whenever any op's active states change (built, stashed or restored): a Sequential
#: re-activates its ops' states only when the recipe or this changed.
ACTIVE_EPOCH = [0]
#: Bumped whenever a public attribute of a basic op that a replay recording ran
#: (:data:`RECORDED_OPS`) is assigned a new value (``Dropout.p``, ``LayerNorm.eps``, a
#: parameter replaced, ...): the ops read such attributes in Python at every step, so the
#: replay executor's recordings (ops/replay.py) are valid for one value of this counter only.
#: ``training`` (in the plan key) and ``state_gen`` (likewise) do not bump it; nor does building
#: or copying an op (not recorded yet).
CONFIG_EPOCH = [0]
RECORDED_OPS: weakref.WeakSet[BasicOperation] = weakref.WeakSet()
_UNTRACKED = frozenset({"training", "state_gen"})
_MISSING: Any = object()


class BasicOperation(torch.nn.Module):
    """One operation, e.g. LayerNorm or Linear. Subclasses implement ``op_forward`` and
    ``op_backward`` and, if they quantize, ``get_quantizer_roles``.

    ``num_extra_inputs`` / ``num_extra_outputs`` let an op take a tensor from outside the chain
    (``AddExtraInput``: a residual) or emit one (``MakeExtraOutput``: a branch).

    ``call_kwargs``: keyword arguments of ``Sequential.forward`` the op reads on every call that
    are not tensors (``GroupedLinear``: ``m_splits``). :meth:`prepare_call` turns them into a
    hashable constant, which crosses the autograd function as a constant (never part of the
    plan key: a plan serves every value) and reaches the op as ``ctx.call``.
    """

    num_extra_inputs: ClassVar[int] = 0
    num_extra_outputs: ClassVar[int] = 0
    call_kwargs: ClassVar[tuple[str, ...]] = ()
    #: Whether the op computes with its input (so it must be float32, float16 or bfloat16:
    #: ``Sequential`` checks it when a plan is built); False for ops that only move or reshape
    #: it, which take any dtype.
    computes: ClassVar[bool] = True
    # Scope of the op's quantizer roles (e.g. "linear"); modules may re-scope.
    role_scope: ClassVar[str] = ""
    #: Role buckets the op declares (for a recipe's role list) but never quantizes with:
    #: ``explain()`` marks their quantizers "not read".
    unread_buckets: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, *, name: str | None = None) -> None:
        super().__init__()
        self._assign_uid()
        self.quantizer_name = name
        self._role_scope_override: str | None = None
        self._recipe_states: dict[str, RecipeState | None] = {"forward": None, "backward": None}
        self._recipe_key: Any = None
        self.state_gen = 0  # see _STATE_GENS
        self._built = False  # states built for _recipe_key (a recipe, not None)
        # The states of the last recipe, kept while the op runs without one (an evaluation pass
        # outside autocast): (recipe key, states). Restored when that recipe comes back; only a
        # different recipe replaces them.
        self._stashed: tuple[Any, dict[str, RecipeState | None]] | None = None
        # (fwd, role bucket) -> quantizer of the active states (get_quantizer is on the hot path).
        self._qmap: dict[tuple[bool, str], Quantizer | None] = {}
        # Recipe state loaded from a checkpoint before the state exists (it is built lazily, at the
        # first forward under a recipe); applied as soon as it is built.
        self._pending_recipe_state: dict[str, dict[str, torch.Tensor]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name[0] != "_"
            and name not in _UNTRACKED
            and self.__dict__.get(name, _MISSING) is not value
            and self in RECORDED_OPS
        ):
            CONFIG_EPOCH[0] += 1  # see CONFIG_EPOCH
        super().__setattr__(name, value)

    def _assign_uid(self) -> None:
        # Plans are cached by op uid; a copy (deepcopy, pickle) is a different op with its own
        # parameters and recipe state, so it must never share its original's uid.
        self.uid = next(_UIDS)
        OPS_BY_UID[self.uid] = self

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._assign_uid()

    def forward(self, x: Any, *extra_inputs: Any, **kwargs: Any) -> Any:
        """The op called on its own (``ops.GELU()(x)``, ``ops.LayerNorm(64)(x)``), as
        TransformerEngine's basic ops can be: it runs as a one-op ``ops.Sequential``, with that
        container's arguments (``is_first_microbatch``, extra inputs, ``m_splits``) and output.
        The container is made per call, as TransformerEngine makes its fuser per call: one kept
        by the op would keep the op alive through its plans. For repeated calls put the op in an
        ``ops.Sequential`` (which also fuses it with its neighbours). Inside a container the op
        never runs through here: the container's plan runs it."""
        from fusible.ops.sequential import Sequential

        return Sequential(self)(x, *extra_inputs, **kwargs)

    # ---- module hooks ----------------------------------------------------------------------

    def _no_hooks(self, kind: str) -> Any:
        raise RuntimeError(
            f"{type(self).__name__}.{kind}: hooks on a basic op never run: ops run inside their "
            "container's fusion plan (one autograd function), not through Module.__call__. "
            "Register the hook on the enclosing module (ops.Sequential, fusible.Linear, "
            "LayerNormLinear, LayerNormMLP) or use torch.autograd.graph hooks on tensors"
        )

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._no_hooks("register_forward_hook")

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._no_hooks("register_forward_pre_hook")

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._no_hooks("register_full_backward_hook")

    def register_full_backward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._no_hooks("register_full_backward_pre_hook")

    def register_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._no_hooks("register_backward_hook")

    # ---- quantizers ------------------------------------------------------------------------

    @property
    def scope(self) -> str:
        return self._role_scope_override or self.role_scope

    def set_role_scope(self, scope: str, name: str | None = None) -> None:
        """Re-scope this op's roles (used by modules, e.g. ``layernorm_mlp`` with name ``fc1``)."""
        self._role_scope_override = scope
        if name is not None:
            self.quantizer_name = name
        self.reset_recipe_state(None)  # the roles changed: states are rebuilt at the next run

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        """Roles of the quantizers this op owns, in slot order (none by default)."""
        return []

    def num_quantizers(self, fwd: bool) -> int:
        return len(self.get_quantizer_roles(fwd))

    def reset_recipe_state(self, recipe: Any | None) -> None:
        """(Re)build the forward/backward RecipeStates for ``recipe`` (None: high precision;
        this discards the states, unlike :meth:`ensure_recipe_state`)."""
        self.state_gen = next(_STATE_GENS)
        ACTIVE_EPOCH[0] += 1
        self._stashed = None
        self._built = recipe is not None
        self._recipe_states = {"forward": None, "backward": None}  # new: never mutate a held one
        for mode, fwd in (("forward", True), ("backward", False)):
            roles = self.get_quantizer_roles(fwd)
            if recipe is None or not roles:
                self._recipe_states[mode] = None
                continue
            self._recipe_states[mode] = RecipeState.create(
                recipe, mode=mode, num_quantizers=len(roles), roles=roles,
                device=self._state_device(),
            )  # fmt: skip
        self._recipe_key = _recipe_key(recipe)
        try:
            self._apply_pending_recipe_state()
        except ValueError:
            self._built = False  # the next run builds again and raises again: never drops it
            raise
        self._build_qmap()

    def _build_qmap(self) -> None:
        qmap: dict[tuple[bool, str], Quantizer | None] = {}
        for mode, fwd in (("forward", True), ("backward", False)):
            state = self._recipe_states[mode]
            if state is not None:
                for role, q in zip(state.roles or (), state.quantizers, strict=True):
                    qmap.setdefault((fwd, role.bucket), q)
        self._qmap = qmap

    def _state_device(self) -> torch.device:
        """Where the recipe state lives: with the op's parameters (the kernels take the scales
        on the device they run on; ``meta`` for a model built on ``meta``, whose forward gives
        shapes); CPU for an op without parameters."""
        for p in self.parameters(recurse=False):
            return p.device
        return torch.device("cpu")

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # .to(device) / .cuda() / .cpu() move the recipe state with the parameters (a dtype
        # change never casts it: scaling state is float32).
        out = super()._apply(fn, recurse)
        self._move_recipe_states()
        return out

    def _move_recipe_states(self) -> None:
        device = self._state_device()
        active = [s for s in self._recipe_states.values() if s is not None]
        if device.type != "meta" and any(s.device.type == "meta" for s in active):
            # Materialised from meta (to_empty): a meta state holds no values; build it anew.
            self.reset_recipe_state(active[0].recipe)
        if self._stashed is not None and any(
            s is not None and s.device.type == "meta" for s in self._stashed[1].values()
        ):
            self._stashed = None
        stashed = self._stashed[1].values() if self._stashed is not None else ()
        for state in (*self._recipe_states.values(), *stashed):
            if state is not None and state.device != device:
                state.to(device)

    #: What ``_state_snapshot`` saves: everything building recipe states may change.
    _SNAPSHOT_ATTRS: ClassVar[tuple[str, ...]] = (
        "_recipe_states", "_recipe_key", "_stashed", "_qmap", "_pending_recipe_state",
        "state_gen", "_built",
    )  # fmt: skip

    def _state_snapshot(self) -> dict[str, Any]:
        """The recipe-state bookkeeping as it is (containers copied): ``explain()`` plans with
        states of its own and puts these back."""
        out = {}
        for name in self._SNAPSHOT_ATTRS:
            v = self.__dict__.get(name)
            out[name] = dict(v) if isinstance(v, dict) else v
        return out

    def _restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        self.__dict__.update(snapshot)

    def _held_states(self) -> dict[str, RecipeState | None]:
        """The active states, or the stashed ones while the op runs without a recipe."""
        if self._stashed is not None and self._recipe_key is None:
            return self._stashed[1]
        return self._recipe_states

    # ---- checkpoints: recipe state as plain tensors under "<prefix>_extra_state" ------------

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        """Recipe state (amax histories, scales) as a flat dict of plain tensors."""
        out: dict[str, torch.Tensor] = {}
        for mode, state in self._held_states().items():
            for k, v in recipe_state_to_dict(state).items():
                out[f"{mode}.{k}"] = v
        # State loaded from a checkpoint and not built yet (no run under a recipe since): saved
        # as loaded, so re-saving a loaded model keeps it.
        for mode, fields in self._pending_recipe_state.items():
            for k, v in fields.items():
                out.setdefault(f"{mode}.{k}", v)
        return out

    def set_extra_state(self, state: Any) -> None:
        if state is None:
            return
        if _is_te_extra_state(state):
            if isinstance(state, io.BytesIO) or state.numel():
                warnings.warn(
                    f"{type(self).__name__}: the checkpoint's _extra_state is "
                    "TransformerEngine's serialized FP8 state, whose format fusible does not "
                    "read: it is ignored and the recipe state starts afresh (delayed scaling "
                    "re-learns its amax history)",
                    UserWarning,
                    stacklevel=2,
                )
            return  # an empty one: TransformerEngine's "no FP8 state"
        if not isinstance(state, Mapping):
            raise ValueError(
                f"{type(self).__name__}: malformed recipe state in checkpoint: expected a dict of "
                f"tensors, got {type(state).__name__}"
            )
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            mode, _, field = str(key).partition(".")
            if mode == GATHER_KEY:
                continue  # a weight's FP8 all-gather state (fusible.distributed): not the op's
            if mode not in ("forward", "backward") or not field:
                raise ValueError(
                    f"{type(self).__name__}: malformed recipe state key {key!r} in checkpoint; "
                    "expected 'forward.<field>' or 'backward.<field>'"
                )
            # Checked now: the shapes can only be checked once the state is built (they depend on
            # the recipe), but a non-tensor is malformed whatever the recipe.
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"{type(self).__name__}: malformed recipe state in checkpoint: {key!r} must "
                    f"be a torch.Tensor, got {type(value).__name__}"
                )
            pending.setdefault(mode, {})[field] = value
        self._pending_recipe_state = pending
        self._apply_pending_recipe_state()

    def _apply_pending_recipe_state(self) -> None:
        held = self._held_states()
        for mode in list(self._pending_recipe_state):
            state = held[mode]
            if state is not None:
                # Removed only once loaded: a checkpoint that does not fit the recipe raises on
                # every run (it used to raise on the first one only: the next ran on fresh state,
                # the checkpoint's dropped silently).
                try:
                    load_recipe_state(state, self._pending_recipe_state[mode])
                except ValueError as e:
                    raise ValueError(
                        f"{type(self).__name__}: the {mode} recipe state from load_state_dict() "
                        "does not fit the recipe it runs under (a checkpoint saved under another "
                        "recipe?): load one saved under this recipe, or leave out its "
                        f"'_extra_state' entries to start from fresh recipe state. {e}"
                    ) from e
                del self._pending_recipe_state[mode]

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        # Checkpoints without recipe state (older ones, or from a model never run under a recipe)
        # load too: a missing entry means "no state".
        state_dict.setdefault(prefix + "_extra_state", {})
        super()._load_from_state_dict(state_dict, prefix, *args)

    def ensure_recipe_state(self, recipe: Any | None) -> None:
        """Make ``recipe``'s states the active ones. ``None`` (a run without a recipe) sets the
        current states aside without discarding them (still saved by ``state_dict()``); the same
        recipe coming back restores them, amax histories and scales included. A different recipe
        builds new states."""
        key = _recipe_key(recipe)
        if recipe is None:
            if self._recipe_key is not None:
                self._stashed = (self._recipe_key, self._recipe_states)
                self._recipe_states = {"forward": None, "backward": None}
                self._recipe_key = None
                self._qmap = {}
                ACTIVE_EPOCH[0] += 1
            return
        if self._recipe_key is None and self._stashed is not None and self._stashed[0] == key:
            self._recipe_states, self._recipe_key = self._stashed[1], key
            self._stashed = None
            self._build_qmap()
            ACTIVE_EPOCH[0] += 1
            return
        if self._recipe_key != key or not self._built:
            self.reset_recipe_state(recipe)

    def recipe_state(self, fwd: bool) -> RecipeState | None:
        return self._recipe_states["forward" if fwd else "backward"]

    def get_quantizer(self, fwd: bool, role_bucket: str) -> Quantizer | None:
        """The quantizer of this op for a role bucket ("input", "grad_output", ...), or None."""
        return self._qmap.get((fwd, role_bucket))

    def workspace_spec(self) -> tuple[torch.Tensor, Quantizer] | None:
        """``(weight, quantizer)`` if this op keeps a quantized weight workspace, else None."""
        return None

    def workspace_specs(self) -> list[tuple[int | None, torch.Tensor, Quantizer]]:
        """Every quantized weight workspace this op keeps, as ``(key, weight, quantizer)``. The
        default is :meth:`workspace_spec`'s one workspace under key None (``ctx.workspace`` is
        then the workspace itself and the cache ``self.workspace_cache``); an op with several
        (``GroupedLinear``: one per expert) gives int keys, gets ``ctx.workspace`` /
        ``ctx.cache_weight`` / ``ctx.new_workspace`` as dicts by key (see :class:`OpContext`)
        and keeps its caches in ``self.workspace_caches[key]``."""
        spec = self.workspace_spec()
        return [] if spec is None else [(None, spec[0], spec[1])]

    def prepare(self, params_requires_grad: tuple[bool, ...], input_requires_grad: bool) -> Any:
        """What this op's forward and backward decide from the plan's key alone (quantizers and
        their kinds, which copies backward reads, ...), resolved once when a plan is built with
        these requires-grad flags (grad mode folded in: with it off, nothing needs a gradient,
        and ``torch.inference_mode`` turns it off); it reaches the op as ``ctx.prep``. None
        (the default): nothing prepared. An op must also run with ``ctx.prep`` None (a context
        made outside a plan), resolving it per call."""
        return None

    def prepare_call(self, kwargs: Mapping[str, Any]) -> Any:
        """The per-call constant (hashable: ints, tuples, None) of this op from the keyword
        arguments of ``Sequential.forward`` (only those named in :attr:`call_kwargs` are
        passed), checked here: it reaches ``op_forward`` as ``ctx.call``."""
        return None

    def input_quantizer(self) -> Quantizer | None:
        """What this op wants its input quantized with (offered to the previous op)."""
        return None

    def grad_output_quantizer(self) -> Quantizer | None:
        """What this op wants its output gradient quantized with (offered to the next op's
        backward)."""
        return None

    # ---- execution -------------------------------------------------------------------------

    def op_forward(
        self,
        ctx: OpContext,
        x: Any,
        params: list[torch.Tensor],
        *,
        next_input_quantizer: Quantizer | None,
        extra_inputs: list[torch.Tensor],
    ) -> tuple[Any, list[torch.Tensor]]:
        """Return ``(y, extra_outputs)``. ``y`` may be quantized with ``next_input_quantizer``."""
        raise NotImplementedError

    def op_backward(
        self,
        ctx: OpContext,
        dy: Any,
        *,
        prev_grad_quantizer: Quantizer | None,
        extra_output_grads: list[torch.Tensor | None],
    ) -> tuple[Any, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Return ``(dx, param_grads, extra_input_grads)``. Parameters are not passed: an op saves
        in ``ctx.saved`` what its backward needs (e.g. the quantized transposed weight)."""
        raise NotImplementedError

    def kernels(self, fwd: bool) -> list[str]:
        """Kernels this op launches in its forward / backward (for ``explain()``)."""
        return []


def _recipe_key(recipe: Any | None) -> Any:
    return None if recipe is None else (type(recipe), recipe)


class FusedOperation:
    """A unit covering adjacent basic ops, running them with fused kernels.

    Owns no parameters: it reads its basic ops' parameters from ``params`` (one list per basic op)
    and fills each basic op's ``OpContext`` exactly as the basic ops would, so a fused forward can
    pair with an unfused backward and vice versa.
    """

    #: Human-readable name shown by ``explain()``.
    name: ClassVar[str] = "fused"
    #: Which plan(s) this unit can appear in.
    forward: ClassVar[bool] = True
    backward: ClassVar[bool] = False

    def __init__(self, ops: list[BasicOperation]) -> None:
        self.ops = ops

    def kernels(self, fwd: bool) -> list[str]:
        """Kernels this unit launches in the given pass (for ``explain()``)."""
        return []

    def fuser_forward(
        self,
        ctxs: list[OpContext],
        x: Any,
        params: list[list[torch.Tensor]],
        *,
        next_input_quantizer: Quantizer | None,
        extra_inputs: list[list[torch.Tensor]],
    ) -> tuple[Any, list[list[torch.Tensor]]]:
        raise NotImplementedError

    def fuser_backward(
        self,
        ctxs: list[OpContext],
        dy: Any,
        *,
        prev_grad_quantizer: Quantizer | None,
        extra_output_grads: list[list[torch.Tensor | None]],
    ) -> tuple[Any, list[list[torch.Tensor | None]], list[list[torch.Tensor | None]]]:
        raise NotImplementedError


def _is_te_extra_state(state: Any) -> bool:
    """Whether a checkpoint's ``_extra_state`` is TransformerEngine's: a 1-D uint8 tensor of
    its pickled FP8 metadata, or an empty tensor without FP8 state (TE reads any empty tensor
    as that); TE 1.x saved an ``io.BytesIO``. fusible's own is a dict of tensors."""
    return isinstance(state, io.BytesIO) or (
        isinstance(state, torch.Tensor)
        and state.dim() == 1
        and (state.dtype == torch.uint8 or state.numel() == 0)
    )
