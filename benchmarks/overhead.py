"""Host overhead of the op path (issue 11): the block LayerNorm(256) -> Linear(256, 1024) ->
GELU (tanh) -> Linear(1024, 256) at 16 tokens, plain PyTorch eager next to fusible with no
recipe, DelayedScaling, Float8CurrentScaling and MXFP8BlockScaling.

Two tables:

1. Python calls per step (deterministic; CPU and GPU): every call cProfile sees (Python
   functions and C functions called from Python, each call counted: the sum of the profiler's
   raw entries, ``Profile.getstats()``) over one forward + backward step (``y = model(x)``,
   under ``fusible.autocast`` when a recipe is set, then ``y.float().sum().backward()``) after 3
   warm-up steps, and the ratio to torch eager. MXFP8 needs the token count divisible by 32: its
   row runs 32 tokens and is compared with a torch eager row at 32 tokens.
2. Host time per step: wall time of N steps (forward, backward, ``opt.step()``,
   ``zero_grad(set_to_none=True)``) issued back to back with one synchronize at the end, divided
   by N, in interleaved rounds (``--rounds``, default 5: each round runs every row once, so a
   drift of the host's speed reaches every row alike); the median time, and the median of the
   rounds' ratios to torch eager. At this tiny shape the GPU idles, so this is the host's time
   per step (on the CPU
   (``--device cpu``) the kernels run on the host too: the time includes their arithmetic, in
   float32, and the ``graphed`` mode does not exist; the default modes there are ``eager``).
   Three modes:
   ``eager``; ``compiled`` (``torch.compile(fullgraph=True)`` of the forward, autocast inside,
   backward and optimizer outside; one eager step first); ``graphed`` (forward, backward and
   ``opt.step()`` captured in one CUDA graph and replayed: each replay overwrites the grads, so
   no zero_grad). Every row's ratio is to torch eager at its token count, in the same run;
   ``graphs`` counts the graphs torch.compile made for a compiled row (1 = no recompiles).

    python benchmarks/overhead.py                # on the GPU: both tables, JSON into results/
    python benchmarks/overhead.py --device cpu   # both tables on the CPU (eager host time)
    python benchmarks/overhead.py --calls-only   # call counts on CPU only (CI prints these);
                                                 # JSON only with --out
    python benchmarks/overhead.py --calls-only --calls-top 30   # + the most called functions
    python benchmarks/overhead.py --profile DIR  # + torch.profiler traces of eager steps

Counting note: cProfile hooks Python's profiler. On Python >= 3.12 it uses ``sys.monitoring``,
which sees every thread, so the calls autograd makes in its CUDA device thread (the backward of
custom autograd Functions) are counted. Python < 3.12 profiles the calling thread only: on CPU
that still covers the backward (autograd runs CPU work in the calling thread), on CUDA it misses
the backward's Python calls (a warning says so).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import (
    TorchBlock,
    all_recipes,
    capture_cuda_graph,
    dynamo_graphs,
    environment,
    error_cell,
    fusible_block,
    print_table,
    round_ratios,
    write_json,
)

HIDDEN, FFN, TOKENS, MX_TOKENS = 256, 1024, 16, 32
MODES = ("eager", "compiled", "graphed")


def recipes() -> dict[str, Any]:
    """name -> a fresh recipe (None: no autocast); not blockwise."""
    return {k: r for k, r in all_recipes("bf16").items() if k != "blockwise"}


def dtype_for(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def build(kind: str, device: str) -> torch.nn.Module:
    """The benchmark block: ``kind`` ``"torch"`` (plain PyTorch) or ``"fusible"`` (fusible ops)."""
    dt = dtype_for(device)
    if kind == "torch":
        return TorchBlock(HIDDEN, FFN).to(device, dt)
    return fusible_block(HIDDEN, FFN, device=device, dtype=dt)


def variants() -> list[tuple[str, str, Any, int]]:
    """(name, model kind, recipe, tokens); the torch row of a token count is the reference of
    the rows with that token count (mxfp8 runs MX_TOKENS, so a torch row at MX_TOKENS ends the
    list)."""
    rows: list[tuple[str, str, Any, int]] = [("torch", "torch", None, TOKENS)]
    for name, rec in recipes().items():
        n = MX_TOKENS if name == "mxfp8" else TOKENS
        rows.append((f"fusible {name}", "fusible", rec, n))
    rows.append(("torch", "torch", None, MX_TOKENS))
    return rows


def _add_ratios(rows: list[dict[str, Any]], key: str, ref_variant: str) -> None:
    """``vs_torch_eager``: ``row[key]`` over the ``ref_variant`` row's at the same token count."""
    ref = {r["tokens"]: r[key] for r in rows if r["variant"] == ref_variant}
    for r in rows:
        v, base = r[key], ref.get(r["tokens"])
        if isinstance(v, (int, float)) and isinstance(base, (int, float)):
            r["vs_torch_eager"] = v / base


def forward(model: torch.nn.Module, x: torch.Tensor, recipe: Any) -> torch.Tensor:
    """``model(x)``, under ``fusible.autocast(recipe=recipe)`` when a recipe is given."""
    if recipe is None:
        return model(x)
    import fusible

    with fusible.autocast(recipe=recipe):
        return model(x)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.float().sum()


def calls_per_step(model: torch.nn.Module, x: torch.Tensor, recipe: Any, warmup: int = 3) -> int:
    """Python calls (see :func:`profile_step`) of one forward + backward step of ``model`` on
    ``x`` under ``recipe`` (None: no autocast), after ``warmup`` steps."""
    return int(profile_step(model, x, recipe, warmup).raw_calls)  # type: ignore[attr-defined]


def profile_step(
    model: torch.nn.Module, x: torch.Tensor, recipe: Any, warmup: int = 3
) -> pstats.Stats:
    """cProfile statistics of one forward + backward step (see :func:`calls_per_step`), with
    ``raw_calls``: every call the profiler saw. (Not ``total_calls``: ``pstats`` keys C functions
    by module and name, and keeps one entry per key, so calls of distinct C functions of one
    name -- the C++ operator overloads ``torch.ops.<ns>.<op>.<overload>._op`` all are
    ``torch._ops.<ns>.`` -- would count as one function's.)"""

    def step() -> None:
        loss_of(forward(model, x, recipe)).backward()

    for _ in range(warmup):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
        if sys.version_info < (3, 12):
            warnings.warn(
                "Python < 3.12: cProfile misses the Python calls autograd makes in its CUDA "
                "device thread (the backward); the counts are forward-heavy",
                stacklevel=2,
            )
    # Garbage of earlier steps and models collected now, not inside the profiled step (its weak
    # references' callbacks would count there, by the collector's timing).
    gc.collect()
    prof = cProfile.Profile()
    prof.enable()
    try:
        step()
    finally:
        prof.disable()
    stats = pstats.Stats(prof)
    stats.raw_calls = sum(e.callcount for e in prof.getstats())  # type: ignore[attr-defined]
    return stats


def new_input(n: int, device: str) -> torch.Tensor:
    return torch.randn(n, HIDDEN, device=device, dtype=dtype_for(device), requires_grad=True)


def calls_table(device: str, top: int = 0) -> list[dict[str, Any]]:
    """Python calls per step of every variant; ``top`` > 0 also prints each fusible variant's
    ``top`` functions by number of calls."""
    rows: list[dict[str, Any]] = []
    for name, kind, rec, n in variants():
        torch.manual_seed(0)
        stats = profile_step(build(kind, device), new_input(n, device), rec)
        calls = int(stats.raw_calls)  # type: ignore[attr-defined]
        if top > 0 and kind == "fusible":
            print(f"== {name}: {calls} Python calls per step; the {top} most called functions")
            stats.strip_dirs().sort_stats("ncalls").print_stats(top)
        rows.append({"variant": "torch eager" if kind == "torch" else name, "tokens": n,
                     "calls": calls})  # fmt: skip
    _add_ratios(rows, "calls", "torch eager")
    return rows


class Stepper:
    """A model, its SGD optimizer and a fixed input; ``make(mode)`` returns a step callable
    (forward, backward, ``opt.step()``, ``zero_grad(set_to_none=True)``). ``eager`` and
    ``compiled`` run on any device; ``graphed`` needs CUDA."""

    def __init__(self, model: torch.nn.Module, recipe: Any, x: torch.Tensor) -> None:
        self.model, self.recipe, self.x = model, recipe, x
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward(self.model, x, self.recipe)

    def _zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.x.grad = None

    def make(self, mode: str) -> Callable[[], Any]:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        fwd: Callable[[torch.Tensor], torch.Tensor] = self.forward

        def step() -> None:
            loss_of(fwd(self.x)).backward()
            self.opt.step()
            self._zero_grad()

        if mode == "compiled":
            step()  # one eager step first: the steady state is measured
            torch._dynamo.reset()  # a fresh cache: no recompile limit shared across variants
            fwd = torch.compile(self.forward, fullgraph=True)
        if mode != "graphed":
            return step
        if not self.x.is_cuda:
            raise RuntimeError("graphed mode needs CUDA")

        # The whole-network capture recipe of the CUDA graphs docs: warm up on a side stream,
        # set the grads to None so backward allocates them from the graph's pool, capture
        # forward + backward + opt.step (each replay overwrites the grads, so no zero_grad).
        def body() -> None:
            loss_of(self.forward(self.x)).backward()
            self.opt.step()

        return capture_cuda_graph(step, body, self._zero_grad)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cell(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # a variant that cannot run a mode is reported, not fatal
        return error_cell(e)


def _warmed(step: Callable[[], Any], warmup: int = 10) -> Callable[[], Any]:
    for _ in range(warmup):
        step()
    _sync()
    return step


def _ms_per_step(step: Callable[[], Any], iters: int) -> float:
    """Wall time per step of ``iters`` steps issued back to back, one synchronize at the end."""
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    _sync()
    return (time.perf_counter() - t0) * 1e3 / iters


def host_table(device: str, modes: list[str], iters: int, rounds: int = 5) -> list[dict[str, Any]]:
    """Host time per step (microseconds) of every variant in every mode. The variants are
    measured in ``rounds`` interleaved rounds (each round runs every row once, ``iters`` steps),
    so a drift of the host's speed -- on a shared machine torch eager's own time moves by tens of
    percent between runs -- reaches every row of a round alike: ``host_us_per_step`` is the
    median over the rounds, and ``vs_torch_eager`` the median of the rounds' ratios to torch
    eager at the same token count (``ratio_spread``: their min-max)."""
    rows: list[dict[str, Any]] = []
    steps: list[Any] = []
    for name, kind, rec, n in variants():
        torch.manual_seed(0)
        s = Stepper(build(kind, device), rec, new_input(n, device))
        for mode in modes:
            graphs = dynamo_graphs()
            steps.append(_cell(lambda s=s, mode=mode: _warmed(s.make(mode))))
            rows.append({"variant": f"{name} {mode}", "mode": mode, "tokens": n})
            if mode == "compiled":
                rows[-1]["graphs"] = dynamo_graphs() - graphs
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            if callable(step):
                times[i].append(_ms_per_step(step, iters) * 1e3)
    ref = {r["tokens"]: i for i, r in enumerate(rows) if r["variant"] == "torch eager"}
    for i, r in enumerate(rows):
        if not callable(steps[i]):
            r["host_us_per_step"] = steps[i]
            continue
        r["host_us_per_step"] = statistics.median(times[i])
        base = times[ref[r["tokens"]]] if r["tokens"] in ref else []
        if base:
            r["vs_torch_eager"], r["ratio_spread"] = round_ratios(times[i], base)
    return rows


def profile_eager(device: str, out_dir: str, steps: int = 10) -> None:
    """torch.profiler (CPU, + CUDA on a GPU) over ``steps`` eager training steps per variant,
    after 5 warm-up steps: a chrome trace per variant into ``out_dir`` and the ops table by self
    CPU time (where the host's time goes)."""
    from torch.profiler import ProfilerActivity, record_function

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for i, (name, kind, rec, n) in enumerate(variants()):
        if kind == "torch" and i > 0:
            continue  # torch once (at 16 tokens)
        torch.manual_seed(0)
        step = Stepper(build(kind, device), rec, new_input(n, device)).make("eager")
        for _ in range(5):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for i in range(steps):
                with record_function(f"step {i}"):
                    step()
            if device == "cuda":
                torch.cuda.synchronize()
        path = out / f"overhead_{name.replace(' ', '_')}_{n}tok.json"
        prof.export_chrome_trace(str(path))
        print(f"== profile {name}, {n} tokens, {steps} eager steps ({device}); trace {path}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                        max_name_column_width=70))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls-only", action="store_true",
                    help="only the Python call counts, on CPU (fast; what CI runs)")  # fmt: skip
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="the tables' device (auto: CPU if --calls-only, else CUDA)")  # fmt: skip
    ap.add_argument("--modes", default=None,
                    help=f"host-time modes (default: {','.join(MODES)} on CUDA, eager on the "
                         "CPU)")  # fmt: skip
    ap.add_argument("--iters", type=int, default=200, help="steps per host-time measurement")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved host-time rounds (each runs every row once)")  # fmt: skip
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    ap.add_argument("--calls-top", type=int, default=0, metavar="N",
                    help="also print each fusible variant's N most called functions")  # fmt: skip
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also write torch.profiler traces of 10 eager steps per variant (on "
                         "the call counts' device) into DIR and print the op tables")  # fmt: skip
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        device = "cpu" if args.calls_only else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/overhead.py: no CUDA GPU (--device cpu runs on the CPU)")
    default_modes = ",".join(MODES) if device == "cuda" else "eager"
    modes = [m for m in (args.modes or default_modes).split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r} (choose from {', '.join(MODES)})")

    payload: dict[str, Any] = {"env": environment(), "args": vars(args), "device": device,
                               "hidden": HIDDEN, "ffn": FFN}  # fmt: skip
    calls = calls_table(device, args.calls_top)
    print(f"Python calls per forward+backward step ({device}, {dtype_for(device)}, cProfile, "
          f"every call counted, Python {sys.version.split()[0]}); block LayerNorm({HIDDEN}) -> "
          f"Linear({HIDDEN}, {FFN}) -> GELU -> Linear({FFN}, {HIDDEN}); mxfp8 at {MX_TOKENS} "
          f"tokens vs torch eager at {MX_TOKENS}")  # fmt: skip
    print_table(calls, ["variant", "tokens", "calls", "vs_torch_eager"])
    payload["calls"] = calls
    if not args.calls_only:
        host = host_table(device, modes, args.iters, args.rounds)
        what = "bf16 CUDA" if device == "cuda" else "float32 CPU, kernels' arithmetic included"
        print(f"host time per step, {args.iters} steps back to back (fwd, bwd, SGD step, "
              f"zero_grad), {what}; {args.rounds} interleaved rounds: median time, median of "
              "the rounds' ratios to torch eager at the same token count")  # fmt: skip
        print_table(host, ["variant", "tokens", "host_us_per_step", "vs_torch_eager",
                           "ratio_spread", "graphs"])  # fmt: skip
        payload["host"] = host
    if args.out or not args.calls_only:
        print(f"wrote {write_json('overhead', payload, args.out)}")
    if args.profile:
        profile_eager(device, args.profile)


if __name__ == "__main__":
    main()
