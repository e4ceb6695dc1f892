"""Basic ops against plain-PyTorch FP64 references, fused vs unfused, plans, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import DTYPES, E4M3, E5M2, RECIPES, prequantized, rel_err, tol
from torch.utils._python_dispatch import TorchDispatchMode

import fusible
from fusible import ops

SHAPES = [(1, 32), (7, 64), (127, 96), (3, 5, 32)]


def _run(model, x, *extra, recipe=None, grad=None):
    x = x.detach().requires_grad_(True)
    extra = [e.detach().requires_grad_(True) for e in extra]
    with fusible.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x, *extra)
    y0 = y[0] if isinstance(y, tuple) else y
    g = torch.randn_like(y0) if grad is None else grad.to(y0.dtype)
    y0.backward(g)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return y0.detach(), x.grad, [e.grad for e in extra], grads, g


# ---- each basic op, high precision, vs FP64 ----------------------------------------------------


def _ref_norm(x, w, b, eps, kind, zc):
    w = w + 1 if zc else w
    if kind == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zc", [False, True])
def test_norm_vs_fp64(dtype, shape, kind, zc):
    h = shape[-1]
    op = (ops.LayerNorm if kind == "layernorm" else ops.RMSNorm)(
        h, zero_centered_gamma=zc, dtype=dtype
    )
    with torch.no_grad():
        op.weight.normal_(0.1 if zc else 1.0, 0.2)
        if kind == "layernorm":
            op.bias.normal_(0, 0.2)
    x = torch.randn(shape).to(dtype)
    y, dx, _, grads, g = _run(ops.Sequential(op), x)
    xr = x.double().requires_grad_(True)
    wr = op.weight.detach().double().requires_grad_(True)
    br = op.bias.detach().double().requires_grad_(True) if kind == "layernorm" else None
    yr = _ref_norm(xr, wr, br, op.eps, kind, zc)
    yr.backward(g.double())
    assert rel_err(y, yr) < tol(dtype)
    assert rel_err(dx, xr.grad) < 2 * tol(dtype)
    assert rel_err(grads["0.weight"], wr.grad) < 2 * tol(dtype)
    if br is not None:
        assert rel_err(grads["0.bias"], br.grad) < 2 * tol(dtype)


ACTS = {
    "gelu": (lambda: ops.GELU(), lambda x: F.gelu(x, approximate="tanh")),
    "gelu_erf": (lambda: ops.GELU(approximate="none"), lambda x: F.gelu(x)),
    "relu": (lambda: ops.ReLU(), F.relu),
    "silu": (lambda: ops.SiLU(), F.silu),
    "swiglu": (lambda: ops.SwiGLU(), lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]),
    "geglu": (
        lambda: ops.GEGLU(),
        lambda x: F.gelu(x.chunk(2, -1)[0], approximate="tanh") * x.chunk(2, -1)[1],
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", sorted(ACTS))
def test_activation_vs_fp64(dtype, shape, act):
    make, ref = ACTS[act]
    x = torch.randn(shape).to(dtype)
    y, dx, _, _, g = _run(ops.Sequential(make()), x)
    xr = x.double().requires_grad_(True)
    yr = ref(xr)
    yr.backward(g.double())
    assert rel_err(y, yr) < tol(dtype)
    assert rel_err(dx, xr.grad) < 2 * tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_vs_fp64(dtype, shape, bias):
    k, n = shape[-1], 48
    model = ops.Sequential(ops.Linear(k, n, bias=bias, dtype=dtype))
    if bias:
        with torch.no_grad():
            model[1].bias.normal_()
    x = torch.randn(shape).to(dtype)
    y, dx, _, grads, g = _run(model, x)
    xr = x.double().requires_grad_(True)
    wr = model[0].weight.detach().double().requires_grad_(True)
    br = model[1].bias.detach().double().requires_grad_(True) if bias else None
    yr = F.linear(xr, wr, br)
    yr.backward(g.double())
    assert rel_err(y, yr) < tol(dtype)
    assert rel_err(dx, xr.grad) < 2 * tol(dtype)
    assert rel_err(grads["0.weight"], wr.grad) < 2 * tol(dtype)
    if bias:
        assert rel_err(grads["1.bias"], br.grad) < 2 * tol(dtype)


def test_structural_ops():
    x = torch.randn(4, 6, 8)
    model = ops.Sequential(
        ops.MakeExtraOutput(),
        ops.ConstantScale(3.0),
        ops.Reshape((4, 48)),
        ops.Identity(),
        ops.Dropout(0.0),
        ops.Reshape((4, 6, 8)),
        ops.AddExtraInput(),
    )
    xr = x.clone().requires_grad_(True)
    res = torch.randn(4, 6, 8, requires_grad=True)
    y, branch = model(xr, res)
    assert torch.equal(y, 3 * x + res) and torch.equal(branch, x)
    (y.sum() + 2 * branch.sum()).backward()
    assert torch.allclose(xr.grad, torch.full_like(x, 5.0))
    assert torch.allclose(res.grad, torch.ones_like(x))


def test_dropout_train_and_eval():
    torch.manual_seed(0)
    op = ops.Dropout(0.5)
    x = torch.ones(64, 64, requires_grad=True)
    y = ops.Sequential(op)(x)
    kept = y != 0
    assert torch.all(y[kept] == 2.0) and 0.3 < kept.float().mean() < 0.7
    y.sum().backward()
    assert torch.equal(x.grad, kept.float() * 2.0)
    op.eval()
    assert torch.equal(ops.Sequential(op)(x), x)


# ---- Linear under every recipe on pre-quantized inputs ----------------------------------------


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [32, 96])
def test_linear_recipes_prequantized(recipe_name, dtype, m):
    """FP8 GEMMs on inputs every recipe quantizes exactly equal FP64 GEMMs up to fp32
    accumulation and the output rounding. Power-of-two factors keep fp16 outputs finite (every
    scale stays a power of two, so quantization stays exact)."""
    rec = RECIPES[recipe_name]
    k, n = 64, 32
    model = ops.Sequential(ops.Linear(k, n, bias=False, dtype=dtype))
    fx, fg = (2.0**-6, 2.0**-12) if dtype == torch.float16 else (1.0, 1.0)
    w = prequantized((n, k), seed=1) * fx
    with torch.no_grad():
        model[0].weight.copy_(w)
    x = (prequantized((m, k), seed=2) * fx).to(dtype)
    g = prequantized((m, n), E4M3 if recipe_name in ("mxfp8", "blockwise") else E5M2, seed=3) * fg
    if recipe_name == "delayed":
        _run(model, x, recipe=rec, grad=g)  # the first step's amaxes set the scales used next
        model.zero_grad()
    y, dx, _, grads, _ = _run(model, x, recipe=rec, grad=g)
    xd, wd, gd = x.double(), w.double(), g.double()
    assert rel_err(y, xd @ wd.t()) < tol(dtype)
    assert rel_err(dx, gd @ wd) < 2 * tol(dtype)
    assert rel_err(grads["0.weight"], gd.t() @ xd) < 2 * tol(dtype)


# ---- fused == unfused, and the fusions really happen --------------------------------------------


def _block(h=64, f=128, dtype=torch.float32, act=None):
    torch.manual_seed(0)
    return ops.Sequential(
        ops.LayerNorm(h, dtype=dtype),
        ops.Linear(h, f, dtype=dtype),
        act() if act else ops.GELU(),
        ops.Linear(f // 2 if act in (ops.SwiGLU, ops.GEGLU) else f, h, dtype=dtype),
        ops.AddExtraInput(),
    )


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_unfused(recipe_name, dtype):
    rec = RECIPES[recipe_name]
    x = torch.randn(2, 48, 64).to(dtype)
    model = _block(dtype=dtype)
    twin = copy.deepcopy(model)  # same parameters and recipe state (delayed scaling updates it)
    g = torch.randn(2, 48, 64).to(dtype)
    fused = _run(model, x, x, recipe=rec, grad=g)
    with ops.fusion_disabled():
        ref = _run(twin, x, x, recipe=rec, grad=g)
    # Same quantized operands on both paths; GEMM epilogues vs separate kernels differ only in
    # fp32 rounding of the bias/GELU step.
    t = 2e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(fused[0], ref[0]) < t
    assert rel_err(fused[1], ref[1]) < 10 * t
    for name in ref[3]:
        assert rel_err(fused[3][name], ref[3][name]) < 10 * t, name


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_fusions_in_plan(recipe_name):
    model = _block()
    with fusible.autocast(enabled=RECIPES[recipe_name] is not None, recipe=RECIPES[recipe_name]):
        text = model.explain()
        _, plan = model._plan_for(
            list(model), torch.empty(0, requires_grad=True), RECIPES[recipe_name]
        )
    fwd = [u.rule for u in plan.forward_units]
    bwd = [u.rule for u in plan.backward_units]
    assert fwd == [None, "linear_bias_activation", "linear_bias_add"]
    assert "dact_dbias_quantize" in bwd
    assert "linear_bias_activation" in text and "dact_dbias_quantize" in text
    if RECIPES[recipe_name] is not None:
        assert "input:linear" in text and "grad_output:linear" in text
    gemms = [ln for ln in text.splitlines() if "kernels:" in ln and "gemm(" in ln]
    assert len(gemms) == 4  # two fused fprops, two dgrad + wgrad lines
    for ln in gemms:  # fused or not, every MXFP8 GEMM says it runs on dequantized operands
        assert (ln.count("dequantized MXFP8") == ln.count("gemm(")) == (recipe_name == "mxfp8"), ln
        # every blockwise GEMM names its block shapes and where it runs natively
        assert (ln.count("blockwise FP8 (") == ln.count("gemm(")) == (recipe_name == "blockwise")
        # per-tensor FP8 forward GEMMs accumulate fast (as TransformerEngine's fprop); no others
        per_tensor = recipe_name in ("delayed", "current", "custom")
        assert ("fast accumulation" in ln) == (per_tensor and "gemm(fprop" in ln), ln


def test_erf_gelu_fusion_rejected_with_reason():
    model = ops.Sequential(ops.Linear(32, 32), ops.GELU(approximate="none"))
    text = model.explain()
    assert "GELU(approximate='none') has no GEMM epilogue" in text


# ---- training --------------------------------------------------------------------------------


def _train(rec, steps=200, seed=0, device="cpu"):
    torch.manual_seed(seed)
    h = 64
    teacher = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh(), torch.nn.Linear(h, h))
    model = _block(h, 4 * h, dtype=torch.bfloat16).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, h, generator=gen)
        with torch.no_grad():
            t = teacher(x).to(device)
        x = x.to(device, torch.bfloat16)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = model(x, x)
        loss = (y.float() - t).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20, losses[0]


_BF16_LOSS: dict[str, float] = {}  # per device: GEMM algorithms differ between backends


@pytest.mark.parametrize("recipe_name", [r for r in sorted(RECIPES) if r != "none"])
def test_block_trains_like_bf16(recipe_name, devices):
    if devices not in _BF16_LOSS:
        _BF16_LOSS[devices] = _train(None, device=devices)[0]
    bf16_loss = _BF16_LOSS[devices]
    end, start = _train(RECIPES[recipe_name], device=devices)
    assert end < 0.5 * start  # it learned
    assert end <= 1.05 * bf16_loss, (end, bf16_loss)


# ---- errors ------------------------------------------------------------------------------------


def test_feature_mismatch_names_op():
    with pytest.raises(
        ValueError, match="BasicLinear: input feature size 7 does not match in_features 8"
    ):
        ops.Sequential(ops.Linear(8, 4))(torch.randn(3, 7))
    with pytest.raises(ValueError, match="LayerNorm: input feature size"):
        ops.Sequential(ops.LayerNorm(8))(torch.randn(3, 7))


def test_wrong_dtype_raises():
    """An input or parameter dtype no kernel takes is refused when its plan is built, naming
    the module, the tensor and what to do (not the first kernel that would refuse it)."""
    with pytest.raises(TypeError, match=r"Sequential.forward: the input has dtype torch.int32; "
                       r"fusible computes in float32, float16 or bfloat16"):  # fmt: skip
        ops.Sequential(ops.LayerNorm(8))(torch.ones(3, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"Linear.forward: the input has dtype torch.float64"):
        fusible.Linear(8, 4).double()(torch.randn(3, 8, dtype=torch.float64))
    m = ops.Sequential(ops.LayerNorm(8), ops.Linear(8, 4))
    m[1].weight.data = m[1].weight.data.double()
    with pytest.raises(TypeError, match=r"parameter '1.weight' has dtype torch.float64.*"
                       r"model.float\(\)"):  # fmt: skip
        m(torch.randn(3, 8))
    # Not refused: ops that only move their input, and AddExtraInput's own cast of its extra.
    ids = torch.arange(6).reshape(2, 3)
    assert torch.equal(ops.Sequential(ops.Identity(), ops.Reshape((3, 2)))(ids), ids.reshape(3, 2))
    r = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = ops.Sequential(ops.Linear(8, 8), ops.AddExtraInput())(torch.randn(3, 8), r)
    y.sum().backward()
    assert y.dtype == torch.float32 and r.grad.dtype == torch.float64


def test_mxfp8_non_divisible_raises():
    with fusible.autocast(recipe=fusible.recipe.MXFP8BlockScaling()):
        with pytest.raises(ValueError, match=r"MXFP8.*divisible by 32"):
            ops.Sequential(ops.Linear(48, 32))(torch.randn(32, 48))


def test_extra_input_count():
    with pytest.raises(ValueError, match="extra input"):
        ops.Sequential(ops.AddExtraInput())(torch.randn(2, 2))
    with pytest.raises(ValueError, match="extra input"):
        ops.Sequential(ops.Identity())(torch.randn(2, 2), torch.randn(2, 2))


def test_user_op_may_take_integer_inputs():
    """The plan-time dtype check covers fusible's own ops only: a user's op may take token ids
    (an embedding lookup here) as the run's input."""

    class Lookup(ops.BasicOperation):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 8))

        def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
            return params[0][x], []

        def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
            return None, [None], []

    m = ops.Sequential(Lookup())
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(m(ids), m[0].table[ids])


# ---- Bias backward: the bias gradient beside the preceding Linear's grad_output cast -----------


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8", "blockwise", "custom"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 31, 127])
def test_bias_grad_in_the_grad_output_cast(recipe_name, dtype, tokens):
    """Under a recipe whose quantizer fuses (delayed, MXFP8, blockwise on CPU), Bias's backward
    writes dy quantized for the Linear before it and the bias gradient in one kernel
    (activation.h's identity kind); current scaling and custom keep ATen's sum. The Linear sees
    the bits its own cast of dy would give (checked against the same model whose bias is
    frozen: then Linear casts dy itself), the delayed-scaling history records the same amax,
    and the bias gradient is dy's column sum (fp32 sums, one rounding; vs FP64)."""
    rec = RECIPES[recipe_name]
    if recipe_name in ("mxfp8", "blockwise"):
        tokens = 32 * ((tokens + 31) // 32)  # the recipes' alignment
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(64, 96, bias=False, dtype=dtype), ops.Bias(96, dtype=dtype))
    frozen = copy.deepcopy(model)
    frozen[1].bias.requires_grad_(False)
    x = prequantized((tokens, 64)).to(dtype)
    g = prequantized((tokens, 96), E5M2, seed=1).to(dtype) / 64
    for _ in range(2):  # the second step runs on the first's delayed-scaling history
        for m in (model, frozen):
            for p in m.parameters():
                p.grad = None
        got = _run(model, x, recipe=rec, grad=g)
        ref = _run(frozen, x, recipe=rec, grad=g)
        assert torch.equal(got[1], ref[1])  # dgrad
        assert torch.equal(got[3]["0.weight"], ref[3]["0.weight"])  # wgrad
    db = got[3]["1.bias"]
    assert db.dtype == dtype
    want = g.double().sum(0)
    assert rel_err(db, want) < tol(dtype)
    if recipe_name == "delayed":
        hist = model.state_dict()["0._extra_state"]["backward.amax_history"]
        assert hist[:, 0].abs().sum() > 0  # grad_output's amax was recorded
        assert torch.equal(hist, frozen.state_dict()["0._extra_state"]["backward.amax_history"])


class _Ops(TorchDispatchMode):
    """The operators dispatched inside it, by overload packet name (``sum``, ``act_bwd``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.shapes: list[tuple[str, tuple[int, ...] | None]] = []  # (name, first arg's shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names.append(name)
        first = args[0] if args else None
        self.shapes.append((name, tuple(first.shape) if isinstance(first, torch.Tensor) else None))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8", "blockwise"])
def test_bias_backward_runs_no_separate_column_sum(recipe_name):
    """Where the grad_output quantizer fuses (delayed, MXFP8, blockwise on CPU) the bias
    gradient replaces ATen's column sum and the Linear's own cast of dy: the backward runs one
    ``act_bwd`` (the identity kind) and no ``sum`` or cast. Current scaling keeps the sum and
    its cast (bias.py says why). Counted by dispatch, so deterministic on any torch."""
    model = ops.Sequential(ops.Linear(64, 96, bias=False), ops.Bias(96))
    x = torch.randn(32, 64, requires_grad=True)
    with fusible.autocast(recipe=RECIPES[recipe_name]):
        y = model(x)
    loss = y.sum()
    with _Ops() as seen:
        loss.backward()
    # (The weight's casts for dgrad stay: only dy's [32, 96] matters here.)
    casts = [n for n, shape in seen.shapes if n.startswith("quantize") and shape == (32, 96)]
    if recipe_name == "current":
        assert seen.names.count("sum") == 1 and "act_bwd" not in seen.names, seen.names
        assert casts, seen.names
    else:
        assert "sum" not in seen.names and seen.names.count("act_bwd") == 1, seen.names
        assert not casts, seen.names
