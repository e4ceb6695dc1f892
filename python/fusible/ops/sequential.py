"""``Sequential``: an ``nn.Sequential``-like container whose runs of basic ops are fused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fusible.ops import fuser, registry
from fusible.ops.op import OPS_BY_UID, BasicOperation
from fusible.quantization import autocast as _autocast
from fusible.quantization.recipe import recipe_from_key
from fusible.quantization.roles import QuantizerRole

__all__ = ["Sequential"]


@torch._dynamo.assume_constant_result
def _ensure_recipe_states(uids: tuple[int, ...], recipe_key: str | None) -> int:
    """Build (or rebuild, when the recipe changed) the recipe states of the ops ``uids``.

    Under ``torch.compile`` this runs at trace time, outside the graph, like ``plan_key_for``:
    the states' tensors (delayed-scaling ``amax_history`` / ``scale``) are then real tensors the
    graph reads and mutates as inputs. Built inside the traced region they would be graph
    intermediates that dynamo returns as forward outputs to re-materialize the new Python
    objects; the backward states are also written in the backward graph (amax recording and
    the immediate update), so AOTAutograd's partitioner finds forward outputs that depend on
    the backward ("Node ... was invalid, but is output"), and ``id()`` of the quantizers built
    in-trace (the weight-workspace cache key) cannot be reconstructed after the graph.
    The recipe comes as its key (see :class:`fusible.recipe.Recipe`). Returns 0 (a constant).
    """
    recipe = recipe_from_key(recipe_key)
    for uid in uids:
        OPS_BY_UID[uid].ensure_recipe_state(recipe)
    return 0


def _recipe_key(recipe: Any) -> str | None:
    # str(): dynamo may track the attribute as a lazily guarded constant, which it cannot hand
    # to an assume_constant_result function; the call makes a plain constant.
    return None if recipe is None else str(recipe.key)


class Sequential(torch.nn.Module):
    """A chain of ops. Nested ``Sequential``s are flattened; a plain ``nn.Module`` splits fusion.

    ``forward(x, *extra_inputs, is_first_microbatch=None)`` returns ``y``, or
    ``(y, *extra_outputs)`` when the chain holds ``MakeExtraOutput`` ops. Extra inputs are consumed
    by ``AddExtraInput`` ops in order. ``is_first_microbatch`` controls the quantized weight
    workspace cache of Linear ops (see ``fusible.ops.workspace``).
    """

    def __init__(self, *modules: torch.nn.Module) -> None:
        super().__init__()
        for m in self._flatten(modules):
            self.add_module(str(len(self._modules)), m)

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

    def __getitem__(self, i: int) -> torch.nn.Module:
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

    def _runs(self) -> list[list[torch.nn.Module]]:
        """Maximal runs of basic ops; each plain module is a run of its own."""
        runs: list[list[torch.nn.Module]] = []
        for m in self:
            if isinstance(m, BasicOperation) and runs and isinstance(runs[-1][0], BasicOperation):
                runs[-1].append(m)
            else:
                runs.append([m])
        return runs

    def _plan_for(
        self, ops: list[BasicOperation], x: torch.Tensor, recipe: Any
    ) -> tuple[int, fuser.Plan]:
        key = (
            tuple(op.uid for op in ops),
            x.dtype,
            x.device.type,
            x.requires_grad,
            tuple(p.requires_grad for op in ops for p in op.parameters(recurse=False)),
            tuple(op.training for op in ops),
            registry.version(),
        )
        plan_key = fuser.plan_key_for(key, _recipe_key(recipe))
        return plan_key, fuser.get_plan(plan_key)

    # ---- execution -------------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, *extra_inputs: torch.Tensor, is_first_microbatch: bool | None = None
    ) -> Any:
        recipe = _autocast.get_recipe()
        pending = list(extra_inputs)
        extra_outputs: list[torch.Tensor] = []
        for run in self._runs():
            if not isinstance(run[0], BasicOperation):
                x = run[0](x)
                continue
            ops: list[BasicOperation] = run  # type: ignore[assignment]
            n_in = sum(op.num_extra_inputs for op in ops)
            if n_in > len(pending):
                need = sum(op.num_extra_inputs for op in self if isinstance(op, BasicOperation))
                raise ValueError(
                    f"Sequential.forward: the ops need {need} extra input(s) (AddExtraInput), "
                    f"got {len(extra_inputs)}"
                )
            uids = tuple(op.uid for op in ops)
            _ensure_recipe_states(uids, _recipe_key(recipe))
            key, plan = self._plan_for(ops, x, recipe)
            x, outs = fuser.run_plan(key, plan, x, pending[:n_in], is_first_microbatch)
            pending = pending[n_in:]
            extra_outputs.extend(outs)
            states = [op.recipe_state(True) for op in ops]
            if any(s is not None for s in states):
                _autocast.end_forward_pass(states)
        if pending:
            raise ValueError(
                f"Sequential.forward: got {len(extra_inputs)} extra input(s) but the ops consume "
                f"{len(extra_inputs) - len(pending)}"
            )
        return (x, *extra_outputs) if extra_outputs else x

    # ---- introspection ---------------------------------------------------------------------

    def explain(self, dtype: torch.dtype = torch.float32, device: str = "cpu") -> str:
        """The forward and backward plans under the current autocast recipe: units, kernels,
        each quantizer's role and recipe, and fusions that did not apply (with the reason)."""
        recipe = _autocast.get_recipe()
        lines = [f"recipe: {recipe!r}" if recipe is not None else "recipe: none (high precision)"]
        probe = torch.empty(0, dtype=dtype, device=device, requires_grad=True)
        for r, run in enumerate(self._runs()):
            if not isinstance(run[0], BasicOperation):
                lines.append(f"run {r}: plain module {type(run[0]).__name__} (splits fusion)")
                continue
            ops: list[BasicOperation] = run  # type: ignore[assignment]
            for op in ops:
                op.ensure_recipe_state(recipe)
            _, plan = self._plan_for(ops, probe, recipe)
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
                        lines.append(f"    op {i} {type(op).__name__}: {role.qualified}: {what}")
            if not any_q:
                lines.append("    (none)")
            if plan.rejected:
                lines.append("  fusions not applied:")
                for which, a, b, name, reason in plan.rejected:
                    names = " + ".join(type(op).__name__ for op in ops[a:b])
                    lines.append(f"    {which} '{name}' on [{names}]: {reason}")
        return "\n".join(lines)
