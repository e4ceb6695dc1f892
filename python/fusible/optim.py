"""``fusible.optim``: training quantized (FP8) weights through fp32 master weights.

A weight built inside ``fusible.quantized_model_init`` is an ``nn.Parameter`` holding a
``QuantizedTensor``: it cannot be updated in place by a torch optimizer (an FP8 weight would lose
every update smaller than its resolution anyway). :class:`MasterWeightOptimizer` keeps an fp32
master copy of each such parameter on the optimizer side and re-quantizes it into the parameter
after each step; the model itself holds the quantized weights only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fusible.quantization.quantizers import (
    QuantizedData,
    QuantizedTensor,
    qdata_tensors,
    same_layout,
)

__all__ = ["MasterWeightOptimizer"]


class MasterWeightOptimizer(torch.optim.Optimizer):
    """``MasterWeightOptimizer(optimizer_cls, params, **kwargs)``: ``optimizer_cls(groups,
    **kwargs)`` (any ``torch.optim`` optimizer) run over fp32 master weights of the quantized
    parameters in ``params``.

    ``params``: as for a torch optimizer, an iterable of tensors or of param-group dicts. For each
    ``QuantizedTensor`` parameter the wrapper owns an fp32 master (a plain tensor on the
    parameter's device, initialised from its exact dequantization) that takes its place in the
    inner optimizer's groups; plain parameters go to the inner optimizer as they are.

    ``step(closure=None)``: each quantized parameter's ``.grad`` (the plain gradient backward
    accumulated, of its nominal dtype) is cast to fp32 and added to its master's ``.grad`` (set
    when None), and the parameter's ``.grad`` is cleared (None); then the inner optimizer steps
    (masters and plain parameters); then every master that had a gradient is re-quantized into
    its parameter in place (``QuantizedTensor.copy_``: same tensors, new data and scales, so
    references and CUDA-graph addresses stay valid). With a closure, gradients are moved after
    each closure call. A quantized parameter changed outside the optimizer (``load_state_dict``
    of the model, ``reset_parameters``, ``copy_``), so that it is no longer what its master
    quantizes to, re-seeds its master from its exact dequantization at the next ``step``.

    ``zero_grad(set_to_none=True)``: the inner optimizer's (masters, plain parameters) and the
    quantized parameters' gradients. ``param_groups``, ``state`` and ``defaults`` are the inner
    optimizer's (quantized parameters appear there as their masters), so learning-rate
    schedulers work. ``state_dict()`` is ``{"optimizer": inner state dict, "master_weights":
    [fp32 masters, in parameter order]}`` (references, like a torch optimizer's state);
    ``load_state_dict`` restores both, masters in place; the parameters are not written (they
    come from the model's state dict, saved dequantized and re-quantized on load).

    Not supported: ``torch.amp.GradScaler`` (its ``unscale_`` only sees the masters, whose
    gradients are filled in ``step``).
    """

    def __init__(
        self,
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        **kwargs: Any,
    ) -> None:
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "MasterWeightOptimizer: 'params' must be an iterable of tensors or of "
                f"param-group dicts, got {torch.typename(params)}"
            )
        # (quantized parameter, its fp32 master, the parameter's version when they last agreed)
        self._masters: list[tuple[QuantizedTensor, torch.Tensor]] = []
        self._synced: list[int] = []
        groups = [self._group(g) for g in _as_groups(params)]
        self.optimizer = optimizer_cls(groups, **kwargs)
        # Optimizer's hook tables and its step wrapper (what Optimizer.__init__ sets up besides
        # groups and state, which are the inner optimizer's here).
        super().__setstate__({})

    # ---- the inner optimizer's groups, state and defaults ------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def master_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(quantized parameter, fp32 master)`` pairs, in parameter order."""
        return list(self._masters)

    def _group(self, group: dict[str, Any]) -> dict[str, Any]:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        out = []
        for p in params:
            if isinstance(p, QuantizedTensor):
                if any(p is q for q, _ in self._masters):
                    raise ValueError(
                        "MasterWeightOptimizer: a parameter appears in more than one group"
                    )
                master = p.dequantize(torch.float32).requires_grad_(p.requires_grad)
                self._masters.append((p, master))
                self._synced.append(p._version)
                p = master
            out.append(p)
        return {**group, "params": out}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(self._group(param_group))

    # ---- step --------------------------------------------------------------------------------

    def _sync_changed_params(self) -> None:
        """Re-seed the master of every parameter written outside the optimizer since they last
        agreed, unless the parameter is still exactly what its master quantizes to."""
        for i, (p, m) in enumerate(self._masters):
            if p._version == self._synced[i]:
                continue
            q = p.quantizer
            fresh = None if q is None else _requantized(q, m, p.qdata)
            if fresh is None or not _same_bits(fresh, p.qdata):
                m.copy_(p.dequantize(torch.float32))
            self._synced[i] = p._version

    def _move_grads(self) -> None:
        for p, m in self._masters:
            g = p.grad
            if g is None:
                continue
            if m.grad is None:
                m.grad = g.detach().to(torch.float32, copy=True)
            else:
                m.grad.add_(g.detach().to(m.grad.dtype))
            p.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        self._sync_changed_params()
        if closure is None:
            self._move_grads()
            loss = self.optimizer.step()
        else:

            def moved_closure() -> Any:
                with torch.enable_grad():
                    loss = closure()
                self._move_grads()
                return loss

            loss = self.optimizer.step(moved_closure)
        for i, (p, m) in enumerate(self._masters):
            if m.grad is not None:
                p.copy_(m)  # re-quantized in place
                self._synced[i] = p._version
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p, _ in self._masters:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_weights": [m.detach() for _, m in self._masters],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        keys = {"optimizer", "master_weights"}
        if not isinstance(state_dict, Mapping) or set(state_dict) != keys:
            raise ValueError(
                "MasterWeightOptimizer.load_state_dict: expected a dict with keys 'optimizer' and "
                "'master_weights' (what state_dict() returns), got "
                f"{sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict)}"
            )
        masters = list(state_dict["master_weights"])
        if len(masters) != len(self._masters):
            raise ValueError(
                f"MasterWeightOptimizer.load_state_dict: {len(masters)} master weights in the "
                f"state dict, this optimizer has {len(self._masters)}"
            )
        for i, (saved, (_, m)) in enumerate(zip(masters, self._masters, strict=True)):
            if not isinstance(saved, torch.Tensor) or saved.shape != m.shape:
                raise ValueError(
                    f"MasterWeightOptimizer.load_state_dict: master_weights[{i}] must be a tensor "
                    f"of shape {tuple(m.shape)}, got "
                    f"{tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved)}"
                )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for i, (saved, (p, m)) in enumerate(zip(masters, self._masters, strict=True)):
                m.copy_(saved)
                self._synced[i] = p._version


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    groups = list(params)
    if not groups:
        raise ValueError("MasterWeightOptimizer: got an empty parameter list")
    if not isinstance(groups[0], dict):
        return [{"params": groups}]
    return groups


def _requantized(q: Any, master: torch.Tensor, like: QuantizedData) -> QuantizedData:
    return q.quantize(master, rowwise=like.has_rowwise, columnwise=like.has_columnwise)


def _same_bits(a: QuantizedData, b: QuantizedData) -> bool:
    ta, tb = qdata_tensors(a), qdata_tensors(b)
    return same_layout(a, b) and all(
        torch.equal(t.view(torch.uint8), tb[k].view(torch.uint8)) if t.element_size() == 1
        else torch.equal(t, tb[k])
        for k, t in ta.items()
    )  # fmt: skip
