"""MoE expert MLP benchmark: GroupedLinear(E, H, F) -> GELU -> GroupedLinear(E, F, H), forward +
backward, per recipe, next to plain PyTorch (one torch.nn.Linear pair per expert in a loop, the
same token split) measured in the same run. Under delayed and current scaling fusible runs grouped
operators (one cast and one cuBLASLt-loop GEMM call for all experts, see docs/executor.md); without
a recipe the forward GEMMs are grouped; MXFP8 runs one quantize + GEMM per expert.

    python benchmarks/grouped.py [--experts 8] [--tokens 16384] [--hidden 4096] [--ffn 4096]
                                 [--imbalance 0.5] [--out DIR]      # CUDA (bf16)
    python benchmarks/grouped.py --tiny [--out DIR]                 # CPU smoke run (fp32)

``--imbalance`` in [0, 1): 0 gives every expert the same number of tokens; larger values draw
skewed splits (a fixed seed, rounded to multiples of 32 for MXFP8; some experts may be empty).
Without ``--out`` a ``--tiny`` run writes no JSON (its numbers are not results).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import fusible
from _common import environment, print_table, time_ms, write_json
from fusible import ops, recipe

RECIPES: dict[str, Any] = {
    "bf16 (no recipe)": None,
    "delayed": recipe.DelayedScaling(),
    "current": recipe.Float8CurrentScaling(),
    "mxfp8": recipe.MXFP8BlockScaling(),
}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--imbalance", type=float, default=0.5)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny sizes, few iterations")
    ap.add_argument("--out", default=None)
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
    x = torch.randn(n, h, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(n, h, device=dev, dtype=dt)
    flops = 3 * 2 * 2 * n * h * f  # two GEMMs per token, forward + two backward GEMMs each

    ref = TorchExperts(e, h, f).to(dev, dt)
    model = ops.Sequential(
        ops.GroupedLinear(e, h, f, device=dev, dtype=dt),
        ops.GELU(),
        ops.GroupedLinear(e, f, h, device=dev, dtype=dt),
    )
    rows: list[dict[str, Any]] = []
    eager_ms = time_ms(lambda: ref(x, splits).backward(dy), warmup=2, iters=iters)
    rows.append({"variant": "torch eager (per-expert loop)", "ms": eager_ms,
                 "TFLOP/s": flops / eager_ms / 1e9, "speedup_vs_torch_eager": 1.0})  # fmt: skip
    for name, rec in RECIPES.items():

        def step(rec: Any = rec) -> None:
            with fusible.autocast(enabled=rec is not None, recipe=rec):
                y = model(x, m_splits=splits)
            y.backward(dy)

        ms = time_ms(step, warmup=2, iters=iters)
        rows.append({"variant": f"fusible {name}", "ms": ms, "TFLOP/s": flops / ms / 1e9,
                     "speedup_vs_torch_eager": eager_ms / ms})  # fmt: skip
    print(f"experts {e}, tokens {n}, hidden {h}, ffn {f}, m_splits {splits}, {dt}, {dev}")
    print_table(rows, ["variant", "ms", "TFLOP/s", "speedup_vs_torch_eager"])
    if args.tiny and args.out is None:
        return
    shape = {**vars(args), "m_splits": splits}
    path = write_json("grouped", {"env": environment(), "shape": shape, "results": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
