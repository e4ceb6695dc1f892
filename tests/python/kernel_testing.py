"""Helpers shared by the kernel test files (bit comparisons, ids, one torch thread, opcheck, the
fused ops' quantized outputs)."""

from __future__ import annotations

import pytest
import torch


def _name(v: object) -> str:
    return str(v).removeprefix("torch.")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The references run on small tensors, where torch's intra-op threads only add overhead (and,
    on a loaded machine, spin-waiting that makes a file several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of the same width (on the CPU)."""
    t = t.detach().cpu().contiguous()
    return t.view(INT_VIEW[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {got.shape} != {want.shape}"
    bad = bits(got) != bits(want)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements differ"


def fp8_allclose_supported(device) -> bool:
    """Whether torch.allclose has a float8 kernel on ``device`` (opcheck's test_schema needs it;
    pytorch/pytorch#135998)."""
    try:
        t = torch.zeros(2, device=device).to(torch.float8_e4m3fn)
        torch.allclose(t, t, equal_nan=True)
    except (NotImplementedError, RuntimeError):
        return False
    return True


# opcheck's tests but test_schema: its mutation check calls torch.allclose, which has no float8
# kernel (pytorch/pytorch#135998); for ops whose fp8 tensors are outputs only, so that no input
# can be mutated.
OPCHECK_WITHOUT_SCHEMA = (
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


def opcheck_without_schema(op, args) -> None:
    torch.library.opcheck(op, args, test_utils=list(OPCHECK_WITHOUT_SCHEMA))


def assert_quantized_equals_quantize(out, y, quant, fp8_dtype, scale, rowwise, columnwise, what):
    """A fused op's quantized outputs (``out[1:6]``: data, data_t or MXFP8 scales, amax) equal
    fusible's own quantize_fp8 / quantize_mxfp8 of its high-precision output ``y``, bit for bit
    (fused == unfused)."""
    ops = torch.ops.fusible
    if quant == "fp8":
        want = ops.quantize_fp8(y, scale, fp8_dtype, rowwise, columnwise)
        got = (out[1], out[2], out[3], out[5])
    else:
        want = ops.quantize_mxfp8(y, fp8_dtype, rowwise, columnwise)
        got = (out[1], out[3], out[2], out[4])
        amax = y.float().abs().max() if y.numel() else torch.tensor(0.0)
        assert_bits_equal(out[5], amax.reshape(1), f"{what} amax")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bits_equal(g, w, f"{what} output {i}")
