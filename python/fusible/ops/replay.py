"""The replay executor (issue 11): a cached plan runs as a flat list of prepared kernel calls.

The Python executor (``fuser._forward_units`` / ``_backward_units`` and every op's
``op_forward`` / ``op_backward``) decides, at every step, which kernels to call with which
arguments. For a given *step signature* (see :func:`forward`) those decisions are the same at
every step: only the tensors' values change. So eagerly ``_PlanFunction.forward`` and
``.backward`` run the Python executor once per signature under :class:`_Recorder`, a
``TorchDispatchMode`` that captures every operator the step dispatches (``torch.ops.fusible.*``
and aten: views, copies, factories...) with its arguments, each tensor argument mapped to a
*slot*: an input of the function (``x``, extra inputs, parameters, workspaces given; in backward
the saved tensors and the output gradients), an output of an earlier recorded call, or a
*constant* (a recipe-state buffer or a view of one -- delayed-scaling ``amax_history`` /
``scale`` --, kept by reference, its holder's buffers guarded by identity at every replay). The
outputs, the tensors saved for backward, the saved layout and the ops' ``ctx.attrs`` are
recorded as slots / constants too. The recording becomes a program of the operator library's
C++ loop (``cpp/bindings/replay.cpp``, :func:`_program`: one boxed dispatcher call per recorded
operator, every slot dropped right after its last use; one Python call per forward, two per
backward) and is compiled into one straight-line Python function too (:func:`_compile`: one
statement per kernel call on the prebound operator overload, ``OpOverload._op``), which runs
where the library has no C++ loop or with ``FUSIBLE_REPLAY_CPP=0``. Later calls of the
signature run one of them instead of the executor.

Decisions (docs/architecture.md, "The replay executor", repeats them):

* **Record on the second call** of a signature: the first call may initialise Python state
  lazily (a delayed-scaling quantizer's cached slot views, a plan's first-run check), so it is
  not representative; it runs the Python executor. Likewise for backward signatures.
* **The step signature** (forward): the plan (recordings live on it, so its key -- ops, recipe
  and recipe-state generations, dtypes, devices, parameter shapes / types / contiguity and
  requires-grad, grad mode, training flags, fusion registry -- is part of it), the constants
  handed to ``_PlanFunction`` (workspace modes, per-call constants), the input's shape, strides
  and whether it is a view, each extra input's shape / strides / dtype / device / view-ness and
  which earlier input it is the same tensor as (``block(x, x)``), each given workspace tensor's
  metadata, inference mode (plans built with grad off), the ``torch.autocast`` state when any is
  on (the replay then runs with autocast off: the recorded calls are its casts' results), and
  :data:`fusible.ops.op.CONFIG_EPOCH` (bumped when a public attribute of any op is assigned:
  ``Dropout.p``, ``LayerNorm.eps`` ... are read by the Python at every step). The identity of
  the recipe-state buffers the recording reads is a guard checked at each replay (a moved or
  rebuilt state re-records). Backward: the output gradients' None-pattern and strides, and the
  ``torch.autocast`` state.
* **What is not replayed** (the Python executor runs, counted in :func:`stats` under
  ``fallback.<reason>``): ``torch.compile`` tracing (never replayed), saved-tensor hooks active
  (activation checkpointing, offloading: the hooks may hand backward other tensors), a
  ``TorchDispatchMode`` (user, fake, proxy; unless it declares ``replay_transparent = True``:
  an observer that calls every operator unchanged) or a ``TorchFunctionMode`` active, a
  ``fusible.checkpoint`` scale log active, anomaly mode, CUDA graph capture (the graph's own
  replay is the fast path there; capturing runs the Python executor), grad mode on in backward
  (``create_graph``), ``FUSIBLE_REPLAY=0``. A signature is not replayable when its recording saw a
  call it cannot represent: an operator returning a Python scalar or a data-dependent shape (a
  host sync: ``.item()``, ``nonzero``), a tensor argument that is neither a slot nor a known
  recipe-state buffer, a tensor subclass, an argument of another type (a process group: the
  collectives of ``ops.AllGather`` & co.), one tensor given as two inputs of different kinds, a
  non-contiguous parameter, ``ctx.attrs`` holding a tensor. A plan is not replayable when one
  of its ops, fused ops or quantizers is of a class defined outside fusible that does not
  declare ``replayable = True`` (its Python may have side effects the recorder cannot see).
* **Quantized parameters** (``QuantizedTensor``, ``quantized_model_init``): their data are
  Python attributes, so a recording takes each one's data tensors (``qdata_tensors``: data,
  scales, copies) as inputs of their own, after the function's, in place of the parameter
  (whose slot stays empty); their layout (shapes, strides, dtypes) is part of the signature,
  and each replay hands in the tensors the parameter holds then (an optimizer's in-place
  update keeps them; a reload that swaps them is read at the next step).
* **Side effects outside tensors** are replayed explicitly or guarded: the delayed-scaling
  registrations (``end_forward_pass_of_plan`` in ``Sequential.forward``,
  ``end_backward_pass_of_plan`` after the backward) run outside the recorded region at every
  step; the amax recording is an in-place ``torch.maximum(out=)`` on a constant, replayed as
  any call; ``ctx.attrs`` and the saved layout are kept per recording, so a backward that must
  run the Python executor after a replayed forward (a new backward signature, a fallback) gets
  the contexts the forward would have made.
* **Memory**: a slot is deleted right after its last use (computed when the recording is
  compiled), inputs of backward included (the saved tensors are handed in a list the replay
  empties); calls whose outputs nobody reads and that have no side effect (no mutable argument,
  not random) are dropped. So a replay never holds a tensor longer than the Python executor.
* **Bounded**: at most :data:`MAX_SIGNATURES` recordings per plan (least recently used
  dropped; as many backward signatures per recording), and recordings live on their plan (a
  dropped model frees them).
* **Numerics**: the same kernels with the same arguments in the same order: bit-identical.
  ``FUSIBLE_REPLAY_CHECK=1`` (or :func:`configure`) runs both at every replayable step on the
  same state (recipe-state buffers and RNG restored in between) and raises
  :class:`ReplayMismatch` naming the plan and the first differing call.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import keyword
import math
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusible.ops.op import CONFIG_EPOCH, RECORDED_OPS
from fusible.quantization.quantizers import _log_stack, qdata_tensors
from fusible.quantization.tensor import QuantizedTensor

__all__ = [
    "MAX_SIGNATURES",
    "ReplayMismatch",
    "configure",
    "options",
    "reset_stats",
    "stats",
]

#: Recordings kept per plan (least recently used dropped).
MAX_SIGNATURES = 8


class _Config:
    """``enabled``: replay at all (``FUSIBLE_REPLAY=0`` disables it); ``check``: run replay and
    the Python executor at every replayable step and compare (``FUSIBLE_REPLAY_CHECK=1``)."""

    def __init__(self) -> None:
        self.enabled = os.environ.get("FUSIBLE_REPLAY", "1").strip() not in ("0", "false", "")
        self.check = os.environ.get("FUSIBLE_REPLAY_CHECK", "0").strip() not in ("0", "false", "")
        # The recorded calls run by the C++ loop (cpp/bindings/replay.cpp) when the operator
        # library has it, else by the compiled Python function (FUSIBLE_REPLAY_CPP=0: always).
        self.cpp = os.environ.get("FUSIBLE_REPLAY_CPP", "1").strip() not in ("0", "false", "")


CONFIG = _Config()


def configure(
    *, enabled: bool | None = None, check: bool | None = None, cpp: bool | None = None
) -> dict[str, bool]:
    """Set replay options (None: unchanged); returns the previous ones. ``cpp``: run recordings
    made from now on with the C++ loop where the operator library has it."""
    prev = {"enabled": CONFIG.enabled, "check": CONFIG.check, "cpp": CONFIG.cpp}
    if enabled is not None:
        CONFIG.enabled = bool(enabled)
    if check is not None:
        CONFIG.check = bool(check)
    if cpp is not None:
        CONFIG.cpp = bool(cpp)
    return prev


@contextlib.contextmanager
def options(
    *, enabled: bool | None = None, check: bool | None = None, cpp: bool | None = None
) -> Iterator[None]:
    """:func:`configure` for a region (restored on exit)."""
    prev = configure(enabled=enabled, check=check, cpp=cpp)
    try:
        yield
    finally:
        configure(**prev)


_REASONS = (
    "saved_tensor_hooks", "dispatch_mode", "torch_function_mode", "scale_log", "anomaly_mode",
    "cuda_graph_capture", "grad_mode", "disabled", "plan", "signature",
)  # fmt: skip
_COUNTERS = (
    "forward.replay", "forward.python", "forward.record", "forward.check",
    "backward.replay", "backward.python", "backward.record", "backward.check",
    *(f"fallback.{r}" for r in _REASONS),
)  # fmt: skip
_STATS: dict[str, int] = dict.fromkeys(_COUNTERS, 0)


def stats() -> dict[str, int]:
    """Counters since the last :func:`reset_stats`: ``forward.replay`` / ``backward.replay``
    (steps replayed), ``*.python`` (run by the Python executor: first calls of a signature and
    fallbacks), ``*.record`` (recorded), ``*.check`` (checked against the Python executor), and
    ``fallback.<reason>`` (Python runs forced by a condition, see the module docstring;
    ``plan`` / ``signature``: a plan or signature found not replayable)."""
    return dict(_STATS)


def reset_stats() -> None:
    for k in _STATS:
        _STATS[k] = 0


class ReplayMismatch(RuntimeError):
    """A replayed step differs from the Python executor's (``FUSIBLE_REPLAY_CHECK``)."""


class _Unreplayable(Exception):
    pass


# ---- what may be recorded ---------------------------------------------------------------------

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_BUILTIN_PREFIX = "fusible."


def _audited(cls: type) -> bool:
    """Whether instances of ``cls`` (an op, fused op or quantizer class) may be replayed: its
    own ``replayable`` class attribute if it declares one anywhere in its MRO, else whether it is
    defined inside fusible (whose Python was audited: no side effects outside tensors that the
    recorder cannot see)."""
    flag = getattr(cls, "replayable", None)
    if flag is not None:
        return bool(flag)
    return cls.__module__.startswith(_BUILTIN_PREFIX)


def _plan_reason(plan: Any) -> str | None:
    """Why ``plan`` is never replayed, or None."""
    for op in plan.ops:
        if not _audited(type(op)):
            return f"op {type(op).__name__} is not declared replayable"
        for fwd in (True, False):
            state = op.recipe_state(fwd)
            for q in state.quantizers if state is not None else ():
                if q is not None and not _audited(type(q)):
                    return f"quantizer {type(q).__name__} is not declared replayable"
    for u in (*plan.forward_units, *plan.backward_units):
        if u.fused is not None and not _audited(type(u.fused)):
            return f"fused op {type(u.fused).__name__} is not declared replayable"
    return None


def _buffers_of(plan: Any) -> list[Any]:
    """The delayed-scaling buffer holders (``Float8Quantizer.buffers``: a state, or a standalone
    quantizer's own) of the plan's quantizers: the only tensors a recording may hold as
    constants are theirs (``amax_history``, ``scale``) and views of them."""
    seen: dict[int, Any] = {}
    for op in plan.ops:
        quantizers: list[Any] = []
        for fwd in (True, False):
            state = op.recipe_state(fwd)
            if state is not None:
                quantizers += state.quantizers
        for pair in getattr(op, "_rowwise_twins", {}).values():
            quantizers += pair
        for q in quantizers:
            b = getattr(q, "buffers", None)
            if b is not None and hasattr(b, "amax_history") and hasattr(b, "scale"):
                seen.setdefault(id(b), b)
    return list(seen.values())


class _NotReplayable:
    """A signature whose recording saw something it cannot represent."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


_SEEN = object()  # a signature run once by the Python executor: the next call records


class PlanReplay:
    """A plan's recordings: signature -> :class:`Recording`, :data:`_SEEN` or
    :class:`_NotReplayable`, least recently used first; the last hit is kept aside (one tuple
    comparison finds it)."""

    __slots__ = ("buffers", "last", "last_sig", "qparams", "reason", "sigs")

    def __init__(self, plan: Any) -> None:
        self.reason = _plan_reason(plan)
        # Positions in the function's arguments of the QuantizedTensor parameters (the plan's
        # key holds the parameters' types), found at the first forward.
        self.qparams: tuple[int, ...] | None = None
        self.buffers = _buffers_of(plan) if self.reason is None else []
        self.sigs: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self.last_sig: Any = None
        self.last: Any = None

    def lookup(self, sig: Any) -> Any:
        entry = self.sigs.get(sig)
        if entry is not None:
            self.sigs.move_to_end(sig)
            if type(entry) is Recording:
                self.last_sig, self.last = sig, entry
        return entry

    def store(self, sig: Any, entry: Any) -> None:
        self.sigs[sig] = entry
        self.sigs.move_to_end(sig)
        while len(self.sigs) > MAX_SIGNATURES:
            old, _ = self.sigs.popitem(last=False)
            if old == self.last_sig:
                self.last_sig = self.last = None
        if type(entry) is Recording:
            self.last_sig, self.last = sig, entry
        elif sig == self.last_sig:
            self.last_sig = self.last = None

    def known_tensors(self) -> dict[tuple[Any, int], tuple[Any, torch.Tensor]]:
        """(device, storage address) -> (holder, buffer) of the buffers constants may come from
        (by storage, not by ``_base``: views of an inference tensor -- a state built inside
        ``torch.inference_mode`` -- have none)."""
        out: dict[tuple[Any, int], tuple[Any, torch.Tensor]] = {}
        for b in self.buffers:
            for t in (b.amax_history, b.scale):
                ptr = t.untyped_storage().data_ptr()
                if ptr:
                    out[(t.device, ptr)] = (b, t)
        return out


# ---- recording ----------------------------------------------------------------------------------


class _S:
    """A slot in a recorded call's arguments or outputs."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _K:
    """A constant (by reference) in a recorded call's arguments."""

    __slots__ = ("v",)

    def __init__(self, v: Any) -> None:
        self.v = v


_SCALARS = (bool, int, str, type(None))
_OBJECTS = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_SHAPE_TAGS = tuple(
    t for t in (getattr(torch.Tag, "dynamic_output_shape", None),
                getattr(torch.Tag, "data_dependent_output", None)) if t is not None
)  # fmt: skip
_RANDOM = getattr(torch.Tag, "nondeterministic_seeded", None)


class _Call:
    __slots__ = ("args", "func", "kwargs", "name", "outs", "pure")

    def __init__(self, func: Any, args: Any, kwargs: Any, outs: Any) -> None:
        self.func, self.args, self.kwargs, self.outs = func, args, kwargs, outs
        self.name = str(func)
        schema = func._schema
        self.pure = not schema.is_mutable and _RANDOM not in func.tags


def _walk(t: Any, kind: type) -> Iterator[Any]:
    if type(t) is kind:
        yield t
    elif isinstance(t, (list, tuple)):
        for v in t:
            yield from _walk(v, kind)
    elif isinstance(t, dict):
        for v in t.values():
            yield from _walk(v, kind)


def _has_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        v = list(v.values())
    return isinstance(v, (list, tuple, set, frozenset)) and any(_has_tensor(e) for e in v)


def _tensors(t: Any) -> Iterator[torch.Tensor]:
    """The tensors of an operator's output, in order (as :func:`_walk` finds their slots)."""
    if isinstance(t, torch.Tensor):
        yield t
    elif isinstance(t, (list, tuple, type({}.values()))):
        for v in t:
            yield from _tensors(v)


class _Recorder(TorchDispatchMode):
    """Records the calls of one run of the Python executor (see the module docstring).
    ``inputs``: the function's tensor inputs in slot order (None: no tensor there);
    ``groups``: per input, the group within which one tensor may be given at two positions
    (the recording then reads the first: the signature says which are one tensor, or they are
    the parameters, tied for good), None for any input when none may (backward);
    ``known``: see :meth:`PlanReplay.known_tensors`; ``trace``: also keep each call's name and
    a copy of its outputs (the check mode)."""

    def __init__(
        self,
        inputs: list[Any],
        known: dict[tuple[Any, int], tuple[Any, torch.Tensor]],
        trace: bool = False,
        groups: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.ids: dict[int, tuple[Any, int]] = {}
        self.n = 0
        self.calls: list[_Call] = []
        self.failed: str | None = None
        self.known = known
        self.used: dict[int, Any] = {}  # id(holder) -> holder of the constants seen
        self.trace = trace
        self.traced: list[tuple[str, list[torch.Tensor | None]]] = []
        self.result: Any = None
        self.n_inputs = len(inputs)
        for j, t in enumerate(inputs):
            if t is not None:
                i = self._find(t)
                if type(t) not in _PLAIN:
                    self.fail(f"an input is a {type(t).__name__}")
                elif i is None:
                    self.ids[id(t)] = (weakref.ref(t), self.n)
                elif groups is None or groups[i] != groups[j]:
                    self.fail("the same tensor is given as two inputs")
            self.n += 1

    def fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why

    def _find(self, t: torch.Tensor) -> int | None:
        e = self.ids.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]  # type: ignore[no-any-return]
        return None

    def _arg(self, v: Any, func: Any) -> Any:
        t = type(v)
        if t in _PLAIN:
            i = self._find(v)
            if i is not None:
                return _S(i)
            k = self.known.get((v.device, v.untyped_storage().data_ptr()))
            if k is not None:
                self.used[id(k[0])] = k[0]
                return _K(v)
            raise _Unreplayable(
                f"{func}: a tensor argument is neither an input of the plan, the output of an "
                "earlier call nor a recipe-state buffer"
            )
        if isinstance(v, torch.Tensor):
            raise _Unreplayable(f"{func}: a tensor argument is a {t.__name__}")
        if t in _SCALARS:
            return v
        if t is float:
            return v if math.isfinite(v) else _K(v)
        if t in (list, tuple, torch.Size):
            return (list if t is list else tuple)(self._arg(e, func) for e in v)
        if isinstance(v, _OBJECTS):
            return _K(v)
        raise _Unreplayable(f"{func}: an argument of type {t.__name__}")

    def _out(self, v: Any, func: Any) -> Any:
        t = type(v)
        if t in _PLAIN:
            i = self.n
            self.n += 1
            self.ids[id(v)] = (weakref.ref(v), i)
            return _S(i)
        if v is None:
            return None
        if t in (list, tuple):
            return t(self._out(e, func) for e in v)
        raise _Unreplayable(f"{func} returned a {t.__name__} (a host sync or a tensor subclass)")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        targs = tkw = None
        if self.failed is None:
            try:
                if any(tag in func.tags for tag in _SHAPE_TAGS):
                    raise _Unreplayable(f"{func}: its output depends on the values (a host sync)")
                targs = self._arg(tuple(args), func)
                tkw = {k: self._arg(v, func) for k, v in kwargs.items()}
            except _Unreplayable as e:
                self.fail(str(e))
        out = func(*args, **kwargs)
        if self.failed is None:
            try:
                if any(not t.is_cpu for t in _tensors((args, kwargs.values()))) and any(
                    t.is_cpu for t in _tensors(out)
                ):
                    # A device-to-host copy: the Python may read its values without dispatch.
                    raise _Unreplayable(f"{func}: copies to the host (a host sync)")
                self.calls.append(_Call(func, targs, tkw, self._out(out, func)))
            except _Unreplayable as e:
                self.fail(str(e))
        if self.trace:
            self.traced.append((str(func), [o.clone() for o in _tensors(out)]))
        return out

    def slot_of(self, v: Any) -> Any:
        """An output / saved value as a slot, constant or None (raises when unrepresentable)."""
        if v is None:
            return None
        if type(v) not in _PLAIN:
            raise _Unreplayable(f"an output or saved value is a {type(v).__name__}")
        return self._arg(v, "the plan's outputs")


# ---- compiling a recording ----------------------------------------------------------------------


class Recording:
    """A forward signature's compiled calls. ``fn(x, args) -> (outputs, saved)``; ``n_out``:
    outputs that are not new workspaces (``n_ws``); ``layout`` / ``attrs`` / ``calls``: the saved
    layout, the ops' ``ctx.attrs`` and the per-call constants, what a Python backward needs after
    a replayed forward; ``guards``: (holder, amax_history, scale) checked by identity at each
    replay; ``saved_slots``: the slot of each saved tensor; ``backward``: backward signature ->
    :class:`BackwardRecording` / :data:`_SEEN` / :class:`_NotReplayable`; ``names`` /
    ``calls_raw``: the recorded calls (the check mode); ``source``: ``fn``'s code."""

    __slots__ = (
        "attrs", "backward", "calls", "calls_raw", "fn", "guards", "layout", "n_all", "n_out",
        "n_ws", "names", "plan_id", "run", "saved_slots", "source",
    )  # fmt: skip

    attrs: list[dict[str, Any]]
    n_all: int  # the outputs' count (the C++ loop returns outputs and saved tensors in one list)
    run: Any  # the C++ loop's run([x, *args]), or None
    calls: Any
    calls_raw: Any
    fn: Any
    guards: tuple[tuple[Any, torch.Tensor, torch.Tensor], ...]
    layout: Any
    n_out: int
    n_ws: int
    names: list[str]
    plan_id: int
    saved_slots: list[int | None]
    source: str

    def __init__(self) -> None:
        self.backward: dict[Any, Any] = {}


class BackwardRecording:
    """A backward signature's compiled calls: ``fn(saved_list, grads) -> grads`` (it empties
    ``saved_list``); the other fields as :class:`Recording`'s."""

    __slots__ = ("calls_raw", "finish", "fn", "guards", "names", "source", "start")

    start: Any  # the C++ loop's start([*saved, *grads]) and finish(token), or None
    finish: Any
    calls_raw: Any
    fn: Any
    guards: tuple[tuple[Any, torch.Tensor, torch.Tensor], ...]
    names: list[str]
    source: str


_GEN = itertools.count()


def _compile(
    name: str,
    calls: list[_Call],
    n_inputs: int,
    outputs: list[Any],
    saved: list[Any],
    backward_saved: int = -1,
) -> tuple[Any, str, Any]:
    """``(function, source, program)``: straight-line Python of ``calls``, and the C++ loop of
    them (None without it, see :func:`_program`). Forward (``backward_saved`` < 0): ``def f(x,
    a)``, slot 0 is ``x`` and slot i+1 is ``a[i]``; returns ``(outputs, saved)``. Backward:
    ``def f(s, g)``, slots ``0..backward_saved-1`` are the list ``s`` (emptied), the next ones
    ``g``'s items; returns ``outputs`` as a tuple."""
    keep_end: set[int] = set()
    for v in (*outputs, *saved):
        if type(v) is _S:
            keep_end.add(v.i)
    # Dead calls: no output read later, no side effect.
    live: set[int] = set(keep_end)
    kept: list[_Call] = []
    for c in reversed(calls):
        outs = {s.i for s in _walk(c.outs, _S)}
        if c.pure and not (outs & live):
            continue
        kept.append(c)
        live |= {s.i for s in _walk((c.args, c.kwargs), _S)}
    kept.reverse()
    last: dict[int, int] = {}
    for j, c in enumerate(kept):
        for s in _walk((c.args, c.kwargs), _S):
            last[s.i] = j
    ns: dict[str, Any] = {}
    consts: dict[int, str] = {}

    def const(v: Any) -> str:
        key = id(v)
        if key not in consts:
            consts[key] = f"K{len(consts)}"
            ns[consts[key]] = v
        return consts[key]

    def expr(v: Any) -> str:
        t = type(v)
        if t is _S:
            return f"t{v.i}"
        if t is _K:
            return const(v.v)
        if t is list:
            return "[" + ", ".join(expr(e) for e in v) + "]"
        if t is tuple:
            return "(" + "".join(expr(e) + ", " for e in v) + ")"
        return repr(v)

    def target(v: Any, dead: list[str]) -> str:
        t = type(v)
        if t is _S:
            if v.i in live and (v.i in last or v.i in keep_end):
                return f"t{v.i}"
            dead.append(f"t{v.i}")
            return f"t{v.i}"
        if v is None:
            dead.append("_")
            return "_"
        return "[" + ", ".join(target(e, dead) for e in v) + "]"

    lines: list[str] = []
    fwd = backward_saved < 0
    used_inputs = sorted(i for i in set(last) | keep_end if i < n_inputs)
    if fwd:
        head = f"def {name}(x, a):"
        for i in used_inputs:
            lines.append(f"t{i} = x" if i == 0 else f"t{i} = a[{i - 1}]")
    else:
        head = f"def {name}(s, g):"
        if backward_saved:
            names = [f"t{i}" if i in used_inputs else "_" for i in range(backward_saved)]
            lines.append(", ".join(names) + ", = s")
            lines.append("del s[:]")
            if "_" in names:
                lines.append("del _")
        else:
            lines.append("del s[:]")
        for i in used_inputs:
            if i >= backward_saved:
                lines.append(f"t{i} = g[{i - backward_saved}]")
    for j, c in enumerate(kept):
        f = f"F{j}"
        ns[f] = c.func._op
        args = [expr(a) for a in c.args]
        for k, v in c.kwargs.items():  # a keyword-only argument named like a Python keyword
            args.append(f"**{{{k!r}: {expr(v)}}}" if keyword.iskeyword(k) else f"{k}={expr(v)}")
        dead: list[str] = []
        tgt = target(c.outs, dead)
        lines.append(f"{tgt} = {f}({', '.join(args)})  # {c.name}")
        gone = [f"t{i}" for i, j2 in last.items() if j2 == j and i not in keep_end]
        gone += [d for d in dead if d not in gone]
        if gone:
            lines.append("del " + ", ".join(sorted(set(gone), key=gone.index)))
    out = "(" + "".join(expr(v) + ", " for v in outputs) + ")"
    if fwd:
        sv = "(" + "".join(expr(v) + ", " for v in saved) + ")"
        lines.append(f"return {out}, {sv}")
    else:
        lines.append(f"return {out}")
    src = head + "\n" + "\n".join("    " + line for line in lines) + "\n"
    exec(compile(src, f"<fusible replay {name}>", "exec"), ns)
    prog = None
    if CONFIG.cpp and _PROGRAM is not None:
        results = [*outputs, *saved] if fwd else outputs
        prog = _program(kept, last, keep_end, n_inputs, results)
    return ns[name], src, prog


def _program_class() -> Any:
    try:
        return torch.classes.fusible.ReplayProgram
    except (AttributeError, RuntimeError):  # an operator library built without the C++ loop
        return None


_PROGRAM = _program_class()


def _program(
    kept: list[_Call], last: dict[int, int], keep_end: set[int], n_inputs: int,
    results: list[Any],
) -> Any:  # fmt: skip
    """The C++ loop of ``kept`` (cpp/bindings/replay.cpp describes the encoding): the same
    calls, slots, constants and frees as :func:`_compile`'s Python."""
    n_slots = 1 + max(
        [n_inputs - 1, *(s.i for c in kept for s in _walk((c.args, c.kwargs, c.outs), _S)),
         *(v.i for v in results if type(v) is _S)]
    )  # fmt: skip
    prog = _PROGRAM()
    unused = [i for i in range(n_inputs) if i not in last and i not in keep_end]
    prog.init(n_slots, n_inputs, unused)

    def konst(v: Any) -> None:
        t = type(v)
        if t is _K:
            v, t = v.v, type(v.v)
        if isinstance(v, torch.Tensor):
            prog.k_tensor(v)
        elif t is bool:
            prog.k_bool(v)
        elif t is int:
            prog.k_int(v)
        elif t is float:
            prog.k_float(v)
        elif t is str:
            prog.k_str(v)
        elif t is torch.dtype:
            prog.k_dtype(v)
        elif t is torch.device:
            prog.k_device(v)
        elif t is torch.layout:
            prog.k_layout(v)
        elif t is torch.memory_format:
            prog.k_memory_format(v)
        else:
            raise _Unreplayable(f"the C++ loop takes no constant of type {t.__name__}")

    def encode(v: Any, kinds: list[int], slots: list[int]) -> None:
        """A schema argument: :func:`item`'s, or a list -- a constant one, or one of the
        schema's element type (3, its length, its items)."""
        if type(v) is not list and type(v) is not tuple:
            item(v, kinds, slots)
            return
        types = {type(e) for e in v}
        if v and types <= {int}:
            prog.k_ints(list(v))
        elif v and types <= {float, int}:
            prog.k_floats([float(e) for e in v])
        elif v and types <= {bool}:
            prog.k_bools(list(v))
        else:  # tensors, None, or empty
            kinds += (3, len(v))
            for e in v:
                item(e, kinds, slots)
            return
        kinds.append(1)
        slots.append(-1)

    def item(v: Any, kinds: list[int], slots: list[int]) -> None:
        """A list element or a result: a slot (0), None (2) or a constant (1)."""
        if type(v) is _S:
            kinds.append(0)
            slots.append(v.i)
        elif v is None:
            kinds.append(2)
            slots.append(-1)
        else:
            kinds.append(1)
            slots.append(-1)
            konst(v)

    for j, c in enumerate(kept):
        schema = c.func._schema
        kinds: list[int] = []
        slots: list[int] = []
        for i, a in enumerate(schema.arguments):
            if i < len(c.args):
                v = c.args[i]
            elif a.name in c.kwargs:
                v = c.kwargs[a.name]
            elif a.has_default_value():
                v = a.default_value
            else:
                raise _Unreplayable(f"{c.name}: no value for argument {a.name}")
            encode(v, kinds, slots)
        rets = c.outs if len(schema.returns) != 1 else (c.outs,)
        shapes: list[int] = []
        outs: list[int] = []
        for r in rets if schema.returns else ():
            if type(r) is _S or r is None:
                shapes.append(-1)
                outs.append(r.i if type(r) is _S and (r.i in last or r.i in keep_end) else -1)
            else:
                shapes.append(len(r))
                for e in r:
                    live = type(e) is _S and (e.i in last or e.i in keep_end)
                    outs.append(e.i if live else -1)
        frees = [i for i, j2 in last.items() if j2 == j and i not in keep_end]
        prog.add(schema.name, schema.overload_name, kinds, slots, shapes, outs, frees)
    kinds, slots = [], []
    for v in results:
        item(v, kinds, slots)
    prog.results(kinds, slots)
    return prog


def _guards(rec: _Recorder) -> tuple[tuple[Any, torch.Tensor, torch.Tensor], ...]:
    return tuple((b, b.amax_history, b.scale) for b in rec.used.values())


def record_forward(
    ctx: Any, plan: Any, rc: PlanReplay, sig: Any, consts: Any, x: torch.Tensor,
    args: tuple[Any, ...], ins: tuple[Any, ...],
) -> Any:  # fmt: skip
    """Run the Python forward under a recorder, store what it recorded for ``sig`` and return
    the forward's outputs (its backward may then record too: ``ctx.fusible`` names the
    recording). ``ins``: the recording's inputs after ``x`` (``args``, expanded where a
    parameter is quantized: :func:`_expanded`)."""
    n, m = plan.n_extra_in, plan.n_extra_in + plan.n_params
    groups = [0] * (1 + n) + [1] * plan.n_params + [2] * (len(args) - m)
    groups += [3] * (len(ins) - len(args))  # a quantized parameter's tensors
    rec = _Recorder([x, *ins], rc.known_tensors(), groups=groups)
    for p in args[n:m]:
        if not p.is_contiguous():
            rec.fail("a parameter is not contiguous (its strides are not in the signature)")
    with rec:
        outs = _PY_FORWARD(ctx, plan, consts, x, args, rec)
    _STATS["forward.record"] += 1
    for op in plan.ops:  # from now on, assigning their public attributes bumps CONFIG_EPOCH
        RECORDED_OPS.add(op)
    entry: Any
    try:
        if rec.failed is not None:
            raise _Unreplayable(rec.failed)
        entry = _finish_forward(plan, rec, outs, consts)
        ctx.fusible = (*ctx.fusible[:4], entry)
    except _Unreplayable as e:
        entry = _NotReplayable(str(e))
        _STATS["fallback.signature"] += 1
    rc.store(sig, entry)
    return outs


def _finish_forward(plan: Any, rec: _Recorder, outs: tuple[Any, ...], consts: Any) -> Recording:
    tensors, layout, ctxs, n_ws = rec.result
    attrs = []
    for c in ctxs:
        a = dict(c.attrs)
        if _has_tensor(a):
            raise _Unreplayable("an op keeps a tensor in ctx.attrs")
        attrs.append(a)
    outputs = [rec.slot_of(v) for v in outs]
    saved = [rec.slot_of(v) for v in tensors]
    r = Recording()
    r.plan_id = plan.id
    r.fn, r.source, prog = _compile(
        f"replay_forward_p{plan.id}_{next(_GEN)}", rec.calls, rec.n_inputs, outputs, saved
    )
    r.run = None if prog is None else prog.run
    r.n_all = len(outs)
    r.n_out = len(outs) - n_ws
    r.n_ws = n_ws
    r.layout = layout
    r.attrs = attrs
    r.calls = consts[1]
    r.guards = _guards(rec)
    r.saved_slots = [s.i if type(s) is _S else None for s in saved]
    r.names = [c.name for c in rec.calls]
    r.calls_raw = (rec.calls, rec.n_inputs, outputs, saved)
    return r


def record_backward(
    frec: Recording, rc: PlanReplay, bsig: Any, ctx: Any, grads: tuple[Any, ...], run: Any
) -> Any:
    """Run ``run(recorder, box)`` (the Python backward, which pops the saved tensors from
    ``box``: no reference to them stays here, so each is freed when the Python backward drops
    it) under a recorder with the saved tensors and the gradients as inputs; store the recording
    under ``frec.backward[bsig]``."""
    rec = _Recorder([], rc.known_tensors())
    saved = ctx.saved_tensors
    alias = False
    for j, t in enumerate(saved):
        if t is not None:
            i = rec._find(t)
            if i is not None:
                # One tensor at two saved positions: fine when the forward saved one slot there.
                alias = (
                    alias
                    or frec.saved_slots[i] is None
                    or (frec.saved_slots[i] != frec.saved_slots[j])
                )
            elif type(t) not in _PLAIN:
                rec.fail(f"a saved value is a {type(t).__name__}")
            else:
                rec.ids[id(t)] = (weakref.ref(t), j)
        rec.n += 1
    if alias:
        rec.fail("two saved tensors are one tensor")
    n_saved = rec.n
    for g in grads:
        if g is not None:
            if type(g) not in _PLAIN:
                rec.fail(f"a gradient is a {type(g).__name__}")
            elif rec._find(g) is not None:
                rec.fail("a gradient is also a saved tensor")
            else:
                rec.ids[id(g)] = (weakref.ref(g), rec.n)
        rec.n += 1
    rec.n_inputs = rec.n
    box = [saved]
    del saved
    with rec:
        out = run(rec, box)
    _STATS["backward.record"] += 1
    entry: Any
    try:
        if rec.failed is not None:
            raise _Unreplayable(rec.failed)
        outputs = [rec.slot_of(v) for v in out]
        b = BackwardRecording()
        b.fn, b.source, prog = _compile(
            f"replay_backward_p{frec.plan_id}_{next(_GEN)}", rec.calls, rec.n_inputs, outputs,
            [], backward_saved=n_saved,
        )  # fmt: skip
        b.start = None if prog is None else prog.start
        b.finish = None if prog is None else prog.finish
        b.guards = _guards(rec)
        b.names = [c.name for c in rec.calls]
        b.calls_raw = (rec.calls, rec.n_inputs, outputs, n_saved)
        entry = b
    except _Unreplayable as e:
        entry = _NotReplayable(str(e))
        _STATS["fallback.signature"] += 1
    frec.backward[bsig] = entry
    return out


# ---- the hot path: written for few calls (each check is one C call; one helper, _blocked) -----

_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_dispatch_depth = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_anomaly = torch.is_anomaly_enabled
_grad_enabled = torch.is_grad_enabled
_inference = torch.is_inference_mode_enabled
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
_no_autocast = torch._C._DisableAutocast


def _run_forward(rec: Recording, x: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
    """``(outputs, saved)`` of a replayed forward (the C++ loop where there is one)."""
    if rec.run is not None:
        r = rec.run([x, *args])
        return tuple(r[: rec.n_all]), r[rec.n_all :]
    return rec.fn(x, args)  # type: ignore[no-any-return]


def _run_backward(rec: BackwardRecording, saved: list[Any], grads: tuple[Any, ...]) -> Any:
    """The gradients of a replayed backward; ``saved`` is emptied (the caller holds its saved
    tensors in it alone, so each is freed after its last use)."""
    if rec.start is not None:
        token = rec.start([*saved, *grads])
        saved.clear()
        return tuple(rec.finish(token))
    return rec.fn(saved, grads)


def _modes_block() -> bool:
    """Whether an active ``TorchDispatchMode`` forbids replay: any mode does unless it declares
    ``replay_transparent = True`` (it sees every operator and calls it unchanged, as a memory
    tracker does: a replay's operators reach it as the Python executor's would)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return not all(
        getattr(m, "replay_transparent", False) for m in _get_current_dispatch_mode_stack()
    )


def _blocked(t: torch.Tensor | None) -> str | None:
    """Why the state around a forward (``t`` its input) or a backward (``t`` its output
    gradient, maybe None) forbids replay, the ``fallback.*`` counter's name; None: replay may
    run. The checks the two share, after their own (saved-tensor hooks; replay disabled, grad
    mode), each one C call."""
    if _dispatch_depth() and _modes_block():
        return "dispatch_mode"
    if _function_mode():
        return "torch_function_mode"
    if _log_stack:
        return "scale_log"
    if _anomaly():
        return "anomaly_mode"
    if t is not None and t.is_cuda and _capturing():
        return "cuda_graph_capture"
    return None


def _autocast_key() -> tuple[Any, ...]:
    return tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )


def _extras_key(x: torch.Tensor, extras: tuple[Any, ...]) -> tuple[Any, ...]:
    """The extra inputs' part of a forward signature: each one's :func:`_meta` and which
    earlier input it is (``block(x, x)``: the recording reads one tensor there), or -1."""
    out: tuple[Any, ...] = ()
    for j, t in enumerate(extras):
        same = 0 if t is x else -1
        for i in range(j):
            if same < 0 and extras[i] is t:
                same = i + 1
        out += ((t.shape, t.stride(), t.dtype, t.device, t._base is None, same),)
    return out


def _expanded(args: tuple[Any, ...], qparams: tuple[int, ...]) -> tuple[Any, list[Any]]:
    """``(ins, parts)``: ``args`` with the ``QuantizedTensor`` parameters at ``qparams``
    replaced by None and their data tensors (``parts``, in ``qdata_tensors`` order) appended:
    what a recording of a plan with quantized parameters takes after ``x``."""
    ins = list(args)
    parts: list[Any] = []
    for i in qparams:
        parts += qdata_tensors(ins[i].qdata).values()
        ins[i] = None
    return (*ins, *parts), parts


def _meta(ts: Any) -> tuple[Any, ...]:
    return tuple(
        None if t is None else (t.shape, t.stride(), t.dtype, t.device, t._base is None) for t in ts
    )


def forward(ctx: Any, plan: Any, consts: Any, x: torch.Tensor, args: tuple[Any, ...]) -> Any:
    """``_PlanFunction.forward`` eagerly: replay the signature's recording, or run the Python
    executor (``_PY_FORWARD``), recording it on the signature's second call."""
    rc = plan.replay
    if rc is None:
        rc = plan.replay = PlanReplay(plan)
    if rc.reason is not None or not CONFIG.enabled:
        _STATS["fallback.plan" if CONFIG.enabled else "fallback.disabled"] += 1
        _STATS["forward.python"] += 1
        return _PY_FORWARD(ctx, plan, consts, x, args, None)
    if _top_hooks is None or _top_hooks(True) is not None:
        why: str | None = "saved_tensor_hooks"
    else:
        why = _blocked(x)
    if why is not None:
        _STATS["fallback." + why] += 1
        _STATS["forward.python"] += 1
        return _PY_FORWARD(ctx, plan, consts, x, args, None)
    auto = _any_autocast()
    sig: tuple[Any, ...] = (
        consts, x.shape, x.stride(), x._base is None, CONFIG_EPOCH[0],
        _autocast_key() if auto else None, None if plan.grad_enabled else _inference(),
    )  # fmt: skip
    n = plan.n_extra_in
    if n:
        sig += (_extras_key(x, args[:n]),)
    if 1 in consts[0]:
        sig += (_meta(args[n + plan.n_params :]),)
    qparams = rc.qparams
    if qparams is None:
        qparams = rc.qparams = tuple(
            i for i in range(n, n + plan.n_params) if isinstance(args[i], QuantizedTensor)
        )
    ins = args
    if qparams:
        ins, parts = _expanded(args, qparams)
        sig += (_meta(parts),)
    entry = rc.last if sig == rc.last_sig else rc.lookup(sig)
    if type(entry) is Recording:
        held = True
        for b, h, sc in entry.guards:  # _guards_hold, inline
            if b.amax_history is not h or b.scale is not sc:
                held = False
        if not held:
            rc.store(sig, _SEEN)  # a moved or rebuilt state: run Python now, record next time
        else:
            if CONFIG.check:
                return _check_forward(ctx, plan, rc, entry, consts, x, args, ins)
            _STATS["forward.replay"] += 1
            if auto:
                with _no_autocast():
                    outs, saved = _run_forward(entry, x, ins)
            elif entry.run is not None:
                r = entry.run([x, *ins])  # the C++ loop: outputs, then the saved tensors
                outs, saved = tuple(r[: entry.n_all]), r[entry.n_all :]
            else:
                outs, saved = entry.fn(x, ins)
            ctx.save_for_backward(*saved)
            if entry.n_ws:
                ctx.mark_non_differentiable(*outs[entry.n_out :])
            ctx.fusible = (plan, entry.layout, None, True, entry)
            return outs
    elif entry is _SEEN:
        return record_forward(ctx, plan, rc, sig, consts, x, args, ins)
    elif entry is None:
        rc.store(sig, _SEEN)
    _STATS["forward.python"] += 1
    return _PY_FORWARD(ctx, plan, consts, x, args, None)


def backward(ctx: Any, dy: Any, out_grads: tuple[Any, ...]) -> Any:
    """``_PlanFunction.backward`` eagerly when the forward was recorded or replayed: replay
    the backward signature's recording, or run the Python backward (``_PY_BACKWARD``),
    recording it on the signature's second call. Then the delayed-scaling registration of the
    plan's backward states (outside the recorded region: a Python side effect)."""
    plan, _, _, _, frec = ctx.fusible
    if not CONFIG.enabled:
        why: str | None = "disabled"
    elif _grad_enabled():
        why = "grad_mode"
    else:
        why = _blocked(dy)
    if why is None:
        auto = _any_autocast()
        bsig = (
            None if dy is None else dy.stride(),
            tuple([None if g is None else g.stride() for g in out_grads]) if out_grads else (),
            _autocast_key() if auto else None,
        )
        entry = frec.backward.get(bsig)
        held = type(entry) is BackwardRecording
        if held:
            for b, h, sc in entry.guards:  # _guards_hold, inline
                if b.amax_history is not h or b.scale is not sc:
                    held = False
        if held:
            if CONFIG.check:
                grads = _check_backward(ctx, plan, entry, frec, dy, out_grads)
            else:
                _STATS["backward.replay"] += 1
                saved = ctx.saved_tensors
                ctx.maybe_clear_saved_tensors()
                if auto:
                    saved = [*saved]  # the tuple goes: the list is emptied by the replay
                    with _no_autocast():
                        grads = _run_backward(entry, saved, (dy, *out_grads))
                elif entry.start is not None:
                    # The C++ loop in two steps: the saved tensors go to the program (under
                    # the token), and this frame drops them before it runs (each is freed after
                    # its last use).
                    token = entry.start([*saved, dy, *out_grads])
                    del saved
                    grads = tuple(entry.finish(token))
                else:
                    grads = entry.fn([*saved], (dy, *out_grads))
        elif entry is _SEEN or type(entry) is BackwardRecording:
            grads = record_backward(
                frec, plan.replay, bsig, ctx, (dy, *out_grads),
                lambda rec, box: _PY_BACKWARD(ctx, dy, out_grads, frec, rec, box),
            )  # fmt: skip
        else:
            if entry is None:
                if len(frec.backward) >= MAX_SIGNATURES:
                    frec.backward.clear()  # bounded (gradient layouts rarely vary)
                frec.backward[bsig] = _SEEN
            _STATS["backward.python"] += 1
            grads = _PY_BACKWARD(ctx, dy, out_grads, frec, None, None)
    else:
        _STATS["fallback." + why] += 1
        _STATS["backward.python"] += 1
        grads = _PY_BACKWARD(ctx, dy, out_grads, frec, None, None)
    if plan.backward_states:
        _END_BACKWARD(plan.backward_states)
    return grads


# Installed by fuser (it imports this module): the Python executor's forward and backward, and
# the delayed-scaling registration at the end of a backward pass.
_PY_FORWARD: Any = None
_PY_BACKWARD: Any = None
_END_BACKWARD: Any = None


# ---- the check mode -----------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN compares equal to the same NaN)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> str | None:
    """Why ``a`` and ``b`` differ (None: same bits, dtype, shape and strides)."""
    if a is None or b is None:
        return None if a is None and b is None else "one is None"
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return "one is not a tensor"
    if not isinstance(a, torch.Tensor):
        return None
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.stride() != b.stride():
        return f"strides {a.stride()} vs {b.stride()}"
    if a.numel() and not torch.equal(_bits(a), _bits(b)):
        return "values differ"
    return None


def _differing_pair(why: str | None, what: str, pairs: Any) -> str | None:
    """``why`` if set, else the first pair of ``pairs`` that differs (``_same``), as
    ``"<what> <index>: <why>"``; every pair is compared."""
    for k, (a, b) in enumerate(pairs):
        w = _same(a, b)
        if why is None and w is not None:
            why = f"{what} {k}: {w}"
    return why


class _State:
    """Copies of the mutable state a step may change: the recipe-state buffers of the plan and
    the RNG states (so that replay and the Python executor run from the same state)."""

    def __init__(self, holders: list[Any]) -> None:
        self.tensors = [(b, name, getattr(b, name).clone())
                        for b in holders for name in ("amax_history", "scale")]  # fmt: skip
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        for b, name, t in self.tensors:
            getattr(b, name).copy_(t)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def diff(self, other: _State) -> str | None:
        for (b, name, t), (_, _, u) in zip(self.tensors, other.tensors, strict=True):
            why = _same(t, u)
            if why is not None:
                return f"recipe-state buffer {name} of {type(b).__name__}: {why}"
        return None


def _interpret(calls_raw: Any, inputs: list[Any], forward: bool) -> list[tuple[str, list[Any]]]:
    """Run recorded calls one by one (no compiled code), keeping each call's outputs: what the
    check mode compares with the Python executor's trace to name the first differing call."""
    calls = calls_raw[0]
    vals: dict[int, Any] = dict(enumerate(inputs))

    def res(v: Any) -> Any:
        t = type(v)
        if t is _S:
            return vals[v.i]
        if t is _K:
            return v.v
        if t in (list, tuple):
            return t(res(e) for e in v)
        return v

    def bind(o: Any, r: Any) -> None:
        if type(o) is _S:
            vals[o.i] = r
        elif o is not None:
            for oo, rr in zip(o, r, strict=True):
                bind(oo, rr)

    trace = []
    for c in calls:
        r = c.func(*res(c.args), **{k: res(v) for k, v in c.kwargs.items()})
        bind(c.outs, r)
        leaves = [vals[s.i] for s in _walk(c.outs, _S)]
        trace.append((c.name, [t.clone() if t is not None else None for t in leaves]))
    return trace


def _first_difference(plan: Any, names: list[str], py: list[Any], rp: list[Any]) -> str:
    for i, ((pn, po), (rn, ro)) in enumerate(zip(py, rp, strict=False)):
        if pn != rn:
            return f"call {i}: the Python executor called {pn} where the recording has {rn}"
        for k, (a, b) in enumerate(zip(po, ro, strict=False)):
            why = _same(a, b)
            if why is not None:
                return f"call {i} ({pn}) output {k}: {why}"
    if len(py) != len(rp):
        return f"the Python executor made {len(py)} calls, the recording {len(rp)}"
    return "no recorded call differs (the difference is in what the plan returns or saves)"


def _labels(plan: Any) -> str:
    return " -> ".join(type(op).__name__ for op in plan.ops)


def _check_forward(
    ctx: Any, plan: Any, rc: PlanReplay, rec: Recording, consts: Any, x: Any, args: Any,
    ins: Any,
) -> Any:  # fmt: skip
    """Replay, then run the Python executor from the same state (its results are the step's),
    and compare outputs, saved tensors and state bit for bit."""
    _STATS["forward.check"] += 1
    holders = rc.buffers
    before = _State(holders)
    auto = _any_autocast()
    with _no_autocast() if auto else contextlib.nullcontext():
        r_outs, r_saved = _run_forward(rec, x, ins)
    after_r = _State(holders)
    before.restore()
    tr = _Recorder([x, *ins], rc.known_tensors(), trace=True)
    with tr:
        outs = _PY_FORWARD(ctx, plan, consts, x, args, tr)
    after_p = _State(holders)
    tensors = tr.result[0]
    why = None
    names = [n for n, _ in tr.traced]
    if names != rec.names:
        why = "the Python executor called other operators than the recording"
    why = _differing_pair(why, "forward output", zip(outs, r_outs, strict=True))
    if why is None and len(tensors) != len(r_saved):
        why = f"{len(tensors)} saved tensors vs {len(r_saved)}"
    why = _differing_pair(why, "saved tensor", zip(tensors, r_saved, strict=False))
    why = why or after_p.diff(after_r)
    if why is not None:
        before.restore()
        trace = _interpret(rec.calls_raw, [x, *ins], True)
        where = _first_difference(plan, rec.names, tr.traced, trace)
        after_p.restore()
        raise ReplayMismatch(
            f"fusible replay check: plan {plan.id} ({_labels(plan)}), forward: {why}; {where}"
        )
    plan_, layout, held, same, _ = ctx.fusible
    ctx.fusible = (plan_, layout, held, same, rec)
    return outs


def _check_backward(
    ctx: Any, plan: Any, brec: BackwardRecording, frec: Recording, dy: Any, out_grads: Any
) -> Any:
    _STATS["backward.check"] += 1
    rc = plan.replay
    holders = rc.buffers
    before = _State(holders)
    saved = ctx.saved_tensors
    copies = [None if t is None else t.clone() for t in saved]
    grads = tuple(None if g is None else g.clone() for g in (dy, *out_grads))
    auto = _any_autocast()
    with _no_autocast() if auto else contextlib.nullcontext():
        r_grads = _run_backward(brec, list(copies), grads)
    after_r = _State(holders)
    before.restore()
    tr = _Recorder([], rc.known_tensors(), trace=True)
    with tr:
        out = _PY_BACKWARD(ctx, dy, out_grads, frec, None, [saved])
    after_p = _State(holders)
    why = None
    if [n for n, _ in tr.traced] != brec.names:
        why = "the Python executor called other operators than the recording"
    why = _differing_pair(why, "gradient", zip(out, r_grads, strict=True))
    why = why or after_p.diff(after_r)
    if why is not None:
        before.restore()
        inputs = [*(None if t is None else t.clone() for t in copies), *grads]
        trace = _interpret(brec.calls_raw, inputs, False)
        where = _first_difference(plan, brec.names, tr.traced, trace)
        after_p.restore()
        raise ReplayMismatch(
            f"fusible replay check: plan {plan.id} ({_labels(plan)}), backward: {why}; {where}"
        )
    return out
