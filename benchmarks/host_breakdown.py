"""Where a step's host time goes (issue 11): the dispatched operators against everything else.

The block of ``benchmarks/overhead.py`` (LayerNorm(256) -> Linear(256, 1024) -> GELU ->
Linear(1024, 256), 16 tokens, bf16, SGD) runs one step under a ``TorchDispatchMode`` that
records every operator the step dispatches (aten and ``torch.ops.fusible``) with its arguments.
Each recorded call is then replayed alone, N times back to back with no synchronize inside, to
give its host cost per call. The step's own host time (N steps back to back, one synchronize)
minus the sum of its replayed operators is what the step spends outside them: Python (the
module, the executor, the ops), the autograd engine and the optimizer's own code.

Each operator is timed twice: called from Python (``us_per_call``: the ``OpOverload`` call
converts every Python argument to the dispatcher's values, a cost that grows with the argument
count) and from the replay executor's C++ loop (``loop_us_per_call``: a program of N copies of
the call, its arguments held as prepared constants, as a replayed step runs them;
``fusible/ops/replay.py``). ``outside_loop_us`` is the step minus the loop sum: what Python,
autograd's engine, the executor and the optimizer add around the operators. (torch eager calls
its operators from autograd's C++ kernels, unboxed: its loop figures are an upper bound.)

    python benchmarks/host_breakdown.py            # CUDA if present; JSON with --out DIR
    python benchmarks/host_breakdown.py --device cpu   # CPU: operator times include compute

On CPU the operators do their arithmetic on the host, so only the GPU's table says what the
host pays to issue work. Replayed alone, an operator runs with warm caches: the sum is a lower
bound of what the same calls cost inside the step.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _common import environment, write_json

H, F, T = 256, 1024, 16
RECIPES = ("none", "delayed", "current")


class _Record(TorchDispatchMode):
    # An observer: fusible's replay executor (ops/replay.py) keeps replaying under it, so the
    # recorded operators are those of a replayed step.
    replay_transparent = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _step(variant: str, device: str, phases: dict[str, float] | None = None) -> Callable[[], None]:
    import fusible
    from fusible import ops, recipe

    torch.manual_seed(0)
    kw: dict[str, Any] = {"device": device, "dtype": torch.bfloat16}
    x = torch.randn(T, H, requires_grad=True, **kw)
    if variant == "torch":
        m: torch.nn.Module = torch.nn.Sequential(
            torch.nn.LayerNorm(H, **kw), torch.nn.Linear(H, F, **kw),
            torch.nn.GELU(approximate="tanh"), torch.nn.Linear(F, H, **kw),
        )  # fmt: skip
        rec = None
    else:
        m = ops.Sequential(ops.LayerNorm(H, **kw), ops.Linear(H, F, **kw), ops.GELU(),
                           ops.Linear(F, H, **kw))  # fmt: skip
        rec = {"none": None, "delayed": recipe.DelayedScaling(),
               "current": recipe.Float8CurrentScaling()}[variant]  # fmt: skip
    opt = torch.optim.SGD(m.parameters(), lr=1e-6, foreach=True)

    def step() -> None:
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = m(x)
        y.float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed_step() -> None:
        assert phases is not None
        t0 = time.perf_counter()
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = m(x)
        t1 = time.perf_counter()
        y.float().sum().backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        phases["forward"] += t1 - t0
        phases["backward"] += t2 - t1
        phases["optimizer"] += t3 - t2

    return step if phases is None else timed_step


def phases(variant: str, device: str, iters: int) -> dict[str, Any]:
    """Host microseconds a step spends in its forward, its backward (``loss.backward()``, the
    autograd engine included) and the optimizer (``step`` and ``zero_grad``), steps back to back
    with one synchronize at the end; and the CUDA runtime calls one step makes (torch.profiler's
    CPU-side ``cuda*`` / ``cu*`` events: launches, memsets, queries) with their host time."""
    acc: dict[str, float] = collections.defaultdict(float)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step = _step(variant, device, acc)
    for _ in range(30):
        step()
    sync()
    acc.clear()
    for _ in range(iters):
        step()
    sync()
    out: dict[str, Any] = {"variant": variant, **{k: v / iters * 1e6 for k, v in acc.items()}}
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            sync()
        runtime: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu"):
                runtime[e.name][0] += 1 / 5
                runtime[e.name][1] += e.cpu_time_total / 5
        out["runtime_calls"] = {k: {"calls": v[0], "us": v[1]} for k, v in runtime.items()}
    return out


def _loop_us(func: Any, args: Any, kwargs: Any, iters: int, sync: Callable[[], None]) -> float:
    """Host microseconds per call of ``func(*args, **kwargs)`` run ``iters`` times by the replay
    executor's C++ loop (every argument a constant, outputs dropped); NaN where the library has
    no loop or the call has an argument the loop cannot hold."""
    from fusible.ops import replay

    if replay._PROGRAM is None:
        return float("nan")
    out = func(*args, **kwargs)
    # The outputs' structure, each value unread (None); a list return keeps its length.
    if isinstance(out, (tuple, list)) and len(func._schema.returns) != 1:
        outs: Any = tuple([None] * len(o) if isinstance(o, (list, tuple)) else None for o in out)
    elif isinstance(out, (list, tuple)):
        outs = [None] * len(out)
    else:
        outs = None
    try:
        prog = replay._program([replay._Call(func, args, kwargs, outs)] * iters, {}, set(), 0, [])
    except replay._Unreplayable:
        return float("nan")
    prog.run([])
    sync()
    t0 = time.perf_counter()
    prog.run([])
    us = (time.perf_counter() - t0) / iters * 1e6  # the host's issue time (before the sync)
    sync()
    return us


def measure(variant: str, device: str, iters: int) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step = _step(variant, device)
    for _ in range(30):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    step_us = (time.perf_counter() - t0) / iters * 1e6
    rec = _Record()
    with rec:
        step()
    per_op: dict[str, float] = collections.defaultdict(float)
    per_op_loop: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for func, args, kwargs in rec.calls:
        name = str(func)
        count[name] += 1
        with torch.no_grad():  # below autograd, as inside the step's autograd Function
            try:
                for _ in range(3):
                    func(*args, **kwargs)
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    func(*args, **kwargs)
                per_op[name] += (time.perf_counter() - t0) / iters * 1e6  # before the sync
                sync()
            except Exception:  # e.g. a foreach op whose replay is refused: not counted
                per_op[name] += float("nan")
            try:
                per_op_loop[name] += _loop_us(func, args, kwargs, iters, sync)
            except Exception:
                per_op_loop[name] += float("nan")
    ops_us = sum(v for v in per_op.values() if v == v)
    loop_us = sum(v for v in per_op_loop.values() if v == v)
    rows = sorted(
        ({"op": k, "calls": count[k], "us_per_call": v / count[k], "us": v,
          "loop_us_per_call": per_op_loop[k] / count[k], "loop_us": per_op_loop[k]}
         for k, v in per_op.items()),
        key=lambda r: -r["us"] if r["us"] == r["us"] else 0.0,
    )  # fmt: skip
    return {"variant": variant, "step_us": step_us, "dispatched": len(rec.calls),
            "ops_us": ops_us, "outside_ops_us": step_us - ops_us, "ops_loop_us": loop_us,
            "outside_loop_us": step_us - loop_us, "ops": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument(
        "--phases",
        action="store_true",
        help="time forward / backward / optimizer apart, count CUDA runtime calls",
    )
    ap.add_argument("--out", default=None, help="write host_breakdown_<gpu>.json into this folder")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.phases:
        rows = [phases(v, device, args.iters) for v in ("torch", *RECIPES)]
        print(f"host us per step by phase, {T} tokens, hidden {H}, {device}")
        for r in rows:
            rt = r.get("runtime_calls", {})
            n = sum(c["calls"] for c in rt.values())
            us = sum(c["us"] for c in rt.values())
            print(
                f"{r['variant']:10} forward {r['forward']:7.0f} backward {r['backward']:7.0f} "
                f"optimizer {r['optimizer']:6.0f}  CUDA runtime calls {n:5.1f} ({us:6.0f} us)"
            )
            for k, c in sorted(rt.items(), key=lambda kv: -kv[1]["us"]):
                print(f"    {c['calls']:5.1f} x {k} {c['us']:7.1f} us")
        if args.out:
            payload = {"env": environment(), "device": device, "tokens": T, "phases": rows}
            print("wrote", write_json("host_phases", payload, args.out))
        return
    results = [measure(v, device, args.iters) for v in ("torch", *RECIPES)]
    print(
        f"host time per step, {T} tokens, hidden {H}, {device}: the step against its "
        "dispatched operators replayed alone"
    )
    print(f"{'variant':10} {'step_us':>9} {'ops':>5} {'ops_us':>8} {'outside_us':>11} "
          f"{'ops_loop_us':>12} {'outside_loop_us':>16}")  # fmt: skip
    for r in results:
        print(f"{r['variant']:10} {r['step_us']:9.0f} {r['dispatched']:5d} {r['ops_us']:8.0f} "
              f"{r['outside_ops_us']:11.0f} {r['ops_loop_us']:12.0f} "
              f"{r['outside_loop_us']:16.0f}")  # fmt: skip
    for r in results:
        print(f"--- {r['variant']}: the operators (us per call from Python / in the C++ loop)")
        for o in r["ops"][:12]:
            print(f"  {o['calls']:3d} x {o['us_per_call']:6.1f} / {o['loop_us_per_call']:6.1f} us "
                  f"= {o['us']:7.1f} / {o['loop_us']:7.1f}  {o['op']}")  # fmt: skip
    if args.out:
        payload = {"env": environment(), "device": device, "tokens": T, "results": results}
        print("wrote", write_json("host_breakdown", payload, args.out))


if __name__ == "__main__":
    main()
