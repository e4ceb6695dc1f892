"""One fused training step of the benchmark block under a recipe, bracketed by
cudaProfilerStart/Stop after a warm-up step, for kernel profilers:

    ncu --profile-from-start off --section SpeedOfLight python benchmarks/block_step.py delayed
    nsys profile --capture-range=cudaProfilerApi python benchmarks/block_step.py current
"""

from __future__ import annotations

import torch

from _common import fusible_block, fusible_step, shape_parser
from block import RECIPES


def main() -> None:
    ap = shape_parser(__doc__, tokens=16384, hidden=4096, ffn=16384)
    ap.add_argument("recipe", choices=list(RECIPES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/block_step.py needs a CUDA GPU")
    rec = RECIPES[args.recipe]
    model = fusible_block(args.hidden, args.ffn)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)  # fmt: skip
    dy = torch.randn_like(x)

    step = fusible_step(model, rec, x, dy)
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
