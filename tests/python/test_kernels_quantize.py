"""Tests of the quantize and recipe custom ops (torch.ops.fusible.*, python/fusible/_kernels/).

The numerics contract is cpp/include/fusible/{common,quantize,recipe}.h. Every expected value here
comes from a plain-torch reference written in this file, and casts are compared bit for bit on the
uint8 view of the FP8 data:

- per-tensor cast: ``(x.float() * scale).clamp(-max, max).to(fp8)``. torch's own conversion turns
  overflow into NaN (E4M3) or inf (E5M2) where fusible saturates, hence the clamp; NaN keeps
  torch's bits ``0x7F | sign``.
- MXFP8: the OCP MX rule, written below from the header's text (frexp gives floor(log2) exactly).
- delayed scaling: the three steps of recipe.h.

Tests marked ``cuda`` compare the CUDA backend with the CPU backend bit for bit; they are skipped
unless a GPU and a CUDA build of fusible are present (see conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import (  # noqa: F401
    INT_VIEW,
    _name,
    _one_torch_thread,
    bits,
    fp8_allclose_supported,
)

import fusible._kernels as K

ops = torch.ops.fusible

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
EMAX = {E4M3: 8, E5M2: 15}  # exponent of the largest normal (OCP MX emax_elem)
MANT_BITS = {E4M3: 3, E5M2: 2}
MIN_SUBNORMAL_LOG2 = {E4M3: -9, E5M2: -16}  # log2 of the smallest subnormal
FLT_MAX = torch.finfo(torch.float32).max
BLOCK = 32

SHAPES = [(0,), (4, 0), (0, 3), (1,), (7,), (127,), (4097,), (3, 5, 7), (1, 4097), (127, 33)]
MX_SHAPES = [*SHAPES, (32, 32), (33, 65), (64, 31), (95, 64)]
GPU_SHAPES = [(1024, 4097), (4097,), (1, 4097), (127, 33), (3, 5, 7), (33, 1), (0, 7)]

NAN = float("nan")
INF = float("inf")
# Values that exercise the cast: NaN of both signs, infinities, signed zeros, overflow, fp32
# subnormals, ties of the E4M3 grid (464 between 448 and 480, 0.009765625 * 1.5 ...), E5M2 overflow.
SPECIALS = [NAN, -NAN, INF, -INF, 0.0, -0.0, 1e6, -1e6, 1e-42, -3e-39, 6e-5, 464.0, -480.0,
            61440.0, 0.0029296875, 0.0068359375, 1.0625, 5e-3]  # fmt: skip


# ---- helpers ------------------------------------------------------------------------------------


def _mismatches(got: torch.Tensor, want: torch.Tensor, bad: torch.Tensor) -> str:
    idx = bad.nonzero()[:6].tolist()
    g, w = got.detach().cpu(), want.detach().cpu()
    gb, wb = bits(g), bits(w)
    lines = [
        f"  at {tuple(i)}: got {g[tuple(i)].float().item()!r} (bits {gb[tuple(i)].item():#x}), "
        f"want {w[tuple(i)].float().item()!r} (bits {wb[tuple(i)].item():#x})"
        for i in idx
    ]
    return f"{int(bad.sum())} of {bad.numel()} differ:\n" + "\n".join(lines)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits (NaN payloads and signs included)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {got.shape} != {want.shape}"
    bad = bits(got) != bits(want)
    assert not bad.any(), f"{what}: " + _mismatches(got, want, bad)


def assert_equal_nan(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits, except that any NaN matches any NaN (for high-precision
    outputs, whose NaN payload and sign the contract leaves open)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {got.shape} != {want.shape}"
    g, w = got.detach().cpu(), want.detach().cpu()
    bad = (bits(g) != bits(w)) & ~(g.isnan() & w.isnan())
    assert not bad.any(), f"{what}: " + _mismatches(g, w, bad)


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def make_input(shape, dtype, *, magnitude: float = 64.0, specials: bool = True) -> torch.Tensor:
    """randn * magnitude with the SPECIALS scattered in (when there is room), as ``dtype``."""
    x = torch.randn(shape) * magnitude
    if specials and x.numel() >= 4 * len(SPECIALS):
        flat = x.view(-1)
        idx = torch.randperm(flat.numel())[: len(SPECIALS)]
        flat[idx] = torch.tensor(SPECIALS)
        flat[idx[1]] = -torch.tensor(NAN)  # a NaN with the sign bit set, whatever float() gives
    return x.to(dtype)


def random_bits(shape, dtype) -> torch.Tensor:
    """Uniformly random bit patterns of a float dtype: NaNs, infinities, subnormals and all."""
    width = torch.tensor([], dtype=dtype).element_size() * 8
    r = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), shape, dtype=torch.int64)
    return r.to(INT_VIEW[width // 8]).view(dtype)


def all_bit_patterns(dtype) -> torch.Tensor:
    """Every fp16 / bf16 value (65536 of them), as a [2048, 32] matrix."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).view(-1, 32)


def ref_cast(x32: torch.Tensor, scale: torch.Tensor | float, fp8_dtype) -> torch.Tensor:
    """fp8(x * scale): fp32 product, RNE, saturating; NaN -> torch's bits (0x7F | sign), with
    quantize.h's NaN rule for the product: a NaN x keeps its sign, any other NaN product (NaN
    scale, inf * 0) is +NaN."""
    y = x32 * scale
    y = torch.where(y.isnan() & ~x32.isnan(), torch.full_like(y, float("nan")).abs(), y)
    m = FP8_MAX[fp8_dtype]
    y = torch.where(y.isnan(), y, y.clamp(-m, m))
    return y.to(fp8_dtype)


def ref_amax(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros(1)
    return x.detach().cpu().float().abs().max().reshape(1)


def ref_scale(amax: float, fp8_max: float, margin: int, fallback: float = 1.0) -> torch.Tensor:
    """scale = fp8_max / amax (fp32 division) * 2**-margin, FLT_MAX on overflow; fallback unless
    amax is finite and > 0."""
    if not (math.isfinite(amax) and amax > 0):
        return torch.tensor([fallback], dtype=torch.float32)
    q = torch.tensor([fp8_max], dtype=torch.float32) / torch.tensor([amax], dtype=torch.float32)
    s = (q.double() * 2.0**-margin).float()  # exact scaling by 2**-margin, then one rounding
    return torch.where(s.isinf(), torch.tensor(FLT_MAX), s)


def pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """2.0**k as float32 for integer k in [-149, 127], built from float64 bits (exact)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64).float()


def ref_mxfp8_rowwise(x: torch.Tensor, fp8_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX rule along rows of a [rows, cols] matrix: (fp8 data, E8M0 scales as uint8)."""
    x = x.float()
    rows, cols = x.shape
    nb = -(-cols // BLOCK)
    xp = torch.nn.functional.pad(x, (0, nb * BLOCK - cols)).reshape(rows, nb, BLOCK)
    finite = torch.isfinite(xp)
    nonfinite_block = (~finite).any(-1)
    amax = torch.where(finite, xp.abs(), 0.0).amax(-1) if xp.numel() else xp.new_zeros(rows, nb)
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    e = exp.to(torch.int32) - 1 - EMAX[fp8_dtype]
    byte = (e + 127).clamp(0, 254)
    byte = torch.where(amax == 0, 0, byte)
    byte = torch.where(nonfinite_block, 255, byte)
    mult = pow2_f32(127 - byte.clamp(max=254))  # 2**-e with e = byte - 127
    mult = torch.where(nonfinite_block, NAN, mult)
    q = ref_cast(xp, mult[..., None], fp8_dtype).view(torch.uint8)
    # A block with a NaN scale casts x * NaN. The cast keeps x's sign where x is itself a NaN
    # (0x7F | sign); any other element gets the scale's NaN, which is positive (0x7F). Which NaN
    # x86's x * NaN returns depends on operand order, so torch's product is not used here.
    nan_bits = 0x7F | ((xp.isnan() & torch.signbit(xp)).to(torch.uint8) << 7)
    q = torch.where(nonfinite_block[..., None], nan_bits, q).view(fp8_dtype)
    q = q.reshape(rows, nb * BLOCK)[:, :cols]
    return q.contiguous(), byte.to(torch.uint8)


def ref_mxfp8(x: torch.Tensor, fp8_dtype, columnwise: bool):
    """Reference for ``x`` of any shape: (data in x's shape, scales)."""
    m = as_matrix(x)
    if not columnwise:
        q, s = ref_mxfp8_rowwise(m, fp8_dtype)
    else:
        q, s = ref_mxfp8_rowwise(m.t().contiguous(), fp8_dtype)
        q, s = q.t().contiguous(), s.t().contiguous()
    return q.reshape(x.shape), s


def e8m0_to_f32(s: torch.Tensor) -> torch.Tensor:
    v = pow2_f32(s.to(torch.int32).clamp(max=254) - 127)
    return torch.where(s == 255, NAN, v)


def ref_dequantize_mxfp8(data, scale, columnwise: bool, out_dtype) -> torch.Tensor:
    m = as_matrix(data).float()
    rows, cols = m.shape
    s = e8m0_to_f32(scale)
    if columnwise:
        s = s.repeat_interleave(BLOCK, dim=0)[:rows]
    else:
        s = s.repeat_interleave(BLOCK, dim=1)[:, :cols]
    # fp8 value (<= 4 significant bits) times a power of two >= 2**-127 is exact in fp32.
    return (m * s).to(out_dtype).reshape(data.shape)


def round_f64(x: torch.Tensor, dtype) -> torch.Tensor:
    """Rounds float64 to ``dtype`` once, to nearest even. (torch's float64 -> bf16/fp16 goes through
    fp32 and rounds twice; rounding to odd into fp32 first makes the second rounding exact.)"""
    r = x.float()
    if dtype == torch.float32:
        return r
    inexact = (r.double() != x) & ~x.isnan()
    rb = r.view(torch.int32)
    rb = torch.where(inexact & (r.double().abs() > x.abs()), rb - 1, rb)  # toward zero
    rb = torch.where(inexact, rb | 1, rb)  # sticky bit
    return rb.view(torch.float32).to(dtype)


def check_quantize_fp8(x, scale, fp8_dtype, out, what: str = "") -> None:
    data, data_t, scale_inv, amax = out
    want = ref_cast(x.float(), scale, fp8_dtype)
    assert_bits_equal(data, want, f"{what} data")
    assert_bits_equal(data_t, as_matrix(want).t().contiguous(), f"{what} data_t")
    assert_bits_equal(scale_inv, 1.0 / scale, f"{what} scale_inv")
    assert_equal_nan(amax, ref_amax(x), f"{what} amax")
    assert amax.isnan().item() == bool(x.isnan().any()), f"{what} amax NaN-ness"


# ---- reference sanity ---------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
def test_reference_cast_nan_and_overflow_bits(fp8_dtype):
    """The reference's assumptions about torch: NaN -> 0x7F | sign, clamp saturates infinities."""
    x = torch.tensor([NAN, -NAN, INF, -INF, 1e30, -1e30])
    got = bits(ref_cast(x, 1.0, fp8_dtype)).tolist()
    mx = {E4M3: 0x7E, E5M2: 0x7B}[fp8_dtype]
    assert got == [0x7F, 0xFF, mx, 0x80 | mx, mx, 0x80 | mx]


# ---- per-tensor cast ----------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_fp8_matches_reference(shape, dtype, fp8_dtype):
    x = make_input(shape, dtype)
    scale = torch.tensor([3.3 if fp8_dtype == E4M3 else 0.37])
    out = ops.quantize_fp8(x, scale, fp8_dtype, True, True)
    check_quantize_fp8(x, scale, fp8_dtype, out)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-10, 1e30], ids=str)
def test_quantize_fp8_random_fp32_bit_patterns(scale, fp8_dtype):
    x = random_bits((257, 129), torch.float32)
    s = torch.tensor([scale])
    check_quantize_fp8(x, s, fp8_dtype, ops.quantize_fp8(x, s, fp8_dtype, True, True))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("scale", [1.0, 1.7, 2.0**-9], ids=str)
def test_quantize_fp8_every_16bit_value(dtype, scale, fp8_dtype):
    x = all_bit_patterns(dtype)
    s = torch.tensor([scale])
    check_quantize_fp8(x, s, fp8_dtype, ops.quantize_fp8(x, s, fp8_dtype, True, True))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("scale", [0.0, -2.5, 2.0**-149, FLT_MAX, INF], ids=str)
def test_quantize_fp8_follows_formula_for_any_scale(scale, fp8_dtype):
    """The cast is fp8(x * scale) for any given scale, degenerate ones included."""
    x = make_input((64, 33), torch.float32)
    s = torch.tensor([scale])
    check_quantize_fp8(x, s, fp8_dtype, ops.quantize_fp8(x, s, fp8_dtype, True, True))


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_quantize_fp8_only_requested_copies(rowwise, columnwise):
    x = make_input((37, 70), torch.bfloat16)
    scale = torch.tensor([2.0])
    data, data_t, scale_inv, amax = ops.quantize_fp8(x, scale, E4M3, rowwise, columnwise)
    want = ref_cast(x.float(), scale, E4M3)
    if rowwise:
        assert_bits_equal(data, want, "data")
        assert data_t.numel() == 0 and data_t.dtype == E4M3
    else:
        assert data.numel() == 0 and data.dtype == E4M3
        assert_bits_equal(data_t, want.t().contiguous(), "data_t")
    assert_bits_equal(scale_inv, 1.0 / scale, "scale_inv")
    assert_equal_nan(amax, ref_amax(x), "amax")


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_compute_amax(shape, dtype):
    x = make_input(shape, dtype)
    got = ops.compute_amax(x)
    assert_equal_nan(got, ref_amax(x), "amax")
    assert got.isnan().item() == bool(x.isnan().any())


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
def test_compute_amax_specials(dtype):
    cases = [([0.0, -0.0], 0.0), ([-3.0, 2.0], 3.0), ([1.0, -INF], INF), ([INF, NAN], NAN),
             ([-NAN, 1.0], NAN), ([-1e-42, 0.0], 1e-42)]  # fmt: skip
    for values, want in cases:
        x = torch.tensor(values).to(dtype)
        got = ops.compute_amax(x)
        expected = torch.tensor([want]).to(dtype).float()
        assert_equal_nan(got, expected.abs(), f"amax of {values}")


# ---- current scaling ----------------------------------------------------------------------------


def check_current(x, fp8_dtype, margin, out, what: str = "") -> None:
    data, data_t, scale, scale_inv, amax = out
    want_amax = ref_amax(x)
    assert_equal_nan(amax, want_amax, f"{what} amax")
    want_scale = ref_scale(want_amax.item(), FP8_MAX[fp8_dtype], margin)
    assert_bits_equal(scale, want_scale, f"{what} scale")
    assert_bits_equal(scale_inv, 1.0 / want_scale, f"{what} scale_inv")
    want = ref_cast(x.float(), want_scale, fp8_dtype)
    assert_bits_equal(data, want, f"{what} data")
    assert_bits_equal(data_t, as_matrix(want).t().contiguous(), f"{what} data_t")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_fp8_current_matches_reference(shape, dtype, fp8_dtype):
    x = make_input(shape, dtype, specials=False) * 3
    out = ops.quantize_fp8_current(x, fp8_dtype, 0, True, True)
    check_current(x, fp8_dtype, 0, out)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("margin", [0, 1, 3, -2])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 7e3, 1e30])
def test_quantize_fp8_current_scale_formula(magnitude, margin, fp8_dtype):
    x = make_input((33, 65), torch.float32, magnitude=magnitude, specials=False)
    check_current(x, fp8_dtype, margin, ops.quantize_fp8_current(x, fp8_dtype, margin, True, True))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize(
    "values,want_scale",
    [
        ([], 1.0),  # amax 0 (empty)
        ([0.0, -0.0, 0.0], 1.0),  # amax 0
        ([1.0, INF, -2.0], 1.0),  # amax inf
        ([1.0, -NAN, 2.0], 1.0),  # amax NaN
        ([1e-45, -1e-45], FLT_MAX),  # fp8_max / amax overflows fp32
    ],
    ids=["empty", "zeros", "inf", "nan", "overflow"],
)
def test_quantize_fp8_current_degenerate_amax(values, want_scale, fp8_dtype):
    x = torch.tensor(values, dtype=torch.float32)
    out = ops.quantize_fp8_current(x, fp8_dtype, 0, True, True)
    assert_bits_equal(out[2], torch.tensor([want_scale]), "scale")
    check_current(x, fp8_dtype, 0, out)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("margin", [0, 2])
def test_compute_scale(fp8_dtype, margin):
    amaxes = [0.0, -0.0, -1.0, 1e-45, 1e-40, 1.17e-38, 0.3, 1.0, 448.0, 57344.0, 3e38, FLT_MAX,
              INF, -INF, NAN]  # fmt: skip
    for a in amaxes:
        scale, scale_inv = ops.compute_scale(torch.tensor([a]), fp8_dtype, margin)
        want = ref_scale(a, FP8_MAX[fp8_dtype], margin)
        assert_bits_equal(scale, want, f"scale for amax {a}")
        assert_bits_equal(scale_inv, 1.0 / want, f"scale_inv for amax {a}")
        assert math.isfinite(scale.item()) and scale.item() > 0


# ---- dequantize (per tensor) --------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(0,), (1,), (127,), (3, 5, 7), (127, 33), (64, 4097)], ids=str)
def test_dequantize_fp8_is_exact(shape, fp8_dtype, out_dtype):
    """dequantize(quantize(x)) == fp8 value (as float64) * scale_inv, rounded once to out_dtype;
    the transposed copy dequantizes to the transpose."""
    x = make_input(shape, torch.float32, magnitude=10.0 ** torch.empty(()).uniform_(-6, 6).item())
    data, data_t, _, scale_inv, _ = ops.quantize_fp8_current(x, fp8_dtype, 0, True, True)
    want = round_f64(data.double() * scale_inv.double(), out_dtype)
    got = ops.dequantize_fp8(data, scale_inv, out_dtype)
    assert_equal_nan(got, want, "rowwise")
    got_t = ops.dequantize_fp8(data_t, scale_inv, out_dtype)
    assert_equal_nan(got_t, as_matrix(want).t().contiguous(), "columnwise (transposed)")


@pytest.mark.parametrize("out_dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("scale_inv", [1.0, 2.0**-20, 0.3, 1e30, FLT_MAX, 0.0, INF], ids=str)
def test_dequantize_fp8_every_code(scale_inv, fp8_dtype, out_dtype):
    """All 256 FP8 codes (NaN and E5M2 inf included) against float64 * scale_inv rounded once."""
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)
    s = torch.tensor([scale_inv])
    got = ops.dequantize_fp8(data, s, out_dtype)
    assert_equal_nan(got, round_f64(data.double() * s.double(), out_dtype), "dequantize")


@pytest.mark.parametrize(
    "out_dtype,scale_inv,single_rounding",
    [
        # 1.125 * 0x1.c8e39p-1 = 0x1.01000100p+0: just above the bf16 tie 1 + 2**-8
        (torch.bfloat16, float.fromhex("0x1.c8e39p-1"), float.fromhex("0x1.02p0")),
        # 1.125 * 0x1.c7c71cp-1 = 0x1.005fffcp+0: just below the fp16 tie 1 + 3 * 2**-11
        (torch.float16, float.fromhex("0x1.c7c71cp-1"), float.fromhex("0x1.004p0")),
    ],
    ids=["bf16", "fp16"],
)
def test_dequantize_fp8_rounds_through_fp32(out_dtype, scale_inv, single_rounding):
    """quantize.h: the product is formed in fp32 (as every GEMM consumer does), then rounded to
    the output dtype. These inputs are chosen so that this differs from one rounding of the exact
    product, pinning the documented behaviour."""
    data = torch.tensor([1.125]).to(E4M3)
    s = torch.tensor([scale_inv])
    assert s.double().item() == scale_inv
    got = ops.dequantize_fp8(data, s, out_dtype).float().item()
    want = (torch.tensor([1.125]) * s).to(out_dtype).float().item()
    assert got == want, f"got {got.hex()}, want {want.hex()}"
    assert want != single_rounding  # the case really distinguishes the two rules


# ---- FP8 transpose ------------------------------------------------------------------------------

TRANSPOSE_SHAPES = [(1, 1), (1, 17), (17, 1), (2, 3), (31, 33), (129, 77), (127, 4097), (4096, 16),
                    (256, 512), (0, 5), (5, 0), (0, 0)]  # fmt: skip


def ref_transpose(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8).t().contiguous()


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES, ids=str)
def test_transpose_fp8_matches_torch(shape, fp8_dtype, aligned, devices):
    """Every byte (random bits: NaN codes included) moves to its transposed place. ``offset``
    starts the input one byte into its storage, off the 16-byte alignment."""
    n = math.prod(shape)
    base = random_bits((n + 1,), fp8_dtype).to(devices)
    x = base[:n] if aligned else base[1:]
    x = x.view(shape)
    got = ops.transpose_fp8(x)
    assert got.dtype == fp8_dtype and got.device == x.device
    assert tuple(got.shape) == (shape[1], shape[0])
    assert_bits_equal(got.view(torch.uint8), ref_transpose(x), "transpose_fp8")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
def test_transpose_fp8_of_rowwise_copy_is_columnwise_copy(fp8_dtype, devices):
    """The columnwise copy of a per-tensor FP8 tensor, made from its rowwise copy, is the one
    quantize_fp8 writes (and both dequantize with the same scale_inv)."""
    x = make_input((65, 97), torch.bfloat16).to(devices)
    scale = torch.tensor([0.5], device=devices)
    data, data_t, scale_inv, _ = ops.quantize_fp8(x, scale, fp8_dtype, True, True)
    got = ops.transpose_fp8(data)
    assert_bits_equal(got, data_t, "transpose of the rowwise copy")
    deq = ops.dequantize_fp8(data, scale_inv, torch.float32)
    assert_equal_nan(ops.dequantize_fp8(got, scale_inv, torch.float32), deq.t(), "dequantized")


# ---- MXFP8 --------------------------------------------------------------------------------------


def make_mx_input(shape, dtype, *, specials: bool = True) -> torch.Tensor:
    """Values whose magnitude varies by block (so scales differ), with SPECIALS scattered in."""
    x = torch.randn(shape)
    if x.numel():
        m = as_matrix(x)
        expo = torch.randint(-40, 40, (m.shape[0], -(-m.shape[1] // 8)))
        if dtype == torch.float16:
            expo = expo.clamp(-12, 10)
        m.mul_(pow2_f32(expo.repeat_interleave(8, dim=1)[:, : m.shape[1]]))
    if specials and x.numel() >= 4 * len(SPECIALS):
        flat = x.view(-1)
        idx = torch.randperm(flat.numel())[: len(SPECIALS)]
        flat[idx] = torch.tensor(SPECIALS)
    return x.to(dtype)


def check_mxfp8(x, fp8_dtype, out, what: str = "") -> None:
    data, scale, col, col_scale = out
    q, s = ref_mxfp8(x, fp8_dtype, columnwise=False)
    assert_bits_equal(scale, s, f"{what} rowwise scale")
    assert_bits_equal(data, q, f"{what} rowwise data")
    q, s = ref_mxfp8(x, fp8_dtype, columnwise=True)
    assert_bits_equal(col_scale, s, f"{what} columnwise scale")
    assert_bits_equal(col, q, f"{what} columnwise data")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("shape", MX_SHAPES, ids=str)
def test_quantize_mxfp8_matches_reference(shape, dtype, fp8_dtype):
    x = make_mx_input(shape, dtype)
    check_mxfp8(x, fp8_dtype, ops.quantize_mxfp8(x, fp8_dtype, True, True))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
def test_quantize_mxfp8_random_fp32_bit_patterns(fp8_dtype):
    x = random_bits((130, 97), torch.float32)
    x[x.isnan() | x.isinf()] = 1.0  # most blocks would hold a NaN otherwise
    x.view(-1)[torch.randperm(x.numel())[:5]] = torch.tensor([NAN, -NAN, INF, -INF, NAN])
    check_mxfp8(x, fp8_dtype, ops.quantize_mxfp8(x, fp8_dtype, True, True))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_quantize_mxfp8_every_16bit_value(dtype, fp8_dtype):
    x = all_bit_patterns(dtype)
    x = x[torch.randperm(x.shape[0])].contiguous()  # mixes blocks down the columns too
    check_mxfp8(x, fp8_dtype, ops.quantize_mxfp8(x, fp8_dtype, True, True))


@pytest.mark.parametrize(
    "block_values,want_e4m3,want_e5m2",
    [
        ([0.0], 0, 0),  # amax 0: 2**-127
        ([1.0], 119, 112),  # e = 0 - emax
        ([-448.0], 127, 120),  # floor(log2(448)) = 8
        ([511.99997], 127, 120),
        ([512.0], 128, 121),
        ([57344.0], 134, 127),
        ([2.0**-119], 0, 0),  # e = -127 (E4M3); clamped (E5M2)
        ([2.0**-118], 1, 0),
        ([2.0**-111], 8, 1),
        ([1e-45], 0, 0),  # fp32 subnormal, clamped
        ([FLT_MAX], 246, 239),  # floor(log2) = 127
        ([1.0, INF], 255, 255),
        ([1.0, -NAN], 255, 255),
    ],
)
def test_mxfp8_scale_rule_by_hand(block_values, want_e4m3, want_e5m2):
    """E8M0 bytes worked out by hand from the OCP rule; full and partial blocks, both directions."""
    for n in (BLOCK, 5):
        x = torch.zeros(n)
        x[: len(block_values)] = torch.tensor(block_values)
        x = x.flip(0).contiguous()
        for fp8_dtype, want in ((E4M3, want_e4m3), (E5M2, want_e5m2)):
            _, scale, _, _ = ops.quantize_mxfp8(x.reshape(1, n), fp8_dtype, True, False)
            assert scale.tolist() == [[want]], (block_values, n, _name(fp8_dtype), "rowwise")
            _, _, _, col_scale = ops.quantize_mxfp8(x.reshape(n, 1), fp8_dtype, False, True)
            assert col_scale.tolist() == [[want]], (block_values, n, _name(fp8_dtype), "columnwise")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
def test_mxfp8_nan_block_elements(fp8_dtype):
    """Every element of a block with a NaN scale is NaN: 0x7F | sign for a NaN x (the cast keeps
    x's sign), 0x7F (the scale's NaN, which is positive) for any other x. Checked in blocks in the
    middle of long rows and columns, where the CPU loops may be vectorised."""
    block = torch.ones(BLOCK)
    block[:6] = torch.tensor([1.0, -NAN, -2.0, NAN, -INF, 0.0])
    want = torch.tensor([0x7F, 0xFF] + [0x7F] * (BLOCK - 2), dtype=torch.uint8)
    x = torch.ones(3, 4097)
    x[1, 64:96] = block
    data, scale, _, _ = ops.quantize_mxfp8(x, fp8_dtype, True, False)
    assert scale[1, 2].item() == 255
    assert_bits_equal(bits(data[1, 64:96]), want, "rowwise")
    x = torch.ones(64, 4097)
    x[32:64, 100] = block
    _, _, col, col_scale = ops.quantize_mxfp8(x, fp8_dtype, False, True)
    assert col_scale[1, 100].item() == 255
    assert_bits_equal(bits(col[32:64, 100]), want, "columnwise")


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_quantize_mxfp8_only_requested_copies(rowwise, columnwise):
    x = make_mx_input((40, 70), torch.float32)
    data, scale, col, col_scale = ops.quantize_mxfp8(x, E4M3, rowwise, columnwise)
    q, s = ref_mxfp8(x, E4M3, columnwise=columnwise)
    if rowwise:
        assert col.numel() == 0 and col_scale.numel() == 0
        assert_bits_equal(scale, s, "scale")
        assert_bits_equal(data, q, "data")
    else:
        assert data.numel() == 0 and scale.numel() == 0
        assert_bits_equal(col_scale, s, "col_scale")
        assert_bits_equal(col, q, "col")


@pytest.mark.parametrize("out_dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(0, 5), (1,), (7,), (3, 5, 7), (33, 65), (127, 33)], ids=str)
def test_dequantize_mxfp8_matches_reference(shape, fp8_dtype, out_dtype):
    x = make_mx_input(shape, torch.float32)
    data, scale, col, col_scale = ops.quantize_mxfp8(x, fp8_dtype, True, True)
    for columnwise, d, s in ((False, data, scale), (True, col, col_scale)):
        got = ops.dequantize_mxfp8(d, s, columnwise, out_dtype)
        assert_equal_nan(got, ref_dequantize_mxfp8(d, s, columnwise, out_dtype), f"{columnwise=}")
        assert got.shape == x.shape


def test_dequantize_mxfp8_every_code_and_scale():
    """Every FP8 code times every E8M0 byte (NaN and 2**-127 included)."""
    for fp8_dtype in FP8_DTYPES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)
        data = codes.repeat(256, 1).reshape(256, 256)  # row r: all codes, scaled by byte r
        scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 8)
        for out_dtype in HP_DTYPES:
            got = ops.dequantize_mxfp8(data, scale.contiguous(), False, out_dtype)
            want = ref_dequantize_mxfp8(data, scale, False, out_dtype)
            assert_equal_nan(got, want, f"{fp8_dtype} -> {out_dtype}")


def _check_mx_error_bound(x32, deq, scale_bytes, fp8_dtype, columnwise: bool) -> None:
    rows, cols = x32.shape
    e = scale_bytes.to(torch.int64) - 127
    e = (
        e.repeat_interleave(BLOCK, 0)[:rows]
        if columnwise
        else e.repeat_interleave(BLOCK, 1)[:, :cols]
    )
    x, d = x32.double(), deq.double()
    ulp_rel = 2.0 ** -(MANT_BITS[fp8_dtype] + 1)
    half_sub = torch.ldexp(torch.ones_like(x), (e + MIN_SUBNORMAL_LOG2[fp8_dtype] - 1).double())
    top = torch.ldexp(torch.full_like(x, FP8_MAX[fp8_dtype]), e.double())
    err = (d - x).abs()
    saturated = x.abs() > top
    where = "columnwise" if columnwise else "rowwise"
    # Unsaturated: RNE in the FP8 grid scaled by 2**e: half an ulp relative, or half a subnormal.
    bound = torch.maximum(x.abs() * ulp_rel, half_sub)
    bad = ~saturated & (err > bound)
    assert not bad.any(), f"{where}: error bound exceeded: " + _mismatches(deq, x32, bad)
    # Saturated: +-fp8_max * 2**e, and the OCP exponent keeps the loss under 1/8 of |x|.
    assert torch.equal(d[saturated], top[saturated] * x[saturated].sign()), where
    assert bool((err[saturated] < x[saturated].abs() / 8).all()), where
    assert torch.equal(d.sign(), x.sign() * (d != 0)), f"{where}: sign changed"


@settings(max_examples=40)
@given(
    rows=st.integers(1, 70),
    cols=st.integers(1, 100),
    log2_magnitude=st.integers(-140, 120),
    spread=st.integers(0, 24),
    dtype=st.sampled_from(HP_DTYPES),
    fp8_dtype=st.sampled_from(FP8_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_mxfp8_roundtrip_error_bound(rows, cols, log2_magnitude, spread, dtype, fp8_dtype, seed):
    """Property: dequantize(quantize(x)) is within the FP8 rounding bound of x, rowwise and
    columnwise, over random shapes, magnitudes and in-block dynamic ranges."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-24, 13) if dtype == torch.float16 else (-149, 125)
    expo = log2_magnitude + torch.randint(-spread, spread + 1, (rows, cols), generator=g)
    x = torch.randn(rows, cols, generator=g) * pow2_f32(expo.clamp(lo, hi))
    x = x.to(dtype)
    x32 = x.float()
    assert torch.isfinite(x32).all()
    data, scale, col, col_scale = ops.quantize_mxfp8(x, fp8_dtype, True, True)
    deq = ops.dequantize_mxfp8(data, scale, False, torch.float32)
    _check_mx_error_bound(x32, deq, scale, fp8_dtype, columnwise=False)
    deq = ops.dequantize_mxfp8(col, col_scale, True, torch.float32)
    _check_mx_error_bound(x32, deq, col_scale, fp8_dtype, columnwise=True)


# ---- delayed scaling ----------------------------------------------------------------------------


def ref_delayed_update(hist, scale, fp8_max, algo, margin):
    h, s = hist.clone(), scale.clone()
    if h.shape[1]:
        window = h if algo == "max" else h[:1]
        amax = window.abs().amax(0)  # NaN propagates
        for i in range(h.shape[1]):
            s[i] = ref_scale(amax[i].item(), fp8_max, margin, fallback=s[i].item())[0]
    h = torch.cat([h[1:], h[:1]])  # roll: the newest amax moves to the end of the window
    h[0] = 0.0
    return h, s


# (history_len, n, fp8_max)
_GROUPS = [(1, 3, 448.0), (4, 5, 57344.0), (16, 2, 448.0), (3, 0, 448.0), (2, 130, 57344.0)]


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 0), ("max", 2)])
def test_delayed_scaling_update_matches_reference(devices, algo, margin):
    hists = [torch.zeros(L, n) for L, n, _ in _GROUPS]
    scales = [torch.ones(n) for _, n, _ in _GROUPS]
    maxes = [m for *_, m in _GROUPS]
    specials = torch.tensor([0.0, INF, NAN, 1e-45])
    for step in range(7):
        for h in hists:  # this step's amaxes land in row 0
            n = h.shape[1]
            h[0] = torch.rand(n) * pow2_f32(torch.randint(-20, 20, (n,)))
            if n and step in (2, 4):
                h[0, torch.randint(0, n, (2,))] = specials[torch.randint(0, 4, (2,))]
        want = [
            ref_delayed_update(h, s, m, algo, margin)
            for h, s, m in zip(hists, scales, maxes, strict=True)
        ]
        dev_h = [h.to(devices) for h in hists]
        dev_s = [s.to(devices) for s in scales]
        ops.delayed_scaling_update(dev_h, dev_s, maxes, algo, margin)
        for g, ((wh, ws), gh, gs) in enumerate(zip(want, dev_h, dev_s, strict=True)):
            assert_bits_equal(gh.cpu(), wh, f"step {step} group {g} amax_history")
            assert_bits_equal(gs.cpu(), ws, f"step {step} group {g} scale")
            assert torch.isfinite(gs).all()
        hists, scales = [h.cpu() for h in dev_h], [s.cpu() for s in dev_s]


def test_delayed_scaling_update_keeps_scale_on_bad_amax():
    hist = torch.tensor([[0.0, INF, NAN, 2.0], [0.0, 1.0, 1.0, NAN]])
    scale = torch.tensor([5.0, 6.0, 7.0, 8.0])
    ops.delayed_scaling_update([hist], [scale], [448.0], "max", 0)
    assert scale.tolist() == [5.0, 6.0, 7.0, 8.0]
    hist = torch.tensor([[0.0, INF, NAN, 2.0], [0.0, 1.0, 1.0, NAN]])
    scale = torch.tensor([5.0, 6.0, 7.0, 8.0])
    ops.delayed_scaling_update([hist], [scale], [448.0], "most_recent", 0)
    assert scale.tolist() == [5.0, 6.0, 7.0, 224.0]
    assert_bits_equal(hist, torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, INF, NAN, 2.0]]), "hist")


def test_delayed_scaling_update_empty_list():
    ops.delayed_scaling_update([], [], [], "max", 0)


# ---- CUDA == CPU --------------------------------------------------------------------------------


def _gpu_inputs(shape, dtype, kind):
    if kind == "bits":
        return random_bits(shape, dtype)
    return make_input(shape, dtype)


def _assert_same(cpu_out, gpu_out, what):
    if isinstance(cpu_out, torch.Tensor):
        cpu_out, gpu_out = (cpu_out,), (gpu_out,)
    for i, (c, g) in enumerate(zip(cpu_out, gpu_out, strict=True)):
        assert g.device.type == "cuda", f"{what}[{i}] not on the GPU"
        if c.dtype in (E4M3, E5M2, torch.uint8):
            assert_bits_equal(g.cpu(), c, f"{what}[{i}]")
        else:
            assert_equal_nan(g.cpu(), c, f"{what}[{i}]")


def _gpu_quantize_fp8(x, f):
    return ops.quantize_fp8(x, torch.tensor([0.37], device=x.device), f, True, True)


def _gpu_dequantize_fp8(x, f):
    data, data_t, _, scale_inv, _ = ops.quantize_fp8_current(x, f, 0, True, True)
    return [ops.dequantize_fp8(d, scale_inv, o) for d in (data, data_t) for o in HP_DTYPES]


def _gpu_transpose_fp8(x, f):
    data = ops.quantize_fp8(as_matrix(x), torch.tensor([0.37], device=x.device), f, True, False)[0]
    return ops.transpose_fp8(data)


def _gpu_dequantize_mxfp8(x, f):
    data, scale, col, col_scale = ops.quantize_mxfp8(x, f, True, True)
    return [
        ops.dequantize_mxfp8(d, s, columnwise, o)
        for columnwise, d, s in ((False, data, scale), (True, col, col_scale))
        for o in HP_DTYPES
    ]


_GPU_OPS = {
    "quantize_fp8": _gpu_quantize_fp8,
    "quantize_fp8_current": lambda x, f: ops.quantize_fp8_current(x, f, 1, True, True),
    "compute_amax": lambda x, f: ops.compute_amax(x),
    "quantize_mxfp8": lambda x, f: ops.quantize_mxfp8(x, f, True, True),
    "dequantize_fp8": _gpu_dequantize_fp8,
    "dequantize_mxfp8": _gpu_dequantize_mxfp8,
    "transpose_fp8": _gpu_transpose_fp8,
}


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["values", "bits"])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("op", list(_GPU_OPS))
def test_cuda_matches_cpu(op, dtype, fp8_dtype, kind):
    fn = _GPU_OPS[op]
    for shape in GPU_SHAPES:
        x = _gpu_inputs(shape, dtype, kind)
        _assert_same(fn(x, fp8_dtype), fn(x.cuda(), fp8_dtype), f"{op}{shape}")


@pytest.mark.cuda
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_cuda_matches_cpu_every_16bit_value(dtype, fp8_dtype):
    x = all_bit_patterns(dtype)
    for op, fn in _GPU_OPS.items():
        _assert_same(fn(x, fp8_dtype), fn(x.cuda(), fp8_dtype), op)


@pytest.mark.cuda
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=_name)
def test_cuda_matches_cpu_compute_scale(fp8_dtype):
    amax = torch.cat([random_bits((2000,), torch.float32), torch.tensor([0.0, INF, NAN, 1e-45])])
    for margin in (0, 3):
        for a in amax:
            c = ops.compute_scale(a.reshape(1), fp8_dtype, margin)
            g = ops.compute_scale(a.reshape(1).cuda(), fp8_dtype, margin)
            _assert_same(c, g, f"compute_scale({a.item()}, {margin})")


@pytest.mark.cuda
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_cuda_matches_cpu_delayed_scaling_update(algo):
    shapes = [(1, 7), (16, 1000), (1024, 3), (5, 0)]
    hists = [random_bits(s, torch.float32).abs() for s in shapes]
    scales = [torch.rand(s[1]) + 0.5 for s in shapes]
    maxes = [448.0, 57344.0, 448.0, 448.0]
    gh, gs = [h.cuda() for h in hists], [s.cuda() for s in scales]
    for _ in range(3):
        ops.delayed_scaling_update(hists, scales, maxes, algo, 1)
        ops.delayed_scaling_update(gh, gs, maxes, algo, 1)
        for c, g in zip(hists + scales, gh + gs, strict=True):
            assert_bits_equal(g.cpu(), c, "delayed_scaling_update")


@pytest.mark.cuda
def test_cuda_runs_on_current_stream():
    x = make_input((1024, 4097), torch.bfloat16).cuda()
    want = ops.quantize_fp8_current(x, E4M3, 0, True, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = ops.quantize_fp8_current(x, E4M3, 0, True, True)
    torch.cuda.current_stream().wait_stream(stream)
    _assert_same([t.cpu() for t in want], got, "quantize_fp8_current on a side stream")


# ---- torch.compile and opcheck ------------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager():
    """Default (inductor) backend, no graph break. The graph holds only fusible ops, so inductor
    emits them as extern kernels (no C++ to compile) and checks their outputs' sizes and strides
    against the fake kernels'."""

    def fn(x, scale):
        fp8 = ops.quantize_fp8(x, scale, E5M2, True, True)
        current = ops.quantize_fp8_current(x, E4M3, 0, True, True)
        mx = ops.quantize_mxfp8(x, E5M2, True, True)
        deq = ops.dequantize_mxfp8(mx[2], mx[3], True, torch.bfloat16)
        return (*fp8, *current, *mx, deq, ops.compute_amax(x), ops.transpose_fp8(fp8[0]))

    x = make_input((65, 97), torch.bfloat16)
    scale = torch.tensor([0.25])
    compiled = torch.compile(fn, fullgraph=True)
    for got, want in zip(compiled(x, scale), fn(x, scale), strict=True):
        assert_bits_equal(got, want, "compiled vs eager")


def _opcheck_cases(device):
    x = torch.randn(5, 40, device=device)
    q = x.to(E4M3)
    return {
        "quantize_fp8": (x, torch.tensor([2.0], device=device), E4M3, True, True),
        "quantize_fp8:keep_scale": (
            x,
            torch.tensor([2.0], device=device),
            E4M3,
            True,
            False,
            torch.zeros(1, device=device),
            True,
            True,
        ),
        "quantize_fp8_current": (x.bfloat16(), E5M2, 1, True, False),
        "dequantize_fp8": (q, torch.tensor([0.5], device=device), torch.bfloat16),
        "compute_amax": (x.half(),),
        "compute_scale": (torch.tensor([3.0], device=device), E4M3, 0),
        "quantize_mxfp8": (x, E4M3, True, True),
        "dequantize_mxfp8": (
            q,
            torch.full((5, 2), 120, dtype=torch.uint8, device=device),
            False,
            torch.float32,
        ),
        "delayed_scaling_update": (
            [torch.rand(3, 4, device=device), torch.rand(1, 2, device=device)],
            [torch.ones(4, device=device), torch.ones(2, device=device)],
            [448.0, 57344.0],
            "max",
            0,
        ),
        "transpose_fp8": (q,),
        "quantize_fp8_block": (
            torch.randn(130, 257, device=device),
            E4M3,
            1,
            True,
            0.0,
            *(True,) * 2,
        ),
        "dequantize_fp8_block": (
            torch.randn(130, 257, device=device).to(E4M3),
            torch.rand(2, 3, device=device),
            2,
            torch.bfloat16,
        ),
    }


@pytest.mark.parametrize("op", list(_opcheck_cases("cpu")))
def test_opcheck(op, devices):
    args = _opcheck_cases(devices)[op]
    op = op.split(":")[0]  # "name:case": another argument combination of the operator name
    utils = [
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    ]
    takes_fp8 = any(isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES for a in args)
    if takes_fp8 and not fp8_allclose_supported(devices):
        # torch's SchemaCheckMode (behind test_schema) detects input mutation with
        # torch.allclose, which has no float8 kernel on this device ("mul_cpu_reduced_float" not
        # implemented for 'Float8_e4m3fn'); pytorch/pytorch#135998. Check no mutation by hand.
        utils.remove("test_schema")
        before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
        getattr(ops, op)(*args)
        after = [a for a in args if isinstance(a, torch.Tensor)]
        for b, a in zip(before, after, strict=True):
            assert_bits_equal(a, b, f"{op} mutated an input")
    torch.library.opcheck(getattr(ops, op).default, args, test_utils=utils)


# ---- errors -------------------------------------------------------------------------------------

_X = torch.ones(4, 64)
_S = torch.ones(1)
_Q = _X.to(E4M3)
_U8 = torch.uint8
_H = [torch.zeros(2, 3)]  # one valid amax history and its scales
_HS = [torch.ones(3)]
# (id, exception, op, argument the message must name, arguments of the call)
_ERRORS = [
    ("int_x", TypeError, "quantize_fp8", "x", (_X.int(), _S, E4M3, True, False)),
    ("f64_x", TypeError, "quantize_fp8", "x", (_X.double(), _S, E4M3, True, False)),
    ("transposed_x", ValueError, "quantize_fp8", "x", (_X.t(), _S, E4M3, True, False)),
    ("scalar_x", ValueError, "quantize_fp8", "x", (torch.tensor(1.0), _S, E4M3, True, False)),
    ("scale_shape", ValueError, "quantize_fp8", "scale", (_X, torch.ones(2), E4M3, True, False)),
    ("scale_empty", ValueError, "quantize_fp8", "scale", (_X, torch.ones(0), E4M3, True, False)),
    ("scale_dtype", TypeError, "quantize_fp8", "scale", (_X, _S.double(), E4M3, True, False)),
    ("scale_meta", ValueError, "quantize_fp8", "scale", (_X, _S.to("meta"), E4M3, True, False)),
    ("fp8_dtype", TypeError, "quantize_fp8", "fp8_dtype", (_X, _S, torch.float16, True, False)),
    # keep_scale returns the scale's copy in the amax's place: refused where the amax is returned
    ("keep_scale_amax", ValueError, "quantize_fp8", "keep_scale",
     (_X, _S, E4M3, True, False, None, True, True)),
    ("no_copy", ValueError, "quantize_fp8", "rowwise", (_X, _S, E4M3, False, False)),
    ("no_copy_col", ValueError, "quantize_fp8", "columnwise", (_X, _S, E4M3, False, False)),
    ("cur_int_x", TypeError, "quantize_fp8_current", "x", (_X.long(), E4M3, 0, True, False)),
    ("cur_transposed", ValueError, "quantize_fp8_current", "x", (_X.t(), E4M3, 0, True, False)),
    ("cur_scalar", ValueError, "quantize_fp8_current", "x", (_X[0, 0], E4M3, 0, True, False)),
    ("cur_fp8_dtype", TypeError, "quantize_fp8_current", "fp8_dtype", (_X, _U8, 0, True, False)),
    ("cur_no_copy", ValueError, "quantize_fp8_current", "rowwise", (_X, E4M3, 0, False, False)),
    ("cur_margin", ValueError, "quantize_fp8_current", "margin", (_X, E4M3, 2**40, True, False)),
    ("deq_hp_data", TypeError, "dequantize_fp8", "data", (_X, _S, torch.float32)),
    ("deq_transposed", ValueError, "dequantize_fp8", "data", (_Q.t(), _S, torch.float32)),
    ("deq_scalar", ValueError, "dequantize_fp8", "data", (_Q[0, 0], _S, torch.float32)),
    ("deq_scale_inv", ValueError, "dequantize_fp8", "scale_inv", (_Q, _S.repeat(2), torch.float32)),
    ("deq_scale_meta", ValueError, "dequantize_fp8", "scale_inv",
     (_Q, _S.to("meta"), torch.float32)),
    ("deq_out_dtype", TypeError, "dequantize_fp8", "out_dtype", (_Q, _S, torch.float64)),
    ("amax_int", TypeError, "compute_amax", "x", (_X.short(),)),
    ("amax_scalar", ValueError, "compute_amax", "x", (torch.tensor(1.0),)),
    ("amax_transposed", ValueError, "compute_amax", "x", (_X.t(),)),
    ("scale_amax_shape", ValueError, "compute_scale", "amax", (torch.ones(3), E4M3, 0)),
    ("scale_amax_dtype", TypeError, "compute_scale", "amax", (_S.half(), E4M3, 0)),
    ("scale_fp8_dtype", TypeError, "compute_scale", "fp8_dtype", (_S, torch.float32, 0)),
    ("scale_margin", ValueError, "compute_scale", "margin", (_S, E4M3, -(2**40))),
    ("mx_int_x", TypeError, "quantize_mxfp8", "x", (_X.to(torch.int8), E4M3, True, True)),
    ("mx_transposed", ValueError, "quantize_mxfp8", "x", (_X.t(), E4M3, True, True)),
    ("mx_scalar", ValueError, "quantize_mxfp8", "x", (_X[0, 0], E4M3, True, True)),
    ("mx_fp8_dtype", TypeError, "quantize_mxfp8", "fp8_dtype", (_X, torch.bfloat16, True, True)),
    ("mx_no_copy", ValueError, "quantize_mxfp8", "rowwise", (_X, E4M3, False, False)),
    ("demx_scale_shape", ValueError, "dequantize_mxfp8", "scale",
     (_Q, torch.zeros(4, 3, dtype=_U8), False, torch.float32)),
    ("demx_col_scale_shape", ValueError, "dequantize_mxfp8", "scale",
     (_Q, torch.zeros(4, 2, dtype=_U8), True, torch.float32)),
    ("demx_scale_dtype", TypeError, "dequantize_mxfp8", "scale",
     (_Q, torch.zeros(4, 2), False, torch.float32)),
    ("demx_scale_meta", ValueError, "dequantize_mxfp8", "scale",
     (_Q, torch.zeros(4, 2, dtype=_U8, device="meta"), False, torch.float32)),
    ("demx_hp_data", TypeError, "dequantize_mxfp8", "data",
     (_X, torch.zeros(4, 2, dtype=_U8), False, torch.float32)),
    ("demx_scalar", ValueError, "dequantize_mxfp8", "data",
     (_Q[0, 0], torch.zeros(1, 1, dtype=_U8), False, torch.float32)),
    ("demx_out_dtype", TypeError, "dequantize_mxfp8", "out_dtype",
     (_Q, torch.zeros(4, 2, dtype=_U8), False, E4M3)),
    ("tr_hp_x", TypeError, "transpose_fp8", "x", (_X,)),
    ("tr_u8_x", TypeError, "transpose_fp8", "x", (_Q.view(_U8),)),
    ("tr_scalar", ValueError, "transpose_fp8", "x", (_Q[0, 0],)),
    ("tr_1d", ValueError, "transpose_fp8", "x", (_Q[0],)),
    ("tr_3d", ValueError, "transpose_fp8", "x", (_Q.view(2, 2, 64),)),
    ("tr_transposed", ValueError, "transpose_fp8", "x", (_Q.t(),)),
    ("tr_strided", ValueError, "transpose_fp8", "x", (_Q[:, ::2],)),
    ("dsu_lengths", ValueError, "delayed_scaling_update", "scales", (_H, [], [448.0], "max", 0)),
    ("dsu_lengths_max", ValueError, "delayed_scaling_update", "fp8_maxes",
     (_H, _HS, [448.0, 448.0], "max", 0)),
    ("dsu_algo", ValueError, "delayed_scaling_update", "algo", (_H, _HS, [448.0], "mean", 0)),
    ("dsu_shape", ValueError, "delayed_scaling_update", "scales[0]",
     (_H, [torch.ones(4)], [448.0], "max", 0)),
    ("dsu_hist_len0", ValueError, "delayed_scaling_update", "amax_histories[0]",
     ([torch.zeros(0, 3)], _HS, [448.0], "max", 0)),
    ("dsu_dtype", TypeError, "delayed_scaling_update", "amax_histories[1]",
     ([*_H, torch.zeros(2, 3).half()], _HS * 2, [448.0] * 2, "max", 0)),
    ("dsu_noncontig", ValueError, "delayed_scaling_update", "amax_histories[0]",
     ([torch.zeros(3, 2).t()], _HS, [448.0], "max", 0)),
    ("dsu_fp8_max", ValueError, "delayed_scaling_update", "fp8_maxes[0]",
     (_H, _HS, [0.0], "max", 0)),
    ("dsu_fp8_max_nan", ValueError, "delayed_scaling_update", "fp8_maxes[0]",
     (_H, _HS, [NAN], "max", 0)),
    ("dsu_margin", ValueError, "delayed_scaling_update", "margin",
     (_H, _HS, [448.0], "max", 2**33)),
]  # fmt: skip


@pytest.mark.parametrize("exc,op,arg,args", [e[1:] for e in _ERRORS], ids=[e[0] for e in _ERRORS])
def test_bad_input_raises_naming_op_and_argument(exc, op, arg, args):
    with pytest.raises(exc) as info:
        getattr(ops, op)(*args)
    message = str(info.value)
    assert f"fusible.{op}" in message, message
    assert f"'{arg}'" in message or f" {arg} " in message or f" {arg}," in message, message


def test_bad_input_leaves_state_untouched():
    """A rejected delayed-scaling update must not have updated the groups before the bad one."""
    h, s = torch.full((2, 3), 2.0), torch.ones(3)
    with pytest.raises(TypeError):
        ops.delayed_scaling_update(
            [h, torch.zeros(2, 3).half()], [s, torch.ones(3)], [448.0] * 2, "max", 0
        )
    assert h.eq(2.0).all() and s.eq(1.0).all()


@pytest.mark.cuda
def test_cuda_scale_on_cpu_is_rejected():
    x = torch.ones(4, 64, device="cuda")
    with pytest.raises(ValueError, match=r"fusible\.quantize_fp8: argument 'scale' is on cpu"):
        ops.quantize_fp8(x, torch.ones(1), E4M3, True, False)
    with pytest.raises(ValueError, match=r"fusible\.dequantize_fp8: argument 'scale_inv'"):
        ops.dequantize_fp8(x.to(E4M3), torch.ones(1), torch.float32)


@pytest.mark.skipif(
    not torch.cuda.is_available() or K.has_cuda(),
    reason="needs a CUDA tensor and a core library built without its CUDA backend",
)
def test_cuda_tensor_on_cpu_only_build():
    """With a CPU-only build, a CUDA tensor raises RuntimeError naming the op and argument (the
    C++ operators ask the core library, so a build with the CUDA backend cannot simulate it)."""
    x = torch.ones(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"fusible\.quantize_fp8: argument 'x' is a CUDA tensor"):
        ops.quantize_fp8(x, torch.ones(1, device="cuda"), E4M3, True, False)
    with pytest.raises(RuntimeError, match=r"fusible\.quantize_mxfp8: argument 'x'"):
        ops.quantize_mxfp8(x, E4M3, True, False)
    with pytest.raises(RuntimeError, match=r"fusible\.transpose_fp8: argument 'x'"):
        ops.transpose_fp8(torch.zeros(4, 64, dtype=torch.uint8, device="cuda").view(E4M3))


def test_quantize_fp8_keeping_scale(devices):
    """``keep_scale=True``: the same data, transposed copy and ``scale_inv`` bits, the amax
    max-combined into ``amax_into`` as without it, and in the amax's place a new float32 ``(1,)``
    tensor holding the scale the cast read (a copy: a later in-place change of the scale leaves
    it alone). Also with ``want_amax=False``."""
    device = devices
    torch.manual_seed(0)
    x = torch.randn(67, 129, device=device, dtype=torch.bfloat16) * 3
    scale = torch.tensor([1.7], device=device)
    want_slot, slot = torch.full((1,), 0.5, device=device), torch.full((1,), 0.5, device=device)
    want = K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, True, want_slot)
    for args in ((slot,), (None, False)):
        got = K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, True, *args, keep_scale=True)
        for a, b in zip(want[:3], got[:3], strict=True):
            assert_bits_equal(a, b, "keep_scale changed the cast")
        kept = got[3]
        assert kept.dtype == torch.float32 and kept.shape == (1,) and torch.equal(kept, scale)
        assert kept.data_ptr() != scale.data_ptr()
    assert torch.equal(slot, want_slot) and slot.item() > 0.5  # accumulated once, as without it
    scale.mul_(2)  # the step's update, in place
    assert kept.item() == pytest.approx(1.7)


def test_quantize_fp8_without_amax(devices):
    """``want_amax=False``: the same data, transposed copy and ``scale_inv`` bits, no amax (an
    empty tensor); with ``amax_into`` it is refused (that slot is the amax)."""
    device = devices
    torch.manual_seed(0)
    x = torch.randn(67, 129, device=device, dtype=torch.bfloat16) * 3
    scale = torch.tensor([1.7], device=device)
    want = K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, True)
    got = K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, True, want_amax=False)
    for a, b in zip(want[:3], got[:3], strict=True):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)  # fmt: skip
    assert want[3].numel() == 1 and got[3].numel() == 0
    slot = torch.zeros(1, device=device)
    with pytest.raises(ValueError, match="want_amax"):
        K.quantize_fp8(x, scale, torch.float8_e4m3fn, True, False, slot, want_amax=False)
