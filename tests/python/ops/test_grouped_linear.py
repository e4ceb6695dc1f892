"""ops.GroupedLinear (issue 15): per-expert linears against plain-PyTorch FP64 references (high
precision, and every recipe on pre-quantized inputs), bit-for-bit against one ops.Linear per
expert, empty experts, changing split sizes under one plan, an MoE expert MLP in a Sequential,
per-expert quantizers and weight workspaces, roles, and bad input."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import E4M3, E5M2, RECIPES, CountingOps, prequantized, rel_err, tol
from torch.utils._python_dispatch import TorchDispatchMode

import fusible
from fusible import _kernels as K
from fusible import ops, recipe
from fusible.ops import replay
from fusible.ops.basic import grouped_linear as GL
from fusible.ops.basic.grouped_linear import gemm_index
from fusible.quantization import Float8CurrentScalingQuantizer, QuantizerRole
from fusible.quantization import quantizers as Q

DTYPES = [torch.float32, torch.bfloat16]
FP8_RECIPES = ["blockwise", "current", "custom", "delayed", "mxfp8"]


def _grouped(n, k, out, bias=True, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    op = ops.GroupedLinear(n, k, out, bias, dtype=dtype, **kw)
    if bias:
        with torch.no_grad():
            for b in op.biases():
                b.normal_()
    return op


def _run(model, x, splits, g, rec=None, fm=None):
    """Forward (``m_splits=splits``; None: no such keyword, for ops.Linear) and backward with
    ``g``; returns y, dx, {param: grad}."""
    x = x.detach().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    kw = {} if splits is None else {"m_splits": splits}
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = model(x, is_first_microbatch=fm, **kw)
    y.backward(g.to(y.dtype))
    grads = {n: p.grad for n, p in model.named_parameters()}
    return y.detach(), x.grad, grads


def _reference(op, x, splits, g):
    """Per-expert FP64 linears: y, dx, [dw_i], [db_i]."""
    xr = x.double().requires_grad_(True)
    ws = [w.detach().double().requires_grad_(True) for w in op.weights()]
    bs = [b.detach().double().requires_grad_(True) for b in op.biases()]
    ys, start = [], 0
    for i, m in enumerate(splits):
        ys.append(F.linear(xr[start : start + m], ws[i], bs[i] if bs else None))
        start += m
    y = torch.cat(ys)
    y.backward(g.double())
    return y.detach(), xr.grad, [w.grad for w in ws], [b.grad for b in bs]


def _check(got, want, dtype, splits, factor=2.0):
    y, dx, grads = got
    yr, dxr, dwr, dbr = want
    assert y.shape == yr.shape and dx.shape == dxr.shape
    if y.numel():
        assert rel_err(y, yr) < tol(dtype)
        assert rel_err(dx, dxr) < factor * tol(dtype)
    for i, m in enumerate(splits):
        dw = grads[f"0.weight{i}"]
        assert dw.dtype == dtype and dw.shape == dwr[i].shape
        if m == 0:  # an empty expert: zeros, not None
            assert torch.count_nonzero(dw) == 0
        else:
            assert rel_err(dw, dwr[i]) < factor * tol(dtype), i
        if dbr:
            db = grads[f"0.bias{i}"]
            if m == 0:
                assert db is not None and torch.count_nonzero(db) == 0
            else:
                assert rel_err(db, dbr[i]) < factor * tol(dtype), i


# ---- high precision vs FP64 ---------------------------------------------------------------------

SPLITS = {
    "one_token_each": (1, 1, 1, 1),
    "empty_experts": (0, 5, 0, 2),
    "odd": (31, 1, 0, 3),
    "single_gemm": (7,),
    "all_empty": (0, 0, 0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(SPLITS))
@pytest.mark.parametrize("bias", [False, True])
def test_high_precision_vs_fp64(dtype, case, bias):
    splits = SPLITS[case]
    k, n = 13, 7  # primes
    op = _grouped(len(splits), k, n, bias, dtype)
    x = torch.randn(sum(splits), k).to(dtype)
    g = torch.randn(sum(splits), n).to(dtype)
    got = _run(ops.Sequential(op), x, splits, g)
    _check(got, _reference(op, x, splits, g), dtype, splits)


def test_leading_dimensions_are_flattened():
    op = _grouped(2, 16, 8)
    x = torch.randn(2, 3, 16)
    y = ops.Sequential(op)(x, m_splits=[4, 2])
    x2 = x.reshape(6, 16)
    want = torch.cat([F.linear(x2[:4], op.weight0, op.bias0), F.linear(x2[4:], op.weight1,
                                                                       op.bias1)])  # fmt: skip
    assert y.shape == (2, 3, 8)
    torch.testing.assert_close(y.reshape(6, 8), want)


# ---- every recipe on pre-quantized inputs vs FP64 -----------------------------------------------


def _prequantized_rows(splits, cols, fmt, seed):
    """Each expert's rows pre-quantized on their own (every recipe quantizes each slice
    exactly: its per-tensor amax is the format's max, each 32-block has an emax value)."""
    parts = [prequantized((m, cols), fmt, seed=seed + i) for i, m in enumerate(splits) if m]
    return torch.cat(parts) if parts else torch.zeros(0, cols)


# MXFP8 needs every split divisible by 32 (the odd splits' error: test_bad_input).
RECIPE_SPLITS = [(r, (32, 0, 64)) for r in FP8_RECIPES] + [
    (r, (1, 0, 7, 33)) for r in FP8_RECIPES if r not in ("mxfp8", "blockwise")
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("recipe_name, splits", RECIPE_SPLITS)
def test_recipes_prequantized(recipe_name, dtype, splits):
    """FP8 GEMMs per expert on inputs every recipe quantizes exactly equal FP64 GEMMs up to
    fp32 accumulation and the output rounding (weights, inputs and gradients pre-quantized per
    expert; the bias is added after the GEMM, as in fp64)."""
    rec = RECIPES[recipe_name]
    k, n = 64, 32
    op = _grouped(len(splits), k, n, True, dtype)
    with torch.no_grad():
        for i, w in enumerate(op.weights()):
            w.copy_(prequantized((n, k), seed=10 + i))
    model = ops.Sequential(op)
    x = _prequantized_rows(splits, k, E4M3, 20).to(dtype)
    g = _prequantized_rows(splits, n, E4M3 if recipe_name in ("mxfp8", "blockwise") else E5M2, 30)
    if recipe_name == "delayed":
        _run(model, x, splits, g, rec)  # the first step's amaxes set the scales used next
    got = _run(model, x, splits, g, rec)
    _check(got, _reference(op, x, splits, g), dtype, splits)


# ---- bit for bit: one ops.Linear per expert --------------------------------------------------


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_equals_one_linear_per_expert(recipe_name, dtype, bias):
    """The op runs each expert as ops.Linear runs its slice (same quantizers, kernels, GEMM
    epilogue): outputs, input and parameter gradients and recipe state agree bit for bit, over
    two steps (delayed scaling: the second uses the updated scales); bias gradients where the
    Linear sums them beside its grad_output cast to fp32 rounding."""
    rec = RECIPES[recipe_name]
    splits, k, n = (32, 64, 32), 64, 96
    op = _grouped(3, k, n, bias, dtype)
    grouped = ops.Sequential(op)
    linears = []
    for i in range(3):
        lin = ops.Linear(k, n, bias=bias, dtype=dtype)
        with torch.no_grad():
            lin[0].weight.copy_(op.weights()[i])
            if bias:
                lin[1].bias.copy_(op.biases()[i])
        linears.append(lin)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(sum(splits), k, generator=gen).to(dtype)
        g = torch.randn(sum(splits), n, generator=gen).to(dtype)
        y, dx, grads = _run(grouped, x, splits, g, rec)
        start = 0
        for i, (m, lin) in enumerate(zip(splits, linears, strict=True)):
            rows = slice(start, start + m)
            yi, dxi, gi = _run(lin, x[rows], None, g[rows], rec)
            assert torch.equal(y[rows], yi), (step, i)
            assert torch.equal(dx[rows], dxi), (step, i)
            assert torch.equal(grads[f"0.weight{i}"], gi["0.weight"]), (step, i)
            if bias and recipe_name in ("delayed", "mxfp8", "blockwise"):
                # The Linear's Bias sums dy beside its fusing grad_output cast, in the kernel's
                # order: equal to fp32 rounding (docs/architecture.md).
                t = 1e-6 if dtype == torch.float32 else 4e-3
                assert rel_err(grads[f"0.bias{i}"], gi["1.bias"]) < t, (step, i)
            elif bias:
                assert torch.equal(grads[f"0.bias{i}"], gi["1.bias"]), (step, i)
            if recipe_name == "delayed":
                mine = op.get_extra_state()
                theirs = lin[0].get_extra_state()
                for key in ("forward.scale", "backward.scale"):
                    per = 3 if key.startswith("forward") else 2
                    assert torch.equal(mine[key][i * per : (i + 1) * per], theirs[key]), key
            start += m


# ---- per-expert quantizers and scales -----------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_each_expert_scales_its_own_tensors(recipe_name):
    """Experts whose inputs differ by 2^20 in magnitude: one shared per-tensor scale would
    flush the small expert to zero; with a scale per expert each is accurate."""
    rec = RECIPES[recipe_name]
    splits, k, n = (16, 16, 16), 32, 32
    op = _grouped(3, k, n, bias=False)
    model = ops.Sequential(op)
    mags = (2.0**-10, 1.0, 2.0**10)
    x = torch.cat([torch.randn(m, k) * s for m, s in zip(splits, mags, strict=True)])
    g = torch.cat([torch.randn(m, n) * s for m, s in zip(splits, mags, strict=True)])
    for _ in range(2 if recipe_name == "delayed" else 1):
        y, dx, grads = _run(model, x, splits, g, rec)
    yr, dxr, dwr, _ = _reference(op, x, splits, g)
    start = 0
    for i, m in enumerate(splits):
        rows = slice(start, start + m)
        assert rel_err(y[rows], yr[rows]) < 0.1, i
        assert rel_err(dx[rows], dxr[rows]) < 0.1, i
        assert rel_err(grads[f"0.weight{i}"], dwr[i]) < 0.1, i
        start += m
    if recipe_name == "delayed":
        state = op.recipe_state(True)
        amax_in = state.amax_history[:, 0::3].max(0).values  # the input slot of each GEMM
        assert amax_in[0] < 1e-1 < amax_in[1] < 1e2 < amax_in[2]
        assert len(set(state.scale[0::3].tolist())) == 3


def test_custom_recipe_routes_by_expert():
    """A factory sees one role per slot, with the GEMM index in the role's name: expert 1 in
    high precision (its results equal the unquantized op's bit for bit), the others FP8."""
    seen = []

    def factory(role):
        seen.append(role)
        if gemm_index(role) == 1:
            return None
        return Float8CurrentScalingQuantizer(E5M2 if role.is_gradient else E4M3)

    rec = recipe.CustomRecipe(qfactory=factory)
    splits = (8, 8, 8)
    op = _grouped(3, 32, 16)
    model = ops.Sequential(op)
    x, g = torch.randn(24, 32), torch.randn(24, 16)
    y, dx, grads = _run(model, x, splits, g, rec)
    y0, dx0, grads0 = _run(model, x, splits, g, None)
    assert [r.qualified for r in seen] == [
        str(r.qualified) for r in op.get_quantizer_roles(True) + op.get_quantizer_roles(False)
    ]
    assert torch.equal(y[8:16], y0[8:16]) and torch.equal(dx[8:16], dx0[8:16])
    assert torch.equal(grads["0.weight1"], grads0["0.weight1"])
    assert not torch.equal(y[:8], y0[:8]) and not torch.equal(grads["0.weight0"],
                                                              grads0["0.weight0"])  # fmt: skip


def test_gemm_index():
    assert gemm_index(QuantizerRole("input", "grouped_linear", "gemm12")) == 12
    assert gemm_index(QuantizerRole("input", "grouped_linear", "fc1_gemm3")) == 3
    assert gemm_index(QuantizerRole("input", "linear")) is None
    assert gemm_index(QuantizerRole("input", "linear", "fc1")) is None
    assert gemm_index(QuantizerRole("input", "linear", "xgemm1")) is None


# ---- split sizes: one plan, any split, backward uses its forward's -------------------------


@pytest.mark.parametrize("recipe_name", ["none", "current", "delayed"])
def test_changing_splits_share_one_plan(recipe_name):
    rec = RECIPES[recipe_name]
    op = _grouped(3, 16, 8)
    model = ops.Sequential(op)
    gen = torch.Generator().manual_seed(3)
    cases = [(4, 0, 6), (0, 10, 0), (1, 2, 7), (10, 0, 0)]
    pending = []
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        for splits in cases:  # forwards first, backwards later and in reverse order
            x = torch.randn(10, 16, generator=gen).requires_grad_(True)
            pending.append((splits, x, model(x, m_splits=list(splits))))
    assert len(model._plans) == 1
    for splits, x, y in reversed(pending):
        op.zero_grad(set_to_none=True)
        g = torch.randn(10, 8, generator=gen)
        y.backward(g)
        yr, dxr, dwr, dbr = _reference(op, x.detach(), splits, g)
        # FP8: a few percent (delayed scaling's first scales are 1: E5M2 gradients lose more);
        # the wrong split would be ~100%.
        t = 1e-5 if rec is None else 0.25
        assert rel_err(y.detach(), yr) < t and rel_err(x.grad, dxr) < t
        for i, m in enumerate(splits):
            if m:
                assert rel_err(op.weights()[i].grad, dwr[i]) < t
                assert rel_err(op.biases()[i].grad, dbr[i]) < t
            else:
                assert torch.count_nonzero(op.weights()[i].grad) == 0


def test_splits_as_tensor_and_tuple():
    op = _grouped(3, 16, 8)
    model = ops.Sequential(op)
    x = torch.randn(9, 16)
    want = model(x, m_splits=[2, 3, 4])
    assert torch.equal(model(x, m_splits=(2, 3, 4)), want)
    assert torch.equal(model(x, m_splits=torch.tensor([2, 3, 4])), want)
    assert torch.equal(model(x, m_splits=torch.tensor([2, 3, 4], dtype=torch.int32)), want)


# ---- an MoE expert MLP in a Sequential -----------------------------------------------------


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_moe_expert_mlp(recipe_name):
    """GroupedLinear -> GELU -> GroupedLinear with one m_splits for both: per-expert MLPs."""
    rec = RECIPES[recipe_name]
    e, h, f = 4, 32, 64
    splits = (32, 0, 64, 32)
    torch.manual_seed(0)
    fc1, fc2 = ops.GroupedLinear(e, h, f, name="fc1"), ops.GroupedLinear(e, f, h, name="fc2")
    model = ops.Sequential(fc1, ops.GELU(), fc2)
    x = torch.randn(sum(splits), h)
    g = torch.randn(sum(splits), h)
    _run(model, x, splits, g, rec)  # delayed scaling: scales from the first step
    y, dx, grads = _run(model, x, splits, g, rec)
    xr = x.double().requires_grad_(True)
    p = {n: t.detach().double().requires_grad_(True) for n, t in model.named_parameters()}
    ys, start = [], 0
    for i, m in enumerate(splits):
        hid = F.gelu(F.linear(xr[start : start + m], p[f"0.weight{i}"], p[f"0.bias{i}"]),
                     approximate="tanh")  # fmt: skip
        ys.append(F.linear(hid, p[f"2.weight{i}"], p[f"2.bias{i}"]))
        start += m
    yr = torch.cat(ys)
    yr.backward(g.double())
    t = 1e-5 if rec is None else 0.1  # FP8 of random values: a few percent
    assert rel_err(y, yr) < t and rel_err(dx, xr.grad) < t
    for name, ref in p.items():
        if name.endswith(("weight1", "bias1")):  # the empty expert
            assert torch.count_nonzero(grads[name]) == 0, name
        else:
            assert rel_err(grads[name], ref.grad) < t, name
    _, plan = model._plan_for(list(model), x.requires_grad_(True), rec)
    # fc1 + GELU: grouped GEMMs with the GELU epilogue; backward, GELU's kernel casts for fc1.
    assert [u.rule for u in plan.forward_units] == ["grouped_linear_activation", None]
    assert [u.rule for u in plan.backward_units] == ["dact_grouped_linear", None]
    roles = [r.qualified for r in model.get_quantizer_roles(True)]
    assert roles[:3] == ["input:grouped_linear:fc1_gemm0", "weight:grouped_linear:fc1_gemm0",
                         "output:grouped_linear:fc1_gemm0"]  # fmt: skip
    assert roles[12] == "input:grouped_linear:fc2_gemm0" and len(roles) == 24


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_between_fusing_ops(recipe_name):
    """LayerNorm -> GroupedLinear -> GELU -> Linear -> AddExtraInput: the neighbours fuse and
    hand quantized tensors over among themselves, never to or from the GroupedLinear (per-expert
    scales); the result equals the unfused path."""
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.LayerNorm(32), ops.GroupedLinear(2, 32, 64), ops.GELU(), ops.Linear(64, 32),
        ops.AddExtraInput(),
    )  # fmt: skip
    twin = copy.deepcopy(model)
    x, r, g = torch.randn(64, 32), torch.randn(64, 32), torch.randn(64, 32)
    outs = []
    for m, fuse in ((model, True), (twin, False)):
        xx, rr = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
        region = contextlib.nullcontext() if fuse else ops.fusion_disabled()
        with fusible.autocast(enabled=rec is not None, recipe=rec), region:
            y = m(xx, rr, m_splits=[32, 32])
            y.backward(g)
        outs.append([y.detach(), xx.grad, rr.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*outs, strict=True):
        assert rel_err(a, b) < 2e-5
    assert model[1].input_quantizer() is None and model[1].grad_output_quantizer() is None
    _, plan = model._plan_for(list(model), x.requires_grad_(True), rec)
    assert [u.rule for u in plan.forward_units] == [None, "grouped_linear_activation",
                                                    "linear_bias_add"]  # fmt: skip


# ---- frozen experts, inference ------------------------------------------------------------


def test_frozen_expert_and_inference():
    op = _grouped(3, 32, 32)
    op.weight1.requires_grad_(False)
    op.bias2.requires_grad_(False)
    model = ops.Sequential(op)
    x = torch.randn(96, 32)
    _, _, grads = _run(model, x, (32, 32, 32), torch.randn(96, 32), RECIPES["current"])
    assert grads["0.weight1"] is None and grads["0.bias2"] is None
    assert grads["0.weight0"] is not None and grads["0.bias1"] is not None
    with torch.inference_mode(), fusible.autocast(recipe=RECIPES["mxfp8"]):
        yi = model(x, m_splits=[32, 32, 32])
    with fusible.autocast(recipe=RECIPES["mxfp8"]):
        yt = model(x, m_splits=[32, 32, 32])
    assert torch.equal(yi, yt.detach())


@pytest.mark.parametrize("recipe_name", ["none", "current", "delayed", "mxfp8"])
def test_tied_expert_weights(recipe_name):
    """Experts sharing one weight (``op.weight1 = op.weight0``): ``parameters()`` lists it once,
    the op still takes one weight per expert (it used to fail: the plan counted the
    deduplicated parameters). Output equals an untied twin holding the same values, and the
    shared weight's gradient is the sum of the twin's two, over two steps (the second replayed)."""
    rec = RECIPES[recipe_name]
    tied = _grouped(3, 32, 64)
    tied.weight1 = tied.weight0
    twin = _grouped(3, 32, 64)
    with torch.no_grad():
        for name, p in tied.named_parameters():
            getattr(twin, name).copy_(p)
        twin.weight1.copy_(tied.weight0)
    assert [n for n, _ in tied.named_parameters()] == [
        "weight0",
        "weight2",
        "bias0",
        "bias1",
        "bias2",
    ]
    splits = (32, 0, 64)
    for step in range(2):
        x = torch.randn(96, 32, generator=torch.Generator().manual_seed(step))
        g = torch.randn(96, 64, generator=torch.Generator().manual_seed(10 + step))
        y, dx, grads = _run(ops.Sequential(tied), x, splits, g, rec)
        y2, dx2, grads2 = _run(ops.Sequential(twin), x, splits, g, rec)
        assert torch.equal(y, y2) and torch.equal(dx, dx2), step
        assert torch.equal(grads["0.weight0"], grads2["0.weight0"] + grads2["0.weight1"]), step
        for name in ("0.weight2", "0.bias0", "0.bias1", "0.bias2"):
            assert torch.equal(grads[name], grads2[name]), (step, name)


@pytest.mark.parametrize("recipe_name", ["none", "current", "delayed", "mxfp8"])
def test_saves_per_expert_what_backward_reads(recipe_name):
    """Per expert with tokens, what a Linear saves for its slice (tests/python/ops/
    test_saved_memory.py's rules): the input's and the weight's columnwise copies, never the
    rowwise ones; nothing for an empty expert."""
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[3] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    from saved_memory import saved_bytes

    rec = RECIPES[recipe_name]
    splits, k, n, es = [32, 0, 64], 64, 96, 2

    def columnwise(rows, cols):
        if recipe_name == "none":
            return rows * cols * es
        if recipe_name == "mxfp8":
            return rows * cols + rows // 32 * cols
        return rows * cols + 4

    model = ops.Sequential(ops.GroupedLinear(3, k, n, dtype=torch.bfloat16))
    x = torch.randn(sum(splits), k, dtype=torch.bfloat16, requires_grad=True)
    if recipe_name == "none":  # the input slices are views of x: one storage
        want = columnwise(sum(splits), k)
    else:
        want = sum(columnwise(m, k) + columnwise(n, k) for m in splits if m)
    for _ in range(2 if recipe_name == "delayed" else 1):
        got = saved_bytes(model, x, rec, m_splits=splits)
    assert got == want


# ---- weight workspaces: one per expert ----------------------------------------------------


class _Both:
    """The weight casts of the per-GEMM quantizers and of the grouped path together."""

    def __init__(self, *counts):
        self.counts = counts

    def take(self):
        return sorted(i for c in self.counts for i in c.take())


@pytest.mark.parametrize("recipe_name", FP8_RECIPES)
def test_workspaces_per_expert(recipe_name, monkeypatch):
    rec = RECIPES[recipe_name]
    op = _grouped(3, 32, 32)
    model = ops.Sequential(op)
    count = CountingOps(Q._ops, op.weights)
    monkeypatch.setattr(Q, "_ops", count)
    monkeypatch.setattr(GL, "K", CountingOps(GL.K, op.weights))
    count = _Both(count, GL.K)
    splits = (32, 0, 64)  # expert 1 empty: its weight is still cached on a True step
    x, g = torch.randn(96, 32), torch.randn(96, 32)
    op.ensure_recipe_state(rec)
    before = copy.deepcopy(op.get_extra_state())

    first = _run(model, x, splits, g, rec, fm=True)
    assert count.take() == [0, 1, 2]
    cached = [c.workspace for c in op.workspace_caches]
    assert all(ws is not None for ws in cached)

    op.set_extra_state(copy.deepcopy(before))  # delayed scaling: the True step's scales
    second = _run(model, x, splits, g, rec, fm=False)
    assert count.take() == []  # every expert from its cache
    assert all(c.workspace is ws for c, ws in zip(op.workspace_caches, cached, strict=True))
    for a, b in zip(first[:2], second[:2], strict=True):
        assert torch.equal(a, b)
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name

    with torch.no_grad():
        op.weight2.add_(0.01)  # only expert 2's workspace is stale now
    _run(model, x, splits, g, rec, fm=False)
    assert count.take() == [2]
    assert op.workspace_caches[0].workspace is cached[0]
    assert op.workspace_caches[2].workspace is not cached[2]

    _run(model, x, splits, g, rec, fm=None)  # None: quantizes the experts with tokens, keeps
    assert count.take() == [0, 2]
    _run(model, x, splits, g, rec, fm=False)
    assert count.take() == []

    other = RECIPES["current" if recipe_name != "current" else "mxfp8"]
    _run(model, x, splits, g, other, fm=False)  # another recipe: every cache is invalid
    assert count.take() == [0, 1, 2]


# ---- roles ----------------------------------------------------------------------------------


def test_roles():
    op = ops.GroupedLinear(3, 32, 16)
    fwd, bwd = op.get_quantizer_roles(True), op.get_quantizer_roles(False)
    assert [str(r) for r in fwd] == ["input:grouped_linear", "weight:grouped_linear",
                                     "output:grouped_linear"] * 3  # fmt: skip
    assert [str(r) for r in bwd] == ["grad_output:grouped_linear", "grad_input:grouped_linear"] * 3
    assert [r.name for r in fwd] == [f"gemm{i}" for i in range(3) for _ in range(3)]
    assert [r.name for r in bwd] == [f"gemm{i}" for i in range(3) for _ in range(2)]
    assert op.num_quantizers(True) == 9 and op.num_quantizers(False) == 6
    named = ops.GroupedLinear(2, 32, 32, name="experts")
    assert [r.qualified for r in named.get_quantizer_roles(False)] == [
        "grad_output:grouped_linear:experts_gemm0", "grad_input:grouped_linear:experts_gemm0",
        "grad_output:grouped_linear:experts_gemm1", "grad_input:grouped_linear:experts_gemm1",
    ]  # fmt: skip
    seq = ops.Sequential(named, ops.GELU())
    assert seq.get_quantizer_roles(True) == named.get_quantizer_roles(True)
    for rec_name in FP8_RECIPES:
        with fusible.autocast(recipe=RECIPES[rec_name]):
            seq(torch.randn(64, 32), m_splits=[32, 32])
        state = named.recipe_state(True)
        assert state.num_quantizers == 6 and list(state.roles) == named.get_quantizer_roles(True)
        assert all(q is not None for q in state.quantizers)
        assert len({id(q) for q in state.quantizers}) == 6  # a quantizer per slot
    text = seq.explain()
    assert "weight:grouped_linear:experts_gemm1" in text and "(x2" in text


# ---- bad input ------------------------------------------------------------------------------


BAD_SPLITS = [
    ({}, TypeError, r"GroupedLinear: m_splits is required"),
    ({"m_splits": [4, 4]}, ValueError, r"GroupedLinear: m_splits must have num_gemms=3 .* got 2"),
    ({"m_splits": [4, 4, 4, 0]}, ValueError, r"num_gemms=3 entries"),
    ({"m_splits": [4, 4, 1]}, ValueError, r"m_splits must sum to the number of input rows 8 .*9"),
    ({"m_splits": [10, -2, 0]}, ValueError, r"m_splits entries must be >= 0, got m_splits\[1\]=-2"),
    ({"m_splits": [4.0, 4, 0]}, TypeError, r"GroupedLinear: m_splits\[0\] must be an int"),
    ({"m_splits": [True, 7, 0]}, TypeError, r"m_splits\[0\] must be an int"),
    ({"m_splits": 8}, TypeError, r"GroupedLinear: m_splits must be a list or tuple"),
    ({"m_splits": torch.tensor([4.0, 4.0, 0.0])}, TypeError, r"1-D of an integer dtype"),
    ({"m_splits": torch.tensor([[4, 4, 0]])}, TypeError, r"1-D of an integer dtype"),
    (
        {"m_splits": [4, 4, 0], "splits": [8]},
        TypeError,
        r"unexpected keyword argument\(s\) 'splits'",
    ),
]


@pytest.mark.parametrize("kwargs, exc, match", BAD_SPLITS)
def test_bad_splits(kwargs, exc, match):
    model = ops.Sequential(ops.GroupedLinear(3, 16, 8))
    with pytest.raises(exc, match=match):
        model(torch.randn(8, 16), **kwargs)


def test_bad_input():
    model = ops.Sequential(ops.GroupedLinear(2, 16, 8))
    with pytest.raises(ValueError, match="GroupedLinear: input feature size 15 does not match "
                                         "in_features 16"):  # fmt: skip
        model(torch.randn(8, 15), m_splits=[4, 4])
    with pytest.raises(TypeError, match="no op of this container reads it"):
        ops.Sequential(ops.Linear(16, 8))(torch.randn(8, 16), m_splits=[8])
    want = r"GroupedLinear: MXFP8 needs .* every m_splits entry divisible by 32, got 32, 32 and "
    with pytest.raises(ValueError, match=want + r"m_splits\[1\]=8"):
        mx = ops.Sequential(ops.GroupedLinear(2, 32, 32))
        with fusible.autocast(recipe=RECIPES["mxfp8"]):
            mx(torch.randn(40, 32), m_splits=[32, 8])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="GroupedLinear: num_gemms must be a positive int"):
            ops.GroupedLinear(bad, 16, 8)
    with pytest.raises(ValueError, match="GroupedLinear: in_features must be a positive int"):
        ops.GroupedLinear(2, 0, 8)


# ---- the grouped kernels: bit for bit the per-expert loop, a fixed number of operators -----------

# Splits with empty experts, one token, primes and 2^n - 1 (the per-tensor recipes allow any).
ODD_SPLITS = [(0, 1, 7, 31), (3, 0, 0, 5, 2), (13,), (0, 0, 0), (17, 15, 63, 1, 0, 2)]


def _pair(n, k, out, bias, dtype):
    """Two copies of one GroupedLinear (same parameters): the grouped path and the loop."""
    grouped = _grouped(n, k, out, bias, dtype)
    loop = copy.deepcopy(grouped)
    loop._grouped = False
    return ops.Sequential(grouped), ops.Sequential(loop)


def _state(op):
    st = op.get_extra_state()
    return {} if not isinstance(st, dict) else st


class _Calls:
    """Counts the grouped operators the grouped path runs (so a test knows it ran)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = GL.K

        class Spy:
            def __getattr__(_, name):
                fn = getattr(real, name)
                if not name.startswith("grouped_"):
                    return fn

                def counted(*a, **kw):
                    self.n += 1
                    return fn(*a, **kw)

                return counted

        monkeypatch.setattr(GL, "K", Spy())
        # A replayed step calls the operators it recorded, not the Python handles spied on.
        monkeypatch.setattr(replay.CONFIG, "enabled", False)


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("splits", ODD_SPLITS, ids=str)
def test_grouped_path_equals_loop(recipe_name, dtype, bias, splits, monkeypatch):
    """The grouped kernels give the per-expert loop's bits: output, input and parameter
    gradients and the recipe state (amax histories, scales), over three steps (delayed
    scaling: the later ones cast with updated scales) with weight caching on, reused, off."""
    rec = RECIPES[recipe_name]
    k, n_out = (33, 17) if dtype == torch.float32 else (64, 32)
    grouped, loop = _pair(len(splits), k, n_out, bias, dtype)
    calls = _Calls(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    for step, fm in enumerate((True, False, None)):
        x = torch.randn(sum(splits), k, generator=gen).to(dtype)
        g = torch.randn(sum(splits), n_out, generator=gen).to(dtype)
        before = calls.n
        got = _run(grouped, x, splits, g, rec, fm)
        ran = calls.n - before
        want = _run(loop, x, splits, g, rec, fm)
        assert calls.n - before == ran  # the loop ran no grouped operator
        if recipe_name != "none":
            assert ran >= 2, "the grouped path did not run"
        elif bias:
            assert ran == 1  # the forward GEMMs
        for a, b in zip(got[:2], want[:2], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), step
        assert got[2].keys() == want[2].keys()
        for name in got[2]:
            assert torch.equal(got[2][name], want[2][name]), (step, name)
        mine, theirs = _state(grouped[0]), _state(loop[0])
        assert mine.keys() == theirs.keys()
        for key in mine:
            if isinstance(mine[key], torch.Tensor):
                assert torch.equal(mine[key], theirs[key]), (step, key)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_grouped_mlp_equals_loop(recipe_name):
    """GroupedLinear -> GELU -> GroupedLinear, grouped against the loop, bit for bit (unfused:
    the fused expert MLP has tests of its own below)."""
    rec = RECIPES[recipe_name]
    splits = (5, 0, 31, 1)

    def mlp(grouped):
        torch.manual_seed(0)
        a, b = ops.GroupedLinear(4, 32, 48), ops.GroupedLinear(4, 48, 32)
        a._grouped = b._grouped = grouped
        return ops.Sequential(a, ops.GELU(), b)

    x = torch.randn(sum(splits), 32)
    g = torch.randn(sum(splits), 32)
    for _ in range(2):
        with ops.fusion_disabled():
            got, want = _run(mlp(True), x, splits, g, rec), _run(mlp(False), x, splits, g, rec)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for name in got[2]:
            assert torch.equal(got[2][name], want[2][name]), name


class _OpNames(TorchDispatchMode):
    """Records the name of every operator dispatched inside it, in order, in ``names``."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _dispatched(n, rec, bias=True):
    """Operators dispatched by one forward + backward of a GroupedLinear of ``n`` GEMMs (after
    warm-up steps), counted with a TorchDispatchMode. The gradients come from
    ``torch.autograd.grad``: the autograd engine's per-parameter accumulation into ``.grad`` is
    not the op's work (with ``.backward()`` it adds one ``detach`` per parameter)."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.GroupedLinear(n, 64, 32, bias=bias))
    params = list(model.parameters())
    splits = [16 * (i % 3) for i in range(n)]  # every third expert empty
    x = torch.randn(sum(splits), 64, requires_grad=True)
    g = torch.randn(sum(splits), 32)

    def step():
        with fusible.autocast(recipe=rec):
            y = model(x, m_splits=splits)
        return torch.autograd.grad(y, [x, *params], g)

    for _ in range(3):
        step()
    with _OpNames() as mode:
        step()
    return mode.names


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("bias", [False, True])
def test_dispatch_count_does_not_grow_with_experts(recipe_name, bias):
    """The grouped path's operator count per forward + backward is the same for 2 and for 32
    experts (the per-expert loop's grows by about ten per expert)."""
    rec = RECIPES[recipe_name]
    counts = {n: len(_dispatched(n, rec, bias)) for n in (2, 4, 8, 32)}
    assert max(counts.values()) - min(counts.values()) <= 2, counts
    assert counts[32] < 80, counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe_name", ["delayed", "current", "none"])
@pytest.mark.parametrize("splits", [(0, 16, 48, 32), (7, 0, 33, 1)], ids=str)
def test_grouped_path_equals_loop_cuda(recipe_name, splits, monkeypatch):
    """On CUDA too: the grouped kernels (cuBLASLt per expert from one call) give the loop's bits;
    an expert whose token count is not a multiple of 16 has its weight gradient from the loop's
    dequantized GEMM in both. (The grouped path is opt-in on CUDA until this has passed there.)"""
    from fusible.ops.basic import grouped_linear

    monkeypatch.setattr(grouped_linear, "GROUPED_KERNELS_ON_CUDA", True)
    rec = RECIPES[recipe_name]
    grouped, loop = _pair(len(splits), 64, 32, True, torch.bfloat16)
    grouped.cuda()
    loop.cuda()
    gen = torch.Generator().manual_seed(5)
    for fm in (True, False, None):
        x = torch.randn(sum(splits), 64, generator=gen).to(torch.bfloat16).cuda()
        g = torch.randn(sum(splits), 32, generator=gen).to(torch.bfloat16).cuda()
        got, want = _run(grouped, x, splits, g, rec, fm), _run(loop, x, splits, g, rec, fm)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for name in got[2]:
            assert torch.equal(got[2][name], want[2][name]), name
        mine, theirs = _state(grouped[0]), _state(loop[0])
        for key in mine:
            if isinstance(mine[key], torch.Tensor):
                assert torch.equal(mine[key], theirs[key]), key


# ---- the fused expert MLP: GELU in fc1's grouped GEMM epilogue ---------------------------------


def _mlp(recipe_name, dtype, f=64, approximate="tanh", bias=True):
    torch.manual_seed(0)
    e, h = 4, 32
    fc1 = ops.GroupedLinear(e, h, f, bias, dtype=dtype)
    fc2 = ops.GroupedLinear(e, f, h, bias, dtype=dtype)
    if bias:
        with torch.no_grad():
            for b in (*fc1.biases(), *fc2.biases()):
                b.normal_()
    return ops.Sequential(fc1, ops.GELU(approximate), fc2)


def _dispatched_ops(model, x, splits, g, rec):
    """The operators one forward + backward dispatches (a TorchDispatchMode), and the result."""
    with _OpNames() as mode:
        out = _run(model, x, splits, g, rec)
    return mode.names, out


MLP_SPLITS = {"blockwise": (32, 0, 64, 16), "mxfp8": (32, 0, 64, 32)}  # the recipes' multiples


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_expert_mlp_equals_unfused(devices, recipe_name, dtype, bias):
    """GroupedLinear -> GELU -> GroupedLinear with fc1's grouped GEMMs fused with the bias + GELU
    epilogue against the same ops unfused (a GELU kernel), over two steps (delayed scaling: the
    second with updated scales). Where the grouped kernels serve the recipe and the GEMM has the
    epilogue, no forward activation kernel runs; elsewhere the fused unit runs the unfused ops,
    bit for bit. CPU float32: the epilogue and the activation kernel compute the same function
    on the same fp32 values, so the bits match too; bfloat16 rounds the GEMM result once before
    the separate GELU, so within one bf16 rounding. CUDA: cuBLASLt's epilogue computes GELU its
    own way, so within tolerance there. Backward under delayed scaling, the activation kernel
    writes fc1's FP8 output gradient per expert (the unfused cast's bits) and its bias gradient
    (summed in the kernel's order, not torch's: within fp32 rounding of the unfused one)."""
    rec = RECIPES[recipe_name]
    splits = MLP_SPLITS.get(recipe_name, (5, 0, 31, 1))
    fused = _mlp(recipe_name, dtype, bias=bias).to(devices)
    unfused = _mlp(recipe_name, dtype, bias=bias).to(devices)
    gen = torch.Generator().manual_seed(1)
    # The grouped kernels serve per-tensor scaling (custom: current scaling for every role).
    grouped = recipe_name not in ("mxfp8", "blockwise")
    for _ in range(2):
        x = torch.randn(sum(splits), 32, generator=gen).to(dtype).to(devices)
        g = torch.randn(sum(splits), 32, generator=gen).to(dtype).to(devices)
        names, got = _dispatched_ops(fused, x, splits, g, rec)
        with ops.fusion_disabled():
            want = _run(unfused, x, splits, g, rec)
        # No recipe and no bias: the loop (torch's linear); FP8 with a float32 output and a
        # bias: cuBLASLt has no bias + GELU + aux kernel (gemm.h), the ops run unfused.
        fp8 = recipe_name != "none"
        epi = "bias_gelu_aux" if bias else "gelu_aux"
        operand = E4M3 if fp8 else dtype
        fwd_fused = (grouped and (bias or fp8)
                     and K.gemm_epilogue_supported(operand, operand, dtype, epi))  # fmt: skip
        assert ("fusible.act_fwd.default" not in names) == fwd_fused, names
        assert "fusible.act_bwd.default" in names
        bwd_fused = recipe_name == "delayed"  # the per-expert act_bwd casts for fc1
        # Grouped bias gradients: fc1's and fc2's on the grouped FP8 path, fc2's alone fused.
        want_bgrad = (2 - bwd_fused) if bias and grouped and fp8 else 0
        assert names.count("fusible.grouped_bias_grad.default") == want_bgrad, names
        exact = (dtype == torch.float32 and devices == "cpu") or not fwd_fused
        # Under FP8: an element one rounding apart may cast to the neighbouring FP8 value
        # downstream (E5M2 gradients: 2^-2 apart), a few percent of a small expert's norm.
        t = 0.05 if fp8 else 2 * tol(dtype)
        for a, b in zip(got[:2], want[:2], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b) if exact else rel_err(a, b) < t
        for name in got[2]:
            a, b = got[2][name], want[2][name]
            if name.endswith(("weight1", "bias1")):  # the empty expert
                assert torch.count_nonzero(a) == 0, name
            elif exact and not (bwd_fused and name.startswith("0.bias")):
                assert torch.equal(a, b), name
            else:
                assert rel_err(a, b) < (t if not exact else 1e-5), name
    _, plan = fused._plan_for(list(fused), x.requires_grad_(True), rec)
    assert [u.rule for u in plan.forward_units] == ["grouped_linear_activation", None]
    assert [u.rule for u in plan.backward_units] == ["dact_grouped_linear", None]


def test_fused_expert_mlp_rejections():
    """The fusion needs the tanh GELU (the epilogue's function) and an out_features that
    cuBLASLt's aux rule takes; explain() names the reason, and the unfused ops run."""
    erf = _mlp("none", torch.float32, approximate="none")
    text = erf.explain()
    assert "grouped_linear_activation' on [GroupedLinear + GELU]: GELU(approximate='none') has " \
        "no GEMM epilogue" in text  # fmt: skip
    odd = _mlp("none", torch.float32, f=36)
    text = odd.explain()
    assert "out_features 36 is not a multiple of 8 (the aux epilogue's N)" in text
    x = torch.randn(8, 32)
    for model in (erf, odd):
        _, plan = model._plan_for(list(model), x.requires_grad_(True), None)
        assert [u.rule for u in plan.forward_units] == [None, None, None]
        # The backward fusion takes any activation that is not gated.
        assert [u.rule for u in plan.backward_units] == ["dact_grouped_linear", None]
        _run(model, x, (2, 2, 0, 4), torch.randn(8, 32))


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "none"])
def test_fused_expert_mlp_compiled_and_replayed(recipe_name):
    """The fused expert MLP in the replayed steady state (ops/replay.py) gives the Python
    executor's bits, with changing splits; under torch.compile(fullgraph=True) the same within
    fp32 rounding (inductor may reorder the torch reductions of the loop's bias gradients)."""
    rec = RECIPES[recipe_name]
    model = _mlp(recipe_name, torch.float32)
    replayed, python = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    replay.reset_stats()
    for splits in [(5, 0, 31, 1)] * 4 + [(8, 0, 3, 6)] * 4:  # replays from the third / fourth
        x = torch.randn(sum(splits), 32, generator=gen)
        g = torch.randn(sum(splits), 32, generator=gen)
        want = _run(replayed, x, splits, g, rec)
        with replay.options(enabled=False):
            for got, exact in ((_run(python, x, splits, g, rec), True),
                               (_run(compiled, x, splits, g, rec), False)):  # fmt: skip
                for a, b in zip(got[:2], want[:2], strict=True):
                    assert torch.equal(a, b)
                for (name, a), b in zip(got[2].items(), want[2].values(), strict=True):
                    assert torch.equal(a, b) if exact else rel_err(a, b) < 1e-6, name
    stats = replay.stats()
    assert stats["forward.replay"] >= 2 and stats["backward.replay"] >= 2, stats
