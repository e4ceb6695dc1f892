"""fusible.GroupedLinear (issue 15): TransformerEngine's call and naming conventions over the op
``ops.GroupedLinear`` -- ``m(x, m_splits, is_first_microbatch)``, the same numbers and roles as
the op, ``weight0..`` / ``bias0..`` attributes and state_dict keys, meta-device construction,
the weight cache and activation recomputation."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from modules_helpers import RECIPES, rel_err, tol

import fusible
from fusible import ops

E, K, N = 3, 32, 64
SPLITS = [32, 0, 64]  # an empty expert; MXFP8-aligned


def _module(seed=0, **kw):
    torch.manual_seed(seed)
    m = fusible.GroupedLinear(E, K, N, **kw)
    with torch.no_grad():
        for i in range(E):
            if m.use_bias:
                getattr(m, f"bias{i}").normal_()
    return m


def _step(m, rec, splits=SPLITS, fm=None, seed=1, call=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(splits), K, generator=g).requires_grad_(True)
    dy = torch.randn(sum(splits), N, generator=g)
    m.zero_grad(set_to_none=True)
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = call(m, x) if call is not None else m(x, splits, is_first_microbatch=fm)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def _assert_bits(a, b):
    assert len(a) == len(b)
    for i, (s, t) in enumerate(zip(a, b, strict=True)):
        assert (s is None) == (t is None), i
        if s is not None:
            assert torch.equal(s, t), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_vs_fp64(dtype, bias):
    m = _module(bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, K, generator=g).to(dtype)
    dy = torch.randn(96, N, generator=g).to(dtype)
    xx = x.clone().requires_grad_(True)
    y = m(xx, SPLITS)
    y.backward(dy)
    xr = x.double().requires_grad_(True)
    ws = [getattr(m, f"weight{i}").detach().double().requires_grad_(True) for i in range(E)]
    bs = [getattr(m, f"bias{i}").detach().double().requires_grad_(True) for i in range(E) if bias]
    parts, start = [], 0
    for i, s in enumerate(SPLITS):
        parts.append(F.linear(xr[start : start + s], ws[i], bs[i] if bias else None))
        start += s
    yr = torch.cat(parts)
    yr.backward(dy.double())
    assert y.dtype == dtype and rel_err(y, yr) < tol(dtype)
    assert rel_err(xx.grad, xr.grad) < 2 * tol(dtype)
    for i in range(E):
        if SPLITS[i]:
            assert rel_err(getattr(m, f"weight{i}").grad, ws[i].grad) < 2 * tol(dtype)
        else:
            assert torch.count_nonzero(getattr(m, f"weight{i}").grad) == 0


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_module_is_its_op(recipe_name):
    """The module is the op in a Sequential: the same bits as the op run directly, over two
    steps (delayed scaling updates its state in between), with a list, a tuple or a tensor of
    splits."""
    rec = RECIPES[recipe_name]
    m = _module()
    seq = ops.Sequential(copy.deepcopy(m[0]))
    for step in range(2):
        got = _step(m, rec, seed=step)
        want = _step(seq, rec, seed=step, call=lambda s, x: s(x, m_splits=SPLITS))
        _assert_bits(got, want)
    _assert_bits(_step(m, rec, call=lambda s, x: s(x, torch.tensor(SPLITS))),
                 _step(seq, rec, call=lambda s, x: s(x, m_splits=tuple(SPLITS))))  # fmt: skip


def test_roles_are_the_ops():
    m = fusible.GroupedLinear(E, K, N, name="experts")
    for fwd in (True, False):
        roles = m.get_quantizer_roles(fwd)
        assert roles == m[0].get_quantizer_roles(fwd)
        assert {r.scope for r in roles} == {"grouped_linear"}
        assert m.num_quantizers(fwd) == (3 if fwd else 2) * E
    assert [r.qualified for r in m.get_quantizer_roles(True)][:4] == [
        "input:grouped_linear:experts_gemm0", "weight:grouped_linear:experts_gemm0",
        "output:grouped_linear:experts_gemm0", "input:grouped_linear:experts_gemm1",
    ]  # fmt: skip
    plain = fusible.GroupedLinear(2, K, N)
    assert [str(r) for r in plain.get_quantizer_roles(False)] == [
        "grad_output:grouped_linear", "grad_input:grouped_linear"] * 2  # fmt: skip


def test_te_attributes_and_state_dict_names():
    m = _module()
    for i in range(E):
        assert m.weight0 is m[0].weight0 and getattr(m, f"bias{i}") is getattr(m[0], f"bias{i}")
        assert getattr(m, f"weight{i}").shape == (N, K)
    with pytest.raises(AttributeError):
        m.weight3  # noqa: B018
    _step(m, RECIPES["delayed"])
    sd = m.state_dict()
    assert list(sd) == [f"weight{i}" for i in range(E)] + [f"bias{i}" for i in range(E)] + [
        "_extra_state"
    ]
    assert sd["_extra_state"]["forward.scale"].shape == (3 * E,)
    assert sd["_extra_state"]["backward.scale"].shape == (2 * E,)
    nobias = fusible.GroupedLinear(2, K, N, bias=False)
    assert list(nobias.state_dict()) == ["weight0", "weight1", "_extra_state"]
    assert not hasattr(nobias, "bias0")


@pytest.mark.parametrize("spelling", ["te", "positional"])
def test_state_dict_round_trip(spelling):
    src = _module(seed=1)
    _step(src, RECIPES["delayed"])
    _step(src, RECIPES["delayed"], seed=2)
    sd = src.state_dict()
    if spelling == "positional":
        sd = {("0." + k): v for k, v in sd.items()}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    dst = _module(seed=7)
    result = dst.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for (n, p), q in zip(src.named_parameters(), dst.parameters(), strict=True):
        assert torch.equal(p, q), n
    _assert_bits(_step(dst, RECIPES["delayed"], seed=3), _step(src, RECIPES["delayed"], seed=3))


def test_meta_device_then_to_empty_and_reset_parameters():
    ref = _module(seed=3, bias=True)
    torch.manual_seed(3)
    m = fusible.GroupedLinear(E, K, N, device="meta")
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device="cpu")
    torch.manual_seed(3)
    m.reset_parameters()
    for i in range(E):
        assert torch.equal(getattr(m, f"weight{i}"), getattr(ref, f"weight{i}"))
        assert torch.equal(getattr(m, f"bias{i}"), torch.zeros(N))


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "mxfp8"])
def test_is_first_microbatch(recipe_name):
    """True caches every expert's weight, False reuses them bit for bit (gradient
    accumulation over micro-batches), None keeps the cache as it is."""
    rec = RECIPES[recipe_name]
    m = _module()
    m[0].ensure_recipe_state(rec)
    before = copy.deepcopy(m[0].get_extra_state())
    first = _step(m, rec, fm=True)
    cached = [c.workspace for c in m[0].workspace_caches]
    assert all(ws is not None for ws in cached)
    m[0].set_extra_state(copy.deepcopy(before))
    second = _step(m, rec, fm=False)
    _assert_bits(first, second)
    _step(m, rec, fm=None)
    assert [c.workspace for c in m[0].workspace_caches] == cached


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "mxfp8"])
def test_activation_recomputation(recipe_name):
    rec = RECIPES[recipe_name]
    m = _module()
    twin = copy.deepcopy(m)
    got = _step(m, rec, call=lambda s, x: fusible.checkpoint(s, x, SPLITS))
    want = _step(twin, rec)
    _assert_bits(got, want)


def test_bad_input_names_the_module_op():
    m = _module()
    with pytest.raises(ValueError, match=r"GroupedLinear: m_splits must have num_gemms=3"):
        m(torch.randn(96, K), [96])
    with pytest.raises(ValueError, match=r"GroupedLinear: m_splits must sum to .* 96"):
        m(torch.randn(96, K), [1, 2, 3])
    with pytest.raises(ValueError, match=r"m_splits entries must be >= 0"):
        m(torch.randn(96, K), [100, -4, 0])
    with pytest.raises(ValueError, match=r"input feature size 31 does not match in_features 32"):
        m(torch.randn(96, 31), SPLITS)
    with pytest.raises(TypeError, match=r"m_splits is required"):
        m(torch.randn(96, K), None)
