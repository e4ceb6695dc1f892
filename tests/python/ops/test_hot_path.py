"""The hot path (issue 11): a cached plan runs lean, and what the kernels' argument checks guard
still holds on later runs (a new shape, layout or dtype is checked again: the C++ operators check
every call). Counts, never timings."""

from __future__ import annotations

import copy
import sys
import threading
from pathlib import Path

import pytest
import torch

import fusible
from fusible import ops, recipe
from fusible.ops import replay

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import overhead  # noqa: E402

CURRENT = recipe.Float8CurrentScaling()


def _block(h=64, f=128):
    return ops.Sequential(ops.LayerNorm(h), ops.Linear(h, f), ops.GELU(), ops.Linear(f, h))


def _step(m, x, rec):
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = m(x)
    y.float().sum().backward()
    return y


def test_new_layout_is_correct():
    torch.manual_seed(0)
    m = _block()
    x = torch.randn(32, 64)
    for _ in range(2):
        with fusible.autocast(recipe=CURRENT):
            m(x)
    xt = torch.randn(64, 32).t()  # same shape, not contiguous
    with fusible.autocast(recipe=CURRENT):
        got = m(xt)
        want = m(xt.contiguous())
    assert torch.equal(got, want)


def test_bad_input_after_cached_runs_still_raises():
    m = fusible.Linear(64, 64)
    for _ in range(2):
        with fusible.autocast(recipe=CURRENT):
            m(torch.randn(8, 64))
    with pytest.raises(ValueError, match="in_features 64"), fusible.autocast(recipe=CURRENT):
        m(torch.randn(8, 63))
    with pytest.raises(TypeError), fusible.autocast(recipe=CURRENT):
        m(torch.randn(8, 64, dtype=torch.float64))


def test_parameter_dtype_change_builds_a_new_plan():
    m = fusible.Linear(64, 64)
    x = torch.randn(8, 64)
    m(x)
    m(x)
    m.to(torch.bfloat16)
    y = m(x.bfloat16())
    assert y.dtype == torch.bfloat16 and len(m._plans) == 2


# Regression ceilings for the Python calls of one forward + backward step of the issue-11 block
# (CPU, Python 3.11, benchmarks/overhead.py, every call counted -- the profiler's raw entries;
# pstats' total_calls would count calls of distinct C functions of one name, the operator
# overloads called directly, as one function's; torch eager makes 71 either way). With the replay
# executor (ops/replay.py: the step runs the kernel calls recorded for its signature, in the C++
# loop of cpp/bindings/replay.cpp: one call per pass) and the trimmed Python around it: bf16 84,
# delayed 133, current 94, mxfp8 94 -- the ceilings below are these + ~2%; the target,
# <= 2x torch eager, is met. With the forward's and backward's shared fallback check
# (replay._blocked, one call each) 86, 135, 96, 96. With the compiled Python loop instead
# (FUSIBLE_REPLAY_CPP=0, one call per operator): 113, 177, 134, 143 (111, 175, 132, 141 before
# _blocked); with the delayed-scaling casts accumulating into the history slot themselves
# (amax_into, no torch.maximum) 171 for delayed -- the C++ loop's 135 is unchanged (the six
# maximum calls ran inside the loop, not in Python). Before the replay executor, counted so:
# 274, 571, 471, 590
# (by total_calls then: 270, 552, 452, 563; with the kernels as C++ torch operators
# (cpp/bindings/) 404, 771, 656, 719, then with the peak-memory work of issue 13 407, 797, 687,
# 743; at 7b8f1fd 407, 841, 689, 745; with session 7's trims 408, 813, 677, 741, and after
# Float8BlockScaling, grouped operators and the activation table 418, 820, 677, 757; with the
# Python kernel wrappers before them: 702, 1566, 1409, 1611; before the executor rewrite
# (60c0229): 1431, 2896, 2667, 3077). What a replayed step still calls: torch's autograd
# machinery, Sequential's plan lookup, the replay's checks, the delayed-scaling registration and
# update (docs/executor.md, "Known costs"). Since session 18 a container under a recipe asks once
# whether saved-tensor hooks are active (a plain torch.utils.checkpoint region to adopt, see
# fusible.quantization.recompute): 86, 136, 97, 97. Since session 19 a module's forward is an
# entry of its own code object (sequential.own_forward: per-layer torch.compile past the
# recompile limit) that calls the class's: 87, 137, 98, 98.
CEILINGS = {"fusible bf16": 87, "fusible delayed": 137, "fusible current": 98,
            "fusible mxfp8": 98}  # fmt: skip


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="counts are for CPython 3.11")
@pytest.mark.skipif(
    not replay.CONFIG.enabled or replay.CONFIG.check or not replay.CONFIG.cpp,
    reason="counts are a replayed step's, in the C++ loop (FUSIBLE_REPLAY=0, "
    "FUSIBLE_REPLAY_CHECK=1 or FUSIBLE_REPLAY_CPP=0 set)",
)
@pytest.mark.skipif(
    replay._PROGRAM is None,
    reason="the operator library has no C++ replay loop (rebuild it: cpp/bindings/replay.cpp)",
)
def test_calls_per_step_stay_below_ceilings():
    rows = {r["variant"]: r for r in overhead.calls_table("cpu")}
    for name, ceiling in CEILINGS.items():
        assert rows[name]["calls"] <= ceiling, (name, rows[name]["calls"])


def test_models_in_threads_match_sequential_runs():
    torch.manual_seed(0)
    models = [_block() for _ in range(2)]
    twins = [copy.deepcopy(m) for m in models]
    xs = [torch.randn(32, 64, requires_grad=True) for _ in models]

    def train(m, x):
        # No fusible.autocast in the threads: its state is process-global (docs), so regions
        # entered and left by two threads at once would not nest.
        for _ in range(5):
            m(x).sum().backward()

    threads = [threading.Thread(target=train, args=(m, x)) for m, x in zip(models, xs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m, x in zip(twins, xs, strict=True):
        train(m, x.detach().requires_grad_())
    for m, t in zip(models, twins, strict=True):
        for p, q in zip(m.parameters(), t.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def _replayed_calls(m: ops.Sequential) -> tuple[list[str], list[str]]:
    """The operator calls of the block's one plan as the replay executor recorded them
    (forward, backward)."""
    ((_, plan),) = m._plans.items()
    fwd = [r for r in plan.replay.sigs.values() if type(r) is replay.Recording]
    assert len(fwd) == 1, fwd
    bwd = [b for b in fwd[0].backward.values() if type(b) is replay.BackwardRecording]
    assert len(bwd) == 1, fwd[0].backward
    return fwd[0].names, bwd[0].names


@pytest.mark.parametrize("rec", [None, "delayed", "current"])
def test_replayed_step_makes_no_needless_operator_calls(rec):
    """A 2-D bf16 input (the GEMMs' own layout): no view or detach around the GEMMs, and the
    trailing bias gradient in one operator (ATen's 16-bit sum accumulates in fp32). Counts of
    the recorded operator calls per forward / backward, deterministic."""
    r = {None: None, "delayed": recipe.DelayedScaling(), "current": CURRENT}[rec]
    torch.manual_seed(0)
    m = _block(256, 1024).to(torch.bfloat16)
    m3 = copy.deepcopy(m)
    x = torch.randn(16, 256, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        _step(m, x, r)
    fwd, bwd = _replayed_calls(m)
    for names in (fwd, bwd):
        assert not [n for n in names if n.split(".")[1] in ("view", "detach", "_to_copy")], names
    # LayerNorm + 2 GEMMs; each GEMM's weight cast and the hand-off cast of fc1's output. Under
    # delayed scaling the scale each weight cast with (kept for backward's cast again) comes out
    # of the cast operator itself (keep_scale): no clone of its own (8 calls before session 20).
    want_fwd = {None: 3, "delayed": 6, "current": 7}[rec]
    assert len(fwd) == want_fwd, fwd
    # Delayed: fc2's bias gradient and its grad_output cast (both copies) are one act_bwd of
    # the identity kind (11 before session 27: an ATen sum and a quantize_fp8).
    assert len(bwd) <= {None: 9, "delayed": 10, "current": 14}[rec], bwd
    # 3-D input: the views that flatten and restore the leading dimensions are needed there;
    # the same bits.
    x3 = x.detach().view(2, 8, 256).requires_grad_()
    for _ in range(3):
        _step(m3, x3, r)
    fwd3, _ = _replayed_calls(m3)
    assert [n for n in fwd3 if n.startswith("aten.view")], fwd3
    torch.testing.assert_close(_step(m3, x3, r).view(16, 256), _step(m, x, r), rtol=0, atol=0)
