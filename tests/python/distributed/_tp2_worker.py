"""One rank of the second tensor-parallel test module (test_tp_fp8_gather.py): FP8 all-gather,
TransformerLayer / GroupedLinear TP, torch.compile of a TP module. Same harness as
_tp_worker.py (whose helpers and ``main`` it reuses): ``python _tp2_worker.py RANK WORLD PORT
OUT_DIR [CASES]``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import _tp_worker as base
import torch
import torch.distributed as dist
from _tp_worker import RECIPES, close, exact, load, rand, run, toks

import fusible
from fusible.ops import registry
from fusible.ops.basic import comm
from fusible.quantization.quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
)

S, H, F = base.S, base.H, base.F
CASES: list[Any] = []
E4M3 = torch.float8_e4m3fn


def case(name: str) -> Any:
    def deco(fn: Any) -> Any:
        CASES.append((name, fn))
        return fn

    return deco


@contextlib.contextmanager
def wire_log() -> Iterator[list[tuple[torch.dtype, int]]]:
    """Record (dtype, bytes) of every all-gather input (the comm ops' one entry point)."""
    log: list[tuple[torch.dtype, int]] = []
    orig = comm._all_gather

    def spy(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
        log.append((x.dtype, x.numel() * x.element_size()))
        orig(out, x, group)

    comm._all_gather = spy  # type: ignore[assignment]
    try:
        yield log
    finally:
        comm._all_gather = orig  # type: ignore[assignment]


@contextlib.contextmanager
def without_fp8_gather() -> Iterator[None]:
    """The reference: every other fusion as it is, the FP8 all-gather rules taken out (the
    all-gathers move high precision and the Linear quantizes the gathered tensor)."""
    mine = [r for r in registry._BUILTIN if r.name.startswith(("fp8_all_gather", "linear_fp8_"))]
    for r in mine:
        registry.unregister_fusion(r)
    try:
        yield
    finally:
        registry._BUILTIN[:0] = mine
        registry._VERSION[0] += 1


def u8(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.view(torch.uint8) if t.element_size() == 1 else t


# ---- the gathered FP8 data == the quantizer's cast of the gathered tensor ----------------------


@case("fp8_gather_bits")
def fp8_gather_bits() -> None:
    ag = fusible.ops.AllGather(dist.group.WORLD)
    full = rand(S, H, seed=50) * (1 + torch.arange(S).unsqueeze(1) / S)  # amax on rank 1's rows
    local = toks(full, base.RANK)
    # Current scaling: the local amaxes differ; the agreed (max-reduced) one is the whole's.
    q = Float8CurrentScalingQuantizer(E4M3)
    with wire_log() as log:
        h = comm.gather_quantized(ag, q, local, columnwise=False)
    assert h is not None
    ref = q.quantize(full, rowwise=True, columnwise=False)
    exact("current data", u8(h.qdata.data), u8(ref.data))
    exact("current scale_inv", h.qdata.scale_inv, ref.scale_inv)
    if log != [(torch.uint8, local.numel())]:  # FP8 bytes: 1 per element, vs 4 for float32
        raise AssertionError(f"current: the all-gather moved {log}")
    # Delayed scaling: the state's scale; the history records the gathered tensor's amax.
    qd = Float8Quantizer.standalone(E4M3, scale=3.0)
    h = comm.gather_quantized(ag, qd, local, columnwise=True)
    assert h is not None
    ref = Float8Quantizer.standalone(E4M3, scale=3.0).quantize(full, columnwise=False)
    exact("delayed data", u8(h.qdata.data), u8(ref.data))
    exact("delayed scale_inv", h.qdata.scale_inv, ref.scale_inv)
    exact("delayed amax", qd.buffers.amax_history[0], full.abs().max().reshape(1))
    # MXFP8: rowwise only, and both copies (each rank's 32 rows are whole column blocks).
    qm = MXFP8Quantizer(E4M3)
    for col in (False, True):
        with wire_log() as log:
            h = comm.gather_quantized(ag, qm, local, columnwise=col)
        assert h is not None
        ref = qm.quantize(full, rowwise=True, columnwise=col)
        exact(f"mxfp8 data col={col}", u8(h.qdata.data), u8(ref.data))
        exact(f"mxfp8 scale col={col}", h.qdata.scale, ref.scale)
        if col:
            exact("mxfp8 col_data", u8(h.qdata.col_data), u8(ref.col_data))
            exact("mxfp8 col_scale", h.qdata.col_scale, ref.col_scale)
        want = [(torch.uint8, local.numel()), (torch.uint8, local.numel() // 32)] * (1 + col)
        if sorted(log) != sorted(want):
            raise AssertionError(f"mxfp8 col={col}: the all-gather moved {log}, want {want}")
    # Where it does not apply: 16 rows per rank cut MXFP8 column blocks across ranks.
    if comm.gather_quantized(ag, qm, local[:16], columnwise=True) is not None:
        raise AssertionError("mxfp8: columnwise blocks straddling ranks must fall back")


# ---- fused == unfused, bit for bit; bytes on the wire; explain() ---------------------------------


def _steps(make: Any, x: torch.Tensor, dy: torch.Tensor, rec: Any, steps: int) -> list[Any]:
    torch.manual_seed(base.RANK)
    m = make()
    out = []
    for _ in range(steps):
        for p in m.parameters():
            p.grad = None
        y, dx = run(m, x, dy, rec)
        out.append((y, dx, [p.grad.clone() for p in m.parameters()]))
    return out


def fused_vs_unfused(rec_name: str) -> None:
    rec = RECIPES[rec_name]
    g = dist.group.WORLD
    x, dy = toks(rand(S, H, seed=60), base.RANK), toks(rand(S, H, seed=61), base.RANK)
    makers = {
        "column Linear": (lambda: fusible.Linear(H, F, tp_group=g, parallel_mode="column",
                                                 sequence_parallel=True), F),  # fmt: skip
        "LayerNormMLP": (lambda: fusible.LayerNormMLP(H, F, tp_group=g, sequence_parallel=True),
                         H),  # fmt: skip
    }
    for what, (make, n_out) in makers.items():
        d = dy if n_out == H else rand(S, F // 2, seed=62)
        steps = 2 if rec_name == "delayed" else 1
        with wire_log() as log:
            fused = _steps(make, x, d, rec, steps)
        with without_fp8_gather():
            ref = _steps(make, x, d, rec, steps)
        for i, ((y, dx, gs), (yr, dxr, gr)) in enumerate(zip(fused, ref, strict=True)):
            exact(f"{what} step {i} y", y, yr)
            exact(f"{what} step {i} dx", dx, dxr)
            for j, (a, b) in enumerate(zip(gs, gr, strict=True)):
                exact(f"{what} step {i} grad {j}", a, b)
        fp8 = [b for dt, b in log if dt == torch.uint8]
        if rec is not None and not fp8:
            raise AssertionError(f"{what}: no FP8 all-gather under {rec_name}: {log}")
        if rec is not None and what == "LayerNormMLP":
            # forward: fc1's input; backward: fc2's output gradient: both in FP8.
            if sum(b for b in fp8 if b % (S // 2 * H) == 0) < 2 * steps * (S // 2) * H:
                raise AssertionError(f"LayerNormMLP: FP8 all-gathers {log}")
        if rec is None and any(dt == torch.uint8 for dt, _ in log):
            raise AssertionError(f"{what}: FP8 on the wire without a recipe: {log}")


for _r in RECIPES:
    case(f"fp8_gather_fused_{_r}")(lambda r=_r: fused_vs_unfused(r))


@case("fp8_gather_explain")
def fp8_gather_explain() -> None:
    tp = fusible.LayerNormMLP(H, F, tp_group=dist.group.WORLD, sequence_parallel=True)
    text = tp.explain(recipe=fusible.recipe.Float8CurrentScaling())
    for want in ("fp8_all_gather_linear", "linear_fp8_grad_all_gather", "FP8 on the wire",
                 "all_reduce(max) of the amax: one scale"):  # fmt: skip
        if want not in text:
            raise AssertionError(f"explain() lacks {want!r}:\n{text}")
    plain = tp.explain(recipe=None)
    if "(rule 'fp8_all_gather" in plain or "no recipe: the all-gather moves high precision" not in plain:
        raise AssertionError(plain)


if __name__ == "__main__":
    base.CASES[:] = CASES
    base.main()
