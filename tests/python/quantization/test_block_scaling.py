"""Float8BlockScaling (blockwise FP8, 1x128 / 128x128 blocks, fp32 scales): the recipe, a plain
torch emulation of the cast equal to the CPU backend bit for bit, dequantization, outliers, the
GEMM, ops and modules under the recipe, checkpoints, a short training run, bad input. The CUDA
cases (CUDA == CPU bits, GEMM vs the dequantized reference) skip without a GPU."""

from __future__ import annotations

import copy
import io
import itertools
import math

import pytest
import torch

import fusible
from fusible import _kernels as K
from fusible import ops, recipe
from fusible.ops import _compute as C
from fusible.quantization import (
    Float8BlockData,
    Float8BlockQuantizer,
    Float8BlockTensor,
    Float8CurrentScalingQuantizer,
    RecipeState,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
HP = [torch.float32, torch.bfloat16, torch.float16]
# 1, primes, 2^n - 1, partial blocks and exact multiples of 128.
SHAPES = [(1, 1), (1, 129), (7, 13), (31, 127), (127, 255), (128, 128), (130, 257), (3, 5, 131)]
cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and K.has_cuda()),
    reason="needs a CUDA GPU and fusible built with its CUDA backend",
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))
    return x.to(dtype)


# ---- the emulation (the documented rule in plain torch) --------------------------------------


def _scale(amax: torch.Tensor, fmax: float, pow2: bool, eps: float) -> torch.Tensor:
    m = torch.clamp_min(amax, eps)
    s = torch.tensor(fmax, dtype=torch.float32) / m
    s = torch.where(torch.isinf(s), torch.tensor(torch.finfo(torch.float32).max), s)
    s = torch.where((m == 0) | ~torch.isfinite(m), torch.ones_like(s), s)
    if pow2:
        s = (s.view(torch.int32) & torch.tensor(-8388608, dtype=torch.int32)).view(torch.float32)
    return s


def emulate(m: torch.Tensor, block_dim: int, fp8=E4M3, pow2=True, eps=0.0):
    """(q, scale_inv) of a copy [R, C] (blocks along its rows), in the documented layouts."""
    x = m.float()
    R, C = x.shape
    nr, nc = math.ceil(R / 128), math.ceil(C / 128)
    xp = torch.zeros(nr * 128, nc * 128)
    xp[:R, :C] = x.abs()
    if block_dim == 1:
        amax = xp.view(nr * 128, nc, 128).amax(-1)[:R]  # [R, nc]
        s = _scale(amax, FMAX[fp8], pow2, eps)
        per_elem = s.repeat_interleave(128, dim=1)[:, :C]
        scale_inv = (1.0 / s).t().contiguous()  # [nc, R]
    else:
        amax = xp.view(nr, 128, nc, 128).amax(dim=(1, 3))  # [nr, nc]
        s = _scale(amax, FMAX[fp8], pow2, eps)
        per_elem = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:R, :C]
        scale_inv = 1.0 / s
    q = (x * per_elem).clamp(-FMAX[fp8], FMAX[fp8]).to(fp8)
    return q, scale_inv


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
def test_emulation_equals_cpu_bit_for_bit(shape, dtype, block_dim, pow2):
    x = _x(shape, dtype, seed=sum(shape))
    q = Float8BlockQuantizer(E4M3, block_dim=block_dim, power_2_scale=pow2).quantize(x)
    m = x.reshape(-1, shape[-1])
    want_q, want_s = emulate(m, block_dim, pow2=pow2)
    want_qt, want_st = emulate(m.t(), block_dim, pow2=pow2)
    assert torch.equal(_bits(q.data.reshape(m.shape)), _bits(want_q))
    assert torch.equal(_bits(q.scale_inv), _bits(want_s))
    assert torch.equal(_bits(q.data_t), _bits(want_qt))
    assert torch.equal(_bits(q.col_scale_inv), _bits(want_st))
    if block_dim == 2:  # one tile scale serves both copies: the byte transpose
        assert torch.equal(_bits(q.data_t), _bits(q.data.reshape(m.shape)).t())


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_emulation_formats_and_epsilon(fp8, eps):
    x = _x((67, 300), torch.float32, seed=5)
    x[3, :128] = 0.0  # an all-zero block: scale 1 (or from eps)
    x[10:20, 128:256] *= 1e-6  # tiny blocks: eps caps their scale
    for block_dim in (1, 2):
        q = Float8BlockQuantizer(fp8, block_dim=block_dim, amax_epsilon=eps).quantize(x)
        wq, ws = emulate(x, block_dim, fp8=fp8, eps=eps)
        assert torch.equal(_bits(q.data), _bits(wq)) and torch.equal(q.scale_inv, ws)


def test_scale_edge_cases():
    """amax 0 -> scale 1; inf / NaN blocks -> scale 1 (the finite elements saturate, NaN stays
    NaN); power-of-two scales are exact powers of two."""
    x = torch.zeros(2, 256)
    x[1, 0] = float("inf")
    x[1, 128] = float("nan")
    x[1, 129] = 3.0
    q = Float8BlockQuantizer(E4M3, block_dim=1).quantize(x)
    assert torch.equal(q.scale_inv, torch.ones(2, 2))
    assert q.data[1, 0].float().item() == 448.0
    assert math.isnan(q.data[1, 128].float().item()) and q.data[1, 129].float().item() == 3.0
    y = _x((64, 384), torch.float32)
    s = Float8BlockQuantizer(E4M3, block_dim=1).quantize(y).scale_inv
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)


def _dequant_emulated(m: torch.Tensor, block_dim: int, out: torch.dtype) -> torch.Tensor:
    q, s = emulate(m, block_dim)
    R, C = m.shape
    if block_dim == 1:
        per = s.t().repeat_interleave(128, 1)[:, :C]
    else:
        per = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:R, :C]
    return (q.float() * per).to(out)


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("out", HP)
def test_dequantize_round_trip(block_dim, out):
    x = _x((130, 257), torch.float32, seed=1)
    q = Float8BlockQuantizer(E4M3, block_dim=block_dim).quantize(x)
    assert torch.equal(q.dequantize(out), _dequant_emulated(x, block_dim, out))
    # The columnwise copy alone dequantizes to the transposed copy's values.
    col_only = Float8BlockData(None, None, q.data_t, q.col_scale_inv, E4M3, x.shape, block_dim)
    assert torch.equal(col_only.dequantize(out), _dequant_emulated(x.t(), block_dim, out).t())
    # Values the format holds with every block's amax at 448 round-trip exactly.
    e = (torch.randn(256, 256) * 50).clamp(-448, 448).to(E4M3).float()
    e[::17, ::17] = 448.0
    e[:, 0] = 448.0
    e[0, :] = 448.0
    qe = Float8BlockQuantizer(E4M3, block_dim=block_dim).quantize(e)
    assert torch.equal(qe.dequantize(), e)


def test_outliers_survive_block_scaling():
    """One outlier token (or weight tile) 2^20 times larger: per-tensor scaling flushes the other
    tokens' small values to zero; block scaling keeps them (their blocks have their own
    scales)."""
    x = torch.full((256, 256), 1e-3) * torch.sign(torch.randn(256, 256))
    x[7] *= 2.0**20  # the outlier token (row)
    per_tensor = Float8CurrentScalingQuantizer(E4M3).quantize(x).dequantize()
    block = Float8BlockQuantizer(E4M3, block_dim=1).quantize(x).dequantize()
    others = torch.arange(256) != 7
    assert (per_tensor[others] == 0).all()  # flushed
    assert torch.allclose(block[others], x[others], rtol=0.07)
    w = torch.full((256, 256), 1e-3)
    w[:128, :128] *= 2.0**20  # the outlier tile
    per_tensor_w = Float8CurrentScalingQuantizer(E4M3).quantize(w).dequantize()
    block_w = Float8BlockQuantizer(E4M3, block_dim=2).quantize(w).dequantize()
    assert (per_tensor_w[128:, 128:] == 0).all()
    assert torch.allclose(block_w[128:, 128:], w[128:, 128:], rtol=0.07)


# ---- recipe, roles, states ---------------------------------------------------------------------


def test_recipe_defaults_and_validation():
    r = recipe.Float8BlockScaling()
    assert (r.fp8_format, r.x_block_scaling_dim, r.w_block_scaling_dim) == (
        recipe.Format.E4M3, 1, 2,
    )  # fmt: skip
    assert r.grad_block_scaling_dim == 1 and r.power_2_scale is True and r.amax_epsilon == 0.0
    assert r == recipe.Float8BlockScaling() and hash(r) == hash(recipe.Float8BlockScaling())
    with pytest.raises(AttributeError):  # frozen
        r.power_2_scale = False  # type: ignore[misc]
    bad = [
        dict(fp8_format=recipe.Format.E5M2),
        dict(fp8_format="E4M3"),
        dict(x_block_scaling_dim=3),
        dict(w_block_scaling_dim=True),
        dict(x_block_scaling_dim=2),  # x and w both 2D
        dict(w_block_scaling_dim=1, grad_block_scaling_dim=2, x_block_scaling_dim=2),
        dict(power_2_scale=1),
        dict(amax_epsilon=-1.0),
        dict(amax_epsilon=float("inf")),
    ]
    for kw in bad:
        with pytest.raises(ValueError, match=r"Float8BlockScaling"):
            recipe.Float8BlockScaling(**kw)
    ok = recipe.Float8BlockScaling(fp8_format=recipe.Format.HYBRID, w_block_scaling_dim=1,
                                   x_block_scaling_dim=2)  # fmt: skip
    assert ok.block_dim(fusible.quantization.QuantizerRole.parse("input:linear")) == 2


def test_recipe_state_block_dims_by_role():
    r = recipe.Float8BlockScaling(fp8_format=recipe.Format.HYBRID)
    fwd = RecipeState.create(r, "forward", 3, ["input:linear", "weight:linear", "output:linear"])
    assert [q.block_dim for q in fwd.quantizers] == [1, 2, 1]
    assert all(q.dtype == E4M3 for q in fwd.quantizers)
    bwd = RecipeState.create(r, "backward", 2, ["grad_output:linear", "grad_input:linear"])
    assert [q.block_dim for q in bwd.quantizers] == [1, 1]
    assert all(q.dtype == E5M2 for q in bwd.quantizers)
    assert RecipeState.create(r, "forward", 2).quantizers[0].block_dim == 1  # no roles
    assert fusible.quantization.recipe_state_to_dict(fwd) == {}  # stateless


def test_rule_recipe_weights_blockwise_rest_per_tensor():
    rec = recipe.CustomRecipe.from_rules(
        {"weight:*": recipe.Float8BlockScaling(), "*": recipe.Float8CurrentScaling()}
    )
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(128, 64, bias=False))
    state = RecipeState.create(rec, "forward", 3, model.get_quantizer_roles(True))
    assert isinstance(state.quantizers[1], Float8BlockQuantizer)
    assert isinstance(state.quantizers[0], Float8CurrentScalingQuantizer)
    x = torch.randn(32, 128, requires_grad=True)
    with fusible.autocast(recipe=rec):
        y = model(x)
        text = model.explain()
    y.sum().backward()
    ref = x.double() @ model[0].weight.double().t()
    assert ((y - ref).norm() / ref.norm()).item() < 0.1
    assert "dequantized operands (blockwise FP8 mixed with another format)" in text


# ---- GEMM -------------------------------------------------------------------------------------


def _operands(m, n, k, da, db):
    a = _x((m, k), torch.float32, 1)
    b = _x((n, k), torch.float32, 2)
    qa = Float8BlockQuantizer(E4M3, block_dim=da).quantize(a, columnwise=False)
    qb = Float8BlockQuantizer(E4M3, block_dim=db).quantize(b, columnwise=False)
    return qa, qb


@pytest.mark.parametrize("dims", [(1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("mnk", [(16, 32, 48), (128, 256, 384), (64, 48, 656), (4, 4, 16)])
def test_gemm_block_cpu_is_the_dequantized_gemm(dims, mnk):
    m, n, k = mnk
    qa, qb = _operands(m, n, k, *dims)
    c = torch.randn(m, n)
    d = K.gemm_block(qa.data, qa.scale_inv, dims[0], qb.data, qb.scale_inv, dims[1],
                     torch.float32, c, 2.0, 1.0)  # fmt: skip
    ref = 2.0 * (qa.dequantize().double() @ qb.dequantize().double().t()) + c.double()
    assert torch.allclose(d.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("mnk", [(16, 32, 48), (128, 256, 400), (48, 16, 656)])
def test_gemm_block_bias_is_added_before_the_one_rounding(mnk, dims, out, device):
    """The BIAS epilogue of the blockwise GEMM: on the CPU, the bits of the float32 GEMM plus the
    bias in one fp32 add, rounded once to out (gemm.h's order); on CUDA (cuBLASLt) the same
    within the GEMM's tolerance."""
    m, n, k = mnk
    qa, qb = _operands(m, n, k, *dims)
    if out == torch.float16:  # operands scaled down (by powers of 2): no fp16 overflow
        qa = Float8BlockQuantizer(E4M3, block_dim=dims[0]).quantize(
            qa.dequantize() * 2.0**-6, columnwise=False
        )
        qb = Float8BlockQuantizer(E4M3, block_dim=dims[1]).quantize(
            qb.dequantize() * 2.0**-6, columnwise=False
        )
    bias = (torch.randn(n) * 4).to(out)
    args = (
        [t.to(device) for t in (qa.data, qa.scale_inv)],
        [t.to(device) for t in (qb.data, qb.scale_inv)],
    )
    (a, sa), (b, sb) = args
    d = K.gemm_block(a, sa, dims[0], b, sb, dims[1], out, None, 1.0, 0.0, bias.to(device))
    f32 = K.gemm_block(qa.data, qa.scale_inv, dims[0], qb.data, qb.scale_inv, dims[1],
                       torch.float32, None, 1.0, 0.0)  # fmt: skip
    want = (f32 + bias.float()).to(out)
    if device == "cpu":
        assert torch.equal(d, want)
    else:
        ref = qa.dequantize().double() @ qb.dequantize().double().t() + bias.double()
        tol = 2e-2 * ref.abs().max().item()
        assert torch.isfinite(ref).all() and (d.cpu().double() - ref).abs().max().item() <= tol
        # One rounding, not two: never further from the exact value than the unfused pair's.
        two = K.gemm_block(a, sa, dims[0], b, sb, dims[1], out, None, 1.0, 0.0) + bias.to(device)
        assert (d.cpu().double() - ref).abs().mean() <= (
            two.cpu().double() - ref
        ).abs().mean() * 1.05


def test_gemm_block_bias_bad_input_names_the_argument():
    qa, qb = _operands(16, 32, 48, 1, 2)
    call = lambda bias, out=torch.bfloat16: K.gemm_block(  # noqa: E731
        qa.data, qa.scale_inv, 1, qb.data, qb.scale_inv, 2, out, None, 1.0, 0.0, bias
    )
    with pytest.raises(ValueError, match=r"gemm_block.*'bias' has shape \(31,\), expected \(32,\)"):
        call(torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises((TypeError, ValueError), match=r"gemm_block.*'bias'"):
        call(torch.zeros(32, dtype=torch.float16))  # not out_dtype
    with pytest.raises((TypeError, ValueError), match=r"gemm_block.*'bias'"):
        call(torch.zeros(32), torch.float32)  # a float32 output: no 16-bit bias epilogue


def test_gemm_rules_block_rows_match_gemm_block():
    """GEMM_RULES' blockwise rows (read from the core library) agree with what gemm_block
    accepts on the CPU: every pair of block shapes, every output dtype."""
    rules = K.GEMM_RULES
    assert rules.block_epilogues == ("none", "bias")
    for (da, db), out in itertools.product(
        itertools.product((1, 2), (1, 2)), K.HIGH_PRECISION_DTYPES + K.FP8_DTYPES
    ):
        qa, qb = _operands(16, 16, 32, da, db)
        try:
            K.gemm_block(qa.data, qa.scale_inv, da, qb.data, qb.scale_inv, db, out, None, 1.0, 0.0)
            accepted = True
        except (TypeError, ValueError):
            accepted = False
        expected = (da, db) in rules.block_pairs and out in rules.block_out_dtypes
        assert accepted == expected, (da, db, out)


def test_gemm_block_bad_input():
    qa, qb = _operands(16, 16, 32, 2, 2)
    with pytest.raises(TypeError, match=r"both 128x128"):  # FUS_ERROR_UNSUPPORTED
        K.gemm_block(qa.data, qa.scale_inv, 2, qb.data, qb.scale_inv, 2, torch.float32, None,
                     1.0, 0.0)  # fmt: skip
    qa, qb = _operands(16, 16, 32, 1, 2)
    with pytest.raises(ValueError, match=r"gemm_block.*'a_scale_inv'.*expected"):
        K.gemm_block(qa.data, qb.scale_inv, 1, qb.data, qb.scale_inv, 2, torch.float32, None,
                     1.0, 0.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"gemm_block.*'a_block_dim'"):
        K.gemm_block(qa.data, qa.scale_inv, 3, qb.data, qb.scale_inv, 2, torch.float32, None,
                     1.0, 0.0)  # fmt: skip
    with pytest.raises(TypeError, match=r"out_dtype"):
        K.gemm_block(qa.data, qa.scale_inv, 1, qb.data, qb.scale_inv, 2, E4M3, None, 1.0, 0.0)
    qa, qb = _operands(6, 16, 32, 1, 2)
    with pytest.raises(ValueError, match=r"multiples of 4"):
        K.gemm_block(qa.data, qa.scale_inv, 1, qb.data, qb.scale_inv, 2, torch.float32, None,
                     1.0, 0.0)  # fmt: skip


def test_quantize_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"quantize_fp8_block.*'block_dim'"):
        K.quantize_fp8_block(x, E4M3, 3, True, 0.0, True, True)
    with pytest.raises(ValueError, match=r"quantize_fp8_block.*'amax_epsilon'"):
        K.quantize_fp8_block(x, E4M3, 1, True, -1.0, True, True)
    with pytest.raises(ValueError, match=r"dequantize_fp8_block.*'scale_inv'.*expected"):
        K.dequantize_fp8_block(x.to(E4M3), torch.ones(2, 2), 1, torch.float32)
    with pytest.raises(ValueError, match=r"block_dim"):
        Float8BlockQuantizer(E4M3, block_dim=0)


def test_fake_kernels_match():
    """Shapes under fake tensors (torch.compile) equal the C++ operators' (the quantize and
    dequantize cases are in test_kernels_quantize.py's opcheck table)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    qa, qb = _operands(32, 16, 256, 1, 2)
    real = K.gemm_block(qa.data, qa.scale_inv, 1, qb.data, qb.scale_inv, 2, torch.bfloat16, None,
                        1.0, 0.0)  # fmt: skip
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = K.gemm_block(qa.data, qa.scale_inv, 1, qb.data, qb.scale_inv, 2, torch.bfloat16,
                            None, 1.0, 0.0)  # fmt: skip
        outs = K.quantize_fp8_block(torch.empty(130, 257), E4M3, 2, True, 0.0, True, True)
    assert fake.shape == real.shape and fake.dtype == real.dtype
    want = K.quantize_fp8_block(torch.randn(130, 257), E4M3, 2, True, 0.0, True, True)
    assert [tuple(t.shape) for t in outs] == [tuple(t.shape) for t in want]


# ---- ops and modules under the recipe -------------------------------------------------------


def _preq(shape, seed):
    """Values every blockwise cast quantizes exactly: E4M3 values with 448 in every 128-block
    along rows and down columns (block scale 1)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 56).clamp(-448, 448).to(E4M3).float()
    m = x.reshape(-1, shape[-1])
    r, c = torch.arange(m.shape[0]).unsqueeze(1), torch.arange(m.shape[1]).unsqueeze(0)
    m[(r % 128) == (c % 128)] = 448.0
    return m.reshape(shape)


REC = recipe.Float8BlockScaling()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_mlp_and_layernorm_linear_vs_fp64(dtype):
    """The fc GEMMs on pre-quantized operands (identity norm, ReLU-free: only the GEMMs round)."""
    h, f, t = 128, 256, 64
    x = _preq((t, h), 1).to(dtype)
    m = fusible.LayerNormLinear(h, f, bias=False, dtype=dtype)
    seq = ops.Sequential(
        ops.Linear(h, f, bias=False, dtype=dtype), ops.Linear(f, h, bias=False, dtype=dtype)
    )
    with torch.no_grad():
        seq[0].weight.copy_(_preq((f, h), 3))
        seq[1].weight.copy_(_preq((h, f), 4) / 448.0 / 16.0)
    with fusible.autocast(recipe=REC):
        y = seq(x)
    ref = x.double() @ seq[0].weight.double().t()
    ref = ref.to(dtype).double()  # the hidden activation is rounded to dtype between the GEMMs
    ref2 = ref @ seq[1].weight.double().t()
    err = ((y.double() - ref2).norm() / ref2.norm()).item()
    assert err < 0.1  # the hidden activation is re-quantized (not pre-quantized) for fc2
    with fusible.autocast(recipe=REC):
        out = m(x)
    assert out.shape == (t, f) and torch.isfinite(out.float()).all()
    mlp = fusible.LayerNormMLP(h, f, dtype=dtype)
    with fusible.autocast(recipe=REC):
        y = mlp(x)
        text = mlp.explain() if hasattr(mlp, "explain") else ""
    y.float().sum().backward()
    assert torch.isfinite(y.float()).all()
    assert "blockwise FP8" in text or not text


def test_fused_plan_equals_unfused_plan():
    """The norm and activation kernels write the blockwise output themselves (the cast of their
    rounded output): the fused plan equals the unfused one bit for bit."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.LayerNorm(128), ops.Linear(128, 256), ops.GELU(),
                           ops.Linear(256, 128))  # fmt: skip
    twin = copy.deepcopy(model)
    x = torch.randn(64, 128)
    with fusible.autocast(recipe=REC):
        y = model(x)
        text = model.explain()
        with ops.fusion_disabled():
            y2 = twin(x)
    assert "linear_bias_activation" in text and "separate blockwise cast" not in text
    assert torch.equal(y, y2)


# ---- the fused kernels write the blockwise output ------------------------------------------------

# The recipes' blockwise variants the fused kernels take: 1x128 activations (default), 128x128
# ones (x_block_scaling_dim=2, weights 1x128 then), exact fp32 scales with an amax floor.
FUSED_RECIPES = {
    "default": recipe.Float8BlockScaling(),
    "x128x128": recipe.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    "exact_eps": recipe.Float8BlockScaling(power_2_scale=False, amax_epsilon=1e-3),
}
ACTS = [
    ops.GELU,
    lambda: ops.GELU(approximate="none"),
    ops.ReLU,
    ops.SiLU,
    ops.SwiGLU,
    ops.GEGLU,
]


def _fused_models(h: int, f: int, dtype: torch.dtype):
    """(name, model, [(pass, shape)] of the activations a separate cast would quantize): every
    pattern whose units write the next op's blockwise input -- norm + quantize, activation +
    quantize forward and backward, Linear + Bias + GELU forward, dact + dbias + quantize."""
    out = []
    for norm in (ops.LayerNorm, ops.RMSNorm):
        torch.manual_seed(0)
        model = ops.Sequential(norm(h, dtype=dtype), ops.Linear(h, f, dtype=dtype))
        out.append((norm.__name__, model, [("fwd", h)]))
    for make in ACTS:
        for bias in (False, True):
            torch.manual_seed(0)
            act = make()
            f2 = f // 2 if act.glu else f
            model = ops.Sequential(ops.Linear(h, f, bias=bias, dtype=dtype), act,
                                   ops.Linear(f2, h, dtype=dtype))  # fmt: skip
            with torch.no_grad():
                if bias:
                    model[1].bias.normal_()
            out.append((f"{act.kind}_bias{int(bias)}", model, [("fwd", f2), ("bwd", f)]))
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("tokens", [16, 144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rec_name", sorted(FUSED_RECIPES))
def test_fused_kernels_write_blockwise_output_bit_for_bit(
    rec_name, dtype, tokens, device, monkeypatch
):
    """Every fusion under Float8BlockScaling against the unfused ops (fusion_disabled: no
    hand-off, the next op casts with the blockwise quantize): outputs and gradients bit for bit
    (the bias gradients of a dact + dbias unit and of a Bias beside the Linear's grad_output
    cast are summed in the kernel's fixed order, so within fp32 rounding). On CPU the fused plan
    runs no separate cast of the activations it hands off (the norm / activation kernels write
    them blockwise); on CUDA it does (_compute.fused_quant_args: the fused blockwise kernels are
    slower there than kernel + cast). Widths 80 and 224 are not multiples of 128 (partial
    blocks), nor is the token count 144."""
    rec = FUSED_RECIPES[rec_name]
    kernel_casts = device == "cpu"
    h, f = 80, 224
    calls: list[tuple[str, tuple[int, ...]]] = []
    real = K.quantize_fp8_block

    def counting(x, *args):
        calls.append((phase[0], tuple(x.shape)))
        return real(x, *args)

    phase = ["fwd"]
    monkeypatch.setattr(K, "quantize_fp8_block", counting)
    # The fused Linear + Bias adds a 16-bit bias in the blockwise GEMM's epilogue (one rounding;
    # tested by test_gemm_block_bias_is_added_before_the_one_rounding), the unfused Bias op after
    # it (two): here both add it after, so the hand-offs under test see the same bits.
    monkeypatch.setattr(C, "_BLOCK_BIAS_DTYPES", ())
    for name, model, handed in _fused_models(h, f, dtype):
        model = model.to(device)
        twin = copy.deepcopy(model)
        x = _x((tokens, h), dtype, seed=1).float().clamp(-8, 8).to(dtype).to(device)
        results = []
        for m, fused in ((model, True), (twin, False)):
            calls.clear()
            xr = x.clone().requires_grad_(True)
            with fusible.autocast(recipe=rec):
                phase[0] = "fwd"
                if fused:
                    y = m(xr)
                    text = m.explain()
                else:
                    with ops.fusion_disabled():
                        y = m(xr)
            phase[0] = "bwd"
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
            y.backward(dy.to(device))
            seen = {(p, s[-1]) for p, s in calls if s[0] == tokens}
            for pas, width in handed:  # a separate cast of a handed-off activation?
                separate = not (fused and kernel_casts)
                assert ((pas, width) in seen) == separate, (name, fused, pas, width, seen)
            results.append((y, xr.grad, {n: p.grad for n, p in m.named_parameters()}))
        (y, dx, grads), (y2, dx2, grads2) = results
        assert "separate blockwise cast" not in text
        assert torch.equal(_bits(y), _bits(y2)), name
        assert torch.equal(_bits(dx), _bits(dx2)), name
        for n in grads:
            if n.endswith("bias"):  # dact + dbias, Bias beside the cast: the kernel's order
                torch.testing.assert_close(grads[n], grads2[n], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(_bits(grads[n]), _bits(grads2[n])), (name, n)


def test_quantized_model_init_and_state_dict_round_trip():
    with fusible.quantized_model_init(REC):
        model = fusible.LayerNormMLP(128, 256)
    weights = [p for p in model.parameters() if p.dim() == 2]
    assert weights and all(isinstance(w, Float8BlockTensor) for w in weights)
    x = torch.randn(32, 128)
    with fusible.autocast(recipe=REC):
        y = model(x)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    with fusible.quantized_model_init(REC):
        other = fusible.LayerNormMLP(128, 256)
    other.load_state_dict(torch.load(buf, weights_only=False))
    with fusible.autocast(recipe=REC):
        y2 = other(x)
    assert torch.equal(y, y2)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        if isinstance(a, Float8BlockTensor):
            assert torch.equal(_bits(a.qdata.data), _bits(b.qdata.data))
            assert torch.equal(a.qdata.scale_inv, b.qdata.scale_inv)


def test_linear_sizes_the_gemm_cannot_take_raise():
    with fusible.autocast(recipe=REC):
        with pytest.raises(ValueError, match=r"BasicLinear.*in_features.*multiple of 16.*100"):
            ops.Sequential(ops.Linear(100, 64))(torch.randn(16, 100))
        with pytest.raises(ValueError, match=r"out_features.*multiple of 16.*33"):
            ops.Sequential(ops.Linear(64, 33))(torch.randn(16, 64))
        with pytest.raises(ValueError, match=r"token count.*multiple of 16.*7"):
            ops.Sequential(ops.Linear(64, 64))(torch.randn(7, 64))
        with pytest.raises(ValueError, match=r"GroupedLinear.*multiples of 16.*m_splits"):
            ops.Sequential(ops.GroupedLinear(2, 64, 64))(torch.randn(24, 64), m_splits=[8, 16])


def test_training_within_5_percent_of_bf16():
    """A short regression run: the blockwise loss stays within 5% of the bf16 one."""

    def run(rec):
        torch.manual_seed(0)
        model = ops.Sequential(ops.LayerNorm(128), ops.Linear(128, 256), ops.GELU(),
                               ops.Linear(256, 128))  # fmt: skip
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        target = ops.Sequential(ops.Linear(128, 128)).to(torch.bfloat16)
        losses = []
        for _ in range(60):
            x = torch.randn(64, 128, generator=g).to(torch.bfloat16)
            with torch.no_grad():
                t = torch.tanh(target(x))
            with fusible.autocast(enabled=rec is not None, recipe=rec):
                y = model(x)
            loss = (y.float() - t.float()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return sum(losses[-10:]) / 10

    base, block = run(None), run(REC)
    assert abs(block - base) / base < 0.05, (block, base)


# ---- CUDA (skipped on CPU-only machines) -----------------------------------------------------


@cuda
@pytest.mark.parametrize("shape", [*SHAPES, (1024, 4096)])
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
def test_cuda_quantize_equals_cpu(shape, dtype, block_dim, pow2):
    x = _x(shape, dtype, seed=3)
    q = Float8BlockQuantizer(E4M3, block_dim=block_dim, power_2_scale=pow2)
    a, b = q.quantize(x), q.quantize(x.cuda())
    for f in ("data", "scale_inv", "data_t", "col_scale_inv"):
        assert torch.equal(_bits(getattr(a, f)), _bits(getattr(b, f).cpu())), f
    for out in HP:
        assert torch.equal(_bits(a.dequantize(out)), _bits(b.dequantize(out).cpu()))
        col_a = Float8BlockData(None, None, a.data_t, a.col_scale_inv, E4M3, a.shape, block_dim)
        col_b = Float8BlockData(None, None, b.data_t, b.col_scale_inv, E4M3, b.shape, block_dim)
        assert torch.equal(_bits(col_a.dequantize(out)), _bits(col_b.dequantize(out).cpu()))


# Shapes for the CUDA kernels' edge paths: widths below one 16-byte input chunk (< 4 fp32 or < 8
# 16-bit elements) or not a multiple of it, widths a multiple of 8 but not of 16, row counts that
# are not a multiple of 16 (no 16-byte stores of the transposed copy), one row, full tiles.
CUDA_EDGE_SHAPES = [(5, 3), (300, 2), (17, 7), (1, 4096), (2, 1024), (136, 200), (144, 264),
                    (256, 384), (255, 513), (1000, 12)]  # fmt: skip
USAGES = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}


def _x_specials(shape, dtype, seed):
    """_x with zeros of both signs, NaNs, infinities, subnormals (of fp32 / bf16 and of fp16) and
    values that saturate either FP8 format mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = _x(shape, torch.float32, seed)
    pick = torch.randint(0, 1000, shape, generator=g)
    for lo, hi, v in [(0, 10, torch.zeros(())), (10, 15, torch.tensor(-0.0)),
                      (15, 17, torch.tensor(float("nan"))), (17, 18, torch.tensor(float("inf"))),
                      (18, 19, torch.tensor(float("-inf"))), (19, 25, x * 2.0**-130),
                      (25, 31, x * 2.0**-14), (31, 35, x * 2.0**100)]:  # fmt: skip
        x = torch.where((pick >= lo) & (pick < hi), v, x)
    return x.to(dtype)


def _same_outputs(want, got):
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert torch.equal(_bits(a), _bits(b.cpu())), i


@cuda
@pytest.mark.parametrize("shape", [*SHAPES, *CUDA_EDGE_SHAPES])
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("usage", USAGES)
def test_cuda_quantize_formats_usages_specials(shape, dtype, fp8, block_dim, usage):
    """CUDA == CPU bits for each FP8 format and each usage (both copies, one of them), on values
    with specials; then the same input at an address one element past a 16-byte boundary (the
    kernels' element-wise load path)."""
    x = _x_specials(shape, dtype, seed=sum(shape) + 7)
    args = (fp8, block_dim, True, 0.0, *USAGES[usage])
    want = K.quantize_fp8_block(x, *args)
    _same_outputs(want, K.quantize_fp8_block(x.cuda(), *args))
    xm = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:].view(x.shape)
    xm.copy_(x)
    assert xm.data_ptr() % 16 != 0
    _same_outputs(want, K.quantize_fp8_block(xm, *args))


@cuda
@pytest.mark.parametrize("shape", [(130, 257), (256, 384), (17, 7)])
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("block_dim", [1, 2])
def test_cuda_quantize_epsilon_and_exact_scales(shape, dtype, block_dim):
    """amax_epsilon > 0 with power_2_scale off (the scale's division is not rounded away)."""
    x = _x(shape, dtype, seed=11)
    x[..., :3] *= 1e-6  # tiny blocks: eps caps their scale
    for fp8 in (E4M3, E5M2):
        args = (fp8, block_dim, False, 1e-3, True, True)
        _same_outputs(K.quantize_fp8_block(x, *args), K.quantize_fp8_block(x.cuda(), *args))


@cuda
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("shape", [(130, 256), (3, 200), (257, 16), (64, 4096), (1, 5), (129, 129)])
def test_cuda_dequantize_every_code_equals_cpu(fp8, block_dim, shape):
    """Random codes (every code, NaN codes too) with scales 0, inf, NaN, negative and spread over
    2^+-20, into every output dtype: the 16-byte path (C % 16 == 0, aligned) and the element path
    (C % 16 != 0, or the codes at an address 3 bytes past a 16-byte boundary)."""
    R, C = shape
    g = torch.Generator().manual_seed(R * 131 + C)
    codes = torch.randint(0, 256, (R, C), generator=g, dtype=torch.uint8)
    nr, nc = math.ceil(R / 128), math.ceil(C / 128)
    sshape = (nc, R) if block_dim == 1 else (nr, nc)
    specials = torch.tensor([1.0, 0.0, float("inf"), float("nan"), -2.0, 1e-30, 3e38, 0.75])
    s = specials[torch.randint(0, 8, sshape, generator=g)] * torch.exp2(
        torch.randint(-20, 21, sshape, generator=g).float()
    )
    qm = torch.empty(R * C + 3, dtype=torch.uint8, device="cuda")[3:].view(R, C)
    qm.copy_(codes)
    for out in HP:
        want = K.dequantize_fp8_block(codes.view(fp8), s, block_dim, out)
        got = K.dequantize_fp8_block(codes.view(fp8).cuda(), s.cuda(), block_dim, out)
        assert torch.equal(_bits(want), _bits(got.cpu())), out
        got = K.dequantize_fp8_block(qm.view(fp8), s.cuda(), block_dim, out)
        assert torch.equal(_bits(want), _bits(got.cpu())), out


@cuda
@pytest.mark.parametrize("dims", [(1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize(
    "mnk", [(16, 32, 48), (128, 256, 384), (256, 512, 656), (2048, 1024, 8192)]
)
@pytest.mark.parametrize("out", HP)
def test_cuda_gemm_block_vs_dequantized_reference(dims, mnk, out):
    """cuBLASLt's block-scaled FP8 GEMM against the exactly dequantized FP64 GEMM.

    Operands of unit scale: _x's spread of 2**+-12 makes dot products of ~1e8, past float16's
    range (an inf there says nothing about the kernel). The float32 bound is Hopper's FP8 tensor
    cores, which keep partial sums to about 14 bits inside each 128-long K block before the
    scaled promotion (the DeepSeek-V3 report, section 3.3.2): 1.4e-4 relative was measured on
    the H200 for (128, 256, 384) with _x's operands, against 1e-7 for an exact float32 sum."""
    m, n, k = mnk
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    qa = Float8BlockQuantizer(E4M3, block_dim=dims[0]).quantize(a, columnwise=False).to("cuda")
    qb = Float8BlockQuantizer(E4M3, block_dim=dims[1]).quantize(b, columnwise=False).to("cuda")
    d = K.gemm_block(qa.data, qa.scale_inv, dims[0], qb.data, qb.scale_inv, dims[1], out, None,
                     1.0, 0.0)  # fmt: skip
    assert torch.isfinite(d).all()
    ref = qa.dequantize().double() @ qb.dequantize().double().t()
    err = ((d.double() - ref).norm() / ref.norm()).item()
    assert err < {torch.float32: 1e-3, torch.bfloat16: 8e-3, torch.float16: 3e-3}[out], err


def test_blockwise_fuses_into_norm_and_activation_kernels_on_cpu_only():
    """_compute.fused_quant_args: the norm / activation kernels write blockwise output on CPU; on
    CUDA their output is cast by the standalone blockwise quantize (faster there)."""

    for block_dim in (1, 2):
        q = Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=block_dim)
        got = C.fused_quant_args(q, torch.device("cpu"))
        assert got is not None and got[0] == f"block{block_dim}d"
        assert C.fused_quant_args(q, torch.device("cuda", 0)) is None


@cuda
def test_cuda_linear_matches_cpu():
    torch.manual_seed(0)
    model = ops.Sequential(ops.LayerNorm(256), ops.Linear(256, 512), ops.GELU(),
                           ops.Linear(512, 256))  # fmt: skip
    gpu = copy.deepcopy(model).cuda()
    x = torch.randn(128, 256)
    with fusible.autocast(recipe=REC):
        y, yg = model(x), gpu(x.cuda())
    # The CPU GEMM is the exact dequantized one, the GPU's keeps ~14-bit partial sums (see
    # test_cuda_gemm_block_vs_dequantized_reference): fc1's outputs differ by ~1e-4, and the
    # cast after GELU then rounds a few values to the neighbouring E4M3 code (6-12% each), so
    # the two agree to about 1e-2, not to the GEMM's own error.
    assert ((yg.cpu() - y).norm() / y.norm()).item() < 2e-2
