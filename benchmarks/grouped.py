"""MoE expert MLP benchmark: GroupedLinear(E, H, F) -> GELU -> GroupedLinear(E, F, H), forward +
backward, per recipe, next to plain PyTorch (one torch.nn.Linear pair per expert in a loop, the
same token split) measured in the same run. Under delayed and current scaling fusible runs grouped
operators (one cast and one cuBLASLt-loop GEMM call for all experts, see docs/executor.md); without
a recipe the forward GEMMs are grouped; MXFP8 runs one quantize + GEMM per expert.

    python benchmarks/grouped.py [--experts 8] [--tokens 16384] [--hidden 4096] [--ffn 14336]
                                 [--imbalance 0.5] [--out DIR]      # CUDA (bf16)
    python benchmarks/grouped.py --tiny [--out DIR]                 # CPU smoke run (fp32)

Four tables, in one run:

* **forward + backward** (JSON ``results``): the torch bf16 per-expert loop, fusible per recipe,
  and the same MLP on ``torch._grouped_mm`` (bf16, no bias: it takes none; backward through its
  autograd formula), where the installed torch has it, each step starting with fresh gradients
  (every ``.grad`` set to None first, as ``zero_grad(set_to_none=True)`` leaves them in a
  training step: backward assigns the gradients). ``time_vs_bf16_loop`` is ms over the loop's
  ms (issue 15's target for the FP8 MLP: <= 0.65). The "cached weight workspaces" row is a
  micro-batch after the first of an optimizer step (``is_first_microbatch=False``: the weights'
  FP8 copies from the cache, no weight cast). The "FP8 weights" rows run the same MLP built
  inside ``fusible.quantized_model_init(Float8CurrentScaling())`` (``+ transposes``: with
  ``keep_transpose=True``): its weights are stored per-tensor FP8 and read as they are (no weight
  cast in the step), as a model trained with ``fusible.optim.MasterWeightOptimizer`` runs. That
  optimizer re-quantizes every weight from its fp32 master once per step: the "re-quantize"
  rows time that alone (no optimizer step is timed in any row; the bf16 rows' casts happen in
  the step instead).
* **forward + backward, accumulating** (JSON ``results_accumulate``): the same rows with the
  gradients left in place, so every step adds its gradients into ``.grad`` (autograd's
  ``AccumulateGrad``: one read-modify-write of every weight's gradient, 1.4 ms of the H200's
  step at the default shape, for every variant alike), as micro-batches of one optimizer step
  do. (Until session 13 this was the only forward + backward table.)
* **forward only** (JSON ``forward``, under ``torch.no_grad``): the loop, fusible per recipe,
  ``torch._grouped_mm`` bf16, and ``torch._scaled_grouped_mm`` FP8 rowwise (e4m3, dynamic
  per-row scales: the quantization of x and of the GELU output is timed, the weights' is not;
  torch gives it no autograd, hence forward only). ``time_vs_bf16_loop`` against the loop's
  forward.
* **GEMM only** (JSON ``gemm``), at the two forward shapes (fc1: M = tokens, N = ffn, K = hidden;
  fc2: N = hidden, K = ffn) with operands quantized beforehand: fusible's ``grouped_gemm`` (the
  call the grouped forward makes; FP8 per-tensor with fast accumulation, and bf16),
  ``torch._grouped_mm`` and ``torch._scaled_grouped_mm`` over the same split, next to one single
  GEMM of the same total size (M = all tokens): ``torch._scaled_mm`` (cuBLASLt) FP8 per-tensor
  and rowwise, fusible's ``gemm`` FP8 per-tensor, and a bf16 ``torch.mm``.
  ``frac_of_single_fp8`` is TFLOP/s over the single per-tensor ``torch._scaled_mm``'s.

A row torch cannot run (an older torch without the operator, a layout or GPU it refuses) reports
the error in its ``ms`` cell instead of stopping the run; ``--tiny`` (CPU) marks the rows with
CUDA-only kernels (``torch._scaled_grouped_mm``) as skipped. ``--imbalance`` in [0, 1): 0 gives
every expert the same number of tokens; larger values draw skewed splits (a fixed seed, rounded
to multiples of 32 for MXFP8; some experts may be empty). Without ``--out`` a ``--tiny`` run
writes no JSON (its numbers are not results).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable
from typing import Any

import torch

import fusible
from _common import (
    all_recipes,
    environment,
    error_cell,
    print_table,
    round_ratios,
    time_ms,
    write_json,
)
from fusible import _kernels as K
from fusible import ops
from fusible.quantization import QuantizedTensor

RECIPES: dict[str, Any] = {
    k: r for k, r in all_recipes("bf16 (no recipe)").items() if k != "blockwise"
}
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
COLUMNS = ["variant", "ms", "TFLOP/s", "time_vs_bf16_loop", "speedup_vs_torch_eager"]
GEMM_COLUMNS = ["gemm", "MxNxK", "variant", "ms", "TFLOP/s", "frac_of_single_fp8"]


def make_splits(tokens: int, experts: int, imbalance: float, seed: int = 0) -> list[int]:
    """``experts`` multiples of 32 summing to ``tokens`` (itself a multiple of 32)."""
    blocks = tokens // 32
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 + imbalance * 4.0 * torch.rand(experts, generator=g) ** 3
    if imbalance > 0:
        weights[torch.randint(experts, (1,), generator=g)] = 0.0  # one empty expert
    share = (weights / weights.sum() * blocks).floor().long()
    share[int(torch.argmax(weights))] += blocks - int(share.sum())
    return [int(s) * 32 for s in share]


class TorchExperts(torch.nn.Module):
    """The plain-PyTorch reference: per expert, Linear(H, F) -> GELU (tanh) -> Linear(F, H)."""

    def __init__(self, experts: int, h: int, f: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.ModuleList(torch.nn.Linear(h, f) for _ in range(experts))
        self.fc2 = torch.nn.ModuleList(torch.nn.Linear(f, h) for _ in range(experts))

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        gelu = torch.nn.functional.gelu
        pairs = zip(x.split(splits), self.fc1, self.fc2, strict=True)
        return torch.cat([fc2(gelu(fc1(xi), approximate="tanh")) for xi, fc1, fc2 in pairs])


def offsets(splits: list[int], device: str) -> torch.Tensor:
    """``torch._grouped_mm``'s ``offs``: int32 [G], the cumulative row ends of the groups (an
    empty group repeats the previous end)."""
    return torch.tensor(splits, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


class TorchGroupedExperts(torch.nn.Module):
    """The MLP on ``torch._grouped_mm`` (2D x 3D, ``offs`` along M): weights ``[E, N, K]`` as
    nn.Linear stores them, passed transposed (``[E, K, N]``, K-major); no bias (the operator
    takes none)."""

    def __init__(self, experts: int, h: int, f: int, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.w1 = torch.nn.Parameter(torch.randn(experts, f, h, **kw) / h**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, h, f, **kw) / f**0.5)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gmm = torch._grouped_mm  # type: ignore[attr-defined]
        y = gmm(x, self.w1.transpose(-2, -1), offs=offs)
        y = torch.nn.functional.gelu(y, approximate="tanh")
        return gmm(y, self.w2.transpose(-2, -1), offs=offs)


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` ([..., rows, K]) as e4m3 with one scale per row: the data (row-major) and the
    dequantizing scales ([..., rows], float32), the form ``torch._scaled_mm`` /
    ``torch._scaled_grouped_mm`` take for rowwise scaling."""
    amax = t.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal().squeeze(-1)


def timed_row(
    variant: str, fn: Callable[[], Any] | str, flops: int, iters: int, base_ms: float | None
) -> dict[str, Any]:
    """One table row: ``fn`` timed (a string: the reason it was not run), TFLOP/s, and the time
    relative to ``base_ms``; an exception becomes the ``ms`` cell."""
    row: dict[str, Any] = {"variant": variant}
    if isinstance(fn, str):
        row["ms"] = fn
        return row
    try:
        ms = time_ms(fn, warmup=2, iters=iters)
    except Exception as e:  # an operator this torch / GPU refuses is reported, not fatal
        row["ms"] = error_cell(e)
        return row
    row.update({"ms": ms, "TFLOP/s": flops / ms / 1e9})
    if isinstance(base_ms, float):  # the loop's row itself may be an error cell
        row.update(time_vs_bf16_loop=ms / base_ms, speedup_vs_torch_eager=base_ms / ms)
    return row


def unavailable(name: str) -> str | None:
    """Why ``torch.<name>`` cannot run here, or None."""
    if not hasattr(torch, name):
        return f"unavailable: torch {torch.__version__} has no torch.{name}"
    return None


def cuda_only(name: str, dev: str) -> str | None:
    """``unavailable``, or the note for a CUDA-only kernel on the CPU."""
    if dev != "cuda":
        return f"skipped: needs CUDA (torch.{name} has no CPU kernel)"
    return unavailable(name)


def mlp_rows(
    args: argparse.Namespace, splits: list[int], dev: str, dt: torch.dtype, iters: int
) -> tuple[list[dict[str, Any]], ...]:
    """The forward + backward tables (fresh gradients, then accumulating), the forward-only
    table and the interleaved rounds' table (empty without ``--rounds``)."""
    e, h, f, n = args.experts, args.hidden, args.ffn, args.tokens
    x = torch.randn(n, h, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(n, h, device=dev, dtype=dt)
    flops = 3 * 2 * 2 * n * h * f  # two GEMMs per token, forward + two backward GEMMs each
    fwd_flops = 2 * 2 * n * h * f
    offs = offsets(splits, dev)
    dtn = str(dt).removeprefix("torch.")

    ref = TorchExperts(e, h, f).to(dev, dt)
    model = ops.Sequential(
        ops.GroupedLinear(e, h, f, device=dev, dtype=dt),
        ops.GELU(),
        ops.GroupedLinear(e, f, h, device=dev, dtype=dt),
    )

    # The same MLP with FP8 weights (quantized_model_init, per-tensor current scaling: the
    # format delayed and current scaling read as they are, so no weight is cast in a step), the
    # rowwise copy only, or with the transposed copy too (keep_transpose).
    def fp8_mlp(keep_transpose: bool) -> torch.nn.Module:
        init = fusible.recipe.Float8CurrentScaling()
        with fusible.quantized_model_init(init, keep_transpose=keep_transpose):
            return ops.Sequential(
                ops.GroupedLinear(e, h, f, device=dev, dtype=dt),
                ops.GELU(),
                ops.GroupedLinear(e, f, h, device=dev, dtype=dt),
            )

    fp8_model, fp8t_model = fp8_mlp(False), fp8_mlp(True)
    fp8_weights = ("delayed", "current")  # the recipes with FP8-weights rows
    gmm_model = TorchGroupedExperts(e, h, f, dev, dt)  # its weights only: any torch makes them
    gmm_why = unavailable("_grouped_mm")

    def fusible_step(
        rec: Any, backward: bool, fuse: bool = True, m: torch.nn.Module = model,
        first: bool | None = None,
    ) -> Callable[[], None]:  # fmt: skip
        def step() -> None:
            with fusible.autocast(enabled=rec is not None, recipe=rec):
                region = contextlib.nullcontext() if fuse else ops.fusion_disabled()
                with region:
                    y = m(x, m_splits=splits, is_first_microbatch=first)
            if backward:
                y.backward(dy)

        return step

    # forward + backward, in both gradient modes
    loop = "torch eager (per-expert loop)"

    def fwd_bwd(accumulate: bool) -> list[dict[str, Any]]:
        def variant(fn: Callable[[], Any], module: torch.nn.Module) -> Callable[[], None]:
            return fn if accumulate else fresh_step(fn, [x, *module.parameters()])

        got = [timed_row(loop, variant(lambda: ref(x, splits).backward(dy), ref), flops, iters,
                         None)]  # fmt: skip
        base = got[0]["ms"]
        got[0].update(time_vs_bf16_loop=1.0, speedup_vs_torch_eager=1.0)
        for name, rec in RECIPES.items():
            step = variant(fusible_step(rec, True), model)
            got.append(timed_row(f"fusible {name}", step, flops, iters, base))
            if name == "delayed" and not accumulate:  # what fc1's GELU epilogue saves
                step = variant(fusible_step(rec, True, False), model)
                got.append(timed_row("fusible delayed, unfused (GELU kernel)", step, flops, iters,
                                     base))  # fmt: skip
            if name == "delayed" and not accumulate:
                # A micro-batch after the first of an optimizer step: the weights' FP8 copies
                # come from the workspace cache (filled by one is_first_microbatch=True call).
                fusible_step(rec, True, first=True)()
                step = variant(fusible_step(rec, True, first=False), model)
                got.append(timed_row("fusible delayed, cached weight workspaces "
                                     "(is_first_microbatch=False)", step, flops, iters,
                                     base))  # fmt: skip
            if name in fp8_weights and not accumulate:
                for tag, m in (("", fp8_model), (" + transposes", fp8t_model)):
                    step = variant(fusible_step(rec, True, m=m), m)
                    got.append(timed_row(f"fusible {name}, FP8 weights{tag} (quantized_model_init)",
                                         step, flops, iters, base))  # fmt: skip
        gmm: Callable[[], Any] | str = gmm_why or variant(
            lambda: gmm_model(x, offs).backward(dy), gmm_model
        )
        got.append(timed_row(f"torch _grouped_mm {dtn} (no bias)", gmm, flops, iters, base))
        return got

    rows, acc_rows = fwd_bwd(False), fwd_bwd(True)
    # The FP8 rows against the loop in interleaved rounds (--rounds): a drift of the host's or
    # the GPU's speed between rows reaches every row of a round alike.
    rounds: list[dict[str, Any]] = []
    if args.rounds:
        steps = {loop: fresh_step(lambda: ref(x, splits).backward(dy), [x, *ref.parameters()])}
        for name in ("delayed", "current"):
            steps[f"fusible {name}"] = fresh_step(
                fusible_step(RECIPES[name], True), [x, *model.parameters()]
            )
        rounds = interleaved_rounds(steps, loop, args.rounds, iters)
    # What FP8 weights cost once per optimizer step: MasterWeightOptimizer re-quantizes each
    # weight from its fp32 master (QuantizedTensor.copy_), both copies with keep_transpose.
    for tag, m in (("", fp8_model), (" + transposes", fp8t_model)):
        pairs = [(w, w.dequantize(torch.float32)) for w in m.parameters()
                 if isinstance(w, QuantizedTensor)]  # fmt: skip

        def requantize(pairs: list[Any] = pairs) -> None:
            with torch.no_grad():
                for w, master in pairs:
                    w.copy_(master)

        rows.append(timed_row(f"FP8 weights{tag}: re-quantize from fp32 masters (once per "
                              "optimizer step, not in the rows above)", requantize, 0, iters,
                              rows[0]["ms"]))  # fmt: skip
        del pairs

    # forward only
    xs = x.detach()
    with torch.no_grad():
        fwd = [timed_row(f"{loop}, forward", lambda: ref(xs, splits), fwd_flops, iters, None)]
        loop_ms = fwd[0]["ms"]
        fwd[0].update(time_vs_bf16_loop=1.0, speedup_vs_torch_eager=1.0)
        for name, rec in RECIPES.items():
            step = fusible_step(rec, False)
            fwd.append(timed_row(f"fusible {name}, forward", step, fwd_flops, iters, loop_ms))
            if name == "delayed":
                step = fusible_step(rec, False, False)
                fwd.append(timed_row("fusible delayed, unfused (GELU kernel), forward", step,
                                     fwd_flops, iters, loop_ms))  # fmt: skip
            if name in fp8_weights:
                step = fusible_step(rec, False, m=fp8_model)
                fwd.append(timed_row(f"fusible {name}, FP8 weights, forward", step, fwd_flops,
                                     iters, loop_ms))  # fmt: skip
        gmm: Callable[[], Any] | str = gmm_why or (lambda: gmm_model(xs, offs))
        fwd.append(timed_row(f"torch _grouped_mm {dtn} (no bias), forward", gmm, fwd_flops, iters,
                             loop_ms))  # fmt: skip
        fwd.append(timed_row("torch _scaled_grouped_mm FP8 rowwise (no bias), forward",
                             scaled_grouped_mlp(xs, offs, e, h, f, dev), fwd_flops, iters,
                             loop_ms))  # fmt: skip
    return rows, acc_rows, fwd, rounds


def fresh_step(fn: Callable[[], Any], params: list[torch.Tensor]) -> Callable[[], None]:
    """``fn`` after setting every ``.grad`` of ``params`` to None (as
    ``zero_grad(set_to_none=True)`` leaves them: backward assigns, adds nothing)."""

    def fresh() -> None:
        for p in params:
            p.grad = None
        fn()

    return fresh


def interleaved_rounds(
    steps: dict[str, Callable[[], Any]], ref: str, rounds: int, iters: int
) -> list[dict[str, Any]]:
    """``steps`` timed in ``rounds`` rounds (each round times every step once, ``time_ms``):
    per step the median ms, and the median and spread of the rounds' ratios to ``ref``'s."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            times[name].append(time_ms(fn, warmup=2, iters=iters))
    rows = []
    for name, ts in times.items():
        ratio, spread = round_ratios(ts, times[ref])
        rows.append({"variant": name, "ms": statistics.median(ts), "time_vs_bf16_loop": ratio,
                     "ratio_spread": spread})  # fmt: skip
    return rows


def scaled_grouped_mlp(
    x: torch.Tensor, offs: torch.Tensor, e: int, h: int, f: int, dev: str
) -> Callable[[], Any] | str:
    """The MLP forward on ``torch._scaled_grouped_mm``: x and the GELU output quantized rowwise
    per call (``rowwise_fp8``), the weights once. ``scale_a`` [M] per row of the 2D operand,
    ``scale_b`` [E, N] per output column of each expert; ``mat2`` column-major ([E, K, N] view of
    the [E, N, K] weights), bf16 output."""
    why = cuda_only("_scaled_grouped_mm", dev)
    if why:
        return why
    sgmm = torch._scaled_grouped_mm  # type: ignore[attr-defined]
    try:
        w1, s1 = rowwise_fp8(torch.randn(e, f, h, device=dev, dtype=torch.bfloat16))
        w2, s2 = rowwise_fp8(torch.randn(e, h, f, device=dev, dtype=torch.bfloat16))
    except Exception as err:  # e.g. out of memory: reported, not fatal
        return error_cell(err)
    bf16 = torch.bfloat16

    def fwd() -> torch.Tensor:
        xq, sx = rowwise_fp8(x)
        y = sgmm(xq, w1.transpose(-2, -1), sx, s1, offs=offs, out_dtype=bf16, use_fast_accum=True)
        yq, sy = rowwise_fp8(torch.nn.functional.gelu(y, approximate="tanh"))
        return sgmm(yq, w2.transpose(-2, -1), sy, s2, offs=offs, out_dtype=bf16,
                    use_fast_accum=True)  # fmt: skip

    return fwd


def gemm_rows(
    splits: list[int], n: int, shapes: list[tuple[str, int, int]], dev: str, dt: torch.dtype,
    iters: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """GEMM-only rows per (name, N, K) shape, M = ``n`` tokens split by ``splits``."""
    e = len(splits)
    offs = offsets(splits, dev)
    dtn = str(dt).removeprefix("torch.")
    one = torch.ones(1, device=dev)
    rows: list[dict[str, Any]] = []
    for gname, nn_, kk in shapes:
        flops = 2 * n * nn_ * kk
        a = torch.randn(n, kk, device=dev, dtype=dt)
        ws = torch.randn(e, nn_, kk, device=dev, dtype=dt) / kk**0.5  # [E, N, K]
        w_single = torch.randn(nn_, kk, device=dev, dtype=dt) / kk**0.5
        aq, wq, wsq = a.to(E4M3), ws.to(E4M3), w_single.to(E4M3)  # per-tensor, scale 1
        ar, sa = rowwise_fp8(a)
        wr, sw = rowwise_fp8(ws)
        wsr, sws = rowwise_fp8(w_single)
        wl, wql = list(ws.unbind(0)), list(wq.unbind(0))
        out = torch.bfloat16 if dev == "cuda" else dt
        cands: list[tuple[str, Callable[[], Any] | str]] = [
            ("fusible grouped_gemm FP8 per-tensor",
             lambda: K.grouped_gemm([aq], wql, splits, [one] * e, [one] * e, out, None, True,
                                    True)),
            (f"fusible grouped_gemm {dtn}",
             lambda: K.grouped_gemm([a], wl, splits, None, None, dt, None, False, True)),
            (f"torch _grouped_mm {dtn}",
             unavailable("_grouped_mm")
             or (lambda: torch._grouped_mm(a, ws.transpose(-2, -1), offs=offs))),
            ("torch _scaled_grouped_mm FP8 rowwise",
             cuda_only("_scaled_grouped_mm", dev)
             or (lambda: torch._scaled_grouped_mm(ar, wr.transpose(-2, -1), sa, sw, offs=offs,
                                                  out_dtype=torch.bfloat16,
                                                  use_fast_accum=True))),
            ("single: torch _scaled_mm FP8 per-tensor",
             unavailable("_scaled_mm")
             or (lambda: torch._scaled_mm(aq, wsq.t(), one, one, out_dtype=out,
                                          use_fast_accum=True))),
            ("single: torch _scaled_mm FP8 rowwise",
             unavailable("_scaled_mm")
             or (lambda: torch._scaled_mm(ar, wsr.t(), sa[:, None], sws[None, :],
                                          out_dtype=out, use_fast_accum=True))),
            ("single: fusible gemm FP8 per-tensor",
             lambda: K.gemm(aq, wsq, False, True, one, one, out, None, "none", None, None, 1.0,
                            0.0, None, False, True)),
            (f"single: torch mm {dtn}", lambda: torch.mm(a, w_single.t())),
        ]  # fmt: skip
        got = []
        for variant, fn in cands:
            row = timed_row(variant, fn, flops, iters, None)
            got.append({"gemm": gname, "MxNxK": f"{n}x{nn_}x{kk}", **row})
        ref = next(r for r in got if r["variant"] == "single: torch _scaled_mm FP8 per-tensor")
        for r in got:
            if isinstance(r.get("TFLOP/s"), float) and isinstance(ref.get("TFLOP/s"), float):
                r["frac_of_single_fp8"] = r["TFLOP/s"] / ref["TFLOP/s"]
        rows += got
    return rows


def add_shape_arguments(ap: argparse.ArgumentParser) -> None:
    """The expert MLP's shape and token split (issue 15's), shared with grouped_profile.py."""
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--imbalance", type=float, default=0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_shape_arguments(ap)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny sizes, few iterations")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="also time the loop, delayed and current in this many interleaved rounds",
    )
    args = ap.parse_args()
    if args.tiny:
        args.experts, args.tokens, args.hidden, args.ffn = 4, 256, 64, 128
        dev, dt, iters = "cpu", torch.float32, 3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/grouped.py needs a CUDA GPU (or --tiny for a CPU run)")
        dev, dt, iters = "cuda", torch.bfloat16, 30
    if args.tokens % 32:
        raise SystemExit("--tokens must be a multiple of 32")
    e, h, f, n = args.experts, args.hidden, args.ffn, args.tokens
    splits = make_splits(n, e, args.imbalance)
    print(f"experts {e}, tokens {n}, hidden {h}, ffn {f}, m_splits {splits}, {dt}, {dev}")
    rows, acc_rows, fwd, rounds = mlp_rows(args, splits, dev, dt, iters)
    print("forward + backward (fresh gradients: .grad set to None before each step)")
    print_table(rows, COLUMNS)
    print("forward + backward, accumulating into .grad (micro-batches of one optimizer step)")
    print_table(acc_rows, COLUMNS)
    if rounds:
        print(
            f"forward + backward, fresh gradients, {args.rounds} interleaved rounds: median ms, "
            "median and spread of the rounds' ratios to the loop"
        )
        print_table(rounds, ["variant", "ms", "time_vs_bf16_loop", "ratio_spread"])
    print("forward only (torch.no_grad)")
    print_table(fwd, COLUMNS)
    if dev == "cuda":
        torch.cuda.empty_cache()
    gemm = gemm_rows(splits, n, [("fc1 fprop", f, h), ("fc2 fprop", h, f)], dev, dt, iters)
    print("GEMM only (operands quantized beforehand; FP8 with fast accumulation)")
    print_table(gemm, GEMM_COLUMNS)
    if args.tiny and args.out is None:
        return
    shape = {**vars(args), "m_splits": splits}
    payload = {"env": environment(), "shape": shape, "results": rows,
               "results_accumulate": acc_rows, "forward": fwd, "gemm": gemm,
               "rounds": rounds}  # fmt: skip
    path = write_json("grouped", payload, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
