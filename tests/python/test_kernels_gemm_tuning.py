"""FUSIBLE_GEMM_TUNING (cpp/src/gemm/gemm.cu, "algorithm choice"): with N > 1 the CUDA backend
times the cuBLASLt heuristic's first N candidates once per problem key and keeps the fastest.

The variable is read once per process, so each test runs a child Python. Timed candidates write
D, aux, the bias gradient and amax before the real call overwrites them: the GEMM test file run
under tuning checks every epilogue's outputs against the references of the untuned run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.cuda


def _child(args: list[str], tuning: str, timeout: float = 300) -> tuple[int, str]:
    """The child's return code and its stdout and stderr as one stream, in the order written."""
    env = dict(os.environ, FUSIBLE_GEMM_TUNING=tuning, FUSIBLE_GEMM_TUNING_LOG="1")
    r = subprocess.run([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=HERE)  # fmt: skip
    return r.returncode, r.stdout


def _needs_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_gemm_kernel_tests_pass_under_tuning():
    _needs_cuda()
    rc, out = _child(["-m", "pytest", "-q", "-x", "-s", "-p", "no:cacheprovider", "-k", "cuda",
                "test_kernels_gemm.py", "test_kernels_grouped.py"], "8", timeout=600)  # fmt: skip
    assert rc == 0, out[-6000:]
    # The log proves candidates were timed (not the heuristic's first taken silently).
    assert "fusible gemm tuning M=" in out


_CAPTURE = """
import torch, fusible._kernels as K
a = torch.randn(96, 160, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(224, 160, device="cuda").to(torch.float8_e4m3fn)
one = torch.ones(1, device="cuda")
def f():
    return K.gemm(a, b, False, True, one, one, torch.bfloat16, None, "none", None, None, 1.0, 0.0,
                  None, False, False)[0]
ref = (a.float() @ b.float().t())
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    with torch.cuda.graph(g, stream=s):
        out = f()  # first call of this key inside a capture: the heuristic's first, not cached
torch.cuda.synchronize()
print("CAPTURED", flush=True)
g.replay()
torch.cuda.synchronize()
assert torch.allclose(out.float(), ref, rtol=2e-2, atol=1e-1), (out.float() - ref).abs().max()
eager = f()  # outside a capture: timed now
torch.cuda.synchronize()
assert torch.allclose(eager.float(), ref, rtol=2e-2, atol=1e-1)
print("DONE", flush=True)
"""


def test_first_call_inside_a_graph_capture_is_timed_afterwards():
    _needs_cuda()
    rc, out = _child(["-c", _CAPTURE], "4")
    assert rc == 0, out[-4000:]
    # No timing happened during the capture: the tuning line comes after CAPTURED.
    assert "DONE" in out
    assert out.index("fusible gemm tuning M=96 N=224 K=160") > out.index("CAPTURED"), out


def test_a_bad_value_names_the_variable():
    _needs_cuda()
    code = (
        "import torch, fusible._kernels as K\n"
        "a = torch.randn(16, 32, device='cuda')\n"
        "K.gemm(a, a, False, True, None, None, torch.float32, None, 'none', None, None, 1.0, 0.0,"
        " None, False, False)\n"
    )
    rc, out = _child(["-c", code], "lots")
    assert rc == 1, out[-2000:]  # a Python exception, not a crash
    assert "FUSIBLE_GEMM_TUNING must be an integer from 0 to 16" in out, out[-2000:]
