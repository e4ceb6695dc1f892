"""Tests of the normalization custom ops (torch.ops.fusible.norm_fwd / norm_bwd).

The contract is cpp/include/fusible/normalization.h. References:

- forward: torch.nn.functional.layer_norm / rms_norm in float64 on the stored inputs;
- backward: torch.autograd through the same float64 functions;
- quantized outputs: fusible's own quantize_fp8 / quantize_mxfp8 / quantize_fp8_block of the
  high-precision output, compared bit for bit (fused == unfused);
- CUDA (tests marked ``cuda``): the CPU backend, bit for bit.
"""

from __future__ import annotations

import math

import kernel_testing as kt
import pytest
import torch
import torch.nn.functional as F
from kernel_testing import _name, _one_torch_thread, assert_bits_equal, bits  # noqa: F401

import fusible._kernels  # noqa: F401  (registers torch.ops.fusible.*)

ops = torch.ops.fusible

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = ("layernorm", "rmsnorm")
SHAPES = [(1, 1), (7, 7), (127, 127), (1, 4097), (4097, 7), (3, 5, 7), (2, 16384), (0, 8)]
EPS = 1e-5
# Relative step of each dtype: one rounding of an fp32 result to it, plus fp32 sum-order error.
STEP = {torch.float32: 2e-5, torch.float16: 2.0**-10 + 2e-5, torch.bfloat16: 2.0**-7 + 2e-5}
TINY = {torch.float32: 1e-30, torch.float16: 2.0**-24, torch.bfloat16: 1e-30}


def assert_close_to(got: torch.Tensor, ref: torch.Tensor, dtype, what: str, atol: float = 0.0):
    """|got - ref| <= atol + STEP[dtype] * (|ref| + scale), scale = rms of ref (cancellation in
    x - mean and in the backward's subtractions is relative to the row's magnitude)."""
    g, r = got.double().cpu(), ref.double().cpu()
    scale = r.pow(2).mean().sqrt().item() if r.numel() else 0.0
    tol = atol + TINY[dtype] + STEP[dtype] * (r.abs() + scale)
    err = (g - r).abs()
    bad = ~(err <= tol)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} outside tolerance; worst excess "
        f"{(err / tol).max().item():.3g}"
    )


def make(shape, dtype, *, mean=0.75, std=2.0):
    return (torch.randn(shape) * std + mean).to(dtype)


def reference_forward(x, gamma, beta, kind, zc):
    x64, w64 = x.double(), gamma.double() + (1.0 if zc else 0.0)
    h = x.shape[-1]
    if kind == "layernorm":
        b64 = beta.double() if beta is not None else None
        y = F.layer_norm(x64, (h,), w64, b64, EPS)
        mean = x64.mean(-1)
        var = (x64 - mean.unsqueeze(-1)).pow(2).mean(-1)
    else:
        y = F.rms_norm(x64, (h,), w64, EPS)
        mean = None
        var = x64.pow(2).mean(-1)
    return y, mean, (var + EPS).rsqrt()


def norm(
    x,
    gamma,
    beta,
    kind,
    zc=False,
    out_dtype=None,
    quant="none",
    fp8_dtype=E4M3,
    scale=None,
    rowwise=True,
    columnwise=True,
    **block,  # the blockwise cast's power_2_scale / amax_epsilon
):
    return ops.norm_fwd(x, gamma, beta, EPS, kind, zc, out_dtype, quant, fp8_dtype, scale,
                        rowwise, columnwise, **block)  # fmt: skip


def inputs(shape, dtype, kind, zc=False, gamma_dtype=None, with_beta=True):
    h = shape[-1]
    x = make(shape, dtype)
    gd = gamma_dtype or dtype
    gamma = (torch.randn(h) * 0.5 + (0.0 if zc else 1.0)).to(gd)
    beta = (torch.randn(h) * 0.5).to(gd) if kind == "layernorm" and with_beta else None
    return x, gamma, beta


# ---- forward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_torch_fp64(kind, dtype, shape):
    for zc, with_beta, gamma_dtype in ((False, True, None), (True, False, torch.float32)):
        x, gamma, beta = inputs(shape, dtype, kind, zc, gamma_dtype, with_beta)
        y, *_, mean, rstd = norm(x, gamma, beta, kind, zc, out_dtype=dtype)
        ref, ref_mean, ref_rstd = reference_forward(x, gamma, beta, kind, zc)
        assert y.shape == x.shape and y.dtype == dtype
        rows = math.prod(shape[:-1])
        assert rstd.shape == (rows,) and rstd.dtype == torch.float32
        assert_close_to(y, ref, dtype, f"y zc={zc}")
        assert_close_to(rstd, ref_rstd.reshape(-1), torch.float32, "rstd")
        if kind == "layernorm":
            assert mean.shape == (rows,)
            assert_close_to(mean, ref_mean.reshape(-1), torch.float32, "mean", atol=1e-6)
        else:
            assert mean.numel() == 0


@pytest.mark.parametrize("out_dtype", HP_DTYPES, ids=_name)
def test_forward_out_dtype_differs_from_input(out_dtype):
    x, gamma, beta = inputs((33, 300), torch.bfloat16, "layernorm")
    y = norm(x, gamma, beta, "layernorm", out_dtype=out_dtype)[0]
    assert y.dtype == out_dtype
    assert_close_to(y, reference_forward(x, gamma, beta, "layernorm", False)[0], out_dtype, "y")


# ---- quantized outputs == quantize(high-precision output) ---------------------------------------


@pytest.mark.parametrize("fp8_dtype", (E4M3, E5M2), ids=_name)
@pytest.mark.parametrize("quant", ("fp8", "mxfp8"))
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_output_equals_quantize_of_output(kind, dtype, quant, fp8_dtype):
    scale = torch.tensor([5.5])
    for shape in [(1, 1), (7, 127), (127, 7), (3, 5, 64), (65, 4097)]:
        x, gamma, beta = inputs(shape, dtype, kind)
        for out_dtype in (None, dtype, torch.float32):
            for rowwise, columnwise in ((True, True), (True, False), (False, True)):
                out = norm(
                    x,
                    gamma,
                    beta,
                    kind,
                    out_dtype=out_dtype,
                    quant=quant,
                    fp8_dtype=fp8_dtype,
                    scale=scale,
                    rowwise=rowwise,
                    columnwise=columnwise,
                )
                # The unfused path: the high-precision output (in x's dtype when none is asked).
                y = norm(x, gamma, beta, kind, out_dtype=out_dtype or dtype)[0]
                what = f"{shape} out_dtype={out_dtype} rowwise={rowwise} columnwise={columnwise}"
                kt.assert_quantized_equals_quantize(
                    out, y, quant, fp8_dtype, scale, rowwise, columnwise, what
                )
                if out_dtype is not None:
                    assert_bits_equal(out[0], y, f"{what} y")


# Rows 1, primes and 2^n - 1 around the 128-row blocks; widths that are and are not multiples of
# 128 (partial edge blocks: the quantize's documented rule).
BLOCK_SHAPES = [(1, 1), (7, 128), (31, 129), (127, 384), (3, 5, 300), (257, 256), (2, 16384)]


@pytest.mark.parametrize("fp8_dtype", (E4M3, E5M2), ids=_name)
@pytest.mark.parametrize("block_dim", (1, 2))
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_blockwise_output_equals_quantize_fp8_block_of_output(kind, dtype, block_dim, fp8_dtype):
    quant = f"block{block_dim}d"
    for shape in BLOCK_SHAPES:
        x, gamma, beta = inputs(shape, dtype, kind)
        for out_dtype, rowwise, columnwise, pow2, eps in (
            (None, True, True, True, 0.0),
            (dtype, True, False, False, 0.0),
            (torch.float32, False, True, True, 1e-3),
        ):
            out = norm(x, gamma, beta, kind, out_dtype=out_dtype, quant=quant, fp8_dtype=fp8_dtype,
                       rowwise=rowwise, columnwise=columnwise, power_2_scale=pow2,
                       amax_epsilon=eps)  # fmt: skip
            y = norm(x, gamma, beta, kind, out_dtype=out_dtype or dtype)[0]
            want = ops.quantize_fp8_block(y, fp8_dtype, block_dim, pow2, eps, rowwise, columnwise)
            got = (out[1], out[3], out[2], out[4])  # data, scale_inv, data_t, col_scale_inv
            what = f"{shape} out_dtype={out_dtype} rowwise={rowwise} columnwise={columnwise}"
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert_bits_equal(g, w, f"{what} output {i}")
            assert_bits_equal(out[5], y.float().abs().max().reshape(1), f"{what} amax")
            if out_dtype is not None:
                assert_bits_equal(out[0], y, f"{what} y")


def test_quant_none_returns_empty_quantized_outputs():
    x, gamma, beta = inputs((4, 8), torch.float32, "layernorm")
    out = norm(x, gamma, beta, "layernorm", out_dtype=torch.float32)
    assert all(t.numel() == 0 for t in out[1:6])


# ---- backward -----------------------------------------------------------------------------------


def reference_backward(dy, x, gamma, kind, zc):
    x64 = x.double().requires_grad_()
    g64 = gamma.double().requires_grad_()
    b64 = torch.zeros_like(g64, requires_grad=True)
    w = g64 + 1.0 if zc else g64
    h = x.shape[-1]
    if kind == "layernorm":
        y = F.layer_norm(x64, (h,), w, b64, EPS)
    else:
        y = F.rms_norm(x64, (h,), w, EPS)
    y.backward(dy.double())
    return x64.grad, g64.grad, b64.grad


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_backward_matches_autograd_fp64(kind, dtype, shape):
    for zc, gamma_dtype in ((False, None), (True, torch.float32)):
        x, gamma, beta = inputs(shape, dtype, kind, zc, gamma_dtype)
        *_, mean, rstd = norm(x, gamma, beta, kind, zc, out_dtype=dtype)
        dy = make(shape, dtype, mean=0.0, std=1.0)
        dx, dgamma, dbeta = ops.norm_bwd(dy, x, mean, rstd, gamma, kind, zc)
        rdx, rdg, rdb = reference_backward(dy, x, gamma, kind, zc)
        assert dx.dtype == dtype and dx.shape == x.shape
        assert dgamma.dtype == gamma.dtype and dgamma.shape == gamma.shape
        # fp32 statistics from the forward feed the backward: allow their error too.
        # dx cancels terms of size |dy * w| * rstd; its fp32 error is relative to those.
        w64 = gamma.double() + (1.0 if zc else 0.0)
        terms = (dy.double() * w64).abs() * rstd.double().reshape(*shape[:-1], 1)
        big = max(rdx.abs().max().item(), terms.max().item()) if rdx.numel() else 0.0
        assert_close_to(dx, rdx, dtype, f"dx zc={zc}", atol=2e-6 * big)
        rows = math.prod(shape[:-1])
        col_atol = 1e-5 * max(rows, 1) ** 0.5 * (rdg.abs().max().item() + 1.0)
        assert_close_to(dgamma, rdg, gamma.dtype, "dgamma", atol=col_atol)
        if kind == "layernorm":
            assert_close_to(dbeta, rdb, gamma.dtype, "dbeta", atol=col_atol)
        else:
            assert dbeta.numel() == 0


def test_backward_zero_rows_gives_zero_weight_gradients():
    x, gamma, _ = inputs((0, 5), torch.float32, "layernorm")
    *_, mean, rstd = norm(x, gamma, None, "layernorm", out_dtype=torch.float32)
    dx, dgamma, dbeta = ops.norm_bwd(x, x, mean, rstd, gamma, "layernorm", False)
    assert dx.shape == (0, 5)
    assert torch.equal(dgamma, torch.zeros(5)) and torch.equal(dbeta, torch.zeros(5))


# ---- CUDA == CPU --------------------------------------------------------------------------------

GPU_SHAPES = [
    (1, 1),
    (7, 7),
    (127, 127),
    (4097, 7),
    (3, 4097),
    (64, 1024),
    (40, 4096),
    (9, 16384),
    (3, 20000),
    (2, 3, 768),
    (0, 8),
]


def _to(t, device):
    return None if t is None else t.to(device)


@pytest.mark.cuda
@pytest.mark.parametrize("quant", ("none", "fp8", "mxfp8", "block1d", "block2d"))
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_forward_matches_cpu(kind, dtype, quant):
    scale = torch.tensor([3.0])
    for shape in GPU_SHAPES:
        for zc, out_dtype, columnwise in (
            (False, dtype, True),
            (True, None, False),
            (False, torch.float32, True),
        ):
            if quant == "none" and out_dtype is None:
                out_dtype = dtype
            x, gamma, beta = inputs(shape, dtype, kind, zc)
            args = dict(
                zc=zc,
                out_dtype=out_dtype,
                quant=quant,
                fp8_dtype=E4M3,
                rowwise=True,
                columnwise=columnwise,
            )
            want = norm(x, gamma, beta, kind, scale=scale, **args)
            got = norm(x.cuda(), gamma.cuda(), _to(beta, "cuda"), kind, scale=scale.cuda(), **args)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g.device.type == "cuda"
                assert_bits_equal(g.cpu(), w, f"{shape} {args} output {i}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_backward_matches_cpu(kind, dtype):
    # (20000, 96): 256 column-sum groups, four full chunks of the finalize kernel.
    for shape in [*GPU_SHAPES, (1000, 1024), (300, 4096), (5000, 300), (20000, 96)]:
        for zc in (False, True):
            x, gamma, beta = inputs(shape, dtype, kind, zc)
            *_, mean, rstd = norm(x, gamma, beta, kind, zc, out_dtype=dtype)
            dy = make(shape, dtype, mean=0.0, std=1.0)
            want = ops.norm_bwd(dy, x, mean, rstd, gamma, kind, zc)
            got = ops.norm_bwd(*(t.cuda() for t in (dy, x, mean, rstd, gamma)), kind, zc)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert_bits_equal(g.cpu(), w, f"{shape} zc={zc} output {i}")


# ---- torch.compile and opcheck ------------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager():
    def fn(x, gamma, beta, scale):
        f = ops.norm_fwd(
            x, gamma, beta, EPS, "layernorm", False, torch.bfloat16, "fp8", E4M3, scale, True, True
        )
        m = ops.norm_fwd(
            x, gamma, None, EPS, "rmsnorm", True, None, "mxfp8", E5M2, None, True, True
        )
        b = ops.norm_bwd(f[0], x, f[6], f[7], gamma, "layernorm", False)
        return (*f, *m, *b)

    x, gamma, beta = inputs((65, 96), torch.bfloat16, "layernorm")
    scale = torch.tensor([2.0])
    compiled = torch.compile(fn, fullgraph=True)
    for i, (got, want) in enumerate(
        zip(compiled(x, gamma, beta, scale), fn(x, gamma, beta, scale), strict=True)
    ):
        assert_bits_equal(got, want, f"compiled vs eager output {i}")


def _opcheck_cases(device):
    x = torch.randn(5, 40, device=device)
    g = torch.randn(40, device=device)
    s = torch.tensor([2.0], device=device)
    _, *_, mean, rstd = ops.norm_fwd(
        x, g, g, EPS, "layernorm", False, torch.float32, "none", E4M3, None, True, True
    )
    block = (x.bfloat16(), g, g, EPS, "layernorm", False, None, "block1d", E4M3, None, True, True)
    block += (False, 1e-4)  # power_2_scale, amax_epsilon
    return {
        "fwd_fp8": (
            "norm_fwd",
            (x, g, g, EPS, "layernorm", False, torch.float32, "fp8", E4M3, s, True, True),
        ),
        "fwd_mx": (
            "norm_fwd",
            (x.bfloat16(), g, None, EPS, "rmsnorm", True, None, "mxfp8", E5M2, None, True, False),
        ),
        "fwd_block": ("norm_fwd", block),
        "bwd": ("norm_bwd", (x, x, mean, rstd, g, "layernorm", False)),
    }


@pytest.mark.parametrize("case", ["fwd_fp8", "fwd_mx", "fwd_block", "bwd"])
def test_opcheck(case, devices):
    name, args = _opcheck_cases(devices)[case]
    kt.opcheck_without_schema(getattr(ops, name).default, args)  # the ops take no fp8 inputs


# ---- errors -------------------------------------------------------------------------------------

_X = torch.ones(4, 8)
_G = torch.ones(8)
_S = torch.ones(1)
_R = torch.ones(4)
F32 = torch.float32
# (id, exception, argument the message must name, arguments of norm_fwd)
_FWD_ERRORS = [
    (
        "int_x",
        TypeError,
        "x",
        (_X.int(), _G, None, EPS, "layernorm", False, F32, "none", E4M3, None, True, True),
    ),
    (
        "transposed_x",
        ValueError,
        "x",
        (_X.t(), _G[:4], None, EPS, "layernorm", False, F32, "none", E4M3, None, True, True),
    ),
    (
        "gamma_shape",
        ValueError,
        "gamma",
        (_X, torch.ones(7), None, EPS, "layernorm", False, F32, "none", E4M3, None, True, True),
    ),
    (
        "gamma_dtype",
        TypeError,
        "gamma",
        (_X, _G.double(), None, EPS, "layernorm", False, F32, "none", E4M3, None, True, True),
    ),
    (
        "beta_rms",
        ValueError,
        "beta",
        (_X, _G, _G, EPS, "rmsnorm", False, F32, "none", E4M3, None, True, True),
    ),
    (
        "kind",
        ValueError,
        "kind",
        (_X, _G, None, EPS, "batchnorm", False, F32, "none", E4M3, None, True, True),
    ),
    (
        "eps",
        ValueError,
        "eps",
        (_X, _G, None, -1.0, "layernorm", False, F32, "none", E4M3, None, True, True),
    ),
    (
        "out_dtype",
        TypeError,
        "out_dtype",
        (_X, _G, None, EPS, "layernorm", False, torch.int32, "none", E4M3, None, True, True),
    ),
    (
        "quant",
        ValueError,
        "quant",
        (_X, _G, None, EPS, "layernorm", False, F32, "int8", E4M3, None, True, True),
    ),
    (
        "fp8_dtype",
        TypeError,
        "fp8_dtype",
        (_X, _G, None, EPS, "layernorm", False, F32, "fp8", torch.bfloat16, _S, True, True),
    ),
    (
        "no_scale",
        ValueError,
        "scale",
        (_X, _G, None, EPS, "layernorm", False, F32, "fp8", E4M3, None, True, True),
    ),
    (
        "scale_shape",
        ValueError,
        "scale",
        (_X, _G, None, EPS, "layernorm", False, F32, "fp8", E4M3, torch.ones(2), True, True),
    ),
    (
        "no_copy",
        ValueError,
        "rowwise",
        (_X, _G, None, EPS, "layernorm", False, F32, "mxfp8", E4M3, None, False, False),
    ),
    (
        "empty_last_dim",
        ValueError,
        "x",
        (
            torch.ones(4, 0),
            torch.ones(0),
            None,
            EPS,
            "layernorm",
            False,
            F32,
            "none",
            E4M3,
            None,
            True,
            True,
        ),
    ),
]

_BWD_ERRORS = [
    ("x_shape", ValueError, "x", (_X, torch.ones(4, 7), _R, _R, _G, "layernorm", False)),
    ("mean_numel", ValueError, "mean", (_X, _X, torch.ones(3), _R, _G, "layernorm", False)),
    ("rstd_dtype", TypeError, "rstd", (_X, _X, _R, _R.double(), _G, "rmsnorm", False)),
    ("gamma_shape", ValueError, "gamma", (_X, _X, _R, _R, torch.ones(4), "layernorm", False)),
    ("kind", ValueError, "kind", (_X, _X, _R, _R, _G, "groupnorm", False)),
]


@pytest.mark.parametrize("case", _FWD_ERRORS, ids=[c[0] for c in _FWD_ERRORS])
def test_forward_errors_name_op_and_argument(case):
    _, exc, arg, args = case
    with pytest.raises(exc, match=rf"fusible\.norm_fwd.*'?{arg}"):
        ops.norm_fwd(*args)


@pytest.mark.parametrize("case", _BWD_ERRORS, ids=[c[0] for c in _BWD_ERRORS])
def test_backward_errors_name_op_and_argument(case):
    _, exc, arg, args = case
    with pytest.raises(exc, match=rf"fusible\.norm_bwd.*'?{arg}"):
        ops.norm_bwd(*args)


@pytest.mark.cuda
def test_device_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"fusible\.norm_fwd.*'gamma'"):
        ops.norm_fwd(
            _X.cuda(), _G, None, EPS, "layernorm", False, F32, "none", E4M3, None, True, True
        )
