"""Gradients summed over a process group as autograd produces them: the sequence-parallel
replicated parameters of the tensor-parallel modules (modules/_tp.py). Here, in the ops layer,
because ``Sequential.forward`` applies it to the parameter objects its ops hold at each call
(FSDP2 puts its own in place), eagerly and traced alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["reduce_grad_over", "with_grad_reductions"]


def reduce_grad_over(op: torch.nn.Module, name: str, group: Any) -> None:
    """Sum the gradient of ``op``'s parameter ``name`` over ``group`` as autograd produces it
    (in the backward graph, before accumulation into ``.grad``: gradient accumulation stays
    right). For parameters applied to a sequence-parallel (split) activation while replicated on
    every rank -- a norm's weight and bias, a row-parallel bias -- whose gradient on each rank
    covers only its tokens. (TransformerEngine leaves this to Megatron-LM; here the module does
    it, so gradients equal the single-process run's.)

    The containing ``Sequential`` passes such a parameter to its ops through an identity whose
    backward all-reduces the gradient (:func:`with_grad_reductions`), at every forward, on the
    parameter object ``op`` holds then: the one built here, or the unsharded parameter FSDP2's
    ``fully_shard`` puts in its place, so under FSDP2 the gradient FSDP2 reduce-scatters over its
    mesh is already summed over ``group``. Being part of the graph, it is traced by
    ``torch.compile`` too (a parameter hook was not, for the parameters FSDP2 puts in place)."""
    keys: dict[str, int] = {**getattr(op, "_reduce_grad_over", {}), name: _group_key(group)}
    op.__dict__["_reduce_grad_over"] = keys  # a plain attribute (nn.Module's setattr aside)


# The groups of reduce_grad_over; the identity takes a group's index, an int (a process group as
# an argument of autograd.Function.apply is a harder case for torch.compile's tracer).
_GROUPS: list[Any] = []


def _group_key(group: Any) -> int:
    for i, g in enumerate(_GROUPS):
        if g is group:
            return i
    _GROUPS.append(group)
    return len(_GROUPS) - 1


class _SumGradOver(torch.autograd.Function):
    """Identity forward (an alias); backward: the gradient summed over group ``key``."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, key: int) -> torch.Tensor:  # type: ignore[override]
        ctx.key = key
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        import torch.distributed as dist

        out = g.contiguous().clone()  # never reduce into a tensor another node may hold
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_GROUPS[ctx.key])
        return out, None


def with_grad_reductions(run: Sequence[torch.nn.Module], params: list[Any]) -> list[Any]:
    """``params`` (the parameters of ``run``'s ops in ``fuser.params_of`` order) with each one
    registered by :func:`reduce_grad_over` that requires grad replaced by an alias whose gradient
    is summed over its group."""
    # No identity test of the lists (torch 2.11's dynamo cannot trace `is` between two lists):
    # a copy is made up front when the run has such an op, else the same list is returned.
    found = False
    for op in run:
        if op.__dict__.get("_reduce_grad_over"):
            found = True
    if not found:
        return params
    out = list(params)
    i = 0
    for op in run:
        keys = op.__dict__.get("_reduce_grad_over")
        for name, p in op._parameters.items():
            if p is None:
                continue
            if keys and name in keys and params[i].requires_grad:
                out[i] = _SumGradOver.apply(params[i], keys[name])
            i += 1
    return out
