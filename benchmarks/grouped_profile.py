"""Where the GPU time of the MoE expert MLP step goes (issue 15): ``torch.profiler``'s CUDA
kernel table of forward + backward of GroupedLinear(E, H, F) -> GELU -> GroupedLinear(E, F, H)
under one recipe, at the shape of ``benchmarks/grouped.py`` (its token split), the table by self
CPU time, and where the GPU waits: the idle time between consecutive kernels of the profiled steps
(from the chrome trace; large gaps mean the host is behind), with the largest gaps and the kernels
on either side. CUDA only.

    python benchmarks/grouped_profile.py [--recipe delayed|current|mxfp8|none] [--steps 3]
                                         [--trace FILE.json] [--steady] [--unfused]
                                         [--fp8-weights]

``--steady`` prints, before the profile, whether a step is host- or GPU-bound away from the
profiler: a step timed as ``grouped.py`` times it (CUDA events, steps issued back to back), its GPU
time alone (CUDA-graph replay), and the host's time to issue one step onto an idle GPU, for the
recipe (fused, and with the fusions disabled) and for the torch per-expert loop. Steps start
with fresh gradients (every ``.grad`` None), as grouped.py's main table. ``--unfused`` profiles
with the fusions disabled. ``--fp8-weights`` builds the MLP inside
``quantized_model_init(Float8CurrentScaling())`` (stored per-tensor FP8 weights, read as they are).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import fusible
from _common import device_ms, time_ms
from fusible import ops
from grouped import RECIPES, TorchExperts, add_shape_arguments, make_splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default="delayed", choices=["delayed", "current", "mxfp8", "none"])
    add_shape_arguments(ap)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace", default=None, help="keep the chrome trace here")
    ap.add_argument("--steady", action="store_true", help="eager vs graphed vs host time first")
    ap.add_argument("--unfused", action="store_true", help="profile with the fusions disabled")
    ap.add_argument("--fp8-weights", action="store_true", help="FP8 weights (quantized_model_init)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grouped_profile.py needs CUDA")
    e, h, f, n = args.experts, args.hidden, args.ffn, args.tokens
    splits = make_splits(n, e, args.imbalance)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    init = fusible.quantized_model_init(fusible.recipe.Float8CurrentScaling(),
                                        enabled=args.fp8_weights)  # fmt: skip
    with init:
        model = ops.Sequential(ops.GroupedLinear(e, h, f, **kw), ops.GELU(),
                               ops.GroupedLinear(e, f, h, **kw))  # fmt: skip
    x = torch.randn(n, h, requires_grad=True, **kw)
    dy = torch.randn(n, h, **kw)
    rec = RECIPES["bf16 (no recipe)" if args.recipe == "none" else args.recipe]

    params = [x, *model.parameters()]

    def step(fuse: bool = not args.unfused) -> None:
        for t in params:  # fresh gradients, as grouped.py's main table (zero_grad(set_to_none))
            t.grad = None
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            with contextlib.nullcontext() if fuse else ops.fusion_disabled():
                y = model(x, m_splits=splits)
        y.backward(dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    if args.steady:
        ref = TorchExperts(e, h, f).to("cuda", torch.bfloat16)
        ref_params = [x, *ref.parameters()]

        def ref_step() -> None:
            for t in ref_params:
                t.grad = None
            ref(x, splits).backward(dy)

        print_steady(f"fusible {args.recipe}", lambda: step(True))
        print_steady(f"fusible {args.recipe}, unfused", lambda: step(False))
        print_steady("torch per-expert loop", ref_step)
    # Two steps queued ahead, unsynchronized: the profiled steps start behind a busy GPU, as in
    # training, so the gaps below are the steady state's (profiled from an idle GPU, the first
    # step's host time to its first kernels showed up as 1-2 ms of idle GPU that training never
    # sees; session 13).
    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    print(f"{args.recipe}: {args.steps} steps, splits {splits}")
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        print(p.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace or str(Path(tmp) / "trace.json")
        p.export_chrome_trace(path)
        print_gpu_gaps(path, args.steps)


def host_ms(fn: Callable[[], Any], iters: int = 10) -> float:
    """Median host time to issue one ``fn`` call onto an idle GPU (synchronized before each)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def print_steady(name: str, fn: Callable[[], Any]) -> None:
    """A step as ``grouped.py`` times it, its GPU time alone, and the host's time to issue it:
    eager above graphed with host below both means the GPU waits on the host inside a step."""
    eager, host = time_ms(fn), host_ms(fn)
    graph = device_ms(fn, reps=3)
    print(
        f"{name}: eager {eager:.3f} ms a step, CUDA graph {graph:.3f} ms (GPU alone), host "
        f"issue {host:.3f} ms (eager - graph {eager - graph:+.3f} ms)"
    )


def print_gpu_gaps(path: str, steps: int, top: int = 12) -> None:
    """The GPU's idle time between kernels (and memsets / copies) in a chrome trace."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])  # fmt: skip
    if not gpu:
        print("no GPU events in the trace")
        return
    gaps = []
    busy = 0.0
    for prev, nxt in itertools.pairwise(gpu):
        busy += prev["dur"]
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap > 0:
            gaps.append((gap, prev["name"][:60], nxt["name"][:60]))
    busy += gpu[-1]["dur"]
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    idle = sum(g for g, _, _ in gaps)
    print(f"GPU span {span / steps:.0f} us a step: busy {busy / steps:.0f} us, idle between "
          f"kernels {idle / steps:.0f} us ({len(gaps) / steps:.0f} gaps a step)")  # fmt: skip
    print("largest gaps (us; the kernel before -> the kernel after):")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap:8.1f}  {before}  ->  {after}")


if __name__ == "__main__":
    main()
