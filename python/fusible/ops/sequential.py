"""``Sequential``: an ``nn.Sequential``-like container whose runs of basic ops are fused."""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any, overload

import torch

from fusible._kernels import HIGH_PRECISION_DTYPES
from fusible.ops import fuser, registry
from fusible.ops.basic.quantized_weight import check_compile_quantized
from fusible.ops.grad_reduction import with_grad_reductions
from fusible.ops.op import ACTIVE_EPOCH, BasicOperation
from fusible.quantization import autocast as _autocast
from fusible.quantization.quantizers import QuantizedTensor, _log_stack, scale_log
from fusible.quantization.recipe import recipe_from_key
from fusible.quantization.recompute import (
    _top_hooks,
    adopt_torch_checkpoint,
    in_reentrant_recompute,
    warn_reentrant_recompute,
)
from fusible.quantization.roles import QuantizerRole

__all__ = ["Sequential"]


_SEQ_UIDS = itertools.count()
try:  # what torch.func.functional_call assigns through (Sequential.__setattr__)
    from torch.nn.utils._named_member_accessor import swap_tensor as _swap_tensor

    _SWAP_CODE: types.CodeType | None = _swap_tensor.__code__
except ImportError:  # pragma: no cover - older torch
    _SWAP_CODE = None
_SEQ_BY_UID: weakref.WeakValueDictionary[str, Sequential] = weakref.WeakValueDictionary()
_NO_RECIPE: Any = object()  # explain(): no recipe argument given
_WHERE = "(raised while running "  # the note _note_where adds
_MAX_PLANS = 32  # per container


def _assume_constant_result(fn: Any) -> Any:
    """``torch._dynamo.assume_constant_result(fn)`` without importing dynamo when fusible is
    imported (``torch._dynamo`` takes about a second to import, and eager users never need it):
    the same mark that function sets (test_import checks that it is the mark dynamo sets)."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _traced_activate(seq_uid: str, recipe_key: str | None) -> int:
    """Make the recipe states of the Sequential ``seq_uid``'s ops those of the recipe with key
    ``recipe_key`` (see :meth:`Sequential._activate`). Under ``torch.compile`` this runs at
    trace time, outside the graph, like :func:`_traced_plan_id`: the states' tensors
    (delayed-scaling ``amax_history`` / ``scale``) are then real tensors the graph reads and
    mutates as inputs. Built inside the traced region they would be graph intermediates that
    dynamo returns as forward outputs to re-materialize the new Python objects; the backward
    states are also written in the backward graph (amax recording and the immediate update),
    so AOTAutograd's partitioner finds forward outputs that depend on the backward, and
    ``id()`` of the quantizers built in-trace (the weight-workspace cache key) cannot be
    reconstructed after the graph. Only constants cross into it. Returns 0 (an int: older
    dynamo takes no tuple from an ``assume_constant_result`` function); the ops' state
    generations after the activation are left in ``seq._traced_gens`` (see forward)."""
    seq = _SEQ_BY_UID[seq_uid]
    for m in seq._modules.values():
        if any(isinstance(p, QuantizedTensor) for p in getattr(m, "_parameters", {}).values()):
            check_compile_quantized(type(m).__name__)  # in plain Python, before dynamo wraps it
    seq._runs()  # cached here, outside the trace
    seq._activate(recipe_from_key(recipe_key))
    seq._traced_gens = seq._state_gens()
    return 0


@_assume_constant_result
def _traced_plan_id(seq_uid: str, key: tuple[Any, ...], recipe_key: str | None) -> int:
    """The id of the plan for ``key`` (see :meth:`Sequential._traced_key`), built on first use.
    Under ``torch.compile`` this runs at trace time and its result is a constant of the graph:
    planning is Python bookkeeping, never traced."""
    seq = _SEQ_BY_UID[seq_uid]
    gens = tuple(op.state_gen for op in seq._runs()[key[0]][1])
    return seq._plan((*key, recipe_key, gens), recipe_from_key(recipe_key)).id


def own_forward(module: torch.nn.Module) -> None:
    """Give ``module`` a ``forward`` with a code object of its own.

    ``torch.compile`` keeps a code object's graphs in one cache and, past
    ``torch._dynamo.config.recompile_limit`` (8) entries, refuses more (``fullgraph=True``:
    ``FailOnRecompileLimitHit``) or runs the frame eagerly. A fusible module's graph holds its
    own plan ids as constants (:func:`_traced_plan_id`), so every module compiled on its own --
    per layer, as FSDP2 is used -- is one more entry: with one shared ``forward`` the ninth
    failed. The module's ``forward`` attribute is a function of its own code object (a copy of
    :func:`_entry_code`'s) that calls its class's ``forward`` on the module, which it reaches
    through a weak reference: a bound method in the module's ``__dict__`` would make a reference
    cycle, and a dropped module would wait for the cyclic garbage collector to be freed. Re-made
    by ``__setstate__`` (a copy or an unpickled module), never pickled (``__getstate__`` drops
    it)."""
    code = _FORWARD_ENTRY_CODE.replace()  # a new code object, its own cache
    cell = types.CellType(weakref.ref(module))
    fn = types.FunctionType(code, globals(), "forward", None, (cell,))
    fn.__qualname__ = f"{type(module).__qualname__}.forward"
    fn.__doc__ = type(module).forward.__doc__
    fn.__signature__ = _bound_signature(type(module))  # type: ignore[attr-defined, arg-type]
    module.__dict__["forward"] = fn


@functools.cache
def _bound_signature(cls: type) -> inspect.Signature:
    """``cls.forward``'s signature without ``self`` (what ``inspect.signature(module.forward)``
    reports for a bound method: tools that bind arguments by name read it)."""
    sig = inspect.signature(cls.forward)  # type: ignore[attr-defined]
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _entry_code() -> types.CodeType:
    """The code of a module's own ``forward`` entry, with the module's weak reference ``ref`` as
    its one free variable (closure cell)."""
    ref: Any = None

    def forward(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        return type(m).forward(m, *args, **kwargs)

    return forward.__code__


_FORWARD_ENTRY_CODE = _entry_code()


class OwnForwardModule(torch.nn.Module):
    """A module with a ``forward`` of its own code object (:func:`own_forward`), kept through
    copies, pickles and ``DataParallel`` replicas (each gets an entry that reaches itself)."""

    def __init__(self) -> None:
        super().__init__()
        own_forward(self)

    def _replicate_for_data_parallel(self) -> Any:
        replica = super()._replicate_for_data_parallel()  # a copy of this module's __dict__
        own_forward(replica)
        return replica

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("forward", None)  # reaches this instance: re-made by __setstate__
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        own_forward(self)


def _recipe_key(recipe: Any) -> str | None:
    # str(): dynamo may track the attribute as a lazily guarded constant, which it cannot hand
    # to an assume_constant_result function; the call makes a plain constant.
    return None if recipe is None else str(recipe.key)


class Sequential(OwnForwardModule):
    """A chain of ops. Nested ``Sequential``s are flattened; a plain ``nn.Module`` splits fusion.

    ``forward(x, *extra_inputs, is_first_microbatch=None, **call_kwargs)`` returns ``y``, or
    ``(y, *extra_outputs)`` when the chain holds ``MakeExtraOutput`` ops. Extra inputs are consumed
    by ``AddExtraInput`` ops in order. ``is_first_microbatch`` controls the quantized weight
    workspace cache of Linear ops (see ``fusible.ops.workspace``). ``call_kwargs`` are the
    per-call, non-tensor arguments some ops read (``BasicOperation.call_kwargs``): every op
    declaring a keyword gets its value, e.g. ``m_splits=[...]`` for each ``GroupedLinear``
    (the two of an MoE expert MLP share the token split); a keyword no op reads raises
    ``TypeError``.
    """

    def __init__(self, *modules: torch.nn.Module) -> None:
        super().__init__()
        for m in self._flatten(modules):
            self.add_module(str(len(self._modules)), m)
        self._init_plans()

    def _forwarded_parameter(self, name: str) -> tuple[torch.nn.Module, str] | None:
        """``(op, attribute)`` of the parameter this container exposes as property ``name``
        (``weight``, ``fc1_weight``, ``layer_norm_weight``, ...), or None. Subclasses with such
        properties say which op holds each one, so :meth:`__setattr__` can forward an
        assignment to it."""
        return None

    def _forwarded(self, name: str) -> Any:
        """The parameter behind forwarded name ``name`` (None where it has none): what the
        subclasses' properties return."""
        target = self._forwarded_parameter(name)
        return None if target is None else getattr(*target)

    def __setattr__(self, name: str, value: Any) -> None:
        # Assigning a Parameter to a forwarded name (weight tying: ``lm_head.weight =
        # embedding.weight``, Hugging Face's tie_weights) replaces the op's parameter;
        # nn.Module would refuse it ("attribute 'weight' already exists": the name is a
        # property here, not a registered parameter).
        # A plain tensor goes into the op's parameter slot as it is, as torch.func.functional_call
        # (torch.nn.utils.stateless) puts one into a module's own parameter slot: functional
        # calls by state_dict() names (the TE names) then work, and its restore assigns the
        # Parameter back through the branch above. Only the accessor's swap may put one there
        # (recognised by its code object; a torch without it allows any caller).
        if isinstance(value, torch.Tensor):
            target = self._forwarded_parameter(name)
            if target is not None:
                op, attr = target
                old = getattr(op, attr)
                if old is not None and value.shape != old.shape:
                    raise ValueError(
                        f"{type(self).__name__}.{name}: a parameter of shape "
                        f"{tuple(old.shape)} was expected, got {tuple(value.shape)}"
                    )
                if isinstance(value, torch.nn.Parameter):
                    setattr(op, attr, value)
                elif sys._getframe(1).f_code is _SWAP_CODE or _SWAP_CODE is None:
                    op._parameters[attr] = value  # type: ignore[assignment]
                else:
                    # Anyone else: a plain tensor would sit in the slot and never train, so
                    # refuse it as nn.Module refuses one for a registered parameter.
                    raise TypeError(
                        f"{type(self).__name__}.{name}: cannot assign a "
                        f"{type(value).__name__} as parameter '{name}' (torch.nn.Parameter "
                        "expected: wrap it, torch.nn.Parameter(t), or copy into the existing "
                        f"one under torch.no_grad(): m.{name}.copy_(t))"
                    )
                return
        super().__setattr__(name, value)

    def _init_plans(self) -> None:
        # Plans live with the container (a dropped model frees them); _SLOTS entries of the
        # plans are released by a finalizer that does not reference the container.
        # A str, not an int: dynamo may track an int attribute of a module as a dynamic
        # (symbolic) int once it has seen two values of it -- FSDP2-managed modules, compiled one
        # frame each -- and a SymInt cannot be handed to an assume_constant_result function.
        self._seq_uid = f"seq{next(_SEQ_UIDS)}"
        _SEQ_BY_UID[self._seq_uid] = self
        self._plans: dict[Any, fuser.Plan] = {}
        self._plan_ids: list[int] = []
        weakref.finalize(self, fuser.release_plans, self._plan_ids)
        self._runs_cache: tuple[tuple[Any, ...], list[Any]] | None = None
        self._traced_gens: tuple[int, ...] = ()  # see _traced_activate
        # Children whose parameters' gradients are summed over a group (sequence-parallel
        # replicated parameters, modules/_tp.py reduce_grad_over; ops/grad_reduction.py); set
        # with the runs, eagerly.
        self._grad_reduce_ops: tuple[Any, ...] = ()
        self._token: Any = None  # (recipe key, ACTIVE_EPOCH) the ops' states were set for
        self._last_run: tuple[Any, torch.dtype, torch.device] | None = None

    def _replicate_for_data_parallel(self) -> Any:
        # A replica shares this container's __dict__ copy: it plans for its own ops.
        replica = super()._replicate_for_data_parallel()
        replica._init_plans()
        return replica

    def __getstate__(self) -> dict[str, Any]:
        # Plans reference this container's ops: a copy (deepcopy, pickle) plans afresh.
        state = super().__getstate__()
        for k in ("_plans", "_plan_ids", "_runs_cache", "_token", "_seq_uid"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._init_plans()

    @staticmethod
    def _flatten(modules: Any) -> Iterator[torch.nn.Module]:
        for m in modules:
            if isinstance(m, Sequential):
                yield from m._modules.values()  # type: ignore[misc]
            elif isinstance(m, torch.nn.Module):
                yield m
            else:
                raise TypeError(
                    "Sequential: arguments must be torch.nn.Module instances, got "
                    f"{type(m).__name__}"
                )

    def __len__(self) -> int:
        return len(self._modules)

    @overload
    def __getitem__(self, i: int) -> torch.nn.Module: ...
    @overload
    def __getitem__(self, i: slice) -> Sequential: ...
    def __getitem__(self, i: int | slice) -> torch.nn.Module:
        """An op by position, or (a slice) a new ``ops.Sequential`` of those ops, as
        ``torch.nn.Sequential`` slices: the ops are shared (their parameters and recipe
        state), the fusion plans are the new container's own."""
        if isinstance(i, slice):
            return Sequential(*list(self._modules.values())[i])  # type: ignore[arg-type]
        return list(self._modules.values())[i]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def append(self, module: torch.nn.Module) -> Sequential:
        for m in self._flatten([module]):
            self.add_module(str(len(self._modules)), m)
        return self

    # ---- conventions: quantizer roles and initialisation (every module has them) -----------

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        """The roles of the quantizers of this container's ops, forward (``fwd``) or backward,
        in slot order: op order, then each op's slots.

        Each role is the one its op emits, unchanged (scope and name, e.g.
        ``weight:layernorm_mlp:fc1``): the very roles a ``CustomRecipe`` factory is called with
        and ``explain()`` lists. A nested ``Sequential`` (or module) is flattened at
        construction, so its ops' roles appear where its ops run, qualified as their ops were
        built (a module scopes and names its ops then); a container never re-qualifies them.
        A plain ``nn.Module`` child that has ``get_quantizer_roles`` adds its roles at its
        position; one that does not is opaque, as it is to the fuser. Roles need not be unique:
        two unnamed ``ops.Linear`` both emit ``input:linear`` (name them to tell them apart)."""
        roles: list[QuantizerRole] = []
        for m in self:
            get = getattr(m, "get_quantizer_roles", None)
            if callable(get):
                roles.extend(get(fwd))
        return roles

    def num_quantizers(self, fwd: bool) -> int:
        """How many quantizers this container's ops own forward / backward:
        ``len(get_quantizer_roles(fwd))``."""
        return len(self.get_quantizer_roles(fwd))

    def reset_parameters(self) -> None:
        """Re-initialise every child that has ``reset_parameters`` (norm weight 1, biases 0,
        Linear weights kaiming-uniform as ``torch.nn.Linear``; a quantized weight is
        re-quantized in place). With ``to_empty()``, this materialises a model built on the
        ``meta`` device: ``m.to_empty(device="cpu"); m.reset_parameters()``. Call it once, on
        the top container (or, as FSDP does, on each module that holds parameters of its own):
        calling it on every module of ``modules()`` would reset the ops twice (other random
        draws than a model built on the CPU from the same seed)."""
        for m in self:
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()

    # ---- planning --------------------------------------------------------------------------

    def _runs(self) -> list[tuple[int, list[Any], int]]:
        """Maximal runs of basic ops, each ``(index, modules, number of extra inputs)``; each
        plain module is a run of its own (extra inputs -1). Cached until the children change."""
        mods: tuple[Any, ...] = ()
        d = self._modules
        for k in d:  # no call per step (a values() view is one)
            mods += (d[k],)
        cache = self._runs_cache
        if cache is not None and cache[0] == mods:
            return cache[1]  # type: ignore[no-any-return]
        groups: list[list[Any]] = []
        for m in mods:
            basic = isinstance(m, BasicOperation)
            if basic and groups and isinstance(groups[-1][0], BasicOperation):
                groups[-1].append(m)
            else:
                groups.append([m])
        runs = [
            (i, g, sum(op.num_extra_inputs for op in g) if isinstance(g[0], BasicOperation) else -1)
            for i, g in enumerate(groups)
        ]
        if not torch.compiler.is_compiling():  # no mutation in a traced region (checkpoint)
            if cache is not None:
                # The children changed: plans of the old runs go, and the new ops get their
                # recipe states at the next run.
                self._drop_plans()
                self._token = None
            self._runs_cache = (mods, runs)
            self._grad_reduce_ops = tuple(m for m in mods if getattr(m, "_reduce_grad_over", None))
        return runs

    def _drop_plans(self, keep: int = 0) -> None:
        """Forget cached plans, oldest first, down to ``keep``."""
        while len(self._plans) > keep:
            plan = self._plans.pop(next(iter(self._plans)))
            fuser.release_plans([plan.id])
            self._plan_ids.remove(plan.id)

    def _state_gens(self) -> tuple[int, ...]:
        return tuple(m.state_gen for m in self._modules.values() if isinstance(m, BasicOperation))

    def _activate(self, recipe: Any) -> None:
        """Make every op's recipe states ``recipe``'s (see ``BasicOperation.ensure_recipe_state``:
        no recipe sets them aside, it never discards them)."""
        for m in self._modules.values():
            if isinstance(m, BasicOperation):
                m.ensure_recipe_state(recipe)
        self._token = (_recipe_key(recipe), ACTIVE_EPOCH[0])

    def _plan(self, key: tuple[Any, ...], recipe: Any) -> fuser.Plan:
        """The plan for ``key`` (a tuple starting with the run index, input requires-grad, grad
        mode and the extra inputs' requires-grad; see forward), built on first use."""
        plan = self._plans.get(key)
        if plan is None:
            ops = self._runs()[key[0]][1]
            plan = fuser.build_plan(
                ops, recipe, input_requires_grad=key[1], grad_enabled=key[2],
                extra_requires_grad=key[3],
            )  # fmt: skip
            if len(self._plans) >= _MAX_PLANS:
                # Plans of states that were replaced (a recipe change, a checkpoint load) are
                # never looked up again: bounded, oldest first.
                self._drop_plans(_MAX_PLANS - 1)
            self._plans[key] = plan
            self._plan_ids.append(plan.id)
        return plan

    def _eager_key(
        self, index: int, rkey: Any, x: torch.Tensor, extra: Any, params: list[torch.Tensor],
        ops: list[Any],
    ) -> tuple[Any, ...]:  # fmt: skip
        # Loops, not comprehensions: this runs at every step (a comprehension is a call).
        gens: tuple[Any, ...] = ()
        training: tuple[bool, ...] = ()
        for op in ops:
            gens += (op.state_gen,)
            training += (op.training,)
        pkey: tuple[Any, ...] = ()
        for p in params:
            pkey += ((p.requires_grad, p.dtype, type(p), p.shape, p.device, p.is_contiguous()),)
        erg: tuple[bool, ...] = ()
        for t in extra:
            erg += (t.requires_grad,)
        return (
            index, x.requires_grad, torch.is_grad_enabled(), erg, rkey, gens, x.dtype, x.device,
            pkey, training, registry._VERSION[0], registry._DISABLED[0],
        )  # fmt: skip

    def _traced_key(
        self, index: int, x: torch.Tensor, extra: Any, params: list[torch.Tensor], ops: list[Any]
    ) -> tuple[Any, ...]:
        # Constants only (see _traced_plan_id); a "traced" tag keeps these apart from eager keys.
        return (
            index, x.requires_grad, torch.is_grad_enabled(),
            tuple(t.requires_grad for t in extra), "traced", x.dtype, x.device.type,
            tuple((p.requires_grad, p.dtype, tuple(p.shape)) for p in params),
            tuple(op.training for op in ops), registry.version(),
        )  # fmt: skip

    def _plan_for(
        self, ops: list[BasicOperation], x: torch.Tensor, recipe: Any
    ) -> tuple[int, fuser.Plan]:
        """The plan this container runs for ``ops`` (one of its runs) on an input like ``x``
        under ``recipe`` (for tests and tools; ``forward`` looks plans up itself)."""
        index = next(i for i, g, _ in self._runs() if g == ops)
        self._activate(recipe)
        params = fuser.params_of(ops)
        key = self._eager_key(index, _recipe_key(recipe), x, (), params, ops)
        plan = self._plan(key, recipe)
        return plan.id, plan

    # ---- execution -------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        *extra_inputs: torch.Tensor,
        is_first_microbatch: bool | None = None,
        **call_kwargs: Any,
    ) -> Any:
        if type(x) is not torch.Tensor and not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}.forward: the input must be a torch.Tensor, got "
                f"{type(x).__name__}"
            )
        if x.ndim == 0:
            raise ValueError(
                f"{type(self).__name__}.forward: the input must have at least one dimension "
                "(features last), got a 0-dim tensor"
            )
        # Under torch.compile the same plans are looked up through constants (see
        # _traced_activate / _traced_plan_id); eagerly, by one dict lookup per run.
        traced = torch.compiler.is_compiling()
        if traced:
            recipe = _autocast.get_recipe()
            rkey = _recipe_key(recipe)
            uid = str(self._seq_uid)  # a plain constant (see _recipe_key)
            _traced_activate(uid, rkey)
            # The activation runs at trace time only: a graph is valid while the ops hold the
            # states it was traced with. Comparing the ops' state generations read here (after
            # the activation) with those it left makes dynamo guard on them (module attributes,
            # read as constants), so a call that finds other states --
            # the recipe switched to another one and back, which builds new states each time --
            # traces again (and activates) instead of running a graph bound to states the ops
            # no longer hold. (Per op, not the global ACTIVE_EPOCH: other modules' activations
            # would recompile this one.)
            if self._state_gens() != self._traced_gens:
                raise RuntimeError(f"{type(self).__name__}: recipe states changed while tracing")
            runs = self._runs()
        else:
            state = _autocast._state  # get_recipe(), read inline (the eager hot path)
            recipe = state.recipe if state.enabled else None
            if recipe is None:
                last = self._last_run
                if last is not None and last[0] is not None and in_reentrant_recompute():
                    warn_reentrant_recompute(type(self).__name__)
            elif not _log_stack and _top_hooks(False) is not None:
                # Maybe a plain torch.utils.checkpoint region: recompute as fusible.checkpoint
                # does (adopt_torch_checkpoint says whether it is one).
                log = adopt_torch_checkpoint()
                if log is not None:
                    with scale_log(log, replaying=False):
                        return self.forward(
                            x, *extra_inputs, is_first_microbatch=is_first_microbatch,
                            **call_kwargs,
                        )  # fmt: skip
            rkey = None if recipe is None else recipe.key
            runs = self._runs()  # first: changed children reset the token
            if self._token != (rkey, ACTIVE_EPOCH[0]):
                self._activate(recipe)
        if call_kwargs:
            self._check_call_kwargs(call_kwargs)
        cast = _torch_autocast_dtype(x) if _any_autocast() else None
        # Traced, the runs' ops are checked (at trace time): _grad_reduce_ops is set eagerly.
        reduce = traced or self._grad_reduce_ops
        pending = extra_inputs
        extra_outputs: list[torch.Tensor] = []
        for index, run, n_in in runs:
            if n_in < 0:
                x = run[0](x)
                continue
            if n_in:
                if n_in > len(pending):
                    self._too_few_extra_inputs(extra_inputs)
                extra, pending = pending[:n_in], pending[n_in:]
            else:
                extra = ()
            params = fuser.params_of(run)
            run_params = params
            if reduce:  # sequence-parallel replicated parameters: gradients summed over tp
                run_params = with_grad_reductions(run, params)
            if cast is not None:
                x, extra, run_params = _cast_for_torch_autocast(cast, x, extra, run_params)
            if traced:
                key = self._traced_key(index, x, extra, run_params, run)
                plan = fuser.plan_by_id(_traced_plan_id(uid, key, rkey))
                if extra:  # block(x, x): dynamo wants distinct autograd.Function inputs
                    extra = fuser.distinct_inputs(x, extra)
                calls = fuser.call_args(plan, call_kwargs) if plan.call_ops else None
                x, outs = fuser.run_plan(
                    plan, x, extra, run_params, is_first_microbatch, params, calls, False
                )
            else:
                # (A try costs nothing until it catches; not traced: dynamo would have to.)
                try:
                    key = self._eager_key(index, rkey, x, extra, run_params, run)
                    found = self._plans.get(key)
                    if found is None:  # a new key: its dtypes are checked once, here
                        self._check_dtypes(x, run, run_params)
                        found = self._plan(key, recipe)
                    plan = found
                    calls = fuser.call_args(plan, call_kwargs) if plan.call_ops else None
                    x, outs = fuser.run_plan(
                        plan, x, extra, run_params, is_first_microbatch, params, calls, True
                    )
                except (ValueError, TypeError, NotImplementedError) as err:
                    self._note_where(err, run)
                    raise
            if outs:
                extra_outputs.extend(outs)
            if plan.forward_states:
                _autocast.end_forward_pass_of_plan(plan.forward_states)
        if pending:
            self._too_many_extra_inputs(extra_inputs, pending)
        if not traced:
            # Written past Module.__setattr__ (a dozen calls per step): a plain attribute.
            self.__dict__["_last_run"] = (recipe, x.dtype, x.device)
        return (x, *extra_outputs) if extra_outputs else x

    def _note_where(self, err: BaseException, run: list[Any]) -> None:
        """Add to ``err`` (shown under its message in the traceback) the module it was raised in
        and that run's ops: an op's message names the op class (``BasicLinear``), which a user
        of ``fusible.Linear`` or of a model of many layers did not write. Once per error; not on
        Python 3.10 (no exception notes)."""
        add_note = getattr(err, "add_note", None)
        if add_note is None or any(n.startswith(_WHERE) for n in getattr(err, "__notes__", ())):
            return
        cls = type(self)
        mod = cls.__module__
        prefix = "fusible." if mod.startswith("fusible.modules") else (
            "fusible.ops." if mod.startswith("fusible.ops") else f"{mod}.")  # fmt: skip
        ops = [
            f"[{k}] {type(op).__name__}"
            + (f" {q!r}" if (q := getattr(op, "quantizer_name", None)) else "")
            for k, op in self._modules.items()
            if any(op is o for o in run)
        ]
        label = getattr(self, "name", None)
        label = f" {label!r}" if isinstance(label, str) and label else ""
        add_note(f"{_WHERE}{prefix}{cls.__qualname__}{label}, in its ops {', '.join(ops)})")

    def _check_dtypes(self, x: torch.Tensor, run: list[Any], params: list[torch.Tensor]) -> None:
        """The input and parameters a run's kernels compute with are float32, float16 or
        bfloat16, and on the input's device (else the first kernel would refuse them, naming
        itself and its argument, not the module and the parameter). Not
        checked: a run with an op defined outside fusible (a user's op may take token ids or
        masks), the input of a run of ops that only move it (``Identity``, ``Reshape``, ...:
        ``BasicOperation.computes``), and extra inputs (``AddExtraInput`` casts its own; their
        dtypes are not in the plan key)."""
        if any(not type(op).__module__.startswith("fusible.") for op in run):
            return
        allowed = "fusible computes in float32, float16 or bfloat16"
        name = type(self).__name__
        if x.dtype not in HIGH_PRECISION_DTYPES and any(op.computes for op in run):
            raise TypeError(
                f"{name}.forward: the input has dtype {x.dtype}; {allowed} (cast it, e.g. "
                f"x.float() or x.to(torch.bfloat16))"
            )

        def pname(p: torch.Tensor) -> str:
            return next((k for k, v in self.named_parameters() if v is p), "?")

        for p in params:
            if p.dtype not in HIGH_PRECISION_DTYPES:
                raise TypeError(
                    f"{name}.forward: parameter '{pname(p)}' has dtype {p.dtype}; "
                    f"{allowed} (convert the model, e.g. model.float() or "
                    f"model.to(torch.bfloat16))"
                )
            if p.device != x.device:
                raise ValueError(
                    f"{name}.forward: the input is on {x.device} but parameter "
                    f"'{pname(p)}' is on {p.device}; put the input and the model "
                    f"on one device (x.to({str(p.device)!r}) or model.to({str(x.device)!r}))"
                )

    def _check_call_kwargs(self, kwargs: dict[str, Any]) -> None:
        known = {k for m in self if isinstance(m, BasicOperation) for k in m.call_kwargs}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.forward: unexpected keyword argument(s) "
                f"{', '.join(repr(k) for k in unknown)}: no op of this container reads "
                f"{'it' if len(unknown) == 1 else 'them'} (keywords the ops read: "
                f"{', '.join(sorted(known)) or 'none'})"
            )

    def _too_few_extra_inputs(self, given: Any) -> None:
        need = sum(op.num_extra_inputs for op in self if isinstance(op, BasicOperation))
        raise ValueError(
            f"{type(self).__name__}.forward: the ops need {need} extra input(s) (AddExtraInput), "
            f"got {len(given)}"
        )

    def _too_many_extra_inputs(self, given: Any, pending: Any) -> None:
        raise ValueError(
            f"{type(self).__name__}.forward: got {len(given)} extra input(s) but the ops consume "
            f"{len(given) - len(pending)}"
        )

    # ---- introspection ---------------------------------------------------------------------

    def explain(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        recipe: Any = _NO_RECIPE,
    ) -> str:
        """The forward and backward plans: units, kernels, each quantizer's role and recipe, and
        fusions that did not apply (with the reason).

        ``recipe``: the recipe to explain (None: high precision). By default the active
        ``fusible.autocast`` recipe inside an autocast region, else the recipe of this model's
        last run: called after the training loop, it shows the plan that ran. ``dtype`` /
        ``device``: of the input (default: the last run's, else float32 on CPU). Explaining
        never changes the ops' recipe states."""
        last = self._last_run
        if recipe is _NO_RECIPE:
            inside = _autocast.get_autocast_state().depth > 0
            recipe = _autocast.get_recipe() if inside or last is None else last[0]
        if dtype is None:
            dtype = last[1] if last is not None else torch.float32
        if device is None:
            device = last[2] if last is not None else "cpu"
        basic = [m for m in self._modules.values() if isinstance(m, BasicOperation)]
        held = [op._state_snapshot() for op in basic]
        try:
            return self._explain(recipe, dtype, device)
        finally:
            for op, h in zip(basic, held, strict=True):
                op._restore_snapshot(h)
            self._token = None

    def _explain(self, recipe: Any, dtype: torch.dtype, device: Any) -> str:
        lines = [f"recipe: {recipe!r}" if recipe is not None else "recipe: none (high precision)"]
        if self._last_run is None:
            lines.append(f"(no run yet: explained for a {dtype} input on {device}; pass dtype, "
                         "device and recipe to explain another)")  # fmt: skip
        self._activate(recipe)
        for r, run, n_in in self._runs():
            if n_in < 0:
                lines.append(f"run {r}: plain module {type(run[0]).__name__} (splits fusion)")
                continue
            ops: list[BasicOperation] = run
            plan = fuser.build_plan(ops, recipe)  # not cached: states may be explain's own
            fuser.release_plans([plan.id])
            lines.append(f"run {r}:")
            for title, units in (
                ("forward", plan.forward_units),
                ("backward", plan.backward_units),
            ):
                lines.append(f"  {title} plan:")
                for u in units:
                    fwd = title == "forward"
                    unit = u.fused if u.fused is not None else ops[u.start]
                    kernels = unit.kernels(fwd)
                    tag = f" (rule '{u.rule}')" if u.rule else ""
                    lines.append(f"    - {u.label(ops)}{tag}")
                    if kernels:
                        lines.append(f"        kernels: {', '.join(kernels)}")
            lines.append("  quantizers:")
            any_q = False
            for i, op in enumerate(ops):
                for fwd in (True, False):
                    state = op.recipe_state(fwd)
                    if state is None:
                        continue
                    for role, q in zip(state.roles or (), state.quantizers, strict=True):
                        any_q = True
                        what = "high precision" if q is None else repr(q)
                        if role.bucket in op.unread_buckets:
                            what += " (not read: a role-list slot, see roles.UNREAD_BUCKETS)"
                        lines.append(f"    op {i} {type(op).__name__}: {role.qualified}: {what}")
            if not any_q:
                lines.append("    (none)")
            if plan.rejected:
                lines.append("  fusions not applied:")
                for which, a, b, name, reason in plan.rejected:
                    names = " + ".join(type(op).__name__ for op in ops[a:b])
                    lines.append(f"    {which} '{name}' on [{names}]: {reason}")
        return "\n".join(lines)


_any_autocast = torch._C._is_any_autocast_enabled


def _torch_autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes in on ``x``'s device, or None outside it."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def _cast_for_torch_autocast(
    dtype: torch.dtype, x: torch.Tensor, extra: Any, params: list[torch.Tensor]
) -> tuple[torch.Tensor, Any, list[torch.Tensor]]:
    """Inside ``torch.autocast``: the input, extra inputs and floating-point parameters in the
    autocast dtype (as TransformerEngine's modules do; the casts are differentiable, so gradients
    reach the fp32 parameters in their dtype). Quantized weights are not cast (they dequantize
    to the dtype their op computes in)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        plain = type(t) in (torch.Tensor, torch.nn.Parameter)
        if plain and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return cast(x), tuple(cast(t) for t in extra), [cast(p) for p in params]
