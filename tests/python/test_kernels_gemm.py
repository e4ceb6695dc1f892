"""Tests of the gemm custom op (torch.ops.fusible.gemm, python/fusible/_kernels/gemm.py).

The contract is cpp/include/fusible/gemm.h. Every expected value comes from a float64 torch
reference on the exact values of the inputs (FP8 operands decoded exactly, then scaled), with an
error bound for FP32 accumulation: ``K * 2^-23 * sum|a b|`` per element on the CPU (any summation
order is within ``(K - 1) * 2^-24 * sum|a b|``), plus the rounding of the output dtype. The CUDA
backend (cuBLASLt) gets the wider bounds gemm.h documents: Hopper's FP8 tensor cores add with about
14 bits inside one MMA, and cuBLASLt's DGELU rounds the matmul result to the output dtype first.

Tests taking ``devices`` run on the CPU and, where a GPU and a CUDA build are present, on CUDA.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from kernel_testing import _one_torch_thread, assert_bits_equal, fp8_allclose_supported  # noqa: F401

import fusible._kernels as K

ops = torch.ops.fusible

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
HP = (torch.float32, torch.float16, torch.bfloat16)
EPILOGUES = K.GEMM_EPILOGUES
USES_BIAS = {"bias", "bias_gelu", "bias_gelu_aux"}
WRITES_AUX = {"gelu_aux", "bias_gelu_aux"}
READS_AUX = {"dgelu", "dgelu_bgrad"}
ODD_SIZES = [(1, 1, 1), (7, 13, 5), (13, 7, 127), (127, 1, 13), (1, 127, 7)]
U = 2.0**-24

# Relative half-ulp and absolute rounding near zero of each output dtype.
REL = {
    torch.float32: U,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    E4M3: 2.0**-4,
    E5M2: 2.0**-3,
}
ABS = {
    torch.float32: 1e-44,
    torch.float16: 2.0**-25,
    torch.bfloat16: 1e-38,
    E4M3: 2.0**-10,
    E5M2: 2.0**-17,
}

# ops.gemm's arguments after a and b, as gemm_args fills them in.
GEMM_DEFAULTS = dict(
    transa=False,
    transb=False,
    a_scale_inv=None,
    b_scale_inv=None,
    out_dtype=torch.float32,
    bias=None,
    epilogue="none",
    aux=None,
    c=None,
    alpha=1.0,
    beta=0.0,
    out_scale=None,
    want_amax=False,
)


def gemm_args(a, b, **kw):
    """ops.gemm's positional arguments: ``a``, ``b``, then GEMM_DEFAULTS with ``kw`` over them."""
    return (a, b, *{**GEMM_DEFAULTS, **kw}.values())


# ---- inputs and the FP64 reference --------------------------------------------------------------


def operand(shape, dtype, device, gen) -> torch.Tensor:
    """Random values of dtype: FP8 well inside the range (no NaN), high precision ~N(0, 1)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dtype in FP8:
        return (x * 8).clamp(-240, 240).to(dtype).to(device)
    return x.to(dtype).to(device)


def gelu64(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def dgelu64(x):
    k0 = math.sqrt(2 / math.pi)
    th = torch.tanh(k0 * (x + 0.044715 * x**3))
    return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * k0 * (1 + 3 * 0.044715 * x * x)


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """[prod(shape[:-1]), shape[-1]], as the op views its tensors."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


class Case:
    """One call of fusible.gemm with its inputs and the FP64 expectation."""

    def __init__(
        self,
        device,
        m,
        n,
        k,
        a_dtype=torch.float32,
        b_dtype=None,
        out_dtype=None,
        transa=False,
        transb=False,
        epilogue="none",
        alpha=1.0,
        beta=0.0,
        want_amax=False,
        seed=0,
        a_batch=None,
    ):
        b_dtype = b_dtype or a_dtype
        out_dtype = out_dtype or (a_dtype if a_dtype in HP else torch.bfloat16)
        gen = torch.Generator().manual_seed(seed)
        fp8 = a_dtype in FP8
        self.m, self.n, self.k = m, n, k
        self.a_dtype, self.b_dtype, self.out_dtype = a_dtype, b_dtype, out_dtype
        self.transa, self.transb, self.epilogue = transa, transb, epilogue
        self.alpha, self.beta, self.want_amax, self.fp8 = alpha, beta, want_amax, fp8
        a_shape = (k, m) if transa else (m, k)
        if a_batch is not None and not transa:
            a_shape = (*a_batch, k)
            assert math.prod(a_batch) == m
        self.a = operand(a_shape, a_dtype, device, gen)
        self.b = operand((n, k) if transb else (k, n), b_dtype, device, gen)
        self.a_scale_inv = torch.tensor([0.5], device=device) if fp8 else None
        self.b_scale_inv = torch.tensor([1 / 3], device=device) if fp8 else None
        vec = out_dtype if out_dtype in HP else torch.bfloat16
        bias_dtype = torch.bfloat16 if fp8 and out_dtype == torch.float32 else vec
        self.bias = operand((n,), bias_dtype, device, gen) if epilogue in USES_BIAS else None
        self.aux = operand((m, n), vec, device, gen) if epilogue in READS_AUX else None
        self.c = operand((m, n), out_dtype, device, gen) if beta != 0 else None
        self.out_scale = torch.tensor([1 / 16], device=device) if out_dtype in FP8 else None

    def args(self):
        return (
            self.a,
            self.b,
            self.transa,
            self.transb,
            self.a_scale_inv,
            self.b_scale_inv,
            self.out_dtype,
            self.bias,
            self.epilogue,
            self.aux,
            self.c,
            self.alpha,
            self.beta,
            self.out_scale,
            self.want_amax,
        )

    def run(self, fast_accum=False):
        return ops.gemm(*self.args(), fast_accum)

    def reference(self, cuda=False):
        """(r, t, r_err, t_err): the epilogue result and pre-activation in float64, and bounds."""
        a = as_matrix(self.a.cpu().double())
        b = as_matrix(self.b.cpu().double())
        if self.transa:
            a = a.t()
        if self.transb:
            b = b.t()
        s = self.alpha
        if self.fp8:
            s = self.alpha * float(self.a_scale_inv) * float(self.b_scale_inv)
        mag = abs(s) * (a.abs() @ b.abs())
        t = s * (a @ b)
        per_k = 2.0**-22 if cuda else 2.0**-23
        floor = 2.0**-9 if cuda and self.fp8 else 0.0
        t_err = (self.k * per_k + floor) * mag + 4 * U * t.abs()
        if self.c is not None:
            cv = self.beta * as_matrix(self.c.cpu().double())
            t = t + cv
            t_err = t_err + 4 * U * (cv.abs() + t.abs())
        if self.bias is not None:
            bv = self.bias.cpu().double()
            t = t + bv
            t_err = t_err + 2 * U * (t.abs() + bv.abs())
        if cuda and self.out_dtype in (torch.float16, torch.bfloat16):
            # cuBLASLt's epilogues may round the matmul result to the output dtype before adding
            # the bias or storing the GELU input (measured: one more rounding of a 16-bit aux).
            extra = t.abs() if self.bias is None else t.abs() + self.bias.cpu().double().abs()
            t_err = t_err + 2 * REL[self.out_dtype] * extra
        r, r_err = t, t_err
        if self.epilogue in ("gelu", "gelu_aux", "bias_gelu", "bias_gelu_aux"):
            r = gelu64(t)
            r_err = 1.2 * t_err + 64 * U * r.abs() + 1e-37
            if cuda:
                r_err = r_err + t.abs() * 2.0**-11
        elif self.epilogue in READS_AUX:
            x = as_matrix(self.aux.cpu().double())
            g = dgelu64(x)
            r = t * g
            r_err = g.abs() * t_err + t.abs() * 64 * U * (1 + x.abs()) + 4 * U * r.abs()
            if cuda:  # cuBLASLt rounds t to the output dtype before the multiply
                r_err = r_err + 2 * REL[self.out_dtype] * (r.abs() + 1.2 * t.abs())
        return r, t, r_err, t_err

    def check(self, outputs, cuda=False):
        d, aux_out, dbias, amax = outputs
        r, t, r_err, t_err = self.reference(cuda)
        od = self.out_dtype
        assert d.dtype == od
        want_shape = (self.m, self.n) if self.transa else (*self.a.shape[:-1], self.n)
        assert tuple(d.shape) == want_shape
        ds = float(self.out_scale) if od in FP8 else 1.0
        got = as_matrix(d.cpu().double()) / ds
        close(got, r, 1.1 * r_err + REL[od] * r.abs() + ABS[od] / ds, "d")
        if self.epilogue in WRITES_AUX:
            vec = aux_out.dtype
            assert tuple(aux_out.shape) == want_shape
            close(
                as_matrix(aux_out.cpu().double()), t, t_err + REL[vec] * t.abs() + ABS[vec], "aux"
            )
        else:
            assert aux_out.numel() == 0
        if self.epilogue == "dgelu_bgrad":
            vec = dbias.dtype
            want = r.sum(0)
            tol = (r_err + 2 * U * self.m * r.abs()).sum(0) + REL[vec] * want.abs() + ABS[vec]
            close(dbias.cpu().double(), want, tol, "dbias")
        else:
            assert dbias.numel() == 0
        if self.want_amax:
            assert amax.shape == (1,) and amax.dtype == torch.float32
            if r.numel() == 0:
                assert amax.item() == 0
            else:
                close(amax.cpu().double(), r.abs().max().reshape(1), r_err.max().reshape(1), "amax")
        else:
            assert amax.numel() == 0

    def __repr__(self):
        return (
            f"Case(M={self.m}, N={self.n}, K={self.k}, a={self.a_dtype}, b={self.b_dtype}, "
            f"out={self.out_dtype}, transa={self.transa}, transb={self.transb}, "
            f"epilogue={self.epilogue}, beta={self.beta})"
        )


def close(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    got = got.reshape(want.shape)
    bad = (got - want).abs() > tol
    if bad.any():
        idx = bad.nonzero()[:6].tolist()
        detail = ", ".join(
            f"{tuple(i)}: got {got[tuple(i)].item():.8g} want {want[tuple(i)].item():.8g} "
            f"+- {tol[tuple(i)].item():.3g}"
            for i in idx
        )
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ: {detail}")


def supported(case: Case) -> bool:
    return K.gemm_epilogue_supported(case.a_dtype, case.b_dtype, case.out_dtype, case.epilogue)


def check_or_refused(case: Case, devices: str) -> None:
    """A supported case checked against its reference; an unsupported one refused by the op."""
    if not supported(case):
        with pytest.raises(TypeError, match=r"fusible\.gemm"):
            case.run()
        return
    case.check(case.run(), cuda=devices == "cuda")


# ---- high precision -----------------------------------------------------------------------------


# (input dtype, output dtype) of the high-precision GEMMs.
HP_TYPES = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("dtype,out_dtype", HP_TYPES)
@pytest.mark.parametrize("transa,transb", list(itertools.product([False, True], repeat=2)))
def test_high_precision_all_transposes_odd_sizes(devices, dtype, out_dtype, transa, transb):
    for seed, (m, n, k) in enumerate(ODD_SIZES):
        case = Case(
            devices, m, n, k, dtype, out_dtype=out_dtype, transa=transa, transb=transb, seed=seed
        )
        case.check(case.run(), cuda=devices == "cuda")


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize(
    "dtype,out_dtype", [t for t in HP_TYPES if t != (torch.float16, torch.float32)]
)
def test_high_precision_epilogues(devices, epilogue, dtype, out_dtype):
    # N multiple of 8: the CUDA backend's aux epilogues need it (cuBLASLt's aux leading dimension).
    for seed, (m, n, k, ta, tb) in enumerate([(7, 8, 5, False, True), (33, 40, 127, True, False)]):
        case = Case(
            devices,
            m,
            n,
            k,
            dtype,
            out_dtype=out_dtype,
            transa=ta,
            transb=tb,
            epilogue=epilogue,
            alpha=0.75,
            seed=seed,
        )
        case.check(case.run(), cuda=devices == "cuda")


@pytest.mark.parametrize("epilogue", ["none", "bias"])
@pytest.mark.parametrize(
    "dtype,out_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_accumulate_returns_new_tensor_and_keeps_c(devices, epilogue, dtype, out_dtype):
    """Residual add / wgrad accumulation: d = a @ b (+ bias) + c; c is not modified."""
    case = Case(devices, 13, 24, 31, dtype, out_dtype=out_dtype, epilogue=epilogue, beta=1.0)
    before = case.c.clone()
    out = case.run()
    assert out[0].data_ptr() != case.c.data_ptr()
    assert torch.equal(case.c, before)
    case.check(out, cuda=devices == "cuda")
    case = Case(devices, 5, 8, 9, dtype, out_dtype=out_dtype, epilogue=epilogue, beta=-0.5, seed=3)
    case.check(case.run(), cuda=devices == "cuda")


def test_beta_zero_ignores_c(devices):
    case = Case(devices, 3, 4, 5)
    nan_c = torch.full((3, 4), float("nan"), device=devices)
    args = list(case.args())
    args[10] = nan_c  # c given, beta 0: never read
    case.check(ops.gemm(*args))


def test_batched_input_keeps_leading_dims(devices):
    case = Case(devices, 6, 8, 16, torch.bfloat16, transb=True, a_batch=(2, 3), epilogue="gelu_aux")
    out = case.run()
    assert out[0].shape == (2, 3, 8) and out[1].shape == (2, 3, 8)
    case.check(out, cuda=devices == "cuda")


def test_matches_torch_matmul_exactly_representable(devices):
    """Small integers: every product and partial sum is exact in fp32, so the result equals
    torch's on every backend, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (17, 33), generator=gen).float().to(devices)
    b = torch.randint(-4, 5, (33, 9), generator=gen).float().to(devices)
    d = ops.gemm(*gemm_args(a, b))[0]
    assert torch.equal(d.cpu(), (a.double() @ b.double()).float().cpu())


# ---- FP8 ----------------------------------------------------------------------------------------

MIXES = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]


@pytest.mark.parametrize("a_dtype,b_dtype", MIXES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16, E4M3, E5M2])
def test_fp8_operands_with_scales(devices, a_dtype, b_dtype, out_dtype):
    sizes = [(1, 16, 16), (13, 32, 64), (127, 48, 32)]
    if devices == "cpu":
        sizes += [(7, 13, 5)]  # the CPU has no alignment rules
    for seed, (m, n, k) in enumerate(sizes):
        case = Case(
            devices,
            m,
            n,
            k,
            a_dtype,
            b_dtype,
            out_dtype,
            transb=True,
            want_amax=out_dtype in FP8,
            seed=seed,
        )
        check_or_refused(case, devices)


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16, E4M3])
def test_fp8_epilogues(devices, epilogue, out_dtype):
    for seed, (a_dtype, b_dtype) in enumerate(MIXES):
        case = Case(
            devices,
            13,
            32,
            64,
            a_dtype,
            b_dtype,
            out_dtype,
            transb=True,
            epilogue=epilogue,
            want_amax=out_dtype in FP8,
            seed=seed,
        )
        check_or_refused(case, devices)


def test_fp8_matches_dequantized_torch_matmul(devices):
    """The user-level statement: an FP8 GEMM equals torch's matmul of the dequantized operands."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen)
    xq, wq = (
        ops.quantize_fp8_current(x, E4M3, 0, True, False),
        ops.quantize_fp8_current(w, E4M3, 0, True, False),
    )
    xd = xq[0].double() * xq[3].double()
    wd = wq[0].double() * wq[3].double()
    args = gemm_args(
        xq[0].to(devices),
        wq[0].to(devices),
        transb=True,
        a_scale_inv=xq[3].to(devices),
        b_scale_inv=wq[3].to(devices),
    )
    d = ops.gemm(*args)[0].cpu().double()
    want = xd @ wd.t()
    tol = (64 * 2.0**-22 + (2.0**-9 if devices == "cuda" else 0)) * (xd.abs() @ wd.abs().t())
    assert ((d - want).abs() <= tol + 1e-30).all()


def test_fp8_layout_must_be_tn():
    a = torch.ones(4, 32).to(E4M3)
    b = torch.ones(32, 16).to(E4M3)
    s = torch.ones(1)
    with pytest.raises(TypeError, match=r"fusible\.gemm.*operand b.*transb = 1"):
        ops.gemm(*gemm_args(a, b, a_scale_inv=s, b_scale_inv=s, out_dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"fusible\.gemm.*operand a.*transa = 0"):
        ops.gemm(
            *gemm_args(
                a.t().contiguous(),
                b.t().contiguous(),
                transa=True,
                transb=True,
                a_scale_inv=s,
                b_scale_inv=s,
                out_dtype=torch.bfloat16,
            )
        )


def test_fp8_output_saturates_and_amax_is_unscaled():
    case = Case("cpu", 4, 16, 32, E4M3, E4M3, E4M3, transb=True, want_amax=True)
    case.out_scale = torch.tensor([1e30])
    d, _, _, amax = case.run()
    r = case.reference()[0]
    codes = d.view(torch.uint8).reshape(r.shape).int()
    assert ((codes & 0x7F) == 0x7E)[r != 0].all()  # +-448
    assert torch.isclose(amax.double(), r.abs().max(), rtol=1e-5)


def test_gemm_epilogue_supported_matches_the_op():
    """The predicate fusions use agrees with what the op accepts, for every combination of
    operand, output and epilogue (on the CPU; the CUDA backend accepts the same, see gemm.h)."""
    for a_dtype, b_dtype, out_dtype, epilogue in itertools.product(
        FP8 + HP, FP8 + HP, FP8 + HP, EPILOGUES
    ):
        predicted = K.gemm_epilogue_supported(a_dtype, b_dtype, out_dtype, epilogue)
        if (b_dtype in FP8) != (a_dtype in FP8):
            assert not predicted
            continue
        case = Case("cpu", 2, 8, 16, a_dtype, b_dtype, out_dtype, transb=True, epilogue=epilogue)
        try:
            case.run()
            accepted = True
        except (TypeError, ValueError):
            accepted = False
        assert accepted == predicted, (a_dtype, b_dtype, out_dtype, epilogue)


# ---- empty problems -----------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", [(0, 8, 16), (4, 0, 16), (3, 8, 0), (0, 0, 0)])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_empty_problems(devices, m, n, k, epilogue):
    case = Case(devices, m, n, k, torch.bfloat16, epilogue=epilogue)
    case.check(case.run(), cuda=devices == "cuda")


# FP8 operands on CUDA need 16-byte rows of D; high-precision ones take any N, so their fills
# also have elements before and after the whole 16-byte stores.
EMPTY_K_FILLS = [(E4M3, out, m, n) for out in HP + FP8 for m, n in [(1, 16), (13, 1024)]] + [
    (hp, hp, m, n) for hp in HP for m, n in [(1, 1), (7, 3), (31, 127), (5, 1024)]
]


@pytest.mark.parametrize("a_dtype,out_dtype,m,n", EMPTY_K_FILLS, ids=str)
@pytest.mark.parametrize("scale", [0.5, -2.0, math.nan])
def test_empty_k_fill(devices, a_dtype, out_dtype, m, n, scale):
    """K = 0 with nothing read per element (an expert's wgrad without tokens): every element of D
    is alpha * scales * 0 -- 0, -0 for a negative scale, NaN for a NaN one; on CUDA the bits are
    the CPU's, an FP8 D's amax included."""
    fp8_out = out_dtype in FP8

    def run(device: str):
        b_dtype = E5M2 if out_dtype == E5M2 else a_dtype  # an E5M2 D needs an E5M2 operand
        alpha = 1.0 if a_dtype in FP8 else scale
        case = Case(device, m, n, 0, a_dtype, b_dtype, out_dtype, transb=True, alpha=alpha,
                    want_amax=fp8_out)  # fmt: skip
        if a_dtype in FP8:
            case.a_scale_inv = torch.tensor([scale], device=device)  # b_scale_inv is 1/3
        return case.run()[::3]

    d, amax = run(devices)
    got = d.cpu().float()
    if math.isnan(scale):
        assert got.isnan().all() and (not fp8_out or amax.isnan().all())
    else:
        factor = scale / 3 if a_dtype in FP8 else scale  # alpha * a_scale_inv * b_scale_inv
        d_scale = 1 / 16 if fp8_out else 1.0  # Case's out_scale
        v = torch.tensor(factor, dtype=torch.float32) * 0.0 * d_scale
        want = v.to(out_dtype).float().expand_as(got)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
        assert not fp8_out or amax.item() == 0
    if devices == "cuda":
        cd, camax = run("cpu")
        if math.isnan(scale):
            # A NaN's payload and sign are unspecified: the GPU's multiply returns the canonical
            # NaN, the CPU's keeps its operand's (measured on the H200, every output dtype).
            assert d.cpu().float().isnan().all() and cd.float().isnan().all()
            assert not fp8_out or (amax.cpu().isnan().all() and camax.isnan().all())
        else:
            assert_bits_equal(d, cd, "d")
            assert_bits_equal(amax, camax, "amax")


# ---- fake tensors, opcheck, torch.compile -------------------------------------------------------


def _fake_cases(device):
    yield Case(device, 5, 8, 16, torch.bfloat16, transa=True, epilogue="bias_gelu_aux")
    yield Case(device, 6, 16, 32, E4M3, E5M2, E4M3, transb=True, want_amax=True, epilogue="bias")
    yield Case(device, 6, 16, 32, E4M3, E4M3, torch.bfloat16, transb=True, epilogue="dgelu_bgrad")
    yield Case(device, 6, 8, 16, torch.float32, a_batch=(2, 3), beta=1.0, epilogue="bias")


@pytest.mark.parametrize("index", range(4))
def test_fake_kernel_shapes_match_real(devices, index):
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = list(_fake_cases(devices))[index]
    real = case.run()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args()]
        fake = ops.gemm(*fake_args)
    for f, r in zip(fake, real, strict=True):
        assert f.shape == r.shape and f.dtype == r.dtype and f.device == r.device
        assert f.stride() == r.stride()


@pytest.mark.parametrize("index", range(4))
def test_opcheck(devices, index):
    case = list(_fake_cases(devices))[index]
    utils = [
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    ]
    if case.fp8 and not fp8_allclose_supported(devices):
        # SchemaCheckMode compares inputs with torch.allclose, which has no float8 kernel here
        # (pytorch/pytorch#135998): check by hand that no input is mutated.
        utils.remove("test_schema")
        tensors = [a for a in case.args() if isinstance(a, torch.Tensor)]
        before = [t.view(torch.uint8).clone() if t.dtype in FP8 else t.clone() for t in tensors]
        case.run()
        for t, b in zip(tensors, before, strict=True):
            assert torch.equal(t.view(torch.uint8) if t.dtype in FP8 else t, b)
    torch.library.opcheck(ops.gemm.default, case.args(), test_utils=utils)


def test_torch_compile_fullgraph_matches_eager():
    def fn(x, w, bias, aux):
        h, pre, _, _ = ops.gemm(*gemm_args(x, w, transb=True, bias=bias, epilogue="bias_gelu_aux"))
        g, _, db, _ = ops.gemm(
            *gemm_args(h, w.t().contiguous(), transb=True, epilogue="dgelu_bgrad", aux=aux)
        )
        return h, pre, g, db

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 16, generator=gen), torch.randn(16, 16, generator=gen)
    bias, aux = torch.randn(16, generator=gen), torch.randn(9, 16, generator=gen)
    compiled = torch.compile(fn, fullgraph=True)
    for got, want in zip(compiled(x, w, bias, aux), fn(x, w, bias, aux), strict=True):
        assert torch.equal(got, want)


# ---- errors -------------------------------------------------------------------------------------

_A = torch.ones(4, 16)
_B = torch.ones(16, 8)
_A8 = torch.ones(4, 16).to(E4M3)
_B8 = torch.ones(8, 16).to(E4M3)
_S = torch.ones(1)
_BF = torch.bfloat16


def _args(**kw):
    return gemm_args(**{"a": _A, "b": _B, **kw})


_FP8 = dict(a=_A8, b=_B8, transb=True, a_scale_inv=_S, b_scale_inv=_S)
# (id, exception, argument the message must name, keyword overrides)
_ERRORS = [
    ("a_dtype", TypeError, "a", dict(a=_A.double())),
    ("a_int", TypeError, "a", dict(a=_A.int())),
    ("a_noncontig", ValueError, "a", dict(a=torch.ones(16, 4).t())),
    ("a_scalar", ValueError, "a", dict(a=torch.tensor(1.0))),
    ("b_meta", ValueError, "b", dict(b=_B.to("meta"))),
    ("inner_dim", ValueError, "b", dict(b=torch.ones(15, 8))),
    ("mixed_fp8", ValueError, "b", dict(b=_B8.t().contiguous(), a_scale_inv=_S, b_scale_inv=_S)),
    ("hp_dtype_mismatch", ValueError, "b", dict(b=_B.half())),
    ("out_dtype", TypeError, "out_dtype", dict(out_dtype=torch.float64)),
    ("out_dtype_hp", ValueError, "out_dtype", dict(a=_A.half(), b=_B.half(), out_dtype=_BF)),
    ("epilogue", ValueError, "epilogue", dict(epilogue="relu")),
    ("scale_missing", ValueError, "b_scale_inv", dict(_FP8, b_scale_inv=None)),
    ("scale_for_hp", ValueError, "a_scale_inv", dict(a_scale_inv=_S)),
    ("scale_shape", ValueError, "a_scale_inv", dict(_FP8, a_scale_inv=torch.ones(2))),
    ("scale_dtype", TypeError, "b_scale_inv", dict(_FP8, b_scale_inv=_S.half())),
    ("e5m2_e5m2", TypeError, "E5M2", dict(_FP8, a=_A8.to(E5M2), b=_B8.to(E5M2))),
    ("fp8_nn", TypeError, "b", dict(_FP8, b=_B8.t().contiguous(), transb=False)),
    ("out_scale_missing", ValueError, "out_scale", dict(_FP8, out_dtype=E4M3)),
    ("out_scale_hp", ValueError, "out_scale", dict(out_scale=_S)),
    ("amax_hp", ValueError, "want_amax", dict(want_amax=True)),
    ("bias_missing", ValueError, "bias", dict(epilogue="bias")),
    ("bias_unused", ValueError, "bias", dict(bias=torch.ones(8))),
    ("bias_shape", ValueError, "bias", dict(epilogue="bias", bias=torch.ones(7))),
    ("bias_dtype", ValueError, "bias", dict(epilogue="bias", bias=torch.ones(8).half())),
    ("bias_fp8_f32", ValueError, "bias", dict(_FP8, epilogue="bias", bias=torch.ones(8))),
    ("aux_missing", ValueError, "aux", dict(epilogue="dgelu")),
    ("aux_unused", ValueError, "aux", dict(epilogue="gelu_aux", aux=torch.ones(4, 8))),
    ("aux_shape", ValueError, "aux", dict(epilogue="dgelu", aux=torch.ones(4, 7))),
    ("c_missing", ValueError, "c", dict(beta=1.0)),
    ("c_shape", ValueError, "c", dict(beta=1.0, c=torch.ones(4, 9))),
    ("c_dtype", ValueError, "c", dict(beta=1.0, c=torch.ones(4, 8).half())),
    ("c_with_gelu", ValueError, "c", dict(beta=1.0, c=torch.ones(4, 8), epilogue="gelu")),
    (
        "fp8_f32_dgelu_bgrad",
        TypeError,
        "DGELU_BGRAD",
        dict(_FP8, epilogue="dgelu_bgrad", aux=torch.ones(4, 8)),
    ),
]


@pytest.mark.parametrize("exc,arg,kw", [e[1:] for e in _ERRORS], ids=[e[0] for e in _ERRORS])
def test_bad_input_raises_naming_op_and_argument(exc, arg, kw):
    with pytest.raises(exc) as info:
        ops.gemm(*_args(**kw))
    message = str(info.value)
    assert "fusible.gemm" in message, message
    assert arg in message, message


# ---- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_alignment_errors_name_the_argument():
    dev = "cuda"
    a = torch.ones(4, 8, device=dev).to(E4M3)
    b = torch.ones(16, 8, device=dev).to(E4M3)
    s = torch.ones(1, device=dev)
    with pytest.raises(ValueError, match=r"fusible\.gemm.*K = 8.*multiple of 16"):
        ops.gemm(
            *gemm_args(a, b, transb=True, a_scale_inv=s, b_scale_inv=s, out_dtype=torch.bfloat16)
        )
    x = torch.ones(4, 16, device=dev, dtype=torch.bfloat16)
    w = torch.ones(6, 16, device=dev, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"fusible\.gemm.*aux.*N = 6"):
        ops.gemm(*gemm_args(x, w, transb=True, out_dtype=torch.bfloat16, epilogue="gelu_aux"))


@pytest.mark.cuda
def test_cuda_matches_cpu_large():
    """A training-sized FP8 GEMM and a bf16 one, CUDA vs the CPU backend."""
    for a_dtype, b_dtype, out, ep in [
        (E4M3, E4M3, torch.bfloat16, "bias_gelu_aux"),
        (E5M2, E4M3, torch.bfloat16, "dgelu_bgrad"),
        (torch.bfloat16, torch.bfloat16, torch.float32, "none"),
    ]:
        case = Case("cuda", 256, 384, 512, a_dtype, b_dtype, out, transb=True, epilogue=ep)
        got = case.run()
        case.check(got, cuda=True)
        cpu = Case("cpu", 256, 384, 512, a_dtype, b_dtype, out, transb=True, epilogue=ep)
        want = cpu.run()
        d, w = got[0].cpu().double(), want[0].double()
        r, _, r_err, _ = case.reference(cuda=True)
        assert ((d - w).abs() <= 2 * (r_err + REL[out] * r.abs()) + 1e-30).all()


@pytest.mark.cuda
def test_cuda_runs_on_current_stream_and_graph_capture():
    case = Case("cuda", 64, 128, 256, E4M3, E4M3, torch.bfloat16, transb=True, epilogue="bias")
    eager = case.run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = case.run()
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(on_stream[0], eager[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = case.run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0])


@pytest.mark.cuda
def test_cuda_fast_accum_runs():
    case = Case("cuda", 128, 256, 1024, E4M3, E4M3, torch.bfloat16, transb=True)
    case.check(case.run(fast_accum=True), cuda=True)
