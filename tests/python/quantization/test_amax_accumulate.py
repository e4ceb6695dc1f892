"""Delayed scaling records each cast's amax by the cast kernel itself (issue 11): the kernel
max-combines it into the quantizer's history slot (``amax_into``) instead of returning a scratch
amax that Python folds in with ``torch.maximum``. The history must hold the bits the old path
made, and a step must dispatch no ``aten.maximum``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusible
from fusible import _kernels as K
from fusible import recipe

# Per operator: the position of amax_into and of the returned amax.
_INTO = {"quantize_fp8": (5, 3), "norm_fwd": (14, 5), "act_fwd": (10, 5), "act_bwd": (12, 5)}


def _old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels called as before: a returned amax, folded into the slot by torch.maximum."""
    for name, (at, out_at) in _INTO.items():
        real = getattr(K, name)

        def wrapped(
            *args: Any, _real: Any = real, _at: int = at, _out: int = out_at, **kw: Any
        ) -> Any:
            into = args[_at] if len(args) > _at else None
            if into is None:
                return _real(*args, **kw)
            # quantize_fp8's keep_scale (the scale's copy in the amax's place) was a clone.
            keep = kw.pop("keep_scale", False)
            out = _real(*args[:_at], **kw)
            torch.maximum(into, out[_out], out=into)
            fourth = args[1].clone() if keep else out[_out].new_empty(0)
            return (*out[:_out], fourth, *out[_out + 1 :])

        monkeypatch.setattr(K, name, wrapped)


def _histories(m: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for v in m.state_dict().values():
        if isinstance(v, dict):
            out += [t.clone() for k, t in sorted(v.items()) if "amax_history" in k]
    return out


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "Linear":
        return fusible.Linear(64, 96)
    if kind == "LayerNormLinear":
        return fusible.LayerNormLinear(64, 96)
    return fusible.LayerNormMLP(64, 128)


def _train(m: torch.nn.Module, steps: int = 3, micro: int = 2) -> list[torch.Tensor]:
    """Steps of two micro-batches each (gradients accumulate; one amax max over both casts)."""
    rec = recipe.DelayedScaling(amax_history_len=4)
    hist = []
    for step in range(steps):
        for mb in range(micro):
            torch.manual_seed(100 * step + mb)
            x = torch.randn(32, 64) * (1 + 3 * mb)
            with fusible.autocast(recipe=rec):
                y = m(x)
            (y.float() ** 2).sum().backward()
        hist += _histories(m)
    return hist + [p.grad.clone() for p in m.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_history_equals_the_old_maximum_path_bit_for_bit(kind, monkeypatch):
    new = _model(kind)
    old = copy.deepcopy(new)
    got = _train(new)
    _old_path(monkeypatch)
    want = _train(old)
    assert len(got) == len(want) and got
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int32 if a.dtype == torch.float32
                                                          else a.dtype), b.view(torch.int32
                                                          if b.dtype == torch.float32
                                                          else b.dtype))  # fmt: skip
    assert any(h.abs().sum() > 0 for h in got)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_delayed_step_dispatches_no_maximum(kind):
    m = _model(kind)
    rec = recipe.DelayedScaling(amax_history_len=4)
    x = torch.randn(32, 64)
    for _ in range(3):  # past the first (lazy) steps and the replay recording
        with fusible.autocast(recipe=rec):
            m(x).sum().backward()
    mode = _Count()
    with mode, fusible.autocast(recipe=rec):
        m(x).sum().backward()
    casts = [n for n in mode.names if n.startswith("fusible.") and
             any(k in n for k in ("quantize_fp8.", "norm_fwd", "act_fwd", "act_bwd"))]  # fmt: skip
    assert casts, mode.names
    assert not [n for n in mode.names if n.startswith("aten.maximum")], mode.names


def test_amax_into_operator_contract():
    x = torch.randn(8, 16)
    scale = torch.ones(1)
    _, _, _, amax = K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, False)
    slots = torch.tensor([0.0, 0.25, 1e9])
    into = slots[1:2]  # a view at an offset
    out = K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, False, into)
    assert out[3].numel() == 0
    assert slots[1] == torch.maximum(amax, torch.tensor(0.25)) and slots[2] == 1e9
    slots[1] = float("nan")
    K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, False, into)
    assert torch.isnan(slots[1])
    with pytest.raises(ValueError, match="amax_into"):
        K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, False, torch.zeros(2))
    with pytest.raises(ValueError, match="amax_into"):
        K.act_fwd(x, "gelu", x.dtype, "none", torch.float8_e4m3fn, None, True, False, True, 0.0,
                  torch.zeros(1))  # fmt: skip


def test_amax_into_opcheck():
    x = torch.randn(8, 16)
    args = (x, torch.ones(1), torch.float8_e4m3fn, True, True, torch.zeros(1))
    torch.library.opcheck(K.quantize_fp8, args,
                          test_utils=["test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"])  # fmt: skip
    nargs = (x, torch.ones(16), None, 1e-5, "rmsnorm", False, None, "fp8", torch.float8_e4m3fn,
             torch.ones(1), True, False, True, 0.0, torch.zeros(1))  # fmt: skip
    torch.library.opcheck(K.norm_fwd, nargs,
                          test_utils=["test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"])  # fmt: skip
