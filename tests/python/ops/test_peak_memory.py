"""The transient peak of a training step: FP8 saves memory, it does not add it (issue 13).

A step of the benchmarks' block (LayerNorm -> Linear -> GELU -> Linear, bf16, SGD) is traced on
CPU by benchmarks/peak_memory.py's ``LiveBytes`` (every storage an operator returns, counted
once until it is freed), which says how high the step's memory goes and what is alive at any
moment. The tests check

* the headline: the step peak without a recipe is plain PyTorch's, and under each FP8 recipe it
  is below the no-recipe peak;
* one rule per fix, as what is alive when a given tensor is allocated: a saved activation is
  freed after the last backward that reads it, a Linear's backward operands after their GEMM,
  a forward's rowwise copies before the next allocation, a current-scaling op's high-precision
  output with the op, and no quantized weight copy lives from forward to backward;
* that autograd's contracts hold: a retained graph backs a second backward, and an in-place
  change of a weight between forward and backward raises (backward reads the parameter);
* that none of this changed a number: outputs, gradients and updated parameters of several
  models per recipe are bit for bit those recorded before (golden_numerics.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fusible
from fusible import ops, recipe

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import golden_numerics  # noqa: E402

import peak_memory as pm  # noqa: E402

DT = torch.bfloat16
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
T, H, F = 128, 64, 256  # the benchmark's proportions (T = 2H, F = 4H), divisible by 32
RECIPES: dict[str, Any] = {
    "none": lambda: None,
    "delayed": recipe.DelayedScaling,
    "current": recipe.Float8CurrentScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
    "blockwise": recipe.Float8BlockScaling,
}
FP8_RECIPES = ["delayed", "current", "mxfp8", "blockwise"]
TWO_COPY = ("mxfp8", "blockwise")  # a columnwise copy with its own block scales


# ---- helpers ------------------------------------------------------------------------------------


def block_trace(name: str, *, t: int = T) -> pm.LiveBytes:
    torch.manual_seed(0)
    x = torch.randn(t, H, dtype=DT, requires_grad=True)
    dy = torch.randn(t, H, dtype=DT)
    if name == "torch":
        return pm.trace_step(pm.TorchBlock(H, F).to(DT), None, x, dy)
    return pm.trace_step(pm.fusible_block(H, F), RECIPES[name](), x, dy)


def linear_trace(name: str, k: int, n: int, t: int = T) -> pm.LiveBytes:
    """One step of a bias-free Linear [n, k] on ``t`` tokens."""
    torch.manual_seed(0)
    x = torch.randn(t, k, dtype=DT, requires_grad=True)
    dy = torch.randn(t, n, dtype=DT)
    return pm.trace_step(ops.Sequential(ops.BasicLinear(k, n, dtype=DT)), RECIPES[name](), x, dy)


def allocs(m: pm.LiveBytes, **want: Any) -> list[pm.Alloc]:
    """The allocations whose fields (phase, op, shape, dtype) match ``want``; ``dtype`` may be a
    tuple of dtypes, ``site`` a substring."""
    out = []
    for a in m.allocs:
        ok = True
        for k, v in want.items():
            got = getattr(a, k)
            if k == "dtype" and isinstance(v, tuple):
                ok = ok and got in v
            elif k == "site":
                ok = ok and v in got
            else:
                ok = ok and got == v
        if ok:
            out.append(a)
    return out


def first(m: pm.LiveBytes, **want: Any) -> pm.Alloc:
    found = allocs(m, **want)
    assert found, f"no allocation {want}"
    return found[0]


def alive_when(m: pm.LiveBytes, at: pm.Alloc, **want: Any) -> list[pm.Alloc]:
    """The allocations matching ``want`` alive when ``at`` was allocated (``at``'s own operator
    call's outputs excluded)."""
    alive = {a.index for a in m.alive_at(at.seq)}
    return [a for a in allocs(m, **want) if a.index in alive and a.seq != at.seq]


# ---- the harness itself -------------------------------------------------------------------------


def test_harness_counts_each_storage_once_until_freed():
    base = torch.ones(4)
    with pm.LiveBytes() as m:
        a = torch.empty(1000, dtype=torch.uint8)
        v = a.view(10, 100)  # a view: nothing new
        a.add_(1)  # in place: nothing new
        base.mul_(2)  # a storage from before: not counted
        b = torch.empty(500, dtype=torch.uint8)
        assert m.live == 1500
        del a
        assert m.live == 1500  # the view keeps the storage
        del v
        assert m.live == 500
        del b
    assert m.peak == 1500 and m.live == 0
    assert sorted(x.nbytes for x in m.at_peak) == [500, 1000]


# ---- the headline -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def block_peaks() -> dict[str, pm.LiveBytes]:
    return {name: block_trace(name) for name in ("torch", *RECIPES)}


def test_no_recipe_step_peak_is_plain_torchs(block_peaks):
    # Before, every saved activation lived until the whole plan's backward had run: 1.25x.
    assert block_peaks["none"].peak <= 1.01 * block_peaks["torch"].peak


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_fp8_step_peak_below_no_recipe(block_peaks, name):
    # Before: 0.975x (delayed), 1.125x (current), 1.188x (mxfp8) of the no-recipe peak, which
    # was itself 1.25x of today's; then 0.97x / 0.97x / 0.98x; now 0.845x / 0.845x / 0.978x
    # (the activation backward's per-tensor FP8 output written rowwise only, no bf16 copy).
    # Issue 13's targets: <= 0.90x per tensor, <= 1.0x MXFP8.
    limit = 0.985 if name in TWO_COPY else 0.86
    assert block_peaks[name].peak < limit * block_peaks["none"].peak


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_per_tensor_step_peak_is_what_the_dact_kernel_reads_and_writes(block_peaks, name):
    # The peak is the GELU backward kernel: it reads the saved pre-activation and fc2's dgrad
    # output (bf16 [T, F] each) and writes GELU's input gradient rowwise in FP8 ([T, F], one
    # byte an element); alive next to them are fc2's weight gradient ([H, F], handed to autograd
    # when the plan's backward ends), the step's output (held by the caller) and fc1's saved
    # input (LayerNorm's output, its transposed FP8 copy). Nothing else of [T, H] size or more.
    m = block_peaks[name]
    big = sorted((a.shape, str(a.dtype)) for a in m.at_peak if a.nbytes >= T * H)
    want = sorted([
        ((T, F), str(DT)), ((T, F), str(DT)), ((T, F), "torch.float8_e5m2"), ((H, F), str(DT)),
        ((T, H), str(DT)), ((H, T), "torch.float8_e4m3fn"),
    ])  # fmt: skip
    assert big == want, [a.describe() for a in m.at_peak]
    small = sum(a.nbytes for a in m.at_peak if a.nbytes < T * H)
    # LayerNorm's mean and rstd (fp32 [T]), the two bias gradients, scalars.
    assert small <= 8 * T + 2 * (F + H) + 64, [a.describe() for a in m.at_peak]


def test_current_scaling_forward_peak_is_delayed_scalings(block_peaks):
    # Current scaling cannot cast inside the norm / activation kernel; the separate cast now runs
    # in the op itself, so its high-precision output is not kept alongside the FP8 copy.
    cur, dly = block_peaks["current"].phase_peaks, block_peaks["delayed"].phase_peaks
    assert cur["forward"] <= dly["forward"] + 64


# ---- one rule per fix ---------------------------------------------------------------------------


def test_saved_activation_freed_after_its_last_backward(block_peaks):
    m = block_peaks["none"]
    # GELU's backward output: by then fc2's backward has run, and its saved input (the GELU
    # output) is gone; only the pre-activation GELU's backward reads is alive.
    at = first(m, phase="backward", op="act_bwd", shape=(T, F))
    saved = alive_when(m, at, phase="forward", shape=(T, F), dtype=DT)
    assert len(saved) == 1, [a.describe() for a in saved]


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_linear_backward_frees_the_first_gemms_operand(name):
    k = 64
    # tokens >= out_features: wgrad first; when dgrad's output is allocated the saved input copy
    # (per-tensor [k, T]; MXFP8 [T, k]) is gone.
    gemm = "gemm_block" if name == "blockwise" else "gemm"
    m = linear_trace(name, k, 32)
    at = first(m, phase="backward", op=gemm, shape=(T, k), dtype=DT)
    shape = (T, k) if name == "mxfp8" else (k, T)  # blockwise: transposed, as per tensor
    assert not alive_when(m, at, phase="forward", shape=shape, dtype=FP8)
    # tokens < out_features: dgrad first; when wgrad's output is allocated the weight copy dgrad
    # read is gone.
    n = 256
    m = linear_trace(name, k, n)
    at = first(m, phase="backward", op=gemm, shape=(n, k), dtype=DT)
    assert not alive_when(m, at, shape=(n, k), dtype=FP8)
    assert not alive_when(m, at, shape=(k, n), dtype=FP8)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_forward_rowwise_copies_freed_before_the_handoff_cast(block_peaks, name):
    m = block_peaks[name]
    # fc1 + bias + GELU runs as one GEMM, whose output is then cast for fc2: by that cast, the
    # rowwise copies of fc1's input ([T, H]) and weight ([F, H]) are gone, their transposed
    # copies ([H, T] saved; no weight copy at all, see below) are what is left.
    at = first(m, phase="forward", shape=(F, T), dtype=FP8)  # the cast's transposed output
    assert not alive_when(m, at, shape=(T, H), dtype=FP8)
    assert not alive_when(m, at, shape=(F, H), dtype=FP8)


def test_mxfp8_forward_gemm_reads_dequantized_copies_only(block_peaks):
    m = block_peaks["mxfp8"]
    # fc2's forward GEMM output [T, H]: its input's rowwise MXFP8 copy ([T, F], the hand-off
    # from fc1) and its weight's ([H, F]) were dequantized and freed before it; the input's
    # columnwise copy (saved for wgrad) is alive.
    at = first(m, phase="forward", op="gemm", shape=(T, H), dtype=DT)
    assert len(alive_when(m, at, shape=(T, F), dtype=FP8)) == 1
    assert not alive_when(m, at, shape=(H, F), dtype=FP8)


def test_current_scaling_high_precision_output_dies_with_its_op(block_peaks):
    m = block_peaks["current"]
    # Forward: by fc1's GEMM output, LayerNorm's bf16 output has been cast and freed.
    at = first(m, phase="forward", op="gemm", shape=(T, F), dtype=DT)
    assert not alive_when(m, at, op="norm_fwd", shape=(T, H), dtype=DT)
    # Backward: by fc1's weight gradient, GELU's bf16 input gradient has been cast and freed.
    at = first(m, phase="backward", op="gemm", shape=(F, H), dtype=DT)
    assert not alive_when(m, at, phase="backward", op="act_bwd", shape=(T, F), dtype=DT)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_dact_transposed_copy_made_after_the_saved_input_is_freed(block_peaks, name):
    m = block_peaks[name]
    # The activation backward writes its per-tensor FP8 output rowwise only: no transposed copy
    # [F, T] is alive when the rowwise one is allocated ...
    row = first(m, phase="backward", shape=(T, F), dtype=FP8)
    assert row.op == "act_bwd"
    assert not alive_when(m, row, phase="backward", shape=(F, T), dtype=FP8)
    # ... and the transposed copy (fc1's wgrad operand) is the rowwise one's byte transpose,
    # made once the saved pre-activation (bf16 [T, F], from forward) is freed.
    col = first(m, phase="backward", shape=(F, T), dtype=FP8)
    assert col.op == "transpose_fp8"
    assert not alive_when(m, col, phase="forward", shape=(T, F), dtype=DT)
    assert len(alive_when(m, col, phase="backward", shape=(T, F), dtype=FP8)) == 1


def test_current_scaling_dact_makes_no_high_precision_gradient(block_peaks):
    m = block_peaks["current"]
    # The kernel runs twice (the amax of the rounded values, then the cast with its scale), and
    # neither pass writes a bf16 GELU input gradient (before: [T, F] bf16, then its cast).
    assert not allocs(m, phase="backward", op="act_bwd", shape=(T, F), dtype=DT)
    assert len(allocs(m, phase="backward", op="act_bwd", shape=(T, F), dtype=FP8)) == 2
    assert not allocs(m, phase="backward", op="quantize_fp8_current", shape=(T, F))


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_no_weight_copy_lives_from_forward_to_backward(block_peaks, name):
    m = block_peaks[name]
    # When backward starts (its first allocation), no quantized copy of either weight made in
    # forward is alive: dgrad quantizes the parameter again (the same bits).
    at = first(m, phase="backward")
    for shape in ((F, H), (H, F)):
        assert not alive_when(m, at, phase="forward", shape=shape, dtype=FP8), shape


# ---- the GPT-style model (benchmarks/gpt.py at 1/8 of its widths) -------------------------------

# Issue 13's targets for the GPT step's peak, against the no-recipe run (CPU trace): <= 0.90x per
# tensor (and blockwise, whose saved bytes are per-tensor-like), <= 1.0x MXFP8. Before this round:
# 0.912x / 0.912x / 0.916x / 0.916x; now 0.894x / 0.894x / 0.898x / 0.898x (the attention output
# projection keeps SDPA's output, which SDPA keeps anyway, instead of an FP8 copy of it).
GPT_LIMITS = {"delayed": 0.90, "current": 0.90, "mxfp8": 1.0, "blockwise": 0.90}


@pytest.fixture(scope="module")
def gpt_peaks() -> dict[str, pm.LiveBytes]:
    return pm.gpt_peaks()  # peak_memory.py's GPT_CFG: 8 layers, hidden 256, 8 x 128 tokens


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_gpt_step_peak_targets(gpt_peaks, name):
    assert gpt_peaks["none"].peak <= 1.001 * gpt_peaks["torch"].peak
    assert gpt_peaks[name].peak <= GPT_LIMITS[name] * gpt_peaks["none"].peak


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_gpt_peak_is_the_saved_activations_with_no_linear_input_copy(gpt_peaks, name):
    # The peak is the start of backward (the logits' gradients next to every saved activation).
    # No FP8 copy a Linear made of its own input is alive then: qkv's and fc1's come from their
    # LayerNorm (hand-off), fc2's from fc1's epilogue cast, and the projection keeps SDPA's
    # output itself (save_original_input; the bf16 tensor SDPA's backward reads).
    m = gpt_peaks[name]
    assert m.peak_phase == "backward"
    own = [a for a in m.at_peak if a.dtype in FP8 and "fprop_operands" in a.site]
    assert not own, [a.describe() for a in own]
    layers = pm.GPT_CFG["layers"]
    sdpa = [a for a in m.at_peak if a.op.startswith("_scaled_dot_product") and a.dtype == DT]
    assert len(sdpa) == layers


@pytest.mark.parametrize("name", list(RECIPES))
def test_retain_graph_keeps_what_a_second_backward_reads(name):
    # Autograd keeps the saved tensors when it keeps the graph: a second backward runs, and
    # gives the same gradients (accumulated: twice the first) -- except under delayed scaling,
    # whose first backward updated the gradient scales the second one casts with.
    torch.manual_seed(0)
    m = pm.fusible_block(H, F)
    x = torch.randn(T, H, dtype=DT, requires_grad=True)
    with fusible.autocast(enabled=RECIPES[name]() is not None, recipe=RECIPES[name]()):
        y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy, retain_graph=True)
    first = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    y.backward(dy)
    for g0, p in zip(first, [*m.parameters(), x], strict=True):
        assert p.grad is not None and bool(p.grad.isfinite().all())
        if name != "delayed":
            assert torch.equal(p.grad, g0 + g0)


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_weight_changed_between_forward_and_backward_raises(name):
    # Backward quantizes the weight again, so it reads the parameter: an in-place change after
    # forward is caught by autograd, as without a recipe.
    m = ops.Sequential(ops.BasicLinear(H, F, dtype=DT))
    x = torch.randn(T, H, dtype=DT, requires_grad=True)
    with fusible.autocast(recipe=RECIPES[name]()):
        y = m(x)
    with torch.no_grad():
        m[0].weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def _dact_inputs(kind: str, case: str, rows: int = 64, cols: int = 96) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(3)
    width = 2 * cols if kind in ("swiglu", "geglu") else cols
    x = (torch.randn(rows, width, generator=g) * 3).to(DT)
    dy = torch.randn(rows, cols, generator=g).to(DT)
    if case == "zeros":
        dy.zero_()
    elif case == "huge":
        dy = (dy.float() * 1e30).to(DT)
    elif case == "nan":
        dy[3, 5] = float("nan")
    return x, dy


def _bits(t: torch.Tensor | None) -> Any:
    return None if t is None else t.contiguous().view(torch.uint8).flatten().tolist()


@pytest.mark.parametrize("case", ["normal", "zeros", "huge", "nan"])
@pytest.mark.parametrize("kind", ["gelu", "gelu_erf", "relu", "silu", "swiglu", "geglu"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_dact_quantized_bits_are_the_two_kernel_references(scaling, kind, case):
    """The activation backward's FP8 output (rowwise kernel + byte transpose; current scaling:
    amax pass + cast pass) against what it was made by before: the kernel writing both copies
    (delayed), or the bf16 dact and ``quantize_fp8_current`` of it (current) -- every byte, the
    scale_inv, the bias gradient and the recorded amax."""
    from fusible import _kernels as K
    from fusible.ops.basic.activation import activation_backward
    from fusible.ops.op import OpContext
    from fusible.quantization.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer

    x, dy = _dact_inputs(kind, case)
    e5 = torch.float8_e5m2
    if scaling == "delayed":
        q = Float8Quantizer.standalone(e5, scale=4.0)
        ref_q = Float8Quantizer.standalone(e5, scale=4.0)
        _, d, d2, s_inv, _, amax, dbias = K.act_bwd(dy, x, kind, None, "fp8", e5, ref_q.scale,
                                                    True, True, True)  # fmt: skip
        ref_q.record_amax(amax)
    else:
        q = Float8CurrentScalingQuantizer(e5, margin=1)
        dx, *_, dbias = K.act_bwd(dy, x, kind, DT, "none", e5, None, True, False, True)
        r = q.quantize(dx)
        d, d2, s_inv = r.data, r.data_t, r.scale_inv
    got, got_dbias = activation_backward(kind, OpContext(saved=[x]), dy, q, True)
    qd = got.take()
    assert got.dtype == DT and qd.shape == x.shape
    assert _bits(qd.data) == _bits(d) and _bits(qd.data_t) == _bits(d2)
    assert _bits(qd.scale_inv) == _bits(s_inv)
    assert _bits(got_dbias) == _bits(dbias)
    if scaling == "delayed":
        assert _bits(q.buffers.amax_history) == _bits(ref_q.buffers.amax_history)


# ---- no numerics changed ------------------------------------------------------------------------

GOLDEN = json.loads(golden_numerics.GOLDEN.read_text())


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_numerics_bit_identical_to_before(case):
    got = golden_numerics.compute(case)
    assert got.keys() == GOLDEN[case].keys()
    want = golden_numerics.expected(case)  # this CPU's digests (torch's kernels vary by ISA)
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not bad, bad


def test_golden_isa_records_only_torch_dependent_digests():
    """Per-ISA records cover only cases whose models run torch's own CPU kernels (no recipe:
    the backward GEMMs; the GPT model), never fusible-only FP8 blocks; and the fallback for an
    unrecorded capability drops exactly the recorded keys."""
    records = golden_numerics._isa_records()
    for cap, rec in records.items():
        for case, digests in rec.items():
            assert case.endswith("/none") or case.startswith("gpt/"), (cap, case)
            assert digests and set(digests) <= set(GOLDEN[case]), (cap, case)
            assert golden_numerics.expected(case, cap) == {**GOLDEN[case], **digests}
            assert not set(digests) & set(golden_numerics.expected(case, "NO_SUCH_ISA"))
    assert golden_numerics.expected("block/delayed", "NO_SUCH_ISA") == GOLDEN["block/delayed"]


def test_golden_cases_cover_every_recipe():
    for r in RECIPES:
        assert f"block/{r}" in GOLDEN and f"gpt/{r}" in GOLDEN
    assert golden_numerics.cases().keys() == GOLDEN.keys()
