"""GPU tests of fusible.quantization: CUDA results equal the CPU backend bit for bit; delayed
scaling state on the GPU; torch.compile and CUDA graph capture. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from fusible import _kernels, recipe
from fusible.quantization import (
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    RecipeState,
    end_forward_pass,
    load_recipe_state,
    recipe_state_to_dict,
    update_delayed_scaling,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and _kernels.has_cuda()),
        reason="needs a CUDA GPU and fusible built with its CUDA backend",
    ),
]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(1, 1), (7, 33), (31, 64), (127, 257), (4, 8, 96), (1024, 1024)]


def _x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g))
    return x.to(dtype)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b):
    return a.shape == b.shape and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_current_scaling_cuda_equals_cpu(shape, dtype, fp8_dtype):
    x = _x(shape, dtype, 1)
    q = Float8CurrentScalingQuantizer(fp8_dtype)
    a, b = q.quantize(x), q.quantize(x.cuda())
    assert b.data.is_cuda and _same(a.data, b.data) and _same(a.data_t, b.data_t)
    assert _same(a.scale_inv, b.scale_inv)
    assert _same(a.dequantize(dtype), b.dequantize(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_mxfp8_cuda_equals_cpu(shape, dtype, fp8_dtype):
    x = _x(shape, dtype, 2)
    q = MXFP8Quantizer(fp8_dtype)
    a, b = q.quantize(x), q.quantize(x.cuda())
    for name in ("data", "scale", "col_data", "col_scale"):
        assert _same(getattr(a, name), getattr(b, name)), name
    assert _same(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_on_gpu_equals_cpu(algo):
    rec = recipe.DelayedScaling(amax_history_len=5, amax_compute_algo=algo, margin=1)
    cpu = RecipeState.create(rec, "forward", 3)
    gpu = RecipeState.create(rec, "forward", 3, device="cuda")
    assert gpu.scale.is_cuda and gpu.amax_history.is_cuda
    for step in range(20):
        for slot in range(3):
            x = _x((17, 64), torch.bfloat16, step * 3 + slot)
            a = cpu.quantizers[slot].quantize(x)
            b = gpu.quantizers[slot].quantize(x.cuda())
            assert _same(a.data, b.data)
        update_delayed_scaling([cpu, gpu])  # one launch per device
        assert _same(cpu.amax_history, gpu.amax_history) and _same(cpu.scale, gpu.scale)
    # checkpoint from GPU into a CPU state and back
    fresh = RecipeState.create(rec, "forward", 3)
    load_recipe_state(fresh, recipe_state_to_dict(gpu))
    assert _same(fresh.scale, gpu.scale)
    fresh.to("cuda")
    assert fresh.quantizers[0].quantize(torch.ones(2, 2, device="cuda")).data.is_cuda


def test_quantized_tensor_device_moves():
    x = torch.randn(32, 64)
    t = MXFP8Quantizer(torch.float8_e4m3fn).quantize_tensor(x)
    g = t.to("cuda")
    assert type(g) is type(t) and g.device.type == "cuda" and g.qdata.data.is_cuda
    assert torch.equal(g.dequantize().cpu(), t.dequantize())
    assert torch.equal(g.cpu().dequantize(), t.dequantize())


def test_delayed_scaling_compiled_on_gpu():
    rec = recipe.DelayedScaling(amax_history_len=4)
    s = RecipeState.create(rec, "forward", 1, device="cuda")
    ref = RecipeState.create(rec, "forward", 1, device="cuda")

    def step(x):
        d = s.quantizers[0].quantize(x)
        end_forward_pass([s])
        return d.dequantize()

    cstep = torch.compile(step, fullgraph=True)
    for i in range(3):
        x = torch.randn(64, 128, device="cuda") * (i + 1)
        out = cstep(x)
        expected = ref.quantizers[0].quantize(x).dequantize()
        ref.update()
        assert torch.equal(out, expected)
        assert torch.equal(s.scale, ref.scale) and torch.equal(s.amax_history, ref.amax_history)


@pytest.mark.parametrize(
    "rec",
    [recipe.DelayedScaling(amax_history_len=4), recipe.Float8CurrentScaling(),
     recipe.MXFP8BlockScaling()],
    ids=["delayed", "current", "mxfp8"],
)  # fmt: skip
def test_cuda_graph_capture(rec):
    s = RecipeState.create(rec, "forward", 1, device="cuda")
    ref = RecipeState.create(rec, "forward", 1, device="cuda")
    x = torch.randn(64, 128, device="cuda")

    def step():
        out = s.quantizers[0].quantize(x).dequantize()
        update_delayed_scaling([s])
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    ref.quantizers[0].quantize(x)
    ref.update()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i in range(3):
        x.copy_(torch.randn(64, 128, device="cuda") * (i + 2))
        graph.replay()
        torch.cuda.synchronize()
        expected = ref.quantizers[0].quantize(x).dequantize()
        ref.update()
        assert torch.equal(out, expected)
        for a, b in zip(s.delayed_states(), ref.delayed_states(), strict=True):
            assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
