"""User fusions: registration (forward, backward, both), precedence over the built-in rules,
predicate rejections in explain(), unregistering, numerics equal to the unfused path, and the
examples/custom_fusion.py script."""

from __future__ import annotations

import copy
import runpy
import sys
from pathlib import Path

import pytest
import torch
from ops_helpers import RECIPES, rel_err

import fusible
from fusible import ops

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "custom_fusion.py"


# ---- user fused ops ----------------------------------------------------------------------------


CALLS: list[str] = []  # "<unit name>.fwd" / ".bwd", appended by the user fused ops when they run


def _hp(x):
    return x if isinstance(x, torch.Tensor) else x.dequantize()


class ScaledGELU(ops.FusedOperation):
    """ConstantScale + GELU: gelu(s * x) forward, s * dgelu backward, through GELU's own kernels."""

    name = "user_scaled_gelu"
    forward = backward = True

    def kernels(self, fwd):
        return ["user: act_fwd(gelu) on s * x"] if fwd else ["user: act_bwd(gelu) * s"]

    def fuser_forward(self, ctxs, x, params, *, next_input_quantizer, extra_inputs):
        CALLS.append(f"{self.name}.fwd")
        scale, gelu = self.ops
        y, _ = gelu.op_forward(
            ctxs[1], _hp(x) * scale.scale, params[1], next_input_quantizer=next_input_quantizer,
            extra_inputs=[],
        )  # fmt: skip
        return y, [[], []]

    def fuser_backward(self, ctxs, dy, *, prev_grad_quantizer, extra_output_grads):
        CALLS.append(f"{self.name}.bwd")
        scale, gelu = self.ops
        dx, _, _ = gelu.op_backward(ctxs[1], dy, prev_grad_quantizer=None, extra_output_grads=[])
        return dx * scale.scale, [[], []], [[], []]


class Chain(ops.FusedOperation):
    """Runs its basic ops one after the other as one unit (any pattern, both plans)."""

    name = "user_chain"
    forward = backward = True

    def fuser_forward(self, ctxs, x, params, *, next_input_quantizer, extra_inputs):
        CALLS.append(f"{self.name}.fwd")
        extra_out = []
        last = len(self.ops) - 1
        for i, op in enumerate(self.ops):
            x, eo = op.op_forward(ctxs[i], x, params[i],
                                  next_input_quantizer=next_input_quantizer if i == last else None,
                                  extra_inputs=extra_inputs[i])  # fmt: skip
            extra_out.append(eo)
        return x, extra_out

    def fuser_backward(self, ctxs, dy, *, prev_grad_quantizer, extra_output_grads):
        CALLS.append(f"{self.name}.bwd")
        n = len(self.ops)
        pgs, egs = [None] * n, [None] * n
        for i in reversed(range(n)):
            dy, pgs[i], egs[i] = self.ops[i].op_backward(
                ctxs[i], dy, prev_grad_quantizer=prev_grad_quantizer if i == 0 else None,
                extra_output_grads=extra_output_grads[i],
            )  # fmt: skip
        return dy, pgs, egs


def _named(cls, name):
    return type(cls.__name__, (cls,), {"name": name})


@pytest.fixture
def register():
    """``register(...)`` = ``ops.register_fusion(...)``; every rule still registered at the end of
    the test is unregistered, so other tests see the built-in rules only."""
    rules = []

    def _register(*args, **kwargs):
        rule = ops.register_fusion(*args, **kwargs)
        rules.append(rule)
        return rule

    try:
        yield _register
    finally:
        for rule in rules:
            try:
                ops.unregister_fusion(rule)
            except ValueError:
                pass  # the test unregistered it itself


# ---- helpers -------------------------------------------------------------------------------------


def _plan(model, rec):
    """(forward units, backward units) as (start, stop, rule name) of the model's single run."""
    opl = list(model)
    for op in opl:
        op.ensure_recipe_state(rec)
    _, plan = model._plan_for(opl, torch.empty(0, requires_grad=True), rec)
    units = lambda us: [(u.start, u.stop, u.rule) for u in us]  # noqa: E731
    return units(plan.forward_units), units(plan.backward_units)


def _explain(model, rec):
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        return model.explain()


def _run(model, x, g, rec, extra=()):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    extra = [e.detach().requires_grad_(True) for e in extra]
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = model(x, *extra)
    y.backward(g)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(v is not None for v in grads.values())
    return y.detach(), x.grad, [e.grad for e in extra], grads


def _steps(model, x, rec, extra=(), steps=2, unfused=False):
    """Results of ``steps`` training steps (delayed scaling updates its state between them), with
    fusions on or under ``fusion_disabled()``; the output gradients are the same for every call."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        g = torch.randn(x.shape, generator=gen).to(x.dtype)
        if unfused:
            with ops.fusion_disabled():
                out.append(_run(model, x, g, rec, extra))
        else:
            out.append(_run(model, x, g, rec, extra))
    return out


def _flat(results):
    flat = []
    for y, dx, dextra, grads in results:
        flat += [("output", y), ("input grad", dx), *(("extra grad", e) for e in dextra)]
        flat += sorted(grads.items())
    return flat


def _assert_same(got, ref, bias_sums=False):
    """Bit for bit; with ``bias_sums``, bias gradients to fp32 rounding: a Bias handed the
    preceding Linear's fusing grad_output quantizer sums dy in the cast kernel's order, the
    unfused one in ATen's (docs/architecture.md, "bias gradients compare to fp32 rounding")."""
    for (name, a), (name_ref, b) in zip(_flat(got), _flat(ref), strict=True):
        assert name == name_ref, name
        if bias_sums and name.endswith("bias"):
            assert a.dtype == b.dtype and rel_err(a, b) < 1e-6, name
        else:
            assert torch.equal(a, b), name


def _assert_close(got, ref, dtype):
    """Within the built-in fusions' tolerance (GEMM epilogues round the bias/GELU step in fp32,
    not in the output dtype)."""
    t = 2e-5 if dtype == torch.float32 else 1e-2
    for (name, a), (_, b) in zip(_flat(got), _flat(ref), strict=True):
        assert rel_err(a, b) < (t if name == "output" else 10 * t), name


def _references(model, x, rec, extra=(), steps=2):
    """(built-in rules only, unfused) results of two deep copies of ``model``; call before
    registering the user rules."""
    builtin = _steps(copy.deepcopy(model), x, rec, extra, steps)
    unfused = _steps(copy.deepcopy(model), x, rec, extra, steps, unfused=True)
    return builtin, unfused


def _scaled_gelu_model(approximate="tanh"):
    torch.manual_seed(0)
    return ops.Sequential(
        ops.LayerNorm(64),
        ops.Linear(64, 96),
        ops.ConstantScale(0.5),
        ops.GELU(approximate=approximate),
        ops.Linear(96, 64),
    )


X = torch.randn(2, 16, 64)  # 32 tokens: MXFP8-compatible


# ---- registration: forward, backward, both -------------------------------------------------------

MODES = {"forward": (True, False), "backward": (False, True), "both": (True, True)}


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_user_fusion_registered(register, mode, recipe_name):
    fwd, bwd = MODES[mode]
    rec = RECIPES[recipe_name]
    model = _scaled_gelu_model()
    before = _plan(model, rec)
    assert all(r != "user_scaled_gelu" for us in before for _, _, r in us)
    builtin, unfused = _references(model, X, rec)
    register((ops.ConstantScale, ops.GELU), ScaledGELU, forward=fwd, backward=bwd)
    fwd_units, bwd_units = _plan(model, rec)
    assert ((3, 5, "user_scaled_gelu") in fwd_units) == fwd
    assert ((3, 5, "user_scaled_gelu") in bwd_units) == bwd
    # The rest of each plan is the built-in one (only the ConstantScale and GELU units changed).
    untouched = lambda us: [u for u in us if u[0] not in (3, 4)]  # noqa: E731
    assert untouched(fwd_units) == untouched(before[0])
    assert untouched(bwd_units) == untouched(before[1])
    text = _explain(model, rec)
    assert ("user: act_fwd(gelu) on s * x" in text) == fwd
    assert ("user: act_bwd(gelu) * s" in text) == bwd
    assert "user_scaled_gelu[ConstantScale + GELU] (rule 'user_scaled_gelu')" in text
    # A fused forward pairs with an unfused backward and vice versa. The user fusion changes no
    # bit; the built-in fusions elsewhere in the plan stay within their tolerance of unfused.
    CALLS.clear()
    got = _steps(model, X, rec)
    assert CALLS == [c for c in ["user_scaled_gelu.fwd", "user_scaled_gelu.bwd"] * 2
                     if (c.endswith("fwd") and fwd) or (c.endswith("bwd") and bwd)]  # fmt: skip
    _assert_same(got, builtin)
    _assert_close(got, unfused, torch.float32)


def test_register_fusion_defaults_and_name(register):
    rule = register((ops.ConstantScale, ops.GELU), ScaledGELU)
    assert rule.name == "user_scaled_gelu" and rule.user
    assert rule.forward and not rule.backward  # forward only by default
    rule2 = register((ops.ConstantScale, ops.GELU), ScaledGELU, name="renamed", backward=True)
    assert rule2.name == "renamed"
    fwd, bwd = _plan(_scaled_gelu_model(), None)
    assert (3, 5, "renamed") in fwd and (3, 5, "renamed") in bwd  # the newest user rule first


def test_register_fusion_rejects_bad_rules():
    with pytest.raises(TypeError, match="pattern must be a non-empty tuple of BasicOperation"):
        ops.register_fusion((torch.nn.Linear,), Chain)
    with pytest.raises(TypeError, match="pattern must be a non-empty tuple"):
        ops.register_fusion((), Chain)
    with pytest.raises(ValueError, match="must apply to forward and/or backward"):
        ops.register_fusion((ops.Bias,), Chain, forward=False, backward=False)


# ---- precedence over the built-in rules ----------------------------------------------------------


def _linear_gelu_model():
    torch.manual_seed(0)
    return ops.Sequential(ops.Linear(64, 96), ops.GELU(), ops.Linear(96, 64))


BUILTIN_FWD = [(0, 3, "linear_bias_activation"), (3, 5, "linear_bias_activation")]


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_user_rule_takes_precedence_over_builtin(register, recipe_name):
    rec = RECIPES[recipe_name]
    model = _linear_gelu_model()
    fwd0, bwd0 = _plan(model, rec)
    assert fwd0 == BUILTIN_FWD
    assert (1, 3, "dact_dbias_quantize") in bwd0
    builtin, unfused = _references(model, X, rec)
    _assert_close(builtin, unfused, torch.float32)
    # _plan above cached the model's built-in plan (the key a training step uses): registering
    # must invalidate it.
    # A shorter user pattern wins at the same position over the longer built-in
    # (BasicLinear, Bias, GELU) rule, and a user backward rule over dact_dbias_quantize.
    register((ops.BasicLinear, ops.Bias), _named(Chain, "user_linear_bias"))
    register((ops.Bias, ops.GELU), _named(Chain, "user_dbias_dgelu"), forward=False, backward=True)
    fwd, bwd = _plan(model, rec)
    assert fwd == [(0, 2, "user_linear_bias"), (2, 3, None), (3, 5, "user_linear_bias")]
    assert (1, 3, "user_dbias_dgelu") in bwd and all(r != "dact_dbias_quantize" for *_, r in bwd)
    text = _explain(model, rec)
    assert "user_linear_bias[BasicLinear + Bias] (rule 'user_linear_bias')" in text
    assert "user_dbias_dgelu[Bias + GELU] (rule 'user_dbias_dgelu')" in text
    assert "linear_bias_activation" not in text and "dact_dbias_quantize" not in text
    CALLS.clear()
    got = _steps(model, X, rec)
    assert CALLS == ["user_linear_bias.fwd", "user_linear_bias.fwd", "user_dbias_dgelu.bwd"] * 2
    # Every unit now runs the basic ops' own code: the unfused numerics, bit for bit (but for
    # fc2's bias gradient, summed beside the hand-off cast).
    _assert_same(got, unfused, bias_sums=recipe_name in ("delayed", "mxfp8", "blockwise"))


def test_unregister_restores_builtin_plan(register):
    model = _linear_gelu_model()
    before = _plan(model, None)
    text_before = _explain(model, None)
    r1 = register((ops.BasicLinear, ops.Bias, ops.GELU), _named(Chain, "user_lbg"))
    r2 = register((ops.Bias, ops.GELU), _named(Chain, "user_bg"), forward=False, backward=True)
    assert _plan(model, None) != before
    ops.unregister_fusion(r1)
    assert _plan(model, None)[0] == before[0]
    assert _plan(model, None)[1] != before[1]
    ops.unregister_fusion(r2)
    assert _plan(model, None) == before
    assert _explain(model, None) == text_before
    with pytest.raises(ValueError, match="'user_bg' is not registered"):
        ops.unregister_fusion(r2)


def test_user_rules_newest_first(register):
    model = _linear_gelu_model()
    register((ops.BasicLinear, ops.Bias), _named(Chain, "older"))
    newer = register((ops.BasicLinear, ops.Bias), _named(Chain, "newer"))
    assert _plan(model, None)[0][0] == (0, 2, "newer")
    ops.unregister_fusion(newer)
    assert _plan(model, None)[0][0] == (0, 2, "older")


# ---- predicates ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "mxfp8"])
def test_predicate_rejection_reason_in_explain(register, recipe_name):
    rec = RECIPES[recipe_name]
    seen = []

    def only_under_current_scaling(window, recipe):
        seen.append(([type(op) for op in window], recipe))
        if isinstance(recipe, fusible.recipe.Float8CurrentScaling):
            return None
        return "needs current scaling"

    register((ops.BasicLinear, ops.Bias, ops.GELU), _named(Chain, "picky"),
             predicate=only_under_current_scaling, backward=True)  # fmt: skip
    model = _linear_gelu_model()
    fwd, _ = _plan(model, rec)
    # Rejected: the built-in rule for the same ops applies instead.
    assert fwd == BUILTIN_FWD
    assert seen and all(r == rec for _, r in seen)
    assert all(t == [ops.BasicLinear, ops.Bias, ops.GELU] for t, _ in seen)
    text = _explain(model, rec)
    assert "fusions not applied:" in text
    assert "forward 'picky' on [BasicLinear + Bias + GELU]: needs current scaling" in text
    assert "backward 'picky' on [BasicLinear + Bias + GELU]: needs current scaling" in text
    # Accepted under the recipe it asks for.
    cur = RECIPES["current"]
    assert _plan(model, cur)[0][0] == (0, 3, "picky")
    assert "'picky' on" not in _explain(model, cur)


def test_predicate_per_window(register):
    """The predicate sees each matching window: it may accept one and reject another."""
    register((ops.ConstantScale, ops.GELU), ScaledGELU, backward=True,
             predicate=lambda w, r: None if w[0].scale > 0 else "negative scale")  # fmt: skip
    torch.manual_seed(0)
    model = ops.Sequential(ops.ConstantScale(2.0), ops.GELU(), ops.ConstantScale(-1.0), ops.GELU())
    fwd, bwd = _plan(model, None)
    assert fwd == bwd == [(0, 2, "user_scaled_gelu"), (2, 3, None), (3, 4, None)]
    text = _explain(model, None)
    assert "forward 'user_scaled_gelu' on [ConstantScale + GELU]: negative scale" in text
    assert "backward 'user_scaled_gelu' on [ConstantScale + GELU]: negative scale" in text
    x = torch.randn(8, 32)
    unfused = _steps(copy.deepcopy(model), x, None, unfused=True)
    CALLS.clear()
    _assert_same(_steps(model, x, None), unfused)
    assert CALLS == ["user_scaled_gelu.fwd", "user_scaled_gelu.bwd"] * 2


# ---- numerics: user fusions on a whole block, every dtype --------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_user_fusions_block_numerics(register, dtype, recipe_name):
    """A residual block whose every unit is a user fusion or a basic op: fused == unfused, bit
    for bit, over two delayed-scaling steps, fp32 and bf16."""
    rec = RECIPES[recipe_name]
    register((ops.ConstantScale, ops.GELU), ScaledGELU, backward=True)
    register((ops.BasicLinear, ops.Bias), _named(Chain, "user_lb"), backward=True)
    register((ops.BasicLinear, ops.Bias, ops.AddExtraInput), _named(Chain, "user_lba"),
             backward=True)  # fmt: skip
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.LayerNorm(64, dtype=dtype),
        ops.Linear(64, 96, dtype=dtype),
        ops.ConstantScale(0.25),
        ops.GELU(),
        ops.Linear(96, 64, dtype=dtype),
        ops.AddExtraInput(),
    )
    fwd, bwd = _plan(model, rec)
    expected = [(0, 1, None), (1, 3, "user_lb"), (3, 5, "user_scaled_gelu"), (5, 8, "user_lba")]
    assert fwd == bwd == expected
    x = X.to(dtype)
    unfused = _steps(copy.deepcopy(model), x, rec, extra=(x,), unfused=True)
    CALLS.clear()
    _assert_same(_steps(model, x, rec, extra=(x,)), unfused)
    per_step = ["user_lb.fwd", "user_scaled_gelu.fwd", "user_lba.fwd"]
    per_step += ["user_lba.bwd", "user_scaled_gelu.bwd", "user_lb.bwd"]
    assert CALLS == per_step * 2


# ---- the example ---------------------------------------------------------------------------------


def test_example_script_runs(capsys, monkeypatch):
    """Runs examples/custom_fusion.py as __main__ in this process (a subprocess would spend its
    time importing torch), with its own command line (no arguments, not pytest's); whatever
    happens, its rule does not outlive the test."""
    from fusible.ops import registry

    monkeypatch.setattr(sys, "argv", [str(EXAMPLE)])
    user_rules = list(registry._USER)
    try:
        try:
            runpy.run_path(str(EXAMPLE), run_name="__main__")
        except SystemExit as e:  # a script may exit explicitly; it must exit 0
            assert e.code in (None, 0), e.code
    finally:
        for rule in [r for r in registry._USER if r not in user_rules]:
            ops.unregister_fusion(rule)
    out = capsys.readouterr().out
    assert "scaled_gelu[ConstantScale + GELU] (rule 'scaled_gelu')" in out
    assert "forward 'scaled_gelu' on [ConstantScale + GELU]: this fusion covers the tanh" in out
    assert "fused == unfused" in out
    assert registry._USER == user_rules  # the example unregistered its rule itself


def test_no_user_rules_leak():
    """Run in any order: no test of this file leaves a user rule registered."""
    from fusible.ops import registry

    assert not [r.name for r in registry._USER]
