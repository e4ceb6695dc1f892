"""Gradients summed over a process group as autograd produces them: the sequence-parallel
replicated parameters of the tensor-parallel modules (modules/_tp.py). Here, in the ops layer,
because ``Sequential.forward`` re-hooks the parameter objects FSDP2 puts in place."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ensure_grad_reductions", "reduce_grad_over"]


def reduce_grad_over(op: torch.nn.Module, name: str, group: Any) -> None:
    """Sum the gradient of ``op``'s parameter ``name`` over ``group`` as autograd produces it (a
    tensor hook, so it runs once per backward, before accumulation into ``.grad``: gradient
    accumulation stays right). For parameters applied to a sequence-parallel (split) activation
    while replicated on every rank -- a norm's weight and bias, a row-parallel bias -- whose
    gradient on each rank covers only its tokens. (TransformerEngine leaves this to Megatron-LM;
    here the module does it, so gradients equal the single-process run's.)

    The hook belongs to the parameter object ``op`` holds at each forward: the one built here,
    or the unsharded parameter FSDP2's ``fully_shard`` puts in its place (the containing
    ``Sequential`` checks before each eager forward, :func:`ensure_grad_reductions`), so under
    FSDP2 the gradient FSDP2 reduce-scatters over its mesh is already summed over ``group``."""
    groups: dict[str, Any] = {**getattr(op, "_reduce_grad_over", {}), name: group}
    op.__dict__["_reduce_grad_over"] = groups  # a plain attribute (nn.Module's setattr aside)
    _hook(op._parameters[name], group)


def ensure_grad_reductions(ops: tuple[torch.nn.Module, ...]) -> None:
    """Hook every parameter of ``ops`` registered by :func:`reduce_grad_over` that is not
    hooked yet (a parameter object FSDP2 put in place of the original)."""
    for op in ops:
        groups: dict[str, Any] = op.__dict__["_reduce_grad_over"]
        for name, group in groups.items():
            p = op._parameters.get(name)
            if p is not None and getattr(p, "_fusible_grad_hooked", None) != id(p):
                _hook(p, group)


def _hook(param: torch.Tensor | None, group: Any) -> None:
    if param is None or not param.requires_grad:
        return

    def hook(g: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = g.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    param.register_hook(hook)
    # The mark is the tensor's own id: a copy that kept the attribute (pickle keeps a
    # parameter's __dict__, not its hooks) is hooked again.
    param._fusible_grad_hooked = id(param)  # type: ignore[attr-defined]
