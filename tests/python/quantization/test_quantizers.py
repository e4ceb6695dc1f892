"""Quantizers and quantized data: numerics against plain-torch references, error bounds,
usage flags, containers and the user-facing QuantizedTensor."""

from __future__ import annotations

import io

import pytest
import torch
from _quant_reference import (
    FP8_MAX,
    MANTISSA_BITS,
    MIN_NORMAL_EXP,
    cast_fp8,
    current_scaling,
    mxfp8_dequantize_rowwise,
    mxfp8_rowwise,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fusible.quantization import (
    Float8CurrentScalingQuantizer,
    Float8Data,
    Float8Quantizer,
    Float8Tensor,
    MXFP8Data,
    MXFP8Quantizer,
    MXFP8Tensor,
    QuantizedTensor,
    Quantizer,
    quantizer_for_recipe,
)
from fusible.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HP = [torch.float32, torch.bfloat16, torch.float16]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs with equal bits compare equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@st.composite
def tensors(draw, max_dim: int = 70):
    """Random (shape, values) with a wide dynamic range, some zeros, in a random input dtype."""
    shape = draw(
        st.one_of(
            st.tuples(st.integers(1, max_dim)),
            st.tuples(st.integers(1, max_dim), st.integers(1, max_dim)),
            st.tuples(st.integers(1, 4), st.integers(1, 20), st.integers(1, 40)),
        )
    )
    dtype = draw(st.sampled_from(HP))
    lo, hi = (-26, 15) if dtype is torch.float16 else (-70, 40)
    lo = draw(st.integers(lo, hi))
    span = draw(st.integers(0, min(20, hi - lo)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(lo + span * torch.rand(shape, generator=g))
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x = sign * mag
    x[torch.rand(shape, generator=g) < 0.05] = 0.0
    return x.to(dtype)


def per_tensor_bound(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """|dequant - x| bound of a per-tensor cast without saturation: half an ulp, relative in the
    normal range and absolute (half the subnormal spacing, unscaled) below it."""
    m = MANTISSA_BITS[fp8_dtype]
    rel = x.abs() * 2.0 ** -(m + 1)
    sub = 2.0 ** (MIN_NORMAL_EXP[fp8_dtype] - m - 1) / scale
    return torch.maximum(rel, torch.full_like(rel, sub)) * (1 + 2**-20)


# ---- current scaling ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(x=tensors(), fp8_dtype=st.sampled_from(FP8), margin=st.integers(0, 3))
def test_current_scaling_matches_reference_and_bound(x, fp8_dtype, margin):
    q = Float8CurrentScalingQuantizer(fp8_dtype, margin=margin)
    out = q.quantize(x)
    ref_data, ref_scale, ref_scale_inv = current_scaling(x, fp8_dtype, margin)
    assert same(out.data, ref_data)
    assert same(out.scale_inv, ref_scale_inv)
    # transposed copy holds the same values
    assert same(out.data_t, ref_data.reshape(-1, x.shape[-1]).t().contiguous())
    deq = out.dequantize(torch.float32)
    assert torch.equal(deq, ref_data.float() * ref_scale_inv)  # exact dequantization
    err = (deq - x.float()).abs()
    assert bool((err <= per_tensor_bound(x.float(), float(ref_scale), fp8_dtype)).all())
    # the columnwise copy alone dequantizes to the same tensor
    only_t = q.quantize(x, rowwise=False, columnwise=True)
    assert only_t.data is None and torch.equal(only_t.dequantize(), deq)


def test_current_scaling_special_values():
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    zeros = q.quantize(torch.zeros(3, 5))
    assert float(zeros.scale_inv) == 1.0 and torch.equal(zeros.dequantize(), torch.zeros(3, 5))
    x = torch.tensor([[1.0, float("nan"), -2.0]])
    out = q.quantize(x)
    assert float(out.scale_inv) == 1.0  # NaN amax: fallback scale 1
    assert torch.isnan(out.dequantize()[0, 1])
    assert torch.equal(out.dequantize()[0, [0, 2]], torch.tensor([1.0, -2.0]))
    big = torch.tensor([[float("inf"), 1.0]])
    assert float(q.quantize(big).scale_inv) == 1.0


def test_dequantize_dtypes_round_from_fp32():
    x = torch.randn(7, 33)
    out = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(x)
    f32 = out.dequantize(torch.float32)
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(out.dequantize(dt), f32.to(dt))


# ---- delayed-scaling quantizer -------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_float8_quantizer_uses_state_scale_and_records_running_max(fp8_dtype):
    q = Float8Quantizer.standalone(fp8_dtype, scale=4.0, amax_history_len=3)
    x1, x2 = torch.randn(4, 8), 5 * torch.randn(2, 8)
    out = q.quantize(x1)
    assert same(out.data, cast_fp8(x1, 4.0, fp8_dtype)) and float(out.scale_inv) == 0.25
    q.quantize(x2)
    q.quantize(x1)
    expected = torch.maximum(x1.abs().max(), x2.abs().max())
    assert float(q.buffers.amax_history[0, 0]) == float(expected)
    assert torch.all(q.buffers.amax_history[1:] == 0)
    q.buffers.scale.fill_(2.0)  # a changed state is seen at the next call
    assert float(q.quantize(x1).scale_inv) == 0.5
    q.record_amax(torch.tensor([100.0]))  # casts done by fused kernels report their amax
    q.record_amax(torch.tensor(3.0))
    assert float(q.buffers.amax_history[0, 0]) == 100.0


def test_float8_quantizer_bad_slot():
    q = Float8Quantizer.standalone(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"'slot' must be an int in \[0, 1\)"):
        Float8Quantizer(q.buffers, 1, torch.float8_e4m3fn)


# ---- MXFP8 --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(x=tensors(), fp8_dtype=st.sampled_from(FP8))
def test_mxfp8_matches_reference_and_bound(x, fp8_dtype):
    out = MXFP8Quantizer(fp8_dtype).quantize(x)
    x2d = x.reshape(-1, x.shape[-1])
    ref, ref_scale = mxfp8_rowwise(x2d, fp8_dtype)
    assert same(out.data.reshape(x2d.shape), ref) and same(out.scale, ref_scale)
    ref_c, ref_cscale = mxfp8_rowwise(x2d.t(), fp8_dtype)
    assert same(out.col_data.reshape(x2d.shape), ref_c.t().contiguous())
    assert same(out.col_scale, ref_cscale.t().contiguous())
    deq = out.dequantize()
    assert torch.equal(deq.reshape(x2d.shape), mxfp8_dequantize_rowwise(ref, ref_scale))
    col_only = MXFP8Quantizer(fp8_dtype, rowwise=False).quantize(x)
    assert col_only.data is None and col_only.scale is None
    deq_c = col_only.dequantize().reshape(x2d.shape)
    assert torch.equal(deq_c, mxfp8_dequantize_rowwise(ref_c, ref_cscale).t())
    # error bound per element, from the block scale 2**e actually used
    m, fmax = MANTISSA_BITS[fp8_dtype], FP8_MAX[fp8_dtype]
    k = x2d.shape[1]
    block = torch.exp2(ref_scale.float() - 127).repeat_interleave(32, dim=1)[:, :k]
    xf = x2d.float()
    err = (deq.reshape(x2d.shape) - xf).abs()
    saturated = xf.abs() > fmax * block
    normal_bound = torch.maximum(
        xf.abs() * 2.0 ** -(m + 1), 2.0 ** (MIN_NORMAL_EXP[fp8_dtype] - m - 1) * block
    ) * (1 + 2**-20)
    assert bool((err[~saturated] <= normal_bound[~saturated]).all())
    # OCP rule: scaled elements stay below 2**(emax_elem + 1) (512 for E4M3, 65536 for E5M2),
    # so saturating at 448 / 57344 costs at most 1/8 of the element
    assert bool((err[saturated] <= xf.abs()[saturated] * 0.125).all())


def test_mxfp8_special_blocks():
    x = torch.zeros(2, 64)
    x[0, 3] = float("nan")  # block (0, 0) -> NaN byte
    x[1, 40] = 3.0
    out = MXFP8Quantizer(torch.float8_e4m3fn, columnwise=False).quantize(x)
    assert out.scale.tolist() == [[255, 0], [0, 128 - 8]]
    deq = out.dequantize()
    assert torch.isnan(deq[0, :32]).all() and torch.equal(deq[0, 32:], torch.zeros(32))
    assert float(deq[1, 40]) == 3.0


# ---- usage flags, containers, errors ------------------------------------------------------------


def test_usage_flags_and_nbytes():
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    both = q.quantize(x)
    assert both.data.shape == (64, 96) and both.data_t.shape == (96, 64)
    assert both.nbytes == 2 * 64 * 96 + 4
    q.set_usage(columnwise=False)
    row = q.quantize(x)
    assert row.data_t is None and row.nbytes == 64 * 96 + 4
    assert q.quantize(x, columnwise=True).has_columnwise  # per-call override
    assert not q.columnwise
    mx = MXFP8Quantizer(torch.float8_e5m2).quantize(x)
    assert mx.nbytes == 2 * 64 * 96 + 64 * 3 + 2 * 96
    with pytest.raises(ValueError, match="at least one of 'rowwise' and 'columnwise'"):
        q.quantize(x, rowwise=False, columnwise=False)


def test_containers_to_detach_clone():
    x = torch.randn(5, 40)
    for q in (
        Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
        MXFP8Quantizer(torch.float8_e4m3fn),
    ):
        d = q.quantize(x)
        for d2 in (d.to("cpu"), d.detach(), d.clone()):
            assert type(d2) is type(d) and torch.equal(d2.dequantize(), d.dequantize())
        assert d.device == torch.device("cpu")
        assert d.clone().data.data_ptr() != d.data.data_ptr()


def test_container_validation():
    e4 = torch.zeros(2, 3, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="at least one of 'data' and 'data_t'"):
        Float8Data(None, None, torch.ones(1), torch.float8_e4m3fn, (2, 3))
    with pytest.raises(ValueError, match=r"'data' has dtype torch.float8_e4m3fn, expected"):
        Float8Data(e4, None, torch.ones(1), torch.float8_e5m2, (2, 3))
    with pytest.raises(ValueError, match="needs both its data and its scale"):
        MXFP8Data(e4, None, None, None, torch.float8_e4m3fn, (2, 3))


def test_quantizer_input_errors():
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"'x' must be a plain torch.Tensor"):
        q.quantize([1.0, 2.0])
    with pytest.raises(
        TypeError, match=r"'x' must be float32, float16 or bfloat16, got torch.int32"
    ):
        q.quantize(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one dimension"):
        q.quantize(torch.tensor(1.0))
    with pytest.raises(
        TypeError, match=r"'dtype' must be torch.float8_e4m3fn or torch.float8_e5m2"
    ):
        MXFP8Quantizer(torch.float16)
    with pytest.raises(ValueError, match="'margin' must be an int >= 0"):
        Float8CurrentScalingQuantizer(torch.float8_e4m3fn, margin=-1)
    with pytest.raises(TypeError, match=r"Float8Data.dequantize: 'dtype' must be"):
        q.quantize(torch.ones(2, 2)).dequantize(torch.int8)
    # non-contiguous inputs are accepted (made contiguous)
    x = torch.randn(8, 6).t()
    assert torch.equal(q.quantize(x).dequantize(), q.quantize(x.contiguous()).dequantize())
    assert isinstance(q, Quantizer) and "margin=0" in repr(q)


def test_quantizer_for_recipe():
    q = quantizer_for_recipe(Float8CurrentScaling(margin=1), "grad_output:linear")
    assert isinstance(q, Float8CurrentScalingQuantizer)
    assert q.dtype == torch.float8_e5m2 and q.margin == 1  # HYBRID: gradients are E5M2
    q = quantizer_for_recipe(Float8CurrentScaling(), "grad_output:linear", mode="forward")
    assert q.dtype == torch.float8_e4m3fn
    q = quantizer_for_recipe(MXFP8BlockScaling(fp8_format=Format.HYBRID), "input:linear")
    assert isinstance(q, MXFP8Quantizer) and q.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"stateless recipe .* got DelayedScaling"):
        quantizer_for_recipe(DelayedScaling(), "input:linear")


# ---- QuantizedTensor ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp8", "mxfp8"])
def test_quantized_tensor(kind):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    q = (
        Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
        if kind == "fp8"
        else MXFP8Quantizer(torch.float8_e4m3fn)
    )
    t = q.quantize_tensor(x)
    assert isinstance(t, QuantizedTensor)
    assert isinstance(t, Float8Tensor if kind == "fp8" else MXFP8Tensor)
    assert t.shape == x.shape and t.dtype == torch.bfloat16
    ref = t.dequantize()
    assert type(ref) is torch.Tensor and ref.dtype == torch.bfloat16
    assert torch.equal(ref, q.quantize(x).dequantize(torch.bfloat16))
    assert t.memory_footprint() == t.qdata.nbytes < x.numel() * 2 * 2
    # kept quantized: detach / clone / to(device)
    for t2 in (t.detach(), t.clone(), t.to("cpu"), t.to(torch.bfloat16)):
        assert type(t2) is type(t) and torch.equal(t2.dequantize(), ref)
    # as_strided to its own size and contiguous strides (FSDP2's view of an all-gathered
    # parameter) is an alias, still quantized; any other as_strided sees the dequantized tensor
    a = torch.as_strided(t, (4, 64), (64, 1), 0)
    assert type(a) is type(t) and a.qdata.data is t.qdata.data
    b = torch.as_strided(t, (2, 64), (64, 1), 0)
    assert type(b) is torch.Tensor and torch.equal(b, ref[:2])
    # dtype change -> plain dequantized tensor
    f = t.float()
    assert type(f) is torch.Tensor and torch.equal(f, q.quantize(x).dequantize(torch.float32))
    # unknown ops see the dequantized tensor
    y = t @ torch.ones(64, 3, dtype=torch.bfloat16)
    assert type(y) is torch.Tensor and torch.equal(y, ref @ torch.ones(64, 3, dtype=torch.bfloat16))
    assert torch.equal(t + 1, ref + 1)
    # copy_ re-quantizes with the quantizer; other in-place ops raise
    t.copy_(2 * x)
    assert torch.equal(t.dequantize(), q.quantize(2 * x).dequantize(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"in-place op .* not supported on quantized tensors"):
        t.add_(1)
    # a frozen parameter can hold it
    p = torch.nn.Parameter(t, requires_grad=False)
    assert isinstance(p, type(t))
    assert "fp8_dtype=torch.float8_e4m3fn" in repr(t)
    # torch.save / torch.load (weights_only=False: custom classes)
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)["w"]
    assert type(loaded) is type(t) and torch.equal(loaded.dequantize(), t.dequantize())


def test_quantized_tensor_errors():
    d = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(torch.randn(2, 3))
    with pytest.raises(TypeError, match="expected MXFP8Data, got Float8Data"):
        MXFP8Tensor(d)
    with pytest.raises(TypeError, match="expected Float8Data, MXFP8Data or Float8BlockData"):
        QuantizedTensor.wrap(torch.zeros(2))
    t = QuantizedTensor.wrap(d)
    with pytest.raises(RuntimeError, match="no quantizer to re-quantize with"):
        t.copy_(torch.zeros(2, 3))
