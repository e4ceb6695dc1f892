"""The fuser: turns a run of basic ops into forward and backward plans and runs them.

A plan is a list of units (a basic op, or a fused op covering adjacent basic ops). Everything
that depends only on the plan's key -- op types and order, recipe and the ops' recipe states,
dtypes, devices, parameter shapes, the requires-grad pattern, grad mode, the fusion rules -- is
resolved when the plan is built: the units, each unit's hand-off quantizers, the positions of
parameters and extra inputs and outputs in the flat argument list, every op's requires-grad
flags, the weight-workspace slots, the delayed-scaling states to register. Running a cached plan
is then a loop over prepared units.

Plans are owned by the ``Sequential`` that built them (``Sequential._plans``): a dropped model
frees its plans, its ops and their parameters. One ``torch.autograd.Function`` runs a plan; its
arguments are tensors and plain constants (the plan's integer id; eagerly, where nothing traces
it, the plan object itself), never a module, so ``torch.compile`` traces it. Eagerly its passes
go through the replay executor (ops/replay.py). The id resolves through :data:`_SLOTS`,
attributes of a plain object (``torch.compile`` reads attributes live at trace time, while a dict
would be read as it was when the trace first touched it, and miss plans built later in the same
trace).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fusible.ops import registry
from fusible.ops import replay as _replay
from fusible.ops.op import BasicOperation, FusedOperation, OpContext
from fusible.ops.workspace import (
    WorkspaceCache,
    flatten_workspace,
    unflatten_workspace,
    workspace_len,
    workspace_meta,
)
from fusible.quantization import autocast as _autocast
from fusible.quantization.quantizers import Float8BlockData, Float8Data, MXFP8Data, Quantizer

__all__ = [
    "Plan", "Unit", "build_plan", "call_args", "params_of", "plan_by_id", "release_plans",
    "run_plan",
]  # fmt: skip


@dataclass(frozen=True)
class Unit:
    """One step of a plan: ``ops[start:stop]`` run by ``fused`` (or by the single basic op)."""

    start: int
    stop: int
    fused: FusedOperation | None = None
    rule: str | None = None

    def label(self, ops: Sequence[BasicOperation]) -> str:
        names = " + ".join(type(op).__name__ for op in ops[self.start : self.stop])
        return f"{self.fused.name}[{names}]" if self.fused is not None else names


@dataclass(frozen=True)
class WorkspaceSlot:
    """A quantized weight workspace of an op: the op's index, the weight's position in the flat
    parameter list, the weight quantizer, the workspace's description, and its key among the
    op's workspaces (None: the op's only one; see ``BasicOperation.workspace_specs``)."""

    op_index: int
    param_index: int
    quantizer: Quantizer
    meta: Any
    key: int | None = None


@dataclass
class Plan:
    ops: list[BasicOperation]
    forward_units: list[Unit]
    backward_units: list[Unit]
    # Fusions whose op types matched but whose predicate said no: (plan, ops range, rule, reason).
    rejected: list[tuple[str, int, int, str, str]] = field(default_factory=list)
    recipe: Any = None
    param_counts: list[int] = field(default_factory=list)
    handoff: bool = True  # ops may quantize their output for the next op
    # ---- resolved when built (see build_plan) ----
    id: int = -1
    # Per op: (params_requires_grad, input_requires_grad) as the op's OpContext gets them.
    flags: list[tuple[tuple[bool, ...], bool]] = field(default_factory=list)
    # Per op: what it resolved for these flags (BasicOperation.prepare), its OpContext's ``prep``.
    preps: list[Any] = field(default_factory=list)
    # Templates of the backward's gradient lists (copied per step).
    ctx_args: list[tuple[Any, Any]] = field(default_factory=list)  # (flags, prep) per op
    param_grads_init: tuple[tuple[None, ...], ...] = ()
    extra_in_grads_init: tuple[tuple[None, ...], ...] = ()
    param_bounds: list[tuple[int, int]] = field(default_factory=list)
    extra_in_bounds: list[tuple[int, int]] = field(default_factory=list)
    n_extra_in: int = 0
    n_params: int = 0
    n_extra_out: list[int] = field(default_factory=list)
    n_out: int = 1  # the function's outputs before the new workspaces: y and the extra outputs
    ws_off: tuple[int, ...] = ()  # every workspace slot's mode without the cache (mode 0)
    # (start, stop, fused, next op's input quantizer) per forward unit.
    forward_steps: list[tuple[int, int, FusedOperation | None, Quantizer | None]] = field(
        default_factory=list
    )
    # (start, stop, fused, previous op's grad-output quantizer, needed) per backward unit, in
    # backward order; ``needed``: some op at or before it needs a gradient.
    backward_steps: list[tuple[int, int, FusedOperation | None, Quantizer | None, bool]] = field(
        default_factory=list
    )
    workspace_slots: list[WorkspaceSlot] = field(default_factory=list)
    # Ops reading keyword arguments of Sequential.forward per call (BasicOperation.call_kwargs):
    # (op index, the keywords it reads).
    call_ops: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)
    forward_states: list[Any] = field(default_factory=list)
    backward_states: list[Any] = field(default_factory=list)
    # The forward units' results are checked on the first (eager) run only.
    checked: bool = False
    # Built with grad mode on (then inference mode cannot be on: it turns grad mode off).
    grad_enabled: bool = True
    # The plan's replay recordings (ops/replay.py: a PlanReplay), made at its first eager run.
    replay: Any = None


def _build_units(
    ops: list[BasicOperation], recipe: Any, forward: bool, rejected: list[Any]
) -> list[Unit]:
    units: list[Unit] = []
    i = 0
    candidates = registry.rules(forward)
    while i < len(ops):
        chosen: Unit | None = None
        for rule in candidates:
            window = ops[i : i + len(rule.pattern)]
            if not rule.matches_types(window):
                continue
            reason = rule.check(window, recipe)
            if reason is None:
                fused = rule.factory(list(window))
                if not isinstance(fused, FusedOperation):
                    raise TypeError(
                        f"fusion rule '{rule.name}': its factory must return a FusedOperation, "
                        f"got {type(fused).__name__}"
                    )
                chosen = Unit(i, i + len(window), fused, rule.name)
                break
            if not isinstance(reason, str):
                raise TypeError(
                    f"fusion rule '{rule.name}': its predicate must return None (accept) or a "
                    f"reason string (reject), got {type(reason).__name__}"
                )
            rejected.append(
                ("forward" if forward else "backward", i, i + len(window), rule.name, reason)
            )
        if chosen is None:
            chosen = Unit(i, i + 1)
        units.append(chosen)
        i = chosen.stop
    return units


_IDS = itertools.count()


class _PlanSlots:
    """Plans by id, as attributes ``p<id>`` (see the module docstring)."""


_SLOTS = _PlanSlots()


def plan_by_id(plan_id: int) -> Plan:
    return getattr(_SLOTS, f"p{plan_id}")  # type: ignore[no-any-return]


def release_plans(ids: list[int]) -> None:
    """Forget the plans ``ids`` (their owner was collected)."""
    for i in ids:
        _SLOTS.__dict__.pop(f"p{i}", None)


def build_plan(
    ops: list[BasicOperation],
    recipe: Any,
    *,
    input_requires_grad: bool = True,
    extra_requires_grad: Sequence[bool] | None = None,
    grad_enabled: bool = True,
) -> Plan:
    """The plan of ``ops`` under ``recipe`` (the ops' recipe states must be ``recipe``'s:
    ``ensure_recipe_state``). ``input_requires_grad`` / ``extra_requires_grad`` (one per extra
    input, in order) / ``grad_enabled``: the requires-grad pattern it is built for (parameters':
    read from the ops now)."""
    for op in ops:
        if torch.nn.utils.parametrize.is_parametrized(op):
            # Their parametrized attribute is recomputed on access, but the kernels read the
            # op's registered parameters, which parametrize moved away (an unpacking error
            # deep in an op's forward, before this check).
            names = ", ".join(getattr(op, "parametrizations", {}))
            raise NotImplementedError(
                f"{type(op).__name__}: parametrized parameters ({names}: "
                "torch.nn.utils.parametrize, weight_norm, spectral_norm, ...) are not supported "
                "on fusible ops; remove them "
                "(parametrize.remove_parametrizations) or apply the transformation to the "
                "weight itself"
            )
    rejected: list[Any] = []
    fwd = _build_units(ops, recipe, True, rejected)
    bwd = _build_units(ops, recipe, False, rejected)
    # Each op's parameters as params_of passes them at every step: a parameter tied to two of an
    # op's names (``gl.weight1 = gl.weight0``) twice, where ``parameters()`` would list it once.
    op_params = [params_of((op,)) for op in ops]
    counts = [len(p) for p in op_params]
    plan = Plan(ops, fwd, bwd, rejected, recipe, counts, registry.fusion_enabled())
    plan.id = next(_IDS)
    plan.grad_enabled = grad_enabled
    n_in = [op.num_extra_inputs for op in ops]
    extra_rg = list(extra_requires_grad) if extra_requires_grad is not None else []
    extra_rg += [True] * (sum(n_in) - len(extra_rg))

    def bounds(ns: list[int]) -> list[tuple[int, int]]:
        out, pos = [], 0
        for n in ns:
            out.append((pos, pos + n))
            pos += n
        return out

    plan.param_bounds, plan.extra_in_bounds = bounds(counts), bounds(n_in)
    plan.n_params, plan.n_extra_in = sum(counts), sum(n_in)
    plan.n_extra_out = [op.num_extra_outputs for op in ops]
    plan.n_out = 1 + sum(plan.n_extra_out)
    # An op's input needs a gradient if the plan input does, or an earlier op has trainable
    # parameters or extra inputs; backward stops at the first op where neither holds.
    upstream = input_requires_grad and grad_enabled
    for ps, (a, b) in zip(op_params, plan.extra_in_bounds, strict=True):
        prg = tuple(p.requires_grad and grad_enabled for p in ps)
        plan.flags.append((prg, upstream))
        upstream = upstream or any(prg) or (grad_enabled and any(extra_rg[a:b]))
    plan.preps = [op.prepare(f[0], f[1]) for op, f in zip(ops, plan.flags, strict=True)]
    plan.ctx_args = list(zip(plan.flags, plan.preps, strict=True))
    plan.param_grads_init = tuple((None,) * n for n in counts)
    plan.extra_in_grads_init = tuple((None,) * n for n in n_in)
    h = plan.handoff
    for u in fwd:
        nxt = ops[u.stop].input_quantizer() if h and u.stop < len(ops) else None
        plan.forward_steps.append((u.start, u.stop, u.fused, nxt))
    for u in reversed(bwd):
        prev = ops[u.start - 1].grad_output_quantizer() if h and u.start > 0 else None
        needed = any(f[1] or any(f[0]) for f in plan.flags[u.start : u.stop])
        plan.backward_steps.append((u.start, u.stop, u.fused, prev, needed))
    for i, op in enumerate(ops):
        for key, weight, q in op.workspace_specs():
            k = next(j for j, p in enumerate(op_params[i]) if p is weight)
            slot = WorkspaceSlot(i, plan.param_bounds[i][0] + k, q, workspace_meta(q, weight), key)
            plan.workspace_slots.append(slot)
        if op.call_kwargs:
            plan.call_ops.append((i, tuple(op.call_kwargs)))
    plan.ws_off = (0,) * len(plan.workspace_slots)
    # The states to register for the delayed-scaling update at the end of each pass: those
    # holding delayed-scaling state (registering the others is a no-op, at every step).
    plan.forward_states = [
        s for op in ops if (s := op.recipe_state(True)) is not None and s.delayed_states()
    ]
    plan.backward_states = [
        s for op in ops if (s := op.recipe_state(False)) is not None and s.delayed_states()
    ]
    setattr(_SLOTS, f"p{plan.id}", plan)
    return plan


# ---- running a plan -----------------------------------------------------------------------------


def _check_forward_result(plan: Plan, start: int, stop: int, fused: Any, out: Any) -> None:
    """A unit's forward result is ``(y, extra_outputs)`` with the op's number of extra outputs
    (checked on a plan's first run: a user fused op that returns something else is named)."""
    who = f"fused op '{fused.name}'" if fused is not None else type(plan.ops[start]).__name__
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{who}: forward must return (y, extra_outputs), got {type(out).__name__}")
    y, eo = out
    if not isinstance(y, torch.Tensor) and not hasattr(y, "dequantize"):
        raise TypeError(f"{who}: forward returned y of type {type(y).__name__}, expected a tensor")
    groups = [eo] if fused is None else eo
    if fused is not None and len(groups) != stop - start:
        raise TypeError(
            f"{who}: forward must return one list of extra outputs per basic op "
            f"({stop - start}), got {len(groups)}"
        )
    for k, g in enumerate(groups):
        want = plan.n_extra_out[start + k]
        if len(g) != want:
            raise TypeError(
                f"{who}: {type(plan.ops[start + k]).__name__} must emit {want} extra output(s), "
                f"got {len(g)}"
            )


def _forward_units(
    plan: Plan, ctxs: list[OpContext], x: Any, params: list[Any], extra_in: list[Any]
) -> tuple[Any, list[Any]]:
    ops = plan.ops
    extra_out: list[Any] = [()] * len(ops)
    check = not plan.checked
    for start, stop, fused, nxt in plan.forward_steps:
        if fused is None:
            out: Any = ops[start].op_forward(
                ctxs[start], x, params[start], next_input_quantizer=nxt,
                extra_inputs=extra_in[start],
            )  # fmt: skip
            if check:
                _check_forward_result(plan, start, stop, None, out)
            x, eo1 = out
            if eo1:
                extra_out[start] = eo1
        else:
            out = fused.fuser_forward(
                ctxs[start:stop], x, params[start:stop], next_input_quantizer=nxt,
                extra_inputs=extra_in[start:stop],
            )  # fmt: skip
            if check:
                _check_forward_result(plan, start, stop, fused, out)
            x, eos = out
            for k, eo in enumerate(eos):
                if eo:
                    extra_out[start + k] = eo
    if check and not torch.compiler.is_compiling():
        # Not while tracing: a mutation of the plan there becomes a side effect dynamo replays
        # with the graph, which then captures the traced tensors.
        plan.checked = True
    return x, extra_out


def _backward_units(
    plan: Plan, ctxs: list[OpContext], dy: Any, extra_out_grads: list[Any]
) -> tuple[Any, list[Any], list[Any]]:
    ops = plan.ops
    param_grads: list[Any] = list(plan.param_grads_init)
    extra_in_grads: list[Any] = list(plan.extra_in_grads_init)
    for start, stop, fused, prev, needed in plan.backward_steps:
        if not needed:
            break  # nothing at or before this unit needs a gradient
        if fused is None:
            dy, pg, eg = ops[start].op_backward(
                ctxs[start], dy, prev_grad_quantizer=prev,
                extra_output_grads=extra_out_grads[start],
            )  # fmt: skip
            param_grads[start], extra_in_grads[start] = pg, eg
        else:
            dy, pgs, egs = fused.fuser_backward(
                ctxs[start:stop], dy, prev_grad_quantizer=prev,
                extra_output_grads=extra_out_grads[start:stop],
            )  # fmt: skip
            param_grads[start:stop], extra_in_grads[start:stop] = pgs, egs
        for c in ctxs[start:stop]:
            c.saved = []  # done with: freed now, unless autograd keeps the graph (see backward)
    return dy, param_grads, extra_in_grads


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor default hooks are active (True when torch cannot say)."""
    return _top_hooks is None or _top_hooks(True) is not None


def _dequantize_if_needed(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.dequantize()


# What backward needs crosses the autograd function through save_for_backward (what
# torch.compile and saved-tensor hooks -- activation checkpointing -- expect); the rest of each
# OpContext stays on the function's ctx. The ops' saved lists hold tensors, None and quantized
# containers, packed here without pytree's generic walk; anything else goes through pytree.
_QFIELDS: dict[type, tuple[str, ...]] = {
    cls: cls.TENSORS for cls in (Float8Data, MXFP8Data, Float8BlockData)
}
# The other fields (dtype, shape): read by name (torch.compile cannot trace __dict__ of a frozen
# dataclass on every torch version).
_QCONSTS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls) if f.name not in names)
    for cls, names in _QFIELDS.items()
}


def _pack(saved_lists: list[list[Any]], tensors: list[torch.Tensor], fast: bool) -> list[Any]:
    """The layout of ``saved_lists`` (one spec per op: an int per tensor -- its position in
    ``tensors``, which gets it --, None, a container's spec, a pytree's spec). ``fast``
    (eager): a container's fields are read from its ``__dict__`` (dynamo cannot trace that of a
    frozen dataclass) and its spec is that dict with each tensor field replaced by its
    position. Written without builtin calls per value: they are most of a step's Python."""
    layout: list[Any] = []
    n = 0
    for saved in saved_lists:
        spec: list[Any] = []
        for v in saved:
            t = type(v)
            if v is None:
                spec += (None,)
            elif t is torch.Tensor or t is torch.nn.Parameter:
                spec += (n,)
                tensors += (v,)
                n += 1
            elif t in _QFIELDS:
                if fast:
                    d = v.__dict__.copy()
                    for name in _QFIELDS[t]:
                        f = d[name]
                        if f is not None:
                            d[name] = n
                            tensors += (f,)
                            n += 1
                    spec += ((d, t),)
                    continue
                fields, consts = {}, {}
                for name in _QFIELDS[t]:
                    f = getattr(v, name)
                    if f is not None:
                        fields[name] = n
                        tensors += (f,)
                        n += 1
                for name in _QCONSTS[t]:
                    consts[name] = getattr(v, name)
                spec += ((t, fields, consts),)
            elif isinstance(v, torch.Tensor):
                spec += (n,)
                tensors += (v,)
                n += 1
            else:
                leaves, tree = pytree.tree_flatten(v)
                idx: list[int | None] = []
                leaf_consts: list[Any] = []
                for leaf in leaves:
                    it = isinstance(leaf, torch.Tensor)
                    idx += (n if it else None,)
                    leaf_consts += (None if it else leaf,)
                    if it:
                        tensors += (leaf,)
                        n += 1
                spec += (("tree", tree, leaf_consts, idx),)
        layout += (spec,)
    return layout


def _unpack(layout: list[Any], tensors: Sequence[torch.Tensor], fast: bool) -> list[list[Any]]:
    """The saved lists of :func:`_pack`'s ``layout``. ``fast``: the layout is a fast one and
    nothing could have changed the saved tensors (no saved-tensor hooks at forward time),
    so containers are rebuilt from a validated one's fields without a second validation."""
    out: list[Any] = []
    for spec in layout:
        saved: list[Any] = []
        for s in spec:
            if s is None:
                saved += (None,)
            elif type(s) is int:
                saved += (tensors[s],)
            elif s[0] == "tree":
                _, tree, leaves, idx = s
                pairs = zip(leaves, idx, strict=True)
                vals = [leaf if i is None else tensors[i] for leaf, i in pairs]
                saved += (pytree.tree_unflatten(vals, tree),)
            elif type(s[0]) is dict:  # a fast spec: the container's fields, tensors by position
                d, cls = s
                d = d.copy()
                for name in _QFIELDS[cls]:
                    i = d[name]
                    if i is not None:
                        d[name] = tensors[i]
                if fast:
                    obj = object.__new__(cls)
                    obj.__dict__.update(d)
                    saved += (obj,)
                else:
                    saved += (cls(**d),)
            else:
                cls, fields, attrs = s
                d = dict(attrs)
                for name in _QFIELDS[cls]:
                    d[name] = tensors[fields[name]] if name in fields else None
                saved += (cls(**d),)
        out += (saved,)
    return out


class _PlanFunction(torch.autograd.Function):
    """Runs a plan. Arguments: the plan id and ``(workspace modes, calls)`` -- constants: each
    workspace slot's mode, and the per-call constants of the plan's ``call_ops`` (None when it
    has none; one argument with the modes, as torch pays per argument) --, then tensors: the
    input, the extra inputs, every op's parameters, and the cached weight workspaces given
    (flattened). Outputs: the output, the extra outputs, then the new workspaces
    (flattened, not differentiable). Workspace modes: 0 quantize the weight and keep nothing,
    1 use the workspace given, 2 quantize and return the new workspace.

    Eagerly both passes go through the replay executor (ops/replay.py): a step signature seen
    before replays its recorded kernel calls, anything else runs the Python executor
    (:func:`_forward_python` / :func:`_backward_python`). Traced (torch.compile), always the
    Python executor: the graph is the replay there."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        plan_id: int,
        consts: tuple[tuple[int, ...], tuple[Any, ...] | None],
        x: torch.Tensor,
        *args: torch.Tensor,
    ) -> Any:
        if type(plan_id) is Plan:  # run_plan's eager call hands the plan itself
            return _replay.forward(ctx, plan_id, consts, x, args)
        if not torch.compiler.is_compiling():
            return _replay.forward(ctx, plan_by_id(plan_id), consts, x, args)
        return _forward_python(ctx, plan_by_id(plan_id), consts, x, args, None, True)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, *out_grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        if ctx.fusible[4] is not None:  # the forward was recorded or replayed
            return _replay.backward(ctx, dy, out_grads)
        grads = _backward_python(ctx, dy, out_grads, None, None, None)
        plan = ctx.fusible[0]
        if plan.backward_states:
            _autocast.end_backward_pass_of_plan(plan.backward_states)
        return grads


def _forward_python(
    ctx: Any,
    plan: Plan,
    consts: tuple[tuple[int, ...], tuple[Any, ...] | None],
    x: torch.Tensor,
    args: tuple[Any, ...],
    record: Any,
    compiling: bool = False,
) -> Any:
    """The Python executor's forward of :class:`_PlanFunction`. ``record``: a replay recorder
    running it (ops/replay.py), which gets the saved tensors, their layout, the contexts and the
    number of new workspaces as ``record.result``."""
    ws_modes, calls = consts
    n_extra = plan.n_extra_in
    extra_in = [args[a:b] for a, b in plan.extra_in_bounds]
    params = [args[n_extra + a : n_extra + b] for a, b in plan.param_bounds]
    ctxs = [OpContext(f[0], f[1], None, None, p) for f, p in plan.ctx_args]
    if calls is not None:
        for (i, _), call in zip(plan.call_ops, calls, strict=True):
            ctxs[i].call = call
    pos = n_extra + plan.n_params
    for slot, mode in zip(plan.workspace_slots, ws_modes, strict=True):
        c = ctxs[slot.op_index]
        ws = None
        if mode == 1:
            n = workspace_len(slot.meta)
            ws = unflatten_workspace(list(args[pos : pos + n]), slot.meta)
            pos += n
        if slot.key is None:
            c.workspace, c.cache_weight = ws, mode == 2
            continue
        if not isinstance(c.cache_weight, dict):  # the op's first keyed workspace
            c.workspace, c.cache_weight, c.new_workspace = {}, {}, {}
        if ws is not None:
            c.workspace[slot.key] = ws
        c.cache_weight[slot.key] = mode == 2
    y, extra_out = _forward_units(plan, ctxs, x, params, extra_in)
    if type(y) is not torch.Tensor and not isinstance(y, torch.Tensor):
        y = y.dequantize()
    elif not compiling and y._base is not None:
        # A view (a GEMM's 2-D output reshaped) would make the output a view of an autograd
        # output, which in-place ops (y += residual) reject: an alias that is not a view.
        y = y.detach()
    tensors: list[torch.Tensor] = []
    saved_lists: list[Any] = []
    for c in ctxs:
        saved_lists += (c.saved,)
    layout = _pack(saved_lists, tensors, not compiling)
    del saved_lists
    ctx.save_for_backward(*tensors)
    # Saved-tensor hooks (activation checkpointing, offloading, user hooks) may hand backward
    # other tensors than forward saved: their containers are then rebuilt with validation.
    same = not compiling and not _saved_tensor_hooks_active()
    flat_out: list[Any] = []
    for eo in extra_out:
        flat_out += eo
    new_ws: list[torch.Tensor] = []
    for slot, mode in zip(plan.workspace_slots, ws_modes, strict=True):
        if mode == 2:
            made = ctxs[slot.op_index].new_workspace
            if slot.key is not None:
                made = made[slot.key]
            new_ws.extend(flatten_workspace(made)[0])  # type: ignore[arg-type]
    if new_ws:
        ctx.mark_non_differentiable(*new_ws)
    if compiling:
        ctx.fusible = (plan, layout, [c.attrs for c in ctxs], same, None)
    else:
        # Eagerly backward reuses the forward's contexts (their flags, prep, attrs), with
        # the saved values handed back in place of what forward put there.
        for c in ctxs:
            c.saved, c.workspace, c.new_workspace = [], None, None
        ctx.fusible = (plan, layout, ctxs, same, None)
    if record is not None:
        record.result = (tensors, layout, ctxs, len(new_ws))
    return (y, *flat_out, *new_ws)


def _rows(g: torch.Tensor | None) -> torch.Tensor | None:
    """An incoming gradient as the kernels read it, row by row: contiguous (the expanded
    gradient of a ``sum()`` is not)."""
    return g if g is None or g.is_contiguous() else g.contiguous()


def _backward_python(
    ctx: Any,
    dy: torch.Tensor | None,
    out_grads: tuple[torch.Tensor | None, ...],
    frec: Any,
    record: Any,
    box: list[Any] | None,
) -> tuple[Any, ...]:
    """The Python executor's backward of :class:`_PlanFunction` (without the delayed-scaling
    registration of the plan's backward states: the caller does it). ``frec``: the forward's
    replay recording, whose contexts' attributes stand in for the forward's contexts when the
    forward was replayed (``ctx.fusible`` holds none then). ``record``: a replay recorder
    running this backward; ``box``: a list holding the saved tensors, read from ``ctx`` by the
    caller (popped here: nothing else keeps them)."""
    plan, layout, held, same, _ = ctx.fusible
    compiling = torch.compiler.is_compiling()
    # Containers are rebuilt without validation only when nothing could have changed the
    # saved tensors (no saved-tensor hooks at forward time). ``saved_tensors`` once:
    # checkpointing unpacks each saved tensor once.
    saved_lists = _unpack(
        layout, box.pop() if box is not None else ctx.saved_tensors, same and not compiling
    )
    if not compiling:
        # Autograd's references to the saved tensors go now (unless it keeps the graph:
        # retain_graph / create_graph), as torch's compiled backward does: the units' ctxs
        # then hold the only ones, and each unit's are dropped once it is done
        # (_backward_units), so an activation is freed after the last backward that reads
        # it instead of after the whole plan's backward.
        ctx.maybe_clear_saved_tensors()
    if compiling or held is None:
        # Traced, or eagerly after a replayed forward (frec): contexts made from the
        # forward's attributes.
        attrs = held if compiling else [dict(a) for a in frec.attrs]
        ctxs = [
            OpContext(f[0], f[1], s, a, p)
            for (f, p), s, a in zip(plan.ctx_args, saved_lists, attrs, strict=True)
        ]
        if not compiling and frec.calls is not None:
            for (i, _), call in zip(plan.call_ops, frec.calls, strict=True):
                ctxs[i].call = call
    else:
        ctxs = held
        for c, s in zip(ctxs, saved_lists, strict=True):
            c.saved = s
        del s  # the last list: its op's backward must hold the only reference
    del saved_lists
    eog: list[Any] = []
    pos = 0
    for n in plan.n_extra_out:
        eog += ([_rows(g) for g in out_grads[pos : pos + n]],)
        pos += n
    dy = _rows(dy)
    dx, param_grads, extra_in_grads = _backward_units(plan, ctxs, dy, eog)
    del ctxs
    if dx is not None and ctx.needs_input_grad[2]:
        if type(dx) is not torch.Tensor:
            dx = _dequantize_if_needed(dx)
    else:
        dx = None
    grads: list[Any] = [None, None, dx]
    for eg in extra_in_grads:
        grads += eg
    for pg in param_grads:
        grads += pg
    # The rest: the workspace inputs (not differentiable).
    grads += (None,) * (len(ctx.needs_input_grad) - 3 - plan.n_extra_in - plan.n_params)
    if not compiling and torch.is_grad_enabled():  # create_graph=True: rare, off the hot path
        return tuple(_refuse_double_backward(plan, grads))
    return tuple(grads)


class _DoubleBackwardRefused(torch.autograd.Function):
    """Identity on a gradient; differentiating it raises ``RuntimeError(where)``."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, where: str) -> torch.Tensor:  # type: ignore[override]
        ctx.where = where
        return g.view_as(g)

    @staticmethod
    def backward(ctx: Any, gg: torch.Tensor) -> Any:  # type: ignore[override]
        raise RuntimeError(ctx.where)


def _runs_a_kernel(fn: Any, budget: int = 256) -> bool:
    """Whether the graph below ``fn`` holds a node of a fusible kernel: fusible's operators
    have no derivative, so torch's fallback gave them a ``NotImplemented`` node, which raises
    "derivative for fusible::<op> is not implemented" when reached. A bounded walk that stops at
    leaves and at forward plans (such nodes sit a few levels below the gradient)."""
    todo, seen = [fn], set[Any]()
    while todo and len(seen) < budget:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        name = f.name()
        if name == "torch::autograd::NotImplemented":
            return True
        if name != "torch::autograd::AccumulateGrad" and name != "_PlanFunctionBackward":
            todo += [n for n, _ in f.next_functions]
    return False


def _refuse_double_backward(plan: Plan, grads: list[Any]) -> list[Any]:
    """A backward run with ``create_graph=True``: each gradient whose graph reaches a fusible
    kernel is wrapped so that differentiating it again raises an error that names the plan's
    ops and says what to do, instead of torch's fallback's message about an internal operator.
    Gradients made by torch operators alone (a Linear's without a recipe) stay
    differentiable."""
    ops = " -> ".join(
        type(op).__name__ + (f" {q!r}" if (q := getattr(op, "quantizer_name", None)) else "")
        for op in plan.ops
    )
    where = (
        f"fusible: double backward is not supported through {ops}: a gradient taken with "
        "create_graph=True was differentiated again, and that gradient was computed by fusible "
        "kernels, which have no derivative. Take it without create_graph=True, or compute "
        "this part with torch.nn modules."
    )
    return [
        _DoubleBackwardRefused.apply(g, where)
        if isinstance(g, torch.Tensor) and g.requires_grad and _runs_a_kernel(g.grad_fn)
        else g
        for g in grads
    ]


def _cache(op: BasicOperation, key: int | None) -> WorkspaceCache:
    cache = (
        getattr(op, "workspace_cache", None) if key is None else op.workspace_caches[key]  # type: ignore[index]
    )
    assert isinstance(cache, WorkspaceCache), f"{type(op).__name__} has a workspace but no cache"
    return cache


def call_args(plan: Plan, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The per-call constants of ``plan``'s ``call_ops`` from ``Sequential.forward``'s keyword
    arguments (each op sees the keywords it declares; ``BasicOperation.prepare_call`` checks
    them), or None when the plan has no such op."""
    if not plan.call_ops:
        return None
    ops = plan.ops
    return tuple(
        ops[i].prepare_call({k: kwargs[k] for k in names if k in kwargs})
        for i, names in plan.call_ops
    )


def run_plan(
    plan: Plan,
    x: torch.Tensor,
    extra_inputs: Sequence[torch.Tensor],
    params: list[torch.Tensor],
    is_first_microbatch: bool | None = None,
    cache_params: list[torch.Tensor] | None = None,
    calls: tuple[Any, ...] | None = None,
    eager: bool | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run ``plan`` on ``x`` with the flat parameter list ``params``; weight workspaces are looked
    up before and stored after the autograd function (see ops/workspace.py for the
    ``is_first_microbatch`` semantics), keyed by ``cache_params`` (the parameters themselves,
    when ``params`` are their casts for torch.autocast; default ``params``). ``calls``: the
    per-call constants of the plan's ``call_ops`` (see :func:`call_args`). ``eager``: not
    under torch.compile (None: found out here)."""
    if cache_params is None:
        cache_params = params
    ws_flat: list[torch.Tensor | None] = []
    # (No slots: is_first_microbatch is not read, so torch.compile does not specialize on it.)
    if not plan.workspace_slots or is_first_microbatch is None:
        modes: Any = plan.ws_off  # nothing cached: every slot quantizes and keeps nothing
    else:
        modes = []
        for slot in plan.workspace_slots:
            ws = None
            if not is_first_microbatch:
                op = plan.ops[slot.op_index]
                ws = _cache(op, slot.key).lookup(
                    cache_params[slot.param_index], slot.quantizer,
                    params[slot.param_index].dtype,
                )  # fmt: skip
            if ws is None:
                modes.append(2)  # first micro-batch, or an invalid cache: quantize and cache
            else:
                modes.append(1)
                ws_flat.extend(flatten_workspace(ws)[0])
        modes = tuple(modes)
    if eager is None:
        eager = not torch.compiler.is_compiling()
    if not eager or _functorch_active():
        # Traced: the function by plan id (see the module docstring). With functorch
        # transforms, Function.apply's own path (which refuses a function without
        # setup_context).
        outs = _PlanFunction.apply(plan.id, (modes, calls), x, *extra_inputs, *params, *ws_flat)
    else:
        # Eagerly: the C++ apply with the plan itself (see _PlanFunction.forward), without
        # Function.apply's Python wrapper (its functorch handling: checked above; it also
        # unwraps tensors left wrapped by a finished functorch transform, which cannot reach
        # here from a supported use).
        outs = _apply(plan, (modes, calls), x, *extra_inputs, *params, *ws_flat)
    n_out = plan.n_out
    if 2 in modes:
        new_ws = list(outs[n_out:])
        for slot, mode in zip(plan.workspace_slots, modes, strict=True):
            if mode == 2:
                n = workspace_len(slot.meta)
                ws = unflatten_workspace(new_ws[:n], slot.meta)
                w = cache_params[slot.param_index]
                src = params[slot.param_index].dtype  # the dtype quantized (torch.autocast)
                _cache(plan.ops[slot.op_index], slot.key).store(w, slot.quantizer, ws, src)
                new_ws = new_ws[n:]
    if n_out == 1:
        return outs[0], []
    return outs[0], list(outs[1:n_out])


def distinct_inputs(
    x: torch.Tensor, extra_inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """``extra_inputs`` with each tensor that is also ``x`` or an earlier extra input replaced by
    a view of it: dynamo cannot trace ``autograd.Function.apply`` given one tensor as two inputs
    (``block(x, x)``, a residual add of the block's own input). Gradients are the same: autograd
    sums them into the tensor either way. Called under ``torch.compile`` only (eagerly the
    function takes duplicates as they are)."""
    # Identity tests, not id(): dynamo guards on the ids of the tensors it is given (a
    # recompilation at every step).
    out: list[torch.Tensor] = []
    for i, t in enumerate(extra_inputs):
        dup = t is x or any(t is u for u in extra_inputs[:i])
        out.append(t.view_as(t) if dup else t)
    return tuple(out)


def params_of(ops: Sequence[BasicOperation]) -> list[torch.Tensor]:
    # A loop over the dicts' keys: no call per op (this runs at every step).
    out: list[torch.Tensor] = []
    for op in ops:
        d = op._parameters
        for k in d:
            p = d[k]
            if p is not None:
                out += (p,)
    return out


_functorch_active = torch._C._are_functorch_transforms_active
# The C++ apply of the function (what Function.apply calls after its Python checks).
_apply = super(torch.autograd.Function, _PlanFunction).apply  # type: ignore[misc]

_replay._PY_FORWARD = _forward_python
_replay._PY_BACKWARD = _backward_python
_replay._END_BACKWARD = _autocast.end_backward_pass_of_plan
