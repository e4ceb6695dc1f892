"""Peak memory of one training step, traced on CPU: which tensors are alive at the peak.

``torch.cuda.max_memory_allocated`` (benchmarks/step.py) says how high one step's memory goes
on a GPU, not what is alive then. This harness runs the same step (the LayerNorm(H) ->
Linear(H, F) -> GELU(tanh) -> Linear(F, H) block, bf16, SGD; forward, backward, optimizer step)
on CPU under a ``TorchDispatchMode`` that sees every operator call -- aten operators and the
core library's ``torch.ops.fusible.*`` alike -- and the tensors each returns. Every new storage
an operator returns is counted once (views and aliases of it are not counted again; storages
that existed before the step, e.g. parameters, gradients and recipe state updated in place, are
not counted) until a ``weakref.finalize`` on the storage reports it freed. So the figures are
deterministic, and at the peak the harness can name every live allocation: the operator that
made it, its shape, dtype and bytes, and the line of fusible (or of the caller) that called it.

What it cannot see: memory an operator allocates and frees inside itself (a GEMM's workspace, a
kernel's temporaries) and the CUDA caching allocator's rounding. The GPU runs the same Python
and allocates the same tensors (same shapes, same lifetimes), so the peak here is the
``step_peak`` of benchmarks/step.py up to those.

    python benchmarks/peak_memory.py [--tokens 512] [--hidden 256] [--ffn 1024] [--top 12]
        [--models block,gpt] [--gpt layers=2,hidden=64,...] [--phase backward] [--out DIR]

Shared with tests/python/ops/test_peak_memory.py (``trace_step``, ``LiveBytes``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from _common import TorchBlock, all_recipes, environment, shape_parser, write_json

_FUSIBLE_DIR = str(Path(__file__).resolve().parents[1] / "python" / "fusible")
# Frames of this harness and of the block (benchmarks/_common.py) are no call site.
_HARNESS = ("peak_memory.py", "_common.py")


@dataclass(frozen=True)
class Alloc:
    """One storage an operator returned: when (operator call index), by whom, how big."""

    index: int  # position in LiveBytes.allocs
    seq: int  # the operator call (count) that returned it
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    site: str  # the innermost fusible frame (file:line function) that called the operator
    phase: str  # the phase label set by LiveBytes.phase when it was allocated

    def describe(self, nbytes: int | None = None) -> str:
        shape = "x".join(map(str, self.shape)) or "()"
        n = self.nbytes if nbytes is None else nbytes
        return f"{n:>10}  {self.op:<28} {shape:<12} {str(self.dtype)[6:]:<14} {self.site}"


def _site(depth: int = 3) -> str:
    """The innermost ``depth`` frames inside the fusible package that led to the operator
    being traced (``file:line function``, innermost first; else the innermost frame outside
    torch)."""
    f = sys._getframe(2)
    frames: list[str] = []
    fallback = None
    while f is not None and len(frames) < depth:
        name = f.f_code.co_filename
        if name.startswith(_FUSIBLE_DIR):
            rel = name[len(_FUSIBLE_DIR) + 1 :]
            frames.append(f"{rel}:{f.f_lineno} {f.f_code.co_name}")
        elif fallback is None and "/torch/" not in name and not name.endswith(_HARNESS):
            fallback = f"{Path(name).name}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return " < ".join(frames) if frames else (fallback or "?")


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of the storages operators return while the mode is active.

    ``live``: bytes alive now; ``peak``: the most alive at once (first reached after operator
    call ``peak_seq``, in phase ``peak_phase``); ``at_peak``: the allocations alive then;
    ``allocs``: every allocation, with ``freed[index]`` the operator count when it was freed.
    ``phase(name)`` labels what follows (e.g. ``forward``, ``backward``, ``step``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.peak_seq = 0
        self.peak_phase = self.peak_op = ""
        self.phase_peaks: dict[str, int] = {}  # phase -> the most alive at once in it
        self.phase_peak_seqs: dict[str, int] = {}  # phase -> operator call when first reached
        self.allocs: list[Alloc] = []
        self.freed: dict[int, int] = {}  # Alloc.index -> operator count when freed
        self._alive: dict[int, Alloc] = {}  # id(storage) -> Alloc
        self._seq = 0
        self._phase = ""
        self._finalizers: list[Any] = []

    def phase(self, name: str) -> None:
        self._phase = name
        if self.live > self.phase_peaks.get(name, -1):
            self.phase_peaks[name], self.phase_peak_seqs[name] = self.live, self._seq

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._seq += 1
        inputs: set[int] | None = None
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in self._alive or st.nbytes() == 0:
                continue
            if inputs is None:
                inputs = {
                    id(a.untyped_storage())
                    for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor)
                }
            if key in inputs:
                continue  # an alias of an input (in-place or out= operator, a view)
            name = getattr(getattr(func, "overloadpacket", None), "__name__", str(func))
            a = Alloc(len(self.allocs), self._seq, name, tuple(t.shape), t.dtype, st.nbytes(),
                      _site(), self._phase)  # fmt: skip
            self._alive[key] = a
            self.allocs.append(a)
            self.live += a.nbytes
            self._finalizers.append(weakref.finalize(st, self._free, key))
            if self.live > self.phase_peaks.get(self._phase, -1):
                self.phase_peaks[self._phase] = self.live
                self.phase_peak_seqs[self._phase] = self._seq
            if self.live > self.peak:
                self.peak, self.peak_seq = self.live, self._seq
                self.peak_phase, self.peak_op = self._phase, name
        return out

    def _free(self, key: int) -> None:
        a = self._alive.pop(key, None)
        if a is not None:
            self.live -= a.nbytes
            self.freed[a.index] = self._seq

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._alive.clear()
        return out

    def alive_at(self, seq: int) -> list[Alloc]:
        """The allocations alive right after operator call ``seq`` returned."""
        return [a for a in self.allocs if a.seq <= seq and self.freed.get(a.index, seq) >= seq]

    @property
    def at_peak(self) -> list[Alloc]:
        return self.alive_at(self.peak_seq)

    def report(self, top: int | None = None, phase: str | None = None) -> str:
        """The allocations alive at the peak (of ``phase``, when given), largest first."""
        if phase is None:
            peak, seq, where = self.peak, self.peak_seq, self.peak_phase
        else:
            peak, seq, where = self.phase_peaks[phase], self.phase_peak_seqs[phase], phase
        groups: dict[tuple[Any, ...], list[Alloc]] = {}
        for a in self.alive_at(seq):  # the same allocation made again (e.g. per layer): one row
            groups.setdefault((a.op, a.shape, a.dtype, a.site), []).append(a)
        rows = sorted(groups.values(), key=lambda g: -sum(a.nbytes for a in g))
        if top is not None:
            rows = rows[:top]
        head = f"peak {peak} bytes in {where} (after operator call {seq}); alive then:"
        lines = [
            ("  " if len(g) == 1 else f"{len(g):>2}x") + g[0].describe(sum(a.nbytes for a in g))
            for g in rows
        ]
        return "\n".join([head, *lines])


# ---- the block and its step ---------------------------------------------------------------------


def fusible_block(h: int, f: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    from fusible import ops

    kw: dict[str, Any] = {"device": "cpu", "dtype": dtype}
    return ops.Sequential(
        ops.LayerNorm(h, **kw), ops.Linear(h, f, **kw), ops.GELU(), ops.Linear(f, h, **kw)
    )


def recipes() -> dict[str, Any]:
    return all_recipes("none")


def trace(step: Callable[[LiveBytes | None], Any], *, warmup: int = 2) -> LiveBytes:
    """``step(mode)`` run ``warmup`` times untraced (optimizer and recipe state exist then; mode
    None), then once traced (it may label phases with ``mode.phase``)."""
    for _ in range(warmup):
        step(None)
    mode = LiveBytes()
    with mode:
        step(mode)
    return mode


def _phase(mode: LiveBytes | None, name: str) -> None:
    if mode is not None:
        mode.phase(name)


def trace_step(
    model: torch.nn.Module,
    rec: Any,
    x: torch.Tensor,
    dy: torch.Tensor,
    *,
    warmup: int = 2,
    optimizer: torch.optim.Optimizer | None = None,
) -> LiveBytes:
    """One training step of ``model`` as benchmarks/step.py runs it (``zero_grad(set_to_none=
    False)``, forward under ``fusible.autocast(rec)`` unless ``rec`` is None, backward with
    ``dy``, an SGD step), traced after ``warmup`` untraced steps."""
    import fusible

    opt = optimizer or torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)

    def step(mode: LiveBytes | None) -> None:
        opt.zero_grad(set_to_none=False)
        _phase(mode, "forward")
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = model(x)
        _phase(mode, "backward")
        y.backward(dy)
        _phase(mode, "step")
        opt.step()

    return trace(step, warmup=warmup)


def block_peaks(tokens: int, hidden: int, ffn: int, *, seed: int = 0) -> dict[str, LiveBytes]:
    """Traced steps of the block per recipe (``none`` .. ``mxfp8``) and of ``torch`` (the
    plain-PyTorch block), same shapes, bf16."""
    out: dict[str, LiveBytes] = {}
    torch.manual_seed(seed)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    tb = TorchBlock(hidden, ffn).to(torch.bfloat16)
    out["torch"] = trace_step(tb, None, x, dy)
    for name, rec in recipes().items():
        torch.manual_seed(seed)
        out[name] = trace_step(fusible_block(hidden, ffn), rec, x, dy)
    return out


# benchmarks/gpt.py's model at 1/8 of its default widths (hidden 2048 -> 256, batch x seq
# 8 x 1024 -> 8 x 128 tokens, vocab 32768 -> 4096; 8 layers): every activation, weight and logit
# tensor scales by the same 1/64, so the peaks' ratios are the full size's.
GPT_CFG = {"layers": 8, "hidden": 256, "heads": 16, "seq": 128, "batch": 8, "vocab": 4096}


def gpt_peaks(cfg: dict[str, int] | None = None) -> dict[str, LiveBytes]:
    """Traced steps of benchmarks/gpt.py's GPT (AdamW, ``zero_grad(set_to_none=True)`` after
    the step, as gpt.py runs it), plain torch and fusible per recipe, bf16."""
    import fusible

    bench = str(Path(__file__).resolve().parent)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import gpt

    cfg = cfg or GPT_CFG
    g = torch.Generator().manual_seed(1)
    shape = (cfg["batch"], cfg["seq"])
    idx = torch.randint(0, cfg["vocab"], shape, generator=g)
    tgt = torch.randint(0, cfg["vocab"], shape, generator=g)
    out: dict[str, LiveBytes] = {}
    for name, rec in {"torch": None, **recipes()}.items():
        torch.manual_seed(0)
        model = gpt.GPT(cfg, name != "torch", "cpu", torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(mode: LiveBytes | None, model: Any = model, opt: Any = opt, rec: Any = rec) -> Any:
            _phase(mode, "forward")
            with fusible.autocast(enabled=rec is not None, recipe=rec):
                loss = model(idx, tgt)
            _phase(mode, "backward")
            loss.backward()
            _phase(mode, "step")
            opt.step()
            opt.zero_grad(set_to_none=True)

        out[name] = trace(step, warmup=1)  # AdamW's and the recipe's state exist after one
    return out


def print_peaks(
    title: str, peaks: dict[str, LiveBytes], top: int, phase: str | None = None
) -> None:
    base = peaks["none"].peak
    print(title)
    cols = f"{'peak_bytes':>12} {'vs_none':>8} {'forward':>12} {'backward':>12}"
    print(f"{'variant':<10} {cols}  where")
    for name, m in peaks.items():
        f, b = m.phase_peaks.get("forward", 0), m.phase_peaks.get("backward", 0)
        print(f"{name:<10} {m.peak:>12} {m.peak / base:>8.3f} {f:>12} {b:>12}  {m.peak_phase} "
              f"({m.peak_op})")  # fmt: skip
    if top:
        for name, m in peaks.items():
            print(f"\n[{name}] " + m.report(top, phase))
    print()


def rows_of(peaks: dict[str, LiveBytes], top: int) -> list[dict[str, Any]]:
    """JSON rows: per variant the peak, its ratio to ``none``, the phase peaks and the ``top``
    largest live groups at the peak."""
    base = peaks["none"].peak
    out = []
    for name, m in peaks.items():
        alive = m.report(top).splitlines()[1:]
        out.append({"variant": name, "peak_bytes": m.peak, "vs_none": m.peak / base,
                    "phase_peaks": dict(m.phase_peaks), "peak_phase": m.peak_phase,
                    "alive_at_peak": [line.strip() for line in alive]})  # fmt: skip
    return out


def main() -> None:
    ap = shape_parser(__doc__, tokens=512, hidden=256, ffn=1024)
    ap.add_argument("--models", default="block,gpt")
    ap.add_argument("--gpt", default=None, help="GPT config as k=v,... over GPT_CFG")
    ap.add_argument("--top", type=int, default=12, help="live allocations listed per variant")
    ap.add_argument(
        "--phase",
        default=None,
        choices=["forward", "backward", "step"],
        help="list what is alive at this phase's peak (default: the step's)",
    )
    ap.add_argument("--out", default=None, help="write peak_memory_cpu.json there")
    args = ap.parse_args()
    models = args.models.split(",")
    cfg = dict(GPT_CFG)
    if args.gpt:
        cfg.update({k: int(v) for k, v in (kv.split("=") for kv in args.gpt.split(","))})
    payload: dict[str, Any] = {"shape": {"tokens": args.tokens, "hidden": args.hidden,
                                         "ffn": args.ffn, "gpt": cfg}}  # fmt: skip
    if "block" in models:
        peaks = block_peaks(args.tokens, args.hidden, args.ffn)
        print_peaks(
            f"block step peak (bytes above the between-steps level), {args.tokens} tokens, "
            f"hidden {args.hidden}, ffn {args.ffn}, bf16, CPU trace", peaks, args.top, args.phase,
        )  # fmt: skip
        payload["block"] = rows_of(peaks, args.top)
    if "gpt" in models:
        peaks = gpt_peaks(cfg)
        print_peaks(f"GPT step peak, {cfg}, bf16, CPU trace", peaks, args.top, args.phase)
        payload["gpt"] = rows_of(peaks, args.top)
    if args.out:
        payload["env"] = environment()
        print(f"wrote {write_json('peak_memory', payload, args.out)}")


if __name__ == "__main__":
    main()


__all__ = ["Alloc", "LiveBytes", "block_peaks", "fusible_block", "gpt_peaks", "trace", "trace_step"]
