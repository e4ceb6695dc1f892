"""Training-step benchmark: one step (forward, backward, SGD update) of the
LayerNorm(H) -> Linear(H, F) -> GELU -> Linear(F, H) block, per recipe, three ways:

* ``eager``: fusible ops as they are;
* ``compiled``: ``torch.compile(fullgraph=True)`` of the forward (autocast inside), backward and
  optimizer outside;
* ``graphed``: the whole step captured once with ``torch.cuda.graph`` and replayed.

Three tables, all measured in the same run:

1. step time at a large shape (GPU-bound);
2. host overhead at a tiny shape (16 tokens, hidden 256): the time of one step when steps are
   issued back to back is then the host's time per step; plain PyTorch eager is the yardstick;
3. peak memory of one eager step (bytes allocated above what lives between steps), the memory
   that lives between steps (parameters, gradients, optimizer state with any fp32 masters, recipe
   state) and the parameters' own bytes, per recipe, next to BF16; ``+fp8w`` variants build the
   Linear weights inside ``fusible.quantized_model_init`` (stored quantized) and train them with
   ``fusible.optim.MasterWeightOptimizer`` (fp32 masters on the optimizer side).

    python benchmarks/step.py [--tokens 8192] [--hidden 4096] [--ffn 16384] [--out DIR]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import fusible
from _common import (
    TorchBlock,
    all_recipes,
    capture_cuda_graph,
    environment,
    fusible_block,
    print_table,
    shape_parser,
    time_ms,
    write_json,
)
from fusible.quantization import QuantizedTensor

RECIPES: dict[str, Any] = all_recipes("bf16")
# FP8-weight variants: (recipe name, weights stored quantized by this recipe).
FP8_WEIGHTS: dict[str, Any] = {"current+fp8w": "current", "mxfp8+fp8w": "mxfp8"}
MIB = 2**20


def variants() -> dict[str, tuple[Any, Any]]:
    """name -> (autocast recipe, quantized_model_init recipe or None)."""
    out: dict[str, tuple[Any, Any]] = {name: (rec, None) for name, rec in RECIPES.items()}
    for name, base in FP8_WEIGHTS.items():
        out[name] = (RECIPES[base], RECIPES[base])
    return out


def param_mib(model: torch.nn.Module) -> float:
    """Bytes of the parameters' storage (a quantized weight counts its data and scales)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        qdata = getattr(p, "qdata", None)
        tensors = [t for t in vars(qdata).values() if isinstance(t, torch.Tensor)] if qdata else [p]
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total / MIB


class Stepper:
    """One model, its optimizer and fixed inputs; ``make(mode)`` returns a step callable."""

    def __init__(self, model: torch.nn.Module, rec: Any, n: int, h: int) -> None:
        self.model, self.rec = model, rec
        params = list(model.parameters())
        self.opt: torch.optim.Optimizer = (
            fusible.optim.MasterWeightOptimizer(torch.optim.SGD, params, lr=1e-6, foreach=True)
            if any(isinstance(p, QuantizedTensor) for p in params)  # fp32 masters for those
            else torch.optim.SGD(params, lr=1e-6, foreach=True)
        )
        self.x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        self.dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fusible.autocast(enabled=self.rec is not None, recipe=self.rec):
            return self.model(x)

    def make(self, mode: str) -> Callable[[], Any]:
        fwd: Callable[[torch.Tensor], torch.Tensor] = self.forward
        if mode == "compiled":
            fwd = torch.compile(self.forward, fullgraph=True)

        def step() -> torch.Tensor:
            self.opt.zero_grad(set_to_none=False)
            y = fwd(self.x)
            y.backward(self.dy)
            self.opt.step()
            return y

        if mode != "graphed":
            return step
        return capture_cuda_graph(step, step)


def host_ms_per_step(step: Callable[[], Any], iters: int = 200) -> float:
    """Wall time per step of ``iters`` steps issued back to back (after warm-up)."""
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def memory_mib(
    make_model: Callable[[], torch.nn.Module], rec: Any, n: int, h: int
) -> tuple[float, float, float]:
    """(peak above the between-steps level during one eager step, between-steps level,
    parameter bytes), MiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    s = Stepper(make_model(), rec, n, h)
    step = s.make("eager")
    for _ in range(2):  # optimizer and recipe state exist after the first step
        step()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (peak - resident) / MIB, (resident - start) / MIB, param_mib(s.model)


def _cell(fn: Callable[[], float]) -> float | str:
    try:
        return fn()
    except Exception as e:  # a recipe that cannot run a shape is reported, not fatal
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main() -> None:
    ap = shape_parser(__doc__, tokens=8192, hidden=4096, ffn=16384)
    ap.add_argument("--tiny-tokens", type=int, default=16)
    ap.add_argument("--tiny-hidden", type=int, default=256)
    ap.add_argument("--modes", default="eager,compiled,graphed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/step.py needs a CUDA GPU")
    modes = args.modes.split(",")
    n, h, f = args.tokens, args.hidden, args.ffn
    tn, th = args.tiny_tokens, args.tiny_hidden

    def torch_block(hh: int, ff: int) -> torch.nn.Module:
        return TorchBlock(hh, ff).to("cuda", torch.bfloat16)

    step_rows: list[dict[str, Any]] = []
    torch_ms = time_ms(Stepper(torch_block(h, f), None, n, h).make("eager"), iters=20)
    step_rows.append({"variant": "torch bf16 eager", "eager_ms": torch_ms})
    for name, (rec, wrec) in variants().items():
        row: dict[str, Any] = {"variant": f"fusible {name}"}
        s = Stepper(fusible_block(h, f, wrec), rec, n, h)
        for mode in modes:
            row[f"{mode}_ms"] = _cell(lambda: time_ms(s.make(mode), iters=20))
        step_rows.append(row)
        del s
    print(f"step time, {n} tokens, hidden {h}, ffn {f}, bf16 parameters + SGD")
    print_table(step_rows, ["variant", *[f"{m}_ms" for m in modes]])

    tiny_rows: list[dict[str, Any]] = []
    torch_host = host_ms_per_step(Stepper(torch_block(th, 4 * th), None, tn, th).make("eager"))
    tiny_rows.append({"variant": "torch bf16 eager", "eager_ms": torch_host})
    for name, rec in RECIPES.items():
        row = {"variant": f"fusible {name}"}
        s = Stepper(fusible_block(th, 4 * th), rec, tn, th)
        for mode in modes:
            row[f"{mode}_ms"] = _cell(lambda: host_ms_per_step(s.make(mode)))
        eager = row.get("eager_ms")
        if isinstance(eager, float):
            row["eager_vs_torch_eager"] = eager / torch_host
        tiny_rows.append(row)
    print(f"host time per step, {tn} tokens, hidden {th} (steps issued back to back)")
    print_table(tiny_rows, ["variant", *[f"{m}_ms" for m in modes], "eager_vs_torch_eager"])

    mem_rows: list[dict[str, Any]] = []
    for name, (rec, wrec) in {"torch bf16": (None, None), **variants()}.items():
        make: Callable[[], torch.nn.Module] = (
            (lambda: torch_block(h, f))
            if name == "torch bf16"
            else (lambda: fusible_block(h, f, wrec))
        )
        res = _cell(lambda: memory_mib(make, rec, n, h))
        if isinstance(res, str):
            mem_rows.append({"variant": name, "step_peak_MiB": res})
        else:
            mem_rows.append({"variant": name, "step_peak_MiB": res[0], "resident_MiB": res[1],
                             "params_MiB": res[2]})  # fmt: skip
    print(f"memory, {n} tokens, hidden {h}, ffn {f}")
    print_table(mem_rows, ["variant", "step_peak_MiB", "resident_MiB", "params_MiB"])

    payload = {
        "env": environment(),
        "shape": vars(args),
        "step": step_rows,
        "host_overhead": tiny_rows,
        "memory": mem_rows,
    }
    print(f"wrote {write_json('step', payload, args.out)}")


if __name__ == "__main__":
    main()
