"""The grouped operators (torch.ops.fusible.grouped_*; MoE experts): each group gives the bits of
the per-tensor operator it stands for (quantize_fp8, quantize_fp8_current, gemm, torch's sum), for
packed and listed groups with empty groups, one row and odd sizes; fake kernels (shapes, opcheck,
torch.compile with symbolic splits); error messages naming the operator, the argument and what
was expected. CUDA instances run where a GPU is present (and compare with the CPU bit for bit for
the casts)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import OPCHECK_WITHOUT_SCHEMA, _one_torch_thread, assert_bits_equal  # noqa: F401

from fusible import _kernels as K

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [(0, 1, 7, 31), (3, 0, 0, 5), (13,), (0, 0), (17, 15, 63, 1, 2)]


def _packed(splits, cols, dtype, device):
    return (torch.randn(sum(splits), cols, dtype=torch.float32) * 4).to(dtype).to(device)


def _groups(x, splits):
    return [t.contiguous() for t in torch.split(x, list(splits))]


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("current", [False, True])
@pytest.mark.parametrize("usage", [(True, True), (True, False), (False, True)])
def test_quantize_packed_equals_per_tensor(devices, splits, dtype, fp8, current, usage):
    x = _packed(splits, 33, dtype, devices)
    scales = None if current else torch.rand(len(splits), device=devices) * 8 + 0.5
    data, data_t, scale_inv, amax, scale = K.grouped_quantize_fp8(
        [x], list(splits), scales, fp8, 1, *usage
    )
    assert len(data) == len(data_t) == len(scale_inv) == len(splits)
    for i, xi in enumerate(_groups(x, splits)):
        if current:
            d, dt, s, si, am = K.quantize_fp8_current(xi, fp8, 1, *usage)
            assert_bits_equal(scale[i : i + 1], s, f"scale[{i}]")
        else:
            d, dt, si, am = K.quantize_fp8(xi, scales[i : i + 1], fp8, *usage)
        assert_bits_equal(data[i], d, f"data[{i}]")
        assert_bits_equal(data_t[i], dt, f"data_t[{i}]")
        assert_bits_equal(scale_inv[i], si, f"scale_inv[{i}]")
        assert_bits_equal(amax[i : i + 1], am, f"amax[{i}]")
    if not current:
        assert scale.numel() == 0


@pytest.mark.parametrize("current", [False, True])
def test_quantize_listed_with_skipped_groups(devices, current):
    ws = [torch.randn(17, 64, device=devices), torch.randn(17, 64, device=devices) * 100,
          torch.randn(17, 64, device=devices)]  # fmt: skip
    scales = None if current else torch.tensor([2.0, 0.5, 4.0], device=devices)
    rows = [17, 0, 17]  # the second skipped
    data, data_t, scale_inv, amax, _ = K.grouped_quantize_fp8(ws, rows, scales, E4M3, 0, True, True)
    assert amax[1].item() == 0 and data[1].shape == (0, 64) and data_t[1].shape == (64, 0)
    for i in (0, 2):
        if current:
            d, dt, _, si, am = K.quantize_fp8_current(ws[i], E4M3, 0, True, True)
        else:
            d, dt, si, am = K.quantize_fp8(ws[i], scales[i : i + 1], E4M3, True, True)
        assert data[i].shape == ws[i].shape
        assert_bits_equal(data[i], d, "data")
        assert_bits_equal(data_t[i], dt, "data_t")
        assert_bits_equal(scale_inv[i], si, "scale_inv")
        assert_bits_equal(amax[i : i + 1], am, "amax")
    # All listed, no m_splits: the same bits for the groups that were cast above.
    full = K.grouped_quantize_fp8(ws, [], scales, E4M3, 0, True, False)
    assert_bits_equal(full[0][2], data[2], "data[2], nothing skipped")


@pytest.mark.skipif(not torch.cuda.is_available() or not K.has_cuda(), reason="needs CUDA")
@pytest.mark.parametrize("current", [False, True])
def test_quantize_cuda_equals_cpu(current):
    splits = [0, 1, 7, 31, 64, 129] * 7  # more groups than one launch takes
    x = _packed(splits, 48, torch.bfloat16, "cpu")
    scales = None if current else torch.rand(len(splits)) * 8 + 0.5
    cpu = K.grouped_quantize_fp8([x], splits, scales, E4M3, 0, True, True)
    gpu = K.grouped_quantize_fp8(
        [x.cuda()], splits, None if current else scales.cuda(), E4M3, 0, True, True
    )
    for a, b in zip(cpu[:3], gpu[:3], strict=True):
        for i, (ta, tb) in enumerate(zip(a, b, strict=True)):
            assert_bits_equal(tb, ta, f"group {i}")
    for ta, tb in zip(cpu[3:], gpu[3:], strict=True):
        assert_bits_equal(tb, ta, "amax / scale")


def _fp8_operands(m, n, k, device, dtype=E4M3):
    a = (torch.randn(m, k) * 2).to(dtype).to(device)
    b = (torch.randn(n, k) * 2).to(dtype).to(device)
    return a, b


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_gemm_fp8_equals_one_gemm_each(devices, splits, out_dtype, bias, packed):
    """FP8 "TN" GEMMs (GroupedLinear's forward): each the bits of gemm as _compute._gemm calls
    it (bias in the epilogue; for a float32 output added afterwards)."""
    n, k = 32, 64
    pairs = [_fp8_operands(m, n, k, devices) for m in splits]
    sa = [torch.rand(1, device=devices) + 0.5 for _ in splits]
    sb = [torch.rand(1, device=devices) + 0.5 for _ in splits]
    bs = [torch.randn(n, device=devices).to(out_dtype) for _ in splits] if bias else None
    got = K.grouped_gemm([a for a, _ in pairs], [b for _, b in pairs], [], sa, sb, out_dtype, bs,
                         True, packed)  # fmt: skip
    want = []
    for i, (a, b) in enumerate(pairs):
        fused = bias and out_dtype != torch.float32
        d = K.gemm(a, b, False, True, sa[i], sb[i], out_dtype, bs[i] if fused else None,
                   "bias" if fused else "none", None, None, 1.0, 0.0, None, False,
                   fast_accum=True)[0]  # fmt: skip
        if bias and not fused:
            d = d + bs[i]
        want.append(d)
    if packed:
        assert len(got) == 1
        assert_bits_equal(got[0], torch.cat(want), "packed d")
    else:
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bits_equal(g, w, f"d[{i}]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_high_precision_packed_a(devices, dtype):
    splits = [3, 0, 17, 1]
    x = _packed(splits, 24, dtype, devices)
    ws = [torch.randn(40, 24, device=devices).to(dtype) for _ in splits]
    bs = [torch.randn(40, device=devices).to(dtype) for _ in splits]
    y = K.grouped_gemm([x], ws, splits, None, None, dtype, bs, False, True)[0]
    want = []
    for xi, w, b in zip(_groups(x, splits), ws, bs, strict=True):
        args = (None, None, dtype, b, "bias", None, None, 1.0, 0.0, None, False)
        want.append(K.gemm(xi, w, False, True, *args)[0])
    assert_bits_equal(y, torch.cat(want), "y")


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("epilogue", ["bias_gelu_aux", "gelu_aux", "dgelu"])
def test_gemm_epilogues_equal_one_gemm_each(devices, splits, fp8, epilogue):
    """An explicit epilogue (the MoE expert MLP's fusions: fc1 with bias + GELU writing GELU's
    input as aux, fc2's dgrad applying GELU's derivative to a packed aux): each group the bits
    of gemm with that epilogue, aux packed as the groups' rows; empty groups write nothing."""
    n, k, dtype = 40, 32, torch.bfloat16
    if fp8:
        pairs = [_fp8_operands(m, n, k, devices) for m in splits]
        sa = [torch.rand(1, device=devices) + 0.5 for _ in splits]
        sb = [torch.rand(1, device=devices) + 0.5 for _ in splits]
    else:
        pairs = [(torch.randn(m, k).to(dtype).to(devices), torch.randn(n, k).to(dtype).to(devices))
                 for m in splits]  # fmt: skip
        sa = sb = None
    with_bias = K.GEMM_RULES.epilogues[epilogue].bias
    bs = [torch.randn(n, device=devices).to(dtype) for _ in splits] if with_bias else None
    aux = torch.randn(sum(splits), n).to(dtype).to(devices) if epilogue == "dgelu" else None
    got = K.grouped_gemm([a for a, _ in pairs], [b for _, b in pairs], [], sa, sb, dtype, bs,
                         fp8, True, epilogue, aux)  # fmt: skip
    writes = K.GEMM_RULES.epilogues[epilogue].writes_aux
    assert len(got) == (2 if writes else 1)
    want_d, want_aux, start = [], [], 0
    for i, (a, b) in enumerate(pairs):
        m = a.shape[0]
        d, ax, _, _ = K.gemm(a, b, False, True, sa[i] if fp8 else None, sb[i] if fp8 else None,
                             dtype, bs[i] if bs else None, epilogue,
                             None if aux is None else aux[start : start + m], None, 1.0, 0.0,
                             None, False, fast_accum=fp8)  # fmt: skip
        want_d.append(d)
        want_aux.append(ax)
        start += m
    assert_bits_equal(got[0], torch.cat(want_d), "packed d")
    if writes:
        assert got[1].shape == got[0].shape
        assert_bits_equal(got[1], torch.cat(want_aux), "packed aux")


def test_gemm_empty_k_writes_zeros(devices):
    """An expert without tokens: its weight gradient (K = 0) is zeros."""
    a = torch.empty(8, 0, dtype=E5M2, device=devices)
    b = torch.empty(16, 0, dtype=E4M3, device=devices)
    one = torch.ones(1, device=devices)
    d = K.grouped_gemm([a], [b], [], [one], [one], torch.bfloat16, None, False, False)[0]
    assert d.shape == (8, 16) and torch.count_nonzero(d) == 0


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bias_grad_equals_torch_sum(devices, splits, out_dtype):
    dy = _packed(splits, 19, torch.bfloat16, devices)
    got = K.grouped_bias_grad(dy, list(splits), out_dtype)
    for i, (g, dyi) in enumerate(zip(got, torch.split(dy, list(splits)), strict=True)):
        want = dyi.sum(0, dtype=torch.float32).to(out_dtype) if len(dyi) else dy.new_zeros(
            19, dtype=out_dtype)  # fmt: skip
        assert_bits_equal(g, want, f"dbias[{i}]")


# ---- fake kernels ------------------------------------------------------------------------------


def _cases(device):
    x = _packed([3, 0, 5], 16, torch.bfloat16, device)
    yield K.grouped_quantize_fp8, ([x], [3, 0, 5], None, E4M3, 0, True, True)
    yield K.grouped_quantize_fp8, ([x], [3, 0, 5], torch.ones(3, device=device), E5M2, 0, True,
                                   False)  # fmt: skip
    a, b = _fp8_operands(4, 8, 16, device)
    one = torch.ones(1, device=device)
    yield K.grouped_gemm, ([a, a], [b, b], [], [one, one], [one, one], torch.bfloat16,
                           [torch.zeros(8, device=device, dtype=torch.bfloat16)] * 2, False,
                           True)  # fmt: skip
    yield K.grouped_bias_grad, (x, [3, 0, 5], torch.float32)
    yield K.grouped_gemm, ([x], [x[:8].contiguous()] * 3, [3, 0, 5], None, None, torch.bfloat16,
                           [torch.zeros(8, device=device, dtype=torch.bfloat16)] * 3, False, True,
                           "bias_gelu_aux")  # fmt: skip


@pytest.mark.parametrize("index", range(5))
def test_fake_kernels_match_real(devices, index):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, args = list(_cases(devices))[index]
    real = op(*args)
    with FakeTensorMode() as mode:

        def fake(a):
            if isinstance(a, torch.Tensor):
                return mode.from_tensor(a)
            if isinstance(a, list):
                return [fake(t) for t in a]
            return a

        out = op(*[fake(a) for a in args])

    def flat(o):
        if isinstance(o, torch.Tensor):
            return [o]
        return [t for e in o for t in flat(e)]

    for f, r in zip(flat(out), flat(real), strict=True):
        assert f.shape == r.shape and f.dtype == r.dtype and f.device == r.device


@pytest.mark.parametrize("index", [1, 3])
def test_opcheck(devices, index):
    op, args = list(_cases(devices))[index]
    # The FP8 outputs/inputs of the casts: SchemaCheckMode has no float8 allclose on every
    # build; the schema test runs for the bias gradient (no FP8 tensors).
    utils = (["test_schema"] if index == 3 else []) + list(OPCHECK_WITHOUT_SCHEMA)
    torch.library.opcheck(op, args, test_utils=utils)


def test_torch_compile_symbolic_splits():
    """fullgraph compile of a grouped cast + GEMM with the splits as symbolic ints: one graph
    for two splits with the same empty experts, and the eager bits."""

    def fn(x, w, splits):
        data, _, si, _, _ = K.grouped_quantize_fp8([x], splits, None, E4M3, 0, True, False)
        wd, _, wsi, _, _ = K.grouped_quantize_fp8([w, w], [], None, E4M3, 0, True, False)
        return K.grouped_gemm(data, wd, [], si, wsi, torch.float32, None, False, True)[0]

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    w = torch.randn(16, 32)
    for splits in ([3, 5], [7, 9]):
        x = torch.randn(sum(splits), 32)
        assert_bits_equal(compiled(x, w, splits), fn(x, w, splits), str(splits))


# ---- bad input ---------------------------------------------------------------------------------


def test_errors_name_op_argument_and_expectation():
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"grouped_quantize_fp8: argument 'm_splits' must sum"):
        K.grouped_quantize_fp8([x], [3, 4], None, E4M3, 0, True, True)
    with pytest.raises(ValueError, match=r"grouped_quantize_fp8: argument 'scales' must be "
                                         r"float32 of shape \(2,\)"):  # fmt: skip
        K.grouped_quantize_fp8([x], [3, 5], torch.ones(3), E4M3, 0, True, True)
    with pytest.raises(TypeError, match=r"argument 'x\[1\]' has dtype torch.bfloat16, expected"):
        K.grouped_quantize_fp8([x, x.bfloat16()], [], None, E4M3, 0, True, True)
    with pytest.raises(ValueError, match=r"argument 'm_splits\[1\]' must be the rows of x\[1\]"):
        K.grouped_quantize_fp8([x, x], [8, 3], None, E4M3, 0, True, True)
    a, b = _fp8_operands(4, 8, 16, "cpu")
    one = torch.ones(1)
    with pytest.raises(ValueError, match=r"grouped_gemm: argument 'b' has 1 tensors, expected 2"):
        K.grouped_gemm([a, a], [b], [], [one, one], [one], torch.bfloat16, None, False, True)
    with pytest.raises(ValueError, match=r"argument 'a_scale_inv' must hold 2 one-element"):
        K.grouped_gemm([a, a], [b, b], [], [one], [one, one], torch.bfloat16, None, False, True)
    with pytest.raises(ValueError, match=r"disagree on K for GEMM 1"):
        K.grouped_gemm([a, a], [b, b[:, :8].contiguous()], [], [one, one], [one, one],
                       torch.bfloat16, None, False, True)  # fmt: skip
    with pytest.raises(
        TypeError, match=r"argument 'bias\[0\]' must have dtype in \(torch.bfloat16"
    ):
        K.grouped_gemm([a], [b], [], [one], [one], torch.bfloat16, [torch.zeros(8)], False, True)
    with pytest.raises(ValueError, match=r"argument 'b\[1\]' is on meta, expected the input's"):
        K.grouped_gemm([a, a], [b, b.to("meta")], [], [one, one], [one, one], torch.bfloat16,
                       None, False, True)  # fmt: skip
    bf = torch.bfloat16
    with pytest.raises(ValueError, match=r"grouped_gemm: argument 'epilogue' 'dgelu_bgrad' is "
                                         r"not offered for grouped GEMMs"):  # fmt: skip
        K.grouped_gemm([a], [b], [], [one], [one], bf, None, False, True, "dgelu_bgrad",
                       torch.zeros(4, 8, dtype=bf))  # fmt: skip
    with pytest.raises(ValueError, match=r"argument 'bias' is required by epilogue "
                                         r"'bias_gelu_aux'"):  # fmt: skip
        K.grouped_gemm([a], [b], [], [one], [one], bf, None, False, True, "bias_gelu_aux")
    with pytest.raises(ValueError, match=r"argument 'aux' is required by epilogue 'dgelu' \(the "
                                         r"GELU input, packed"):  # fmt: skip
        K.grouped_gemm([a], [b], [], [one], [one], bf, None, False, True, "dgelu")
    with pytest.raises(ValueError, match=r"argument 'aux' has shape \(4, 7\), expected a "
                                         r"contiguous \[4, 8\]"):  # fmt: skip
        K.grouped_gemm([a], [b], [], [one], [one], bf, None, False, True, "dgelu",
                       torch.zeros(4, 7, dtype=bf))  # fmt: skip
    with pytest.raises(ValueError, match=r"epilogue 'gelu_aux' needs one N for every GEMM"):
        K.grouped_gemm([a, a], [b, b[:4].contiguous()], [], [one, one], [one, one], bf, None,
                       False, True, "gelu_aux")  # fmt: skip
    with pytest.raises(ValueError, match=r"argument 'epilogue' must be one of"):
        K.grouped_gemm([a], [b], [], [one], [one], bf, None, False, True, "relu")
    with pytest.raises(ValueError, match=r"grouped_bias_grad: argument 'm_splits' must sum"):
        K.grouped_bias_grad(x, [1, 2], torch.float32)
