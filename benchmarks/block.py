"""Transformer MLP block benchmark: LayerNorm(H) -> Linear(H, F) -> GELU -> Linear(F, H), bf16,
forward + backward, per recipe, fused vs unfused plan, next to plain-PyTorch bf16 eager (and
torch.compile of it) measured in the same run.

    python benchmarks/block.py [--tokens 16384] [--hidden 4096] [--ffn 16384] [--out DIR]
"""

from __future__ import annotations

from typing import Any

import torch

from _common import (
    TorchBlock,
    all_recipes,
    environment,
    fusible_block,
    fusible_step,
    print_table,
    shape_parser,
    time_ms,
    write_json,
)
from fusible import ops

RECIPES: dict[str, Any] = all_recipes("bf16 (no recipe)")


def main() -> None:
    ap = shape_parser(__doc__, tokens=16384, hidden=4096, ffn=16384)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="recipe name: print its fused step's kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/block.py needs a CUDA GPU")
    dev, dt = "cuda", torch.bfloat16
    h, f, n = args.hidden, args.ffn, args.tokens
    x = torch.randn(n, h, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(n, h, device=dev, dtype=dt)
    flops = 3 * 2 * 2 * n * h * f  # two GEMMs, forward + two backward GEMMs each

    ref = TorchBlock(h, f).to(dev, dt)
    ref_c = torch.compile(ref)

    def step_torch(m: torch.nn.Module) -> None:
        m(x).backward(dy)

    rows: list[dict[str, Any]] = []
    eager_ms = time_ms(lambda: step_torch(ref))
    rows.append({"variant": "torch bf16 eager", "ms": eager_ms, "TFLOP/s": flops / eager_ms / 1e9,
                 "speedup_vs_torch_eager": 1.0})  # fmt: skip
    ms = time_ms(lambda: step_torch(ref_c))
    rows.append({"variant": "torch bf16 compile", "ms": ms, "TFLOP/s": flops / ms / 1e9,
                 "speedup_vs_torch_eager": eager_ms / ms})  # fmt: skip

    model = fusible_block(h, f)
    for name, rec in RECIPES.items():
        for fused in (True, False):
            step = fusible_step(model, rec, x, dy)
            if fused:
                ms = time_ms(step)
            else:
                with ops.fusion_disabled():
                    ms = time_ms(step)
            variant = f"fusible {name} {'fused' if fused else 'unfused'}"
            rows.append({"variant": variant, "ms": ms, "TFLOP/s": flops / ms / 1e9,
                         "speedup_vs_torch_eager": eager_ms / ms})  # fmt: skip
    print_table(rows, ["variant", "ms", "TFLOP/s", "speedup_vs_torch_eager"])
    if args.profile:
        fused_step = fusible_step(model, RECIPES[args.profile], x, dy)
        fused_step()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                fused_step()
            torch.cuda.synchronize()
        print(f"profile of 3 fused steps, recipe {args.profile!r}:")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=30, max_name_column_width=70
            )
        )
    path = write_json(
        "block", {"env": environment(), "shape": vars(args), "results": rows}, args.out
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
