"""CPU backend benchmark: the README block step (LayerNorm(H) -> Linear(H, F) -> GELU ->
Linear(F, H), fp32, forward + backward) per recipe next to plain torch, and the kernels the step
runs, at the block's sizes, all in the same run. CPU only.

Steps are timed round-robin (one step of every variant per round, ``--rounds`` rounds, medians), so
a machine shared with other jobs slows every variant alike; the ratios to torch are the figures to
compare across runs. Kernels: median of ``--iters`` calls each, with GFLOP/s (GEMMs) or GB/s
(bytes every input read once and every output written once).

    python benchmarks/cpu_backend.py [--tokens 1024] [--hidden 1024] [--ffn 4096] [--out DIR]
        [--profile RECIPE]    # also print torch.profiler's table of that variant's step
        [--no-steps] [--no-kernels]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from _common import (
    TorchBlock,
    environment,
    fusible_block,
    fusible_step,
    print_table,
    shape_parser,
    time_ms,
    write_json,
)
from fusible import _kernels as K
from fusible import recipe

RECIPES: dict[str, Any] = {
    "fusible (no recipe)": None,
    "fusible delayed": recipe.DelayedScaling(),
    "fusible current": recipe.Float8CurrentScaling(),
}
E4M3 = torch.float8_e4m3fn
F32 = torch.float32


def steps(n: int, h: int, f: int, rounds: int, profile: str | None) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    x = torch.randn(n, h, requires_grad=True)
    dy = torch.randn(n, h)
    ref = TorchBlock(h, f)
    variants: dict[str, Callable[[], None]] = {"torch eager": lambda: ref(x).backward(dy)}
    for name, rec in RECIPES.items():
        model = fusible_block(h, f, device="cpu", dtype=F32)
        variants[name] = fusible_step(model, rec, x, dy)
    for fn in variants.values():  # warm-up: plans, delayed-scaling state, allocator
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    flops = 3 * 2 * 2 * n * h * f
    torch_ms = statistics.median(times["torch eager"])
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts)
        rows.append({"variant": name, "ms": ms, "min_ms": min(ts), "GFLOP/s": flops / ms / 1e6,
                     "ratio_vs_torch": ms / torch_ms})  # fmt: skip
    if profile is not None:
        fn = variants[profile]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        print(f"\nprofile of one step, {profile}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return rows


def kernels(n: int, h: int, f: int, iters: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []

    def add(name: str, shape: str, fn: Callable[[], Any], *, flops: int = 0, nbytes: int = 0,
            torch_fn: Callable[[], Any] | None = None) -> None:  # fmt: skip
        ms = time_ms(fn, 2, iters)
        row: dict[str, Any] = {"kernel": name, "shape": shape, "ms": ms}
        row["GFLOP/s"] = flops / ms / 1e6 if flops else None
        row["GB/s"] = nbytes / ms / 1e6 if nbytes else None
        if torch_fn is not None:
            tms = time_ms(torch_fn, 2, iters)
            row["torch_ms"] = tms
            row["ratio_vs_torch"] = ms / tms
        rows.append(row)

    def gemm(a: torch.Tensor, b: torch.Tensor, transa: bool, transb: bool, **kw: Any) -> Any:
        args = {"sa": None, "sb": None, "out": F32, "bias": None, "ep": "none", "aux": None}
        args.update(kw)
        return K.gemm(a, b, transa, transb, args["sa"], args["sb"], args["out"], args["bias"],
                      args["ep"], args["aux"], None, 1.0, 0.0, None, False)  # fmt: skip

    # fc1 forward: [n, h] @ [f, h]^T (+ bias, GELU); fc2 forward: [n, f] @ [h, f]^T.
    xh, w1, b1 = torch.randn(n, h), torch.randn(f, h) * 0.03, torch.randn(f)
    xf, w2, b2 = torch.randn(n, f), torch.randn(h, f) * 0.03, torch.randn(h)
    dyh = torch.randn(n, h)
    pre = torch.randn(n, f)
    fl1 = 2 * n * h * f
    s1 = f"{n}x{f}x{h}"
    mm1 = lambda: torch.nn.functional.linear(xh, w1)  # noqa: E731
    add("gemm fp32 none (fc1 fprop)", s1, lambda: gemm(xh, w1, False, True), flops=fl1,
        torch_fn=mm1)  # fmt: skip
    for ep in ("bias", "gelu_aux", "bias_gelu_aux"):
        kw: dict[str, Any] = {"ep": ep, "bias": b1 if "bias" in ep else None}
        add(f"gemm fp32 {ep} (fc1 fprop)", s1, lambda kw=kw: gemm(xh, w1, False, True, **kw),
            flops=fl1)  # fmt: skip
    add("gemm fp32 bias (fc2 fprop)", f"{n}x{h}x{f}",
        lambda: gemm(xf, w2, False, True, ep="bias", bias=b2), flops=fl1,
        torch_fn=lambda: torch.nn.functional.linear(xf, w2, b2))  # fmt: skip
    # fc2 dgrad: dy[n, h] @ w2[h, f] with the GELU backward (and bias gradient) of fc1's output.
    add("gemm fp32 none (fc2 dgrad)", f"{n}x{f}x{h}", lambda: gemm(dyh, w2, False, False),
        flops=fl1, torch_fn=lambda: dyh @ w2)  # fmt: skip
    add("gemm fp32 dgelu_bgrad (fc2 dgrad)", f"{n}x{f}x{h}",
        lambda: gemm(dyh, w2, False, False, ep="dgelu_bgrad", aux=pre), flops=fl1)  # fmt: skip
    # wgrad: dw2[h, f] = dy^T[h, n] @ x[n, f] (both operands transposed reads).
    add("gemm fp32 none (fc2 wgrad)", f"{h}x{f}x{n}", lambda: gemm(dyh, xf, True, False),
        flops=fl1, torch_fn=lambda: dyh.t() @ xf)  # fmt: skip
    # FP8 forward GEMM (per-tensor scales), fp32 and bf16 output.
    one = torch.ones(1)
    q1, qw1 = xh.to(E4M3), w1.mul(30).to(E4M3)
    add("gemm fp8 none -> fp32 (fc1 fprop)", s1,
        lambda: gemm(q1, qw1, False, True, sa=one, sb=one), flops=fl1)  # fmt: skip
    add("gemm fp8 bias_gelu_aux -> bf16 (fc1 fprop)", s1,
        lambda: gemm(q1, qw1, False, True, sa=one, sb=one, out=torch.bfloat16,
                     ep="bias_gelu_aux", bias=b1.bfloat16()), flops=fl1)  # fmt: skip

    # Quantize, activation, normalization at the block's sizes.
    scale = torch.tensor([2.0])
    nf = n * f
    add("quantize_fp8 fp32 row+col", f"{n}x{f}",
        lambda: K.quantize_fp8(pre, scale, E4M3, True, True), nbytes=nf * 4 + 2 * nf)  # fmt: skip
    add("quantize_fp8_current fp32 row+col", f"{n}x{f}",
        lambda: K.quantize_fp8_current(pre, E4M3, 0, True, True),
        nbytes=nf * 4 + 2 * nf)  # fmt: skip
    add("quantize_mxfp8 fp32 row+col", f"{n}x{f}",
        lambda: K.quantize_mxfp8(pre, E4M3, True, True), nbytes=nf * 4 + 2 * nf)  # fmt: skip
    gelu = torch.nn.functional.gelu
    add("act_fwd gelu fp32", f"{n}x{f}",
        lambda: K.act_fwd(pre, "gelu", F32, "none", E4M3, None, True, False), nbytes=8 * nf,
        torch_fn=lambda: gelu(pre, approximate="tanh"))  # fmt: skip
    add("act_fwd gelu fp32 + fp8 row+col", f"{n}x{f}",
        lambda: K.act_fwd(pre, "gelu", F32, "fp8", E4M3, scale, True, True),
        nbytes=8 * nf + 2 * nf)  # fmt: skip
    g = torch.randn(n, f)
    add("act_bwd gelu fp32", f"{n}x{f}",
        lambda: K.act_bwd(g, pre, "gelu", F32, "none", E4M3, None, True, False, False),
        nbytes=12 * nf,
        torch_fn=lambda: torch.ops.aten.gelu_backward(g, pre, approximate="tanh"))  # fmt: skip
    add("act_bwd gelu fp32 + dbias", f"{n}x{f}",
        lambda: K.act_bwd(g, pre, "gelu", F32, "none", E4M3, None, True, False, True),
        nbytes=12 * nf)  # fmt: skip
    gam, bet = torch.randn(h), torch.randn(h)
    nh = n * h
    add("norm_fwd layernorm fp32", f"{n}x{h}",
        lambda: K.norm_fwd(xh, gam, bet, 1e-5, "layernorm", False, F32, "none", E4M3, None, True,
                           False), nbytes=8 * nh,
        torch_fn=lambda: torch.nn.functional.layer_norm(xh, (h,), gam, bet))  # fmt: skip
    add("norm_fwd layernorm fp32 + fp8 row+col", f"{n}x{h}",
        lambda: K.norm_fwd(xh, gam, bet, 1e-5, "layernorm", False, F32, "fp8", E4M3, scale,
                           True, True), nbytes=8 * nh + 2 * nh)  # fmt: skip
    _, _, _, _, _, _, mean, rstd = K.norm_fwd(xh, gam, bet, 1e-5, "layernorm", False, F32, "none",
                                              E4M3, None, True, False)  # fmt: skip
    add("norm_bwd layernorm fp32", f"{n}x{h}",
        lambda: K.norm_bwd(dyh, xh, mean, rstd, gam, "layernorm", False),
        nbytes=12 * nh)  # fmt: skip
    return rows


def main() -> None:
    ap = shape_parser(__doc__, tokens=1024, hidden=1024, ffn=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--profile", default=None, choices=["torch eager", *RECIPES])
    ap.add_argument("--no-steps", action="store_true")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n, h, f = args.tokens, args.hidden, args.ffn
    payload: dict[str, Any] = {
        "env": environment(),
        "shape": {"tokens": n, "hidden": h, "ffn": f, "dtype": "float32"},
        "cpu_threads": torch.get_num_threads(),
    }
    if not args.no_steps:
        rows = steps(n, h, f, args.rounds, args.profile)
        print_table(rows, list(rows[0]))
        payload["steps"] = rows
    if not args.no_kernels:
        krows = kernels(n, h, f, args.iters)
        print()
        print_table(krows, ["kernel", "shape", "ms", "GFLOP/s", "GB/s", "torch_ms",
                            "ratio_vs_torch"])  # fmt: skip
        payload["kernels"] = krows
    if args.out != "-":
        print(f"wrote {write_json('cpu_backend', payload, args.out)}")


if __name__ == "__main__":
    main()
