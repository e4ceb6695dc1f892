"""Shared benchmark plumbing: timing with CUDA events, copy bandwidth, result tables and JSON."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


class TorchBlock(torch.nn.Module):
    """The plain-PyTorch reference block: LayerNorm -> Linear -> GELU (tanh) -> Linear."""

    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.fc1, self.fc2 = torch.nn.Linear(h, f), torch.nn.Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = torch.nn.functional.gelu
        return self.fc2(gelu(self.fc1(self.norm(x)), approximate="tanh"))


def all_recipes(none: str = "bf16") -> dict[str, Any]:
    """name -> a fresh recipe of each kind (``delayed``, ``current``, ``mxfp8``, ``blockwise``),
    after ``none`` -> None (no autocast)."""
    from fusible import recipe

    return {
        none: None,
        "delayed": recipe.DelayedScaling(),
        "current": recipe.Float8CurrentScaling(),
        "mxfp8": recipe.MXFP8BlockScaling(),
        "blockwise": recipe.Float8BlockScaling(),
    }


def shape_parser(
    description: str | None, tokens: int, hidden: int, ffn: int
) -> argparse.ArgumentParser:
    """An argument parser with the block's shape: ``--tokens``, ``--hidden``, ``--ffn``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--ffn", type=int, default=ffn)
    return ap


def fusible_block(
    h: int,
    f: int,
    weights_recipe: Any = None,
    *,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> torch.nn.Module:
    """The same block as fusible ops (bf16, CUDA unless told); weights stored quantized by
    ``weights_recipe`` when given (``fusible.quantized_model_init``)."""
    import fusible
    from fusible import ops

    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    with fusible.quantized_model_init(weights_recipe, enabled=weights_recipe is not None):
        return ops.Sequential(
            ops.LayerNorm(h, **kw), ops.Linear(h, f, **kw), ops.GELU(), ops.Linear(f, h, **kw)
        )


def round_ratios(times: list[float], base: list[float]) -> tuple[float, str]:
    """Rows timed in interleaved rounds: the median of the rounds' ratios ``times / base`` and
    their spread as ``"min-max"`` (3 decimals)."""
    ratios = [t / b for t, b in zip(times, base, strict=True)]
    return statistics.median(ratios), f"{min(ratios):.3f}-{max(ratios):.3f}"


def time_ms(fn: Callable[[], Any], warmup: int = 5, iters: int = 30) -> float:
    """Median time of one ``fn`` call in milliseconds.

    On GPU, CUDA events bracket each call and calls are issued back to back (one synchronize at
    the end), as a training loop issues them: the host's launch overhead is hidden whenever the
    GPU work takes longer, and shows when it does not. CPU: perf_counter per call."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)
    import time

    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graphed(fn: Callable[[], Any], reps: int = 10) -> Callable[[], Any]:
    """A callable replaying ``reps`` calls of ``fn`` captured in one CUDA graph."""
    fn()  # warm-up / compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g.replay


def device_ms(fn: Callable[[], Any], reps: int = 10) -> float:
    """Device time of one ``fn`` call: CUDA-graph replay, so Python dispatch is excluded."""
    return time_ms(graphed(fn, reps), warmup=3, iters=20) / reps


def bandwidth_row(
    name: str, shape: str, nbytes: int, contenders: dict[str, Callable[[], Any]], copy_gbs: float
) -> dict[str, Any]:
    """Times each contender (``"fusible"`` plus optional ``"torch_eager"`` / ``"torch_compile"`` /
    ``"fusible_unfused"``: fusible's own kernels doing the same work unfused) with
    :func:`device_ms`: fusible's bandwidth, as GB/s and as a fraction of the copy bandwidth, and the
    others' times and fusible's speed-up over them."""
    times = {k: device_ms(f) for k, f in contenders.items()}
    fus = times["fusible"]
    row: dict[str, Any] = {
        "kernel": name,
        "shape": shape,
        "fusible_ms": fus,
        "GB/s": nbytes / fus / 1e6,
        "frac_copy_bw": nbytes / fus / 1e6 / copy_gbs,
    }
    for k in ("torch_eager", "torch_compile", "fusible_unfused"):
        if k in times:
            row[f"{k}_ms"] = times[k]
            row[f"speedup_vs_{k}"] = times[k] / fus
    return row


def fusible_step(
    model: torch.nn.Module, rec: Any, x: torch.Tensor, dy: torch.Tensor
) -> Callable[[], None]:
    """One forward + backward of ``model`` on ``x`` under ``rec`` (None: no autocast)."""
    import fusible

    def step() -> None:
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = model(x)
        y.backward(dy)

    return step


def bandwidth_parser(description: str | None) -> argparse.ArgumentParser:
    """The kernel benchmarks' arguments: ``--shapes`` and ``--out``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--shapes", default="16384x4096,16384x16384")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    return ap


def bandwidth_table(rows: list[dict[str, Any]], copy_gbs: float, columns: list[str]) -> None:
    """Prints the copy bandwidth, then the kernel benchmark's rows (:func:`bandwidth_row`):
    kernel, shape, fusible's time and bandwidth, then ``columns``."""
    print(f"device copy bandwidth: {copy_gbs:.1f} GB/s (read + write)")
    print_table(rows, ["kernel", "shape", "fusible_ms", "GB/s", "frac_copy_bw", *columns])


def copy_bandwidth_gbs(device: str, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * n / ms / 1e6


def environment() -> dict[str, Any]:
    commit = os.environ.get("FUSIBLE_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:
            commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": commit,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """``"16384x4096,16384x16384"`` -> ``[(16384, 4096), (16384, 16384)]``."""
    shapes = []
    for item in spec.split(","):
        r, c = (int(v) for v in item.split("x"))
        shapes.append((r, c))
    return shapes


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


def write_json(name: str, payload: dict[str, Any], out_dir: str | None = None) -> Path:
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    gpu = payload["env"]["gpu"].replace(" ", "_")
    path = out / f"{name}_{gpu}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def dynamo_graphs() -> int:
    """Graphs torch.compile has made so far in this process (a rise of more than one per
    compiled mode means recompiles or graph breaks)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return 0
    return int(counters["stats"]["unique_graphs"])


def error_cell(e: Exception) -> str:
    """A table cell for a variant that failed (reported, not fatal)."""
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"error: {type(e).__name__}: {first}"


def capture_cuda_graph(
    warmup: Callable[[], Any],
    capture: Callable[[], Any],
    before_capture: Callable[[], Any] = lambda: None,
) -> Callable[[], Any]:
    """The CUDA graphs docs' capture recipe: ``warmup`` three times on a side stream, then
    ``before_capture()``, then ``capture`` recorded into a graph; returns its ``replay``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            warmup()
    torch.cuda.current_stream().wait_stream(side)
    before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capture()
    return graph.replay
