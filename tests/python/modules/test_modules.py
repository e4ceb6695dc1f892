"""Modules (fusible.Linear, LayerNormLinear, LayerNormMLP): FP64 references, equality with the
hand-built ops.Sequential under every recipe, quantizer roles, CustomRecipe routing, errors."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from modules_helpers import E4M3, E5M2, RECIPES, rel_err, tol

import fusible
from fusible import ops
from fusible.quantization import Float8CurrentScalingQuantizer, QuantizerRole

ACTIVATIONS = ["gelu", "relu", "silu", "swiglu", "geglu"]
NORMS = ["LayerNorm", "RMSNorm"]
GLU = {"swiglu", "geglu"}
OP_ACT = {"gelu": ops.GELU, "relu": ops.ReLU, "silu": ops.SiLU, "swiglu": ops.SwiGLU,
          "geglu": ops.GEGLU}  # fmt: skip
OP_NORM = {"LayerNorm": ops.LayerNorm, "RMSNorm": ops.RMSNorm}


def _make(kind, h, f, *, bias=True, norm="LayerNorm", act="gelu", zc=False, dtype=None):
    """The module and its equivalent hand-built ops.Sequential (same op types, same order)."""
    if kind == "linear":
        return (fusible.Linear(h, f, bias=bias, dtype=dtype),
                ops.Sequential(ops.Linear(h, f, bias=bias, dtype=dtype)))  # fmt: skip
    n = OP_NORM[norm](h, zero_centered_gamma=zc, dtype=dtype)
    if kind == "layernorm_linear":
        m = fusible.LayerNormLinear(h, f, bias=bias, normalization=norm, zero_centered_gamma=zc,
                                    dtype=dtype)  # fmt: skip
        return m, ops.Sequential(n, ops.Linear(h, f, bias=bias, dtype=dtype))
    m = fusible.LayerNormMLP(h, f, bias=bias, activation=act, normalization=norm,
                             zero_centered_gamma=zc, dtype=dtype)  # fmt: skip
    f1 = 2 * f if act in GLU else f
    seq = ops.Sequential(n, ops.Linear(h, f1, bias=bias, dtype=dtype), OP_ACT[act](),
                         ops.Linear(f, h, bias=bias, dtype=dtype))  # fmt: skip
    return m, seq


def _randomize(module):
    """Non-trivial norm weights and biases (the defaults are ones / zeros)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if name.endswith("weight") else 0.0))


def _run(model, x, g, rec=None):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = model(x)
    y.backward(g)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(v is not None for v in grads.values()), [n for n, v in grads.items() if v is None]
    return y.detach(), x.grad, grads


# ---- FP64 plain-PyTorch references (no recipe) ---------------------------------------------------


def _ref_norm(x, w, b, eps, kind, zc):
    w = w + 1 if zc else w
    if kind == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _ref_act(x, act):
    if act in GLU:
        a, b = x.chunk(2, -1)
        return (F.silu(a) if act == "swiglu" else F.gelu(a, approximate="tanh")) * b
    return {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "silu": F.silu}[act](x)


def _fp64(p):
    return None if p is None else p.detach().double().requires_grad_(True)


def _check_vs_fp64(module, ref_params, ref_fn, x, dtype, grad_factor=2.0):
    """``module`` vs ``ref_fn(x, *ref_params)`` in FP64; ref_params: module param name -> param."""
    g = torch.randn((*x.shape[:-1], module(x).shape[-1])).to(dtype)
    y, dx, grads = _run(module, x, g)
    xr = x.double().requires_grad_(True)
    rp = {n: _fp64(p) for n, p in ref_params.items()}
    yr = ref_fn(xr, rp)
    yr.backward(g.double())
    assert y.dtype == dtype and dx.dtype == dtype
    assert rel_err(y, yr) < tol(dtype), rel_err(y, yr)
    assert rel_err(dx, xr.grad) < grad_factor * tol(dtype), rel_err(dx, xr.grad)
    assert set(grads) == set(rp)
    for n, p in rp.items():
        assert grads[n].dtype == dtype
        assert rel_err(grads[n], p.grad) < grad_factor * tol(dtype), (n, rel_err(grads[n], p.grad))


FP_DTYPES = [torch.float32, torch.bfloat16]
SHAPE = (3, 7)  # 21 tokens: odd on purpose (no recipe has no alignment rule)


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_vs_fp64(dtype, bias):
    torch.manual_seed(0)
    m, _ = _make("linear", 40, 24, bias=bias, dtype=dtype)
    _randomize(m)
    x = torch.randn(*SHAPE, 40).to(dtype)
    params = {"0.weight": m.weight, **({"1.bias": m.bias} if bias else {})}
    assert (m.bias is None) == (not bias)
    _check_vs_fp64(m, params, lambda x, p: F.linear(x, p["0.weight"], p.get("1.bias")), x, dtype)


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("zc", [False, True])
def test_layernorm_linear_vs_fp64(dtype, bias, norm, zc):
    torch.manual_seed(0)
    m, _ = _make("layernorm_linear", 40, 24, bias=bias, norm=norm, zc=zc, dtype=dtype)
    _randomize(m)
    x = torch.randn(*SHAPE, 40).to(dtype)
    params = {"0.weight": m.layer_norm_weight, "1.weight": m.weight}
    if norm == "LayerNorm":
        params["0.bias"] = m[0].bias
    if bias:
        params["2.bias"] = m.bias
    eps = m[0].eps

    def ref(x, p):
        z = _ref_norm(x, p["0.weight"], p.get("0.bias"), eps, norm, zc)
        return F.linear(z, p["1.weight"], p.get("2.bias"))

    _check_vs_fp64(m, params, ref, x, dtype)


@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_layernorm_mlp_vs_fp64(dtype, bias, norm, act):
    torch.manual_seed(0)
    h, f = 40, 56
    m, _ = _make("layernorm_mlp", h, f, bias=bias, norm=norm, act=act, dtype=dtype)
    _randomize(m)
    assert m.fc1.out_features == (2 * f if act in GLU else f) and m.fc2.in_features == f
    x = torch.randn(*SHAPE, h).to(dtype)
    names = dict(m.named_parameters())
    i2 = m._fc2_index
    eps = m[0].eps
    # ReLU's derivative jumps at 0: a pre-activation within rounding of 0 may take either branch
    # in bf16. The reference takes the branch the module's own pre-activation took, and checks
    # it disagrees with FP64 only there.
    with torch.no_grad():
        pre = ops.Sequential(*list(m)[: m._fc2_index - 1])(x).double()

    def ref(x, p):
        z = _ref_norm(x, p["0.weight"], p.get("0.bias"), eps, norm, False)
        z = F.linear(z, p["1.weight"], p.get("2.bias"))
        if act == "relu":
            flipped = (z > 0) != (pre > 0)
            assert (z.detach()[flipped].abs() < 4 * tol(dtype) * z.detach().abs().max()).all()
            z = z * (pre > 0)
        else:
            z = _ref_act(z, act)
        return F.linear(z, p[f"{i2}.weight"], p.get(f"{i2 + 1}.bias"))

    assert names["1.weight"] is m.fc1.weight and names[f"{i2}.weight"] is m.fc2.weight
    # Three rounded GEMM/activation stages in a row: bf16 errors compound.
    _check_vs_fp64(m, names, ref, x, dtype, grad_factor=4.0)


# ---- under every recipe: the module is exactly the hand-built Sequential -------------------------


def _equal_to_sequential(kind, rec, dtype=torch.float32, **cfg):
    torch.manual_seed(0)
    h, f = 64, 96  # MXFP8: features and tokens multiples of 32
    module, seq = _make(kind, h, f, dtype=dtype, **cfg)
    _randomize(module)
    # The module's state_dict() has TE names; named_parameters() stays positional.
    seq.load_state_dict(dict(module.named_parameters()), strict=True)
    assert [type(op) for op in module] == [type(op) for op in seq]
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # two steps: delayed scaling's second step uses the updated scales
        x = torch.randn(2, 16, h, generator=gen).to(dtype)
        g = torch.randn(2, 16, h if kind == "layernorm_mlp" else f, generator=gen).to(dtype)
        a, b = _run(module, x, g, rec), _run(seq, x, g, rec)
        assert torch.equal(a[0], b[0]), "output"
        assert torch.equal(a[1], b[1]), "input gradient"
        assert a[2].keys() == b[2].keys()
        for n in a[2]:
            assert torch.equal(a[2][n], b[2][n]), n
    # The recipe state evolved identically (delayed scaling: amax histories and scales).
    for op_m, op_s in zip(module, seq, strict=True):
        sm, ss = op_m.get_extra_state(), op_s.get_extra_state()
        assert sm.keys() == ss.keys()
        assert all(torch.equal(sm[k], ss[k]) for k in sm)
        if isinstance(rec, fusible.recipe.DelayedScaling) and isinstance(op_m, ops.BasicLinear):
            assert sm["forward.amax_history"].abs().sum() > 0


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("dtype", FP_DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_sequential(recipe_name, dtype, bias):
    _equal_to_sequential("linear", RECIPES[recipe_name], dtype, bias=bias)


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("norm", NORMS)
def test_layernorm_linear_equals_sequential(recipe_name, bias, norm):
    _equal_to_sequential("layernorm_linear", RECIPES[recipe_name], torch.bfloat16, bias=bias,
                         norm=norm)  # fmt: skip


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("norm", NORMS)
def test_layernorm_mlp_equals_sequential(recipe_name, act, norm):
    # bias on with LayerNorm, off with RMSNorm (both bias settings for every activation/recipe).
    _equal_to_sequential("layernorm_mlp", RECIPES[recipe_name], torch.bfloat16,
                         bias=norm == "LayerNorm", norm=norm, act=act)  # fmt: skip


# ---- quantizer roles ---------------------------------------------------------------------------


def _roles(module):
    """Qualified roles of every op, forward then backward, in op and slot order."""
    return [
        r.qualified for op in module for fwd in (True, False) for r in op.get_quantizer_roles(fwd)
    ]


def _expected(scope, name=None):
    sfx = f":{scope}" + (f":{name}" if name else "")
    return [b + sfx for b in ("input", "weight", "output", "grad_output", "grad_input")]


def _modules_and_roles():
    return {
        "linear": (fusible.Linear(64, 32), _expected("linear")),
        "linear_named": (fusible.Linear(64, 32, name="proj"), _expected("linear", "proj")),
        "layernorm_linear": (fusible.LayerNormLinear(64, 32), _expected("layernorm_linear")),
        "layernorm_linear_named": (
            fusible.LayerNormLinear(64, 96, normalization="RMSNorm", name="qkv"),
            _expected("layernorm_linear", "qkv"),
        ),
        **{
            f"layernorm_mlp_{act}": (
                fusible.LayerNormMLP(64, 96, activation=act),
                _expected("layernorm_mlp", "fc1") + _expected("layernorm_mlp", "fc2"),
            )
            for act in ACTIVATIONS
        },
        "layernorm_mlp_nobias_rms": (
            fusible.LayerNormMLP(64, 96, bias=False, normalization="RMSNorm"),
            _expected("layernorm_mlp", "fc1") + _expected("layernorm_mlp", "fc2"),
        ),
    }


CASES = sorted(_modules_and_roles())


@pytest.mark.parametrize("case", CASES)
def test_roles_emitted(case):
    module, expected = _modules_and_roles()[case]
    assert _roles(module) == expected
    linears = [op for op in module if isinstance(op, ops.BasicLinear)]
    for op in module:
        if not isinstance(op, ops.BasicLinear):
            assert op.get_quantizer_roles(True) == [] and op.get_quantizer_roles(False) == []
    for op in linears:
        fwd, bwd = op.get_quantizer_roles(True), op.get_quantizer_roles(False)
        assert [r.bucket for r in fwd] == ["input", "weight", "output"]
        assert [r.bucket for r in bwd] == ["grad_output", "grad_input"]
        for r in fwd + bwd:
            assert isinstance(r, QuantizerRole)
            assert QuantizerRole.parse(str(r)) == r.with_name(None)
            assert str(r) == f"{r.bucket}:{r.scope}"
    if case.startswith("layernorm_mlp"):
        assert {r.name for op in linears for r in op.get_quantizer_roles(True)} == {"fc1", "fc2"}
        assert module.fc1 is linears[0] and module.fc2 is linears[1]


@pytest.mark.parametrize("case", CASES)
def test_custom_recipe_sees_each_role_once(case):
    module, expected = _modules_and_roles()[case]
    calls = []

    def qfactory(role):
        calls.append(role.qualified)
        if role.name == "fc2":
            return None  # fc2 stays in high precision: routing by meaning, not by index
        return Float8CurrentScalingQuantizer(E5M2 if role.is_gradient else E4M3)

    rec = fusible.recipe.CustomRecipe(qfactory=qfactory)
    out_features = 64 if case.startswith("layernorm_mlp") else module.out_features
    for _ in range(2):
        x = torch.randn(32, 64, requires_grad=True)
        with fusible.autocast(recipe=rec):
            y = module(x)
            text = module.explain()
        assert y.shape == (32, out_features)
        y.sum().backward()
    # Once per slot (forward and backward states), over two steps and an explain().
    assert collections.Counter(calls) == collections.Counter(expected)
    assert len(calls) == len(expected) == len(set(expected))
    for role in expected:
        shown = "high precision" if role.endswith(":fc2") else "Float8CurrentScalingQuantizer"
        assert f"{role}: {shown}" in text


def test_custom_recipe_routes_fc2_to_high_precision():
    """Routing by role name: with fc2 routed to None, the MLP is exactly its first half (norm,
    fc1 quantized, activation) followed by a high-precision second half (fc2), each run alone."""
    torch.manual_seed(0)
    module = fusible.LayerNormMLP(64, 96)
    _randomize(module)
    first = ops.Sequential(*[copy.deepcopy(op) for op in list(module)[: module._fc2_index]])
    second = ops.Sequential(*[copy.deepcopy(op) for op in list(module)[module._fc2_index :]])

    def quantize_fc1_only(role):
        if role.name != "fc1":
            return None
        return Float8CurrentScalingQuantizer(E5M2 if role.is_gradient else E4M3)

    rec = fusible.recipe.CustomRecipe(qfactory=quantize_fc1_only)
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    y, dx, grads = _run(module, x, g, rec)
    xs = x.clone().requires_grad_(True)
    with fusible.autocast(recipe=rec):
        ys = second(first(xs))
    ys.backward(g)
    assert torch.equal(y, ys.detach()) and torch.equal(dx, xs.grad)
    split = {f"{i}.{n}": p.grad for i, op in enumerate([*first, *second])
             for n, p in op.named_parameters()}  # fmt: skip
    assert split.keys() == grads.keys()
    assert all(torch.equal(grads[n], split[n]) for n in grads)
    # fc1 is quantized (the result is not the high-precision one), fc2 is not (closer to it
    # than with every slot quantized).
    ref = _run(module, x, g, None)[0]
    everything = fusible.recipe.CustomRecipe(
        qfactory=lambda r: Float8CurrentScalingQuantizer(E5M2 if r.is_gradient else E4M3)
    )
    allq = _run(module, x, g, everything)[0]
    assert 0 < rel_err(y, ref) < rel_err(allq, ref)


# ---- constructor errors --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["GELU", "gelu_erf", "tanh", ""])
def test_bad_activation(bad):
    with pytest.raises(ValueError, match=r"LayerNormMLP: activation must be one of .*got '"):
        fusible.LayerNormMLP(64, 96, activation=bad)


@pytest.mark.parametrize("cls", [fusible.LayerNormLinear, fusible.LayerNormMLP])
@pytest.mark.parametrize("bad", ["layernorm", "BatchNorm", "rms"])
def test_bad_normalization(cls, bad):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: normalization must be .*{bad!r}"):
        cls(64, 96, normalization=bad)
