"""Tests of the activation custom ops (torch.ops.fusible.act_fwd / act_bwd).

The contract is cpp/include/fusible/activation.h (math in cpp/src/common/activation_math.h).
References:

- forward: torch.nn.functional.gelu(approximate="tanh") / gelu / relu / silu, and the gated
  silu(a) * b, gelu_tanh(a) * b, in float64 on the stored inputs;
- backward: torch.autograd through the same float64 functions; dbias: float64 column sums of the
  dx the op returns;
- quantized outputs: fusible's own quantize_fp8 / quantize_mxfp8 of the high-precision output,
  bit for bit (fused == unfused);
- CUDA (tests marked ``cuda``): the CPU backend, bit for bit.
"""

from __future__ import annotations

import kernel_testing as kt
import pytest
import torch
import torch.nn.functional as F
from kernel_testing import _name, _one_torch_thread, assert_bits_equal, bits  # noqa: F401

import fusible._kernels  # noqa: F401  (registers torch.ops.fusible.*)

ops = torch.ops.fusible

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = ("gelu", "gelu_erf", "relu", "silu", "swiglu", "geglu", "identity")
GATED = ("swiglu", "geglu")
SHAPES = [(1, 1), (7, 7), (127, 127), (1, 4097), (4097, 3), (3, 5, 7), (0, 8)]
# fp32 math is within a few ulps (activation_math.h); then one rounding to the output dtype.
STEP = {torch.float32: 2e-5, torch.float16: 2.0**-10 + 2e-5, torch.bfloat16: 2.0**-7 + 2e-5}
TINY = {torch.float32: 1e-12, torch.float16: 2.0**-24, torch.bfloat16: 1e-12}


def assert_close_to(got, ref, dtype, what, atol=0.0):
    g, r = got.double().cpu(), ref.double().cpu()
    tol = atol + TINY[dtype] + STEP[dtype] * r.abs()
    err = (g - r).abs()
    bad = ~(err <= tol)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} outside tolerance; worst excess "
        f"{(err / tol).max().item():.3g}"
    )


def in_shape(shape, kind):
    return (*shape[:-1], 2 * shape[-1]) if kind in GATED else tuple(shape)


def make(shape, dtype, std=2.0):
    return (torch.randn(shape) * std).to(dtype)


def reference(x64: torch.Tensor, kind: str) -> torch.Tensor:
    def act(t, k):
        if k in ("gelu", "geglu"):
            return F.gelu(t, approximate="tanh")
        if k == "gelu_erf":
            return F.gelu(t)
        if k == "relu":
            return F.relu(t)
        if k == "identity":
            return t
        return F.silu(t)

    if kind in GATED:
        a, b = x64.chunk(2, dim=-1)
        return act(a, kind) * b
    return act(x64, kind)


# **block: the blockwise cast's power_2_scale / amax_epsilon (the ops' keyword arguments).
def fwd(x, kind, out_dtype=None, quant="none", fp8_dtype=E4M3, scale=None, rowwise=True,
        columnwise=True, **block):  # fmt: skip
    return ops.act_fwd(x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, **block)


def bwd(
    grad,
    x,
    kind,
    out_dtype=None,
    quant="none",
    fp8_dtype=E4M3,
    scale=None,
    rowwise=True,
    columnwise=True,
    with_dbias=False,
    **block,
):
    return ops.act_bwd(
        grad, x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, with_dbias, **block
    )


# ---- forward / backward vs float64 --------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_torch_fp64(kind, dtype, shape):
    x = make(in_shape(shape, kind), dtype)
    y = fwd(x, kind, out_dtype=dtype)[0]
    assert y.shape == tuple(shape) and y.dtype == dtype
    assert_close_to(y, reference(x.double(), kind), dtype, "y")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_backward_matches_autograd_fp64(kind, dtype, shape):
    x = make(in_shape(shape, kind), dtype)
    grad = make(shape, dtype, std=1.0)
    dx, *_, dbias = bwd(grad, x, kind, out_dtype=dtype, with_dbias=True)
    x64 = x.double().requires_grad_()
    reference(x64, kind).backward(grad.double())
    assert dx.shape == x.shape and dx.dtype == dtype
    # Derivatives are accurate to ~1e-6 of max(|act'|, 0.1), times |grad| (and |b| when gated).
    assert_close_to(dx, x64.grad, dtype, "dx", atol=1e-5)
    assert dbias.shape == (x.shape[-1],) and dbias.dtype == dtype
    colsum = dx.double().reshape(-1, x.shape[-1]).sum(0)
    abssum = dx.double().reshape(-1, x.shape[-1]).abs().sum(0)
    assert_close_to(dbias, colsum, dtype, "dbias", atol=1e-6)
    assert bool(
        (
            (dbias.double() - colsum).abs()
            <= 1e-6 * abssum + STEP[dtype] * colsum.abs() + TINY[dtype]
        ).all()
    )


def test_relu_passes_nan_and_negative_zero_like_torch():
    x = torch.tensor([-0.0, float("nan"), -1.0, 2.0, 0.0])
    assert_bits_equal(fwd(x, "relu", out_dtype=torch.float32)[0], F.relu(x), "relu")


def test_dbias_dtype_follows_out_dtype_then_grad():
    x = make((9, 16), torch.bfloat16)
    g = make((9, 16), torch.bfloat16)
    assert bwd(g, x, "gelu", out_dtype=torch.float32, with_dbias=True)[6].dtype == torch.float32
    only = bwd(g, x, "gelu", with_dbias=True)
    assert only[0].numel() == 0 and only[6].dtype == torch.bfloat16
    # dbias without dx equals dbias with dx in grad's dtype.
    assert_bits_equal(
        only[6], bwd(g, x, "gelu", out_dtype=torch.bfloat16, with_dbias=True)[6], "db"
    )


# ---- quantized outputs == quantize(high-precision output) ---------------------------------------


def _quantized_cases(test):
    """Parametrizes ``test`` over every kind x dtype (fp32, bf16) x quant (fp8, mxfp8) x
    fp8_dtype (E4M3, E5M2)."""
    test = pytest.mark.parametrize("kind", KINDS)(test)
    test = pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_name)(test)
    test = pytest.mark.parametrize("quant", ("fp8", "mxfp8"))(test)
    return pytest.mark.parametrize("fp8_dtype", (E4M3, E5M2), ids=_name)(test)


@_quantized_cases
def test_forward_quantized_equals_quantize_of_output(kind, dtype, quant, fp8_dtype):
    scale = torch.tensor([7.0])
    for shape in [(1, 1), (127, 7), (3, 5, 64), (70, 4097)]:
        x = make(in_shape(shape, kind), dtype)
        for out_dtype in (None, dtype, torch.float32):
            for rowwise, columnwise in ((True, True), (True, False), (False, True)):
                out = fwd(x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise)
                y = fwd(x, kind, out_dtype=out_dtype or dtype)[0]
                what = f"{shape} out_dtype={out_dtype} rowwise={rowwise} columnwise={columnwise}"
                kt.assert_quantized_equals_quantize(
                    out, y, quant, fp8_dtype, scale, rowwise, columnwise, what
                )
                if out_dtype is not None:
                    assert_bits_equal(out[0], y, f"{what} y")


@_quantized_cases
def test_backward_quantized_equals_quantize_of_output(kind, dtype, quant, fp8_dtype):
    scale = torch.tensor([3.0])
    for shape in [(1, 32), (127, 7), (3, 5, 64), (70, 4097)]:
        x = make(in_shape(shape, kind), dtype)
        g = make(shape, dtype, std=1.0)
        for out_dtype in (None, torch.float32):
            for rowwise, columnwise in ((True, True), (False, True)):
                if quant == "mxfp8" and kind in GATED and rowwise and shape[-1] % 32:
                    continue  # documented: a gated backward's MXFP8 rowwise copy needs H % 32 == 0
                out = bwd(
                    g,
                    x,
                    kind,
                    out_dtype,
                    quant,
                    fp8_dtype,
                    scale,
                    rowwise,
                    columnwise,
                    with_dbias=True,
                )
                full = bwd(g, x, kind, out_dtype=out_dtype or dtype, with_dbias=True)
                what = f"{shape} out_dtype={out_dtype} rowwise={rowwise} columnwise={columnwise}"
                kt.assert_quantized_equals_quantize(
                    out, full[0], quant, fp8_dtype, scale, rowwise, columnwise, what
                )
                assert_bits_equal(out[6], full[6], f"{what} dbias")


# Rows 1, primes and 2^n - 1 around the 128-row blocks; H that is and is not a multiple of 128
# (gated backward: blocks straddling [da | db]).
BLOCK_SHAPES = [(1, 1), (7, 128), (31, 129), (127, 64), (3, 5, 300), (257, 256)]


@pytest.mark.parametrize("block_dim", (1, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_blockwise_output_equals_quantize_fp8_block_of_output(kind, dtype, block_dim):
    quant = f"block{block_dim}d"
    for shape in BLOCK_SHAPES:
        x = make(in_shape(shape, kind), dtype)
        g = make(shape, dtype, std=1.0)
        for out_dtype, rowwise, columnwise, fp8, pow2, eps in (
            (None, True, True, E4M3, True, 0.0),
            (dtype, True, False, E5M2, False, 0.0),
            (torch.float32, False, True, E4M3, True, 1e-3),
        ):
            what = f"{shape} out_dtype={out_dtype} rowwise={rowwise} columnwise={columnwise}"
            q = dict(quant=quant, fp8_dtype=fp8, rowwise=rowwise, columnwise=columnwise,
                     power_2_scale=pow2, amax_epsilon=eps)  # fmt: skip
            out = fwd(x, kind, out_dtype, **q)
            y = fwd(x, kind, out_dtype or dtype)[0]
            want = ops.quantize_fp8_block(y, fp8, block_dim, pow2, eps, rowwise, columnwise)
            for i, (a, w) in enumerate(zip((out[1], out[3], out[2], out[4]), want, strict=True)):
                assert_bits_equal(a, w, f"forward {what} output {i}")
            out = bwd(g, x, kind, out_dtype, with_dbias=True, **q)
            dx, *_, dbias = bwd(g, x, kind, out_dtype or dtype, with_dbias=True)
            want = ops.quantize_fp8_block(dx, fp8, block_dim, pow2, eps, rowwise, columnwise)
            for i, (a, w) in enumerate(zip((out[1], out[3], out[2], out[4]), want, strict=True)):
                assert_bits_equal(a, w, f"backward {what} output {i}")
            assert_bits_equal(out[6], dbias, f"backward {what} dbias")


def test_gated_mxfp8_rowwise_needs_h_multiple_of_32():
    x, g = make((4, 14), torch.float32), make((4, 7), torch.float32)
    with pytest.raises(ValueError, match=r"fusible\.act_bwd.*H % 32"):
        bwd(g, x, "swiglu", quant="mxfp8", rowwise=True, columnwise=False)


# ---- CUDA == CPU --------------------------------------------------------------------------------

GPU_SHAPES = [
    (1, 1),
    (7, 7),
    (127, 127),
    (4097, 7),
    (3, 4097),
    (64, 1024),
    (2500, 64),
    (2, 3, 96),
    (2144, 520),  # the row-walking kernel alone (H % 8 == 0, not a multiple of 64), 34 row groups
    (0, 8),
]


@pytest.mark.cuda
@pytest.mark.parametrize("quant", ("none", "fp8", "mxfp8", "block1d", "block2d"))
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_cpu(kind, dtype, quant):
    scale = torch.tensor([5.0])
    for shape in GPU_SHAPES:
        x = make(in_shape(shape, kind), dtype)
        g = make(shape, dtype, std=1.0)
        for out_dtype, columnwise in ((dtype, True), (None, False), (torch.float32, True)):
            if quant == "none":
                out_dtype = out_dtype or dtype
            rowwise = not (quant == "mxfp8" and kind in GATED and shape[-1] % 32)
            args = (out_dtype, quant, E4M3, scale, rowwise, columnwise or not rowwise)
            cargs = (out_dtype, quant, E4M3, scale.cuda(), rowwise, columnwise or not rowwise)
            for i, (c, w) in enumerate(
                zip(fwd(x.cuda(), kind, *cargs), fwd(x, kind, *args), strict=True)
            ):
                assert_bits_equal(c.cpu(), w, f"fwd {shape} {args[:2]} output {i}")
            got = bwd(g.cuda(), x.cuda(), kind, *cargs, with_dbias=True)
            want = bwd(g, x, kind, *args, with_dbias=True)
            for i, (c, w) in enumerate(zip(got, want, strict=True)):
                assert_bits_equal(c.cpu(), w, f"bwd {shape} {args[:2]} output {i}")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ("gelu", "gelu_erf", "silu", "relu"))
def test_cuda_math_same_bits_as_host_dense(kind):
    x = torch.randn(1 << 20) * 8
    x[::7] = torch.randn(x[::7].shape) * 1e-3
    g = torch.ones_like(x)
    assert_bits_equal(
        fwd(x.cuda(), kind, torch.float32)[0].cpu(), fwd(x, kind, torch.float32)[0], kind
    )
    assert_bits_equal(
        bwd(g.cuda(), x.cuda(), kind, torch.float32)[0].cpu(),
        bwd(g, x, kind, torch.float32)[0],
        f"d{kind}",
    )


# ---- torch.compile and opcheck ------------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager():
    def fn(x, g, scale):
        f = ops.act_fwd(x, "swiglu", torch.bfloat16, "fp8", E4M3, scale, True, True)
        b = ops.act_bwd(g, x, "swiglu", None, "mxfp8", E5M2, None, True, True, True)
        return (*f, *b)

    x = make((65, 128), torch.bfloat16)
    g = make((65, 64), torch.bfloat16)
    scale = torch.tensor([2.0])
    compiled = torch.compile(fn, fullgraph=True)
    for i, (got, want) in enumerate(zip(compiled(x, g, scale), fn(x, g, scale), strict=True)):
        assert_bits_equal(got, want, f"compiled vs eager output {i}")


def _opcheck_cases(device):
    x = torch.randn(5, 64, device=device)
    g = torch.randn(5, 32, device=device)
    s = torch.tensor([2.0], device=device)
    return {
        "fwd_fp8": ("act_fwd", (x, "gelu", torch.float32, "fp8", E4M3, s, True, True)),
        "fwd_mx": ("act_fwd", (x.bfloat16(), "geglu", None, "mxfp8", E5M2, None, True, False)),
        "bwd": ("act_bwd", (g, x, "swiglu", torch.bfloat16, "fp8", E5M2, s, True, True, True)),
        "fwd_block": ("act_fwd", (x, "silu", None, "block2d", E4M3, None, True, True, True, 0.0)),
        "bwd_block": (
            "act_bwd",
            (g, x, "geglu", None, "block1d", E4M3, None, True, True, True, False, 1e-3),
        ),
    }


@pytest.mark.parametrize("case", ["fwd_fp8", "fwd_mx", "bwd", "fwd_block", "bwd_block"])
def test_opcheck(case, devices):
    name, args = _opcheck_cases(devices)[case]
    kt.opcheck_without_schema(getattr(ops, name).default, args)  # the ops take no fp8 inputs


# ---- errors -------------------------------------------------------------------------------------

_X = torch.ones(4, 8)
_S = torch.ones(1)
F32 = torch.float32
# (id, exception, op, argument the message must name, arguments)
_ERRORS = [
    ("int_x", TypeError, "act_fwd", "x", (_X.int(), "gelu", F32, "none", E4M3, None, True, True)),
    (
        "transposed_x",
        ValueError,
        "act_fwd",
        "x",
        (_X.t(), "gelu", F32, "none", E4M3, None, True, True),
    ),
    ("kind", ValueError, "act_fwd", "kind", (_X, "tanh", F32, "none", E4M3, None, True, True)),
    (
        "block_epsilon",
        ValueError,
        "act_fwd",
        "amax_epsilon",
        (_X, "gelu", F32, "block1d", E4M3, None, True, True, True, -1.0),
    ),
    (
        "odd_gated",
        ValueError,
        "act_fwd",
        "x",
        (torch.ones(4, 7), "swiglu", F32, "none", E4M3, None, True, True),
    ),
    (
        "nothing",
        ValueError,
        "act_fwd",
        "out_dtype",
        (_X, "gelu", None, "none", E4M3, None, True, True),
    ),
    (
        "out_dtype",
        TypeError,
        "act_fwd",
        "out_dtype",
        (_X, "gelu", torch.float64, "none", E4M3, None, True, True),
    ),
    ("no_scale", ValueError, "act_fwd", "scale", (_X, "gelu", None, "fp8", E4M3, None, True, True)),
    (
        "scale_dtype",
        TypeError,
        "act_fwd",
        "scale",
        (_X, "gelu", None, "fp8", E4M3, _S.double(), True, True),
    ),
    (
        "no_copy",
        ValueError,
        "act_fwd",
        "rowwise",
        (_X, "gelu", None, "mxfp8", E4M3, None, False, False),
    ),
    (
        "fp8_dtype",
        TypeError,
        "act_fwd",
        "fp8_dtype",
        (_X, "gelu", None, "fp8", torch.int8, _S, True, True),
    ),
    (
        "grad_shape",
        ValueError,
        "act_bwd",
        "grad",
        (_X, _X, "swiglu", F32, "none", E4M3, None, True, True, False),
    ),
    (
        "x_device_dtype",
        TypeError,
        "act_bwd",
        "x",
        (_X, _X.half().int(), "gelu", F32, "none", E4M3, None, True, True, False),
    ),
    (
        "bwd_nothing",
        ValueError,
        "act_bwd",
        "with_dbias",
        (_X, _X, "gelu", None, "none", E4M3, None, True, True, False),
    ),
]


@pytest.mark.parametrize("case", _ERRORS, ids=[c[0] for c in _ERRORS])
def test_errors_name_op_and_argument(case):
    _, exc, op, arg, args = case
    with pytest.raises(exc, match=rf"fusible\.{op}.*{arg}"):
        getattr(ops, op)(*args)


@pytest.mark.cuda
def test_device_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"fusible\.act_fwd.*'scale'"):
        ops.act_fwd(_X.cuda(), "gelu", None, "fp8", E4M3, _S, True, True)
