"""Helpers shared by the kernel test files (bit comparisons, ids, one torch thread, opcheck)."""

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
