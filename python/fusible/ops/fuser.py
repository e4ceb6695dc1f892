"""The fuser: turns a run of basic ops into forward and backward plans and runs them.

A plan is a list of units (a basic op, or a fused op covering adjacent basic ops). Plans are
cached per (ops, recipe kind, dtype, device, requires-grad pattern, registry version). One
``torch.autograd.Function`` runs a plan; its arguments are tensors and plain constants (an integer
plan key), never a module, so ``torch.compile`` traces it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fusible.ops import registry
from fusible.ops.op import OPS_BY_UID, BasicOperation, FusedOperation, OpContext
from fusible.ops.workspace import (
    WorkspaceCache,
    flatten_workspace,
    unflatten_workspace,
    workspace_len,
    workspace_meta,
)
from fusible.quantization import autocast as _autocast
from fusible.quantization.recipe import recipe_from_key

__all__ = ["Plan", "Unit", "build_plan", "run_plan"]


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
                chosen = Unit(i, i + len(window), rule.factory(list(window)), rule.name)
                break
            rejected.append(
                ("forward" if forward else "backward", i, i + len(window), rule.name, reason)
            )
        if chosen is None:
            chosen = Unit(i, i + 1)
        units.append(chosen)
        i = chosen.stop
    return units


def build_plan(ops: list[BasicOperation], recipe: Any) -> Plan:
    rejected: list[Any] = []
    fwd = _build_units(ops, recipe, True, rejected)
    bwd = _build_units(ops, recipe, False, rejected)
    counts = [len(list(op.parameters(recurse=False))) for op in ops]
    return Plan(ops, fwd, bwd, rejected, recipe, counts, registry.fusion_enabled())


# ---- running a plan -----------------------------------------------------------------------------

# Plans are looked up by an integer key so the autograd function's arguments stay constants.
_PLANS: dict[int, Plan] = {}
_PLAN_KEYS: dict[Any, int] = {}


@torch._dynamo.assume_constant_result
def plan_key_for(cache_key: tuple[Any, ...], recipe_key: str | None) -> int:
    """The key of the plan for ``cache_key`` (op uids first, then everything else a plan depends
    on) and the recipe with key ``recipe_key`` (:attr:`Recipe.key`), built on first use. Under
    ``torch.compile`` this runs at trace time and its result is a constant of the graph: planning
    is Python bookkeeping, never traced. Only constants (ints, strings, tuples) cross into it."""
    cache_key = (*cache_key, recipe_key)
    key = _PLAN_KEYS.get(cache_key)
    if key is None:
        ops = [OPS_BY_UID[uid] for uid in cache_key[0]]
        key = len(_PLANS)
        _PLANS[key] = build_plan(ops, recipe_from_key(recipe_key))
        _PLAN_KEYS[cache_key] = key
    return key


def get_plan(key: int) -> Plan:
    return _PLANS[key]


def _split(flat: Sequence[Any], counts: Sequence[int]) -> list[list[Any]]:
    out, pos = [], 0
    for c in counts:
        out.append(list(flat[pos : pos + c]))
        pos += c
    return out


def _forward_units(
    plan: Plan,
    ctxs: list[OpContext],
    x: Any,
    params: list[list[torch.Tensor]],
    extra_in: list[list[torch.Tensor]],
) -> tuple[Any, list[list[torch.Tensor]]]:
    ops = plan.ops
    extra_out: list[list[torch.Tensor]] = [[] for _ in ops]
    for u in plan.forward_units:
        nxt = ops[u.stop].input_quantizer() if plan.handoff and u.stop < len(ops) else None
        if u.fused is None:
            x, eo = ops[u.start].op_forward(
                ctxs[u.start], x, params[u.start],
                next_input_quantizer=nxt, extra_inputs=extra_in[u.start],
            )  # fmt: skip
            extra_out[u.start] = eo
        else:
            x, eos = u.fused.fuser_forward(
                ctxs[u.start : u.stop], x, params[u.start : u.stop],
                next_input_quantizer=nxt, extra_inputs=extra_in[u.start : u.stop],
            )  # fmt: skip
            for k, eo in enumerate(eos):
                extra_out[u.start + k] = eo
    return x, extra_out


def _backward_units(
    plan: Plan, ctxs: list[OpContext], dy: Any, extra_out_grads: list[list[torch.Tensor | None]]
) -> tuple[Any, list[list[Any]], list[list[Any]]]:
    ops = plan.ops
    param_grads: list[list[Any]] = [[None] * n for n in plan.param_counts]
    extra_in_grads: list[list[Any]] = [[None] * op.num_extra_inputs for op in ops]
    for u in reversed(plan.backward_units):
        if not any(
            c.input_requires_grad or any(c.params_requires_grad) for c in ctxs[u.start : u.stop]
        ):
            break  # nothing at or before this unit needs a gradient
        prev = ops[u.start - 1].grad_output_quantizer() if plan.handoff and u.start > 0 else None
        if u.fused is None:
            dy, pg, eg = ops[u.start].op_backward(
                ctxs[u.start], dy, prev_grad_quantizer=prev,
                extra_output_grads=extra_out_grads[u.start],
            )  # fmt: skip
            param_grads[u.start], extra_in_grads[u.start] = pg, eg
        else:
            dy, pgs, egs = u.fused.fuser_backward(
                ctxs[u.start : u.stop], dy, prev_grad_quantizer=prev,
                extra_output_grads=extra_out_grads[u.start : u.stop],
            )  # fmt: skip
            for k in range(u.stop - u.start):
                param_grads[u.start + k], extra_in_grads[u.start + k] = pgs[k], egs[k]
    return dy, param_grads, extra_in_grads


def _dequantize_if_needed(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.dequantize()


class _PlanFunction(torch.autograd.Function):
    """Runs a plan. Arguments: the plan key and the workspace descriptions (constants), then
    tensors: the input, the extra inputs, every op's parameters, and the cached weight workspaces
    (flattened). Outputs: the output, the extra outputs, then the new workspaces (flattened, not
    differentiable)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, plan_key: int, ws_meta: tuple[Any, ...], ws_update: tuple[bool, ...],
        x: torch.Tensor, *args: torch.Tensor,
    ) -> Any:  # fmt: skip
        plan = _PLANS[plan_key]
        ops = plan.ops
        n_extra = sum(op.num_extra_inputs for op in ops)
        n_param = sum(plan.param_counts)
        extra_flat, param_flat = args[:n_extra], args[n_extra : n_extra + n_param]
        ws_flat = args[n_extra + n_param :]
        extra_in = _split(extra_flat, [op.num_extra_inputs for op in ops])
        params = _split(param_flat, plan.param_counts)
        ctxs = [OpContext() for _ in ops]
        pos = 0
        for c, meta, upd in zip(ctxs, ws_meta, ws_update, strict=True):
            n = workspace_len(meta)
            c.workspace = unflatten_workspace(list(ws_flat[pos : pos + n]), meta)
            c.cache_weight = upd
            pos += n
        # An op's input needs a gradient if the plan input does, or an earlier op has trainable
        # parameters or extra inputs; backward stops at the first op where neither holds.
        upstream = x.requires_grad
        for c, op_params, op_extra in zip(ctxs, params, extra_in, strict=True):
            c.params_requires_grad = tuple(p.requires_grad for p in op_params)
            c.input_requires_grad = upstream
            upstream = (
                upstream or any(c.params_requires_grad) or any(t.requires_grad for t in op_extra)
            )
        y, extra_out = _forward_units(plan, ctxs, x, params, extra_in)
        y = _dequantize_if_needed(y)
        # Save every tensor the ops kept through save_for_backward (what torch.compile expects);
        # the rest of each OpContext is constants.
        leaves, spec = pytree.tree_flatten([c.saved for c in ctxs])
        is_t = [isinstance(v, torch.Tensor) for v in leaves]
        ctx.save_for_backward(*[v for v, t in zip(leaves, is_t, strict=True) if t])
        ctx.fusible_n_ws = len(ws_flat)
        ctx.fusible = (
            plan_key, spec, is_t, [v for v, t in zip(leaves, is_t, strict=True) if not t],
            [c.attrs for c in ctxs],
            [(c.params_requires_grad, c.input_requires_grad) for c in ctxs],
        )  # fmt: skip
        flat_out = [t for eo in extra_out for t in eo]
        new_ws: list[torch.Tensor] = []
        for c, upd in zip(ctxs, ws_update, strict=True):
            if upd:
                new_ws.extend(flatten_workspace(c.new_workspace)[0])  # type: ignore[arg-type]
        ctx.mark_non_differentiable(*new_ws)
        return (y, *flat_out, *new_ws)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, *out_grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        plan_key, spec, is_t, consts, attrs, flags = ctx.fusible
        plan = _PLANS[plan_key]
        ops = plan.ops
        saved_t = iter(ctx.saved_tensors)
        consts_it = iter(consts)
        leaves = [next(saved_t) if t else next(consts_it) for t in is_t]
        saved_lists = pytree.tree_unflatten(leaves, spec)
        ctxs = [
            OpContext(saved=s, attrs=a, params_requires_grad=f[0], input_requires_grad=f[1])
            for s, a, f in zip(saved_lists, attrs, flags, strict=True)
        ]
        n_extra_out = sum(op.num_extra_outputs for op in ops)
        eog = _split(list(out_grads[:n_extra_out]), [op.num_extra_outputs for op in ops])
        dx, param_grads, extra_in_grads = _backward_units(plan, ctxs, dy, eog)
        states = [op.recipe_state(False) for op in ops]
        if any(s is not None for s in states):
            _autocast.end_backward_pass(states)
        dx = _dequantize_if_needed(dx) if dx is not None and ctx.needs_input_grad[3] else None
        flat_eg = [g for eg in extra_in_grads for g in eg]
        flat_pg = [g for pg in param_grads for g in pg]
        n_ws = ctx.fusible_n_ws
        return (None, None, None, dx, *flat_eg, *flat_pg, *([None] * n_ws))


def _cache(op: BasicOperation) -> WorkspaceCache:
    cache = getattr(op, "workspace_cache", None)
    assert isinstance(cache, WorkspaceCache), f"{type(op).__name__} has a workspace but no cache"
    return cache


def run_plan(
    plan_key: int,
    plan: Plan,
    x: torch.Tensor,
    extra_inputs: list[torch.Tensor],
    is_first_microbatch: bool | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run ``plan`` on ``x``; weight workspaces are looked up before and stored after the
    autograd function (see ops/workspace.py for the ``is_first_microbatch`` semantics)."""
    ops = plan.ops
    params = [p for op in ops for p in op.parameters(recurse=False)]
    metas: list[Any] = []
    updates: list[bool] = []
    ws_flat: list[torch.Tensor | None] = []
    specs = [op.workspace_spec() for op in ops]
    for op, spec in zip(ops, specs, strict=True):
        ws, update = None, False
        if spec is not None and is_first_microbatch is not None:
            weight, q = spec
            ws = None if is_first_microbatch else _cache(op).lookup(weight, q)
            update = ws is None  # first micro-batch, or an invalid cache: quantize and cache
        tensors, meta = flatten_workspace(ws)
        metas.append(meta)
        updates.append(update)
        ws_flat.extend(tensors)
    outs = _PlanFunction.apply(
        plan_key, tuple(metas), tuple(updates), x, *extra_inputs, *params, *ws_flat
    )
    n_out = 1 + sum(op.num_extra_outputs for op in ops)
    new_ws = list(outs[n_out:])
    for op, spec, update in zip(ops, specs, updates, strict=True):
        if update and spec is not None:
            weight, q = spec
            n = workspace_len(workspace_meta(q, weight))
            _cache(op).store(weight, q, unflatten_workspace(new_ws[:n], workspace_meta(q, weight)))
            new_ws = new_ws[n:]
    return outs[0], list(outs[1:n_out])
