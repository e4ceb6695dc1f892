"""Where the GPU time of the MoE expert MLP step goes (issue 15): ``torch.profiler``'s CUDA
kernel table of forward + backward of GroupedLinear(E, H, F) -> GELU -> GroupedLinear(E, F, H)
under one recipe, at the shape of ``benchmarks/grouped.py`` (its token split). CUDA only.

    python benchmarks/grouped_profile.py [--recipe delayed|current|mxfp8|none] [--steps 3]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import fusible
from fusible import ops
from grouped import RECIPES, add_shape_arguments, make_splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default="delayed", choices=["delayed", "current", "mxfp8", "none"])
    add_shape_arguments(ap)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grouped_profile.py needs CUDA")
    e, h, f, n = args.experts, args.hidden, args.ffn, args.tokens
    splits = make_splits(n, e, args.imbalance)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    model = ops.Sequential(ops.GroupedLinear(e, h, f, **kw), ops.GELU(),
                           ops.GroupedLinear(e, f, h, **kw))  # fmt: skip
    x = torch.randn(n, h, requires_grad=True, **kw)
    dy = torch.randn(n, h, **kw)
    rec = RECIPES["bf16 (no recipe)" if args.recipe == "none" else args.recipe]

    def step() -> None:
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = model(x, m_splits=splits)
        y.backward(dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    print(f"{args.recipe}: {args.steps} steps, splits {splits}")
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=25,
                                 max_name_column_width=70))  # fmt: skip


if __name__ == "__main__":
    main()
