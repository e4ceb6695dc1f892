"""Regressions found by review of the plan executor (issue 11): cached plans and trusted input
signatures must never outlive what they were built or checked for."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fusible
from fusible import ops, recipe

CURRENT = recipe.Float8CurrentScaling()
DELAYED = recipe.DelayedScaling(amax_history_len=4)


def test_strided_residual_after_other_strided_residuals():
    torch.manual_seed(0)
    m = ops.Sequential(ops.Linear(64, 64), ops.AddExtraInput())
    x = torch.randn(4, 8, 64)
    permuted = torch.randn(8, 4, 64).transpose(0, 1)
    rows = torch.randn(4, 8, 128)[..., :64]  # as a matrix: a strided view, not a copy
    with torch.no_grad():
        for r in (permuted, permuted, rows, rows):
            ref = torch.nn.functional.linear(x, m[0].weight, m[1].bias) + r
            torch.testing.assert_close(m(x, r), ref, rtol=1e-5, atol=1e-5)


def test_saved_tensor_hooks_are_never_trusted():
    # A hook that changes saved tensors (here: their dtype) reaches backward's checks on every
    # step, not only on the first.
    torch.manual_seed(0)
    m = ops.Sequential(ops.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(2):
        with fusible.autocast(recipe=CURRENT):
            m(x).sum().backward()

    def pack(t):
        return t.bfloat16() if t.dtype == torch.float32 else t

    for _ in range(2):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with fusible.autocast(recipe=CURRENT):
                y = m(x)
        with pytest.raises(TypeError, match="must have dtype"):
            y.sum().backward()


def test_appended_op_gets_recipe_state():
    m = ops.Sequential(ops.Linear(32, 32))
    with fusible.autocast(recipe=CURRENT):
        m(torch.randn(8, 32))
    m.append(ops.Linear(32, 32))
    with fusible.autocast(recipe=CURRENT):
        m(torch.randn(8, 32))
    assert m[2].get_quantizer(True, "weight") is not None


def test_replaced_child_runs():
    torch.manual_seed(0)
    m = ops.Sequential(ops.Linear(8, 8), ops.GELU())  # BasicLinear, Bias, GELU
    x = torch.randn(4, 8)

    def linear() -> torch.Tensor:
        return torch.nn.functional.linear(x, m[0].weight, m[1].bias)

    with torch.no_grad():
        torch.testing.assert_close(m(x), torch.nn.functional.gelu(linear(), approximate="tanh"))
        setattr(m, "2", ops.ReLU())  # the same run structure, another op
        torch.testing.assert_close(m(x), torch.relu(linear()))


def test_pickled_quantizer_keeps_recording_amax():
    m = ops.Sequential(ops.Linear(16, 16))
    for _ in range(2):
        with fusible.autocast(recipe=DELAYED):
            m(torch.randn(8, 16) * 100).sum().backward()
    m2 = pickle.loads(pickle.dumps(m))
    for _ in range(3):
        with fusible.autocast(recipe=DELAYED):
            m2(torch.randn(8, 16) * 100).sum().backward()
    hist = m2[0].recipe_state(True).amax_history
    assert (hist[1:, 0] > 0).all(), hist


def test_explain_keeps_loaded_state_and_handoff_quantizers():
    a, b = ops.Sequential(ops.LayerNorm(16), ops.Linear(16, 16)), None
    for s in range(3):
        with fusible.autocast(recipe=DELAYED):
            a(torch.randn(8, 16) * (s + 1)).sum().backward()
    b = ops.Sequential(ops.LayerNorm(16), ops.Linear(16, 16))
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["1._extra_state"].keys() == a.state_dict()["1._extra_state"].keys()
    b.explain(recipe=DELAYED)
    b.explain(recipe=recipe.MXFP8BlockScaling())
    with fusible.autocast(recipe=DELAYED):
        b(torch.randn(8, 16))
    assert torch.equal(b[1].recipe_state(True).scale, a[1].recipe_state(True).scale)
    c = ops.Sequential(ops.LayerNorm(16), ops.Linear(16, 16))
    c[1].weight.requires_grad_(False)
    with fusible.autocast(recipe=CURRENT):
        c(torch.randn(8, 16))
    before = c[1].input_quantizer().columnwise
    c.explain(recipe=recipe.MXFP8BlockScaling())
    with fusible.autocast(recipe=CURRENT):
        assert c[1].input_quantizer().columnwise == before


def test_plan_cache_is_bounded_and_per_model():
    m = ops.Sequential(ops.Linear(16, 16))
    other = ops.Sequential(ops.Linear(16, 16))
    x = torch.randn(8, 16)
    other(x)
    for i in range(40):
        with fusible.autocast(recipe=DELAYED if i % 2 else CURRENT):
            m(x)
        other(x)  # other's states never change: its plan stays
    assert len(m._plans) <= 32 and len(other._plans) == 1


def test_backward_only_quantize_keeps_its_history():
    m = ops.Sequential(ops.Linear(16, 16), ops.Quantize(forward=False, backward=True))
    other = ops.Sequential(ops.Linear(16, 16))
    ids = set()
    for i in range(3):
        with fusible.autocast(recipe=DELAYED):
            m(torch.randn(8, 16, requires_grad=True)).sum().backward()
        ids.add(id(m[2].recipe_state(False)))
        with fusible.autocast(enabled=bool(i % 2), recipe=DELAYED):
            other(torch.randn(8, 16))
    assert len(ids) == 1 and len(m._plans) == 1


def test_workspace_is_keyed_by_the_dtype_quantized():
    torch.manual_seed(0)
    m = fusible.Linear(64, 64)
    fresh = copy.deepcopy(m)
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), fusible.autocast(recipe=CURRENT):
        m(x, is_first_microbatch=True)
    with fusible.autocast(recipe=CURRENT):
        got = m(x, is_first_microbatch=False)  # fp32 now: the bf16 workspace must not serve
        want = fresh(x)
    assert torch.equal(got, want)
