"""Where a tiny step's host time goes (issue 11): the host cost of each operator a training
step dispatches, summed, next to the step's host time measured in the same run.

For each variant of ``overhead.py`` (torch eager; fusible with no recipe, DelayedScaling,
Float8CurrentScaling, MXFP8BlockScaling; the block LayerNorm -> Linear -> GELU -> Linear at
16 / 32 tokens) one eager training step (forward, backward, ``opt.step()``, ``zero_grad``) runs
under a ``TorchDispatchMode`` that records every operator call below autograd with its
arguments. Each recorded call is then issued ``--calls`` times back to back from Python (autograd
excluded, as inside the step; one synchronize at the end): its host cost per call (on a GPU at
this size the kernels take a few microseconds, so the host is what is timed), twice: called
from Python (``py_us``: the ``OpOverload`` call converts every Python argument to the
dispatcher's values, a cost that grows with the argument count) and from the replay executor's
C++ loop (``loop_us``: a program of ``--calls`` copies of the call, its arguments held as
prepared constants, as a replayed step runs fusible's operators; ``fusible/ops/replay.py``).
The step's operator cost is the sum over its calls; ``framework_us`` is the measured host time of
the step (``overhead.py``'s way: steps issued back to back) minus the loop sum: what Python,
autograd's engine and the executor add around the operators (torch eager calls its operators
from autograd's C++ kernels, unboxed: its loop figures are an upper bound of what they cost it).

    python benchmarks/host_ops.py [--device cuda|cpu] [--calls 300] [--top 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import overhead as ob
from _common import environment, print_table, write_json
from fusible.ops import replay

SKIP = ("profiler.",)  # record_function's markers: not work of the step


class _Record(TorchDispatchMode):
    """Records every operator call (``func``, args, kwargs) that reaches the dispatch mode."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not str(func).startswith(SKIP):
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _call_us(func: Any, args: Any, kwargs: Any, n: int, device: str) -> float:
    """Host microseconds per call of ``func(*args, **kwargs)``, ``n`` calls back to back."""
    below = getattr(torch._C, "_AutoDispatchBelowAutograd", None)
    with torch.no_grad():
        guard = below() if below is not None else None
        try:
            for _ in range(3):
                func(*args, **kwargs)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                func(*args, **kwargs)
            _sync(device)
            return (time.perf_counter() - t0) * 1e6 / n
        finally:
            del guard


def _loop_us(func: Any, args: Any, kwargs: Any, n: int, device: str) -> float | None:
    """Host microseconds per call of ``func(*args, **kwargs)`` run ``n`` times by the replay
    executor's C++ loop (every argument a constant; outputs dropped), or None where the library
    has no loop or the call has an argument it cannot hold."""
    if replay._PROGRAM is None:
        return None
    with torch.no_grad():
        out = func(*args, **kwargs)
    # The outputs' structure, each value unread (None): a list return keeps its length.
    if isinstance(out, (tuple, list)) and len(func._schema.returns) != 1:
        outs: Any = tuple([None] * len(o) if isinstance(o, (list, tuple)) else None for o in out)
    elif isinstance(out, (list, tuple)):
        outs = [None] * len(out)
    else:
        outs = None
    try:
        call = replay._Call(func, args, kwargs, outs)
        prog = replay._program([call] * n, {}, set(), 0, [])
    except replay._Unreplayable:
        return None
    with torch.no_grad():
        prog.run([])
        _sync(device)
        t0 = time.perf_counter()
        prog.run([])
        _sync(device)
        return (time.perf_counter() - t0) * 1e6 / n


def _step_us(step: Callable[[], Any], device: str, iters: int = 200, rounds: int = 5) -> float:
    for _ in range(10):
        step()
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times)


def variant_rows(device: str, calls: int, top: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, kind, rec, n in ob.variants()[:-1]:
        torch.manual_seed(0)
        stepper = ob.Stepper(ob.build(kind, device), rec, ob.new_input(n, device))
        step = stepper.make("eager")
        step_us = _step_us(step, device)
        rec_mode = _Record()
        with rec_mode:
            step()
        py: dict[str, list[float]] = defaultdict(list)
        loop: dict[str, list[float]] = defaultdict(list)
        for func, args, kwargs in rec_mode.calls:
            py[str(func)].append(_call_us(func, args, kwargs, calls, device))
            t = _loop_us(func, args, kwargs, calls, device)
            loop[str(func)].append(t if t is not None else py[str(func)][-1])
        py_us = sum(sum(v) for v in py.values())
        loop_us = sum(sum(v) for v in loop.values())
        label = "torch eager" if kind == "torch" else name
        rows.append({"variant": label, "tokens": n, "ops": len(rec_mode.calls),
                     "step_host_us": step_us, "ops_py_us": py_us, "ops_loop_us": loop_us,
                     "framework_us": step_us - loop_us})  # fmt: skip
        detail = sorted(loop.items(), key=lambda kv: -sum(kv[1]))[:top]
        print(f"== {label}, {n} tokens: {len(rec_mode.calls)} operator calls a step")
        table = [{"operator": k, "calls": len(v), "py_us_per_call": sum(py[k]) / len(v),
                  "loop_us_per_call": sum(v) / len(v), "loop_us": sum(v)}
                 for k, v in detail]  # fmt: skip
        print_table(table, ["operator", "calls", "py_us_per_call", "loop_us_per_call", "loop_us"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=300, help="calls timed per recorded operator")
    ap.add_argument("--top", type=int, default=12, help="operators listed per variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = variant_rows(args.device, args.calls, args.top)
    print(f"host time of a step and of its operators ({args.device}, microseconds)")
    cols = ["variant", "tokens", "ops", "step_host_us", "ops_py_us", "ops_loop_us", "framework_us"]
    print_table(rows, cols)
    if args.out is not None:
        payload = {"env": environment(), "device": args.device, "rows": rows}
        print(f"wrote {write_json('host_ops', payload, args.out)}")


if __name__ == "__main__":
    main()
