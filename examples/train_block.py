"""A second example (the main job is train_gpt.py): train a small stack of transformer MLP
blocks (LayerNorm -> Linear -> GELU -> Linear, with residuals) on a learnable synthetic
regression task, under an FP8 recipe chosen on the command line, next to the same model trained
in BF16 from the same initialisation.

    python examples/train_block.py --recipe current [--steps 200] [--device cpu|cuda]

Prints the fusion plan, a progress bar, and both loss curves; exits non-zero if the FP8 run's
final loss is more than --tolerance (default 5%) above the BF16 run's.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import fusible
from fusible import ops, recipe

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is cosmetic
    tqdm = None

RECIPES = {
    "none": lambda: None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=16),
    "current": lambda: recipe.Float8CurrentScaling(),
    "mxfp8": lambda: recipe.MXFP8BlockScaling(),
    # Roles at work: weights and activations E4M3 current scaling, gradients E5M2, the last
    # layer's fc2 kept in BF16.
    "custom": lambda: recipe.CustomRecipe(qfactory=_custom_factory),
}


def _custom_factory(role: fusible.quantization.QuantizerRole):  # type: ignore[no-untyped-def]
    from fusible.quantization import quantizers as Q

    if role.name == "fc2_last":
        return None
    fmt = torch.float8_e5m2 if role.bucket.startswith("grad") else torch.float8_e4m3fn
    return Q.Float8CurrentScalingQuantizer(fmt)


def make_model(
    layers: int, hidden: int, ffn: int, device: str, dtype: torch.dtype
) -> ops.Sequential:
    blocks = []
    for i in range(layers):
        last = "fc2_last" if i == layers - 1 else "fc2"
        blocks.append(
            ops.Sequential(
                ops.LayerNorm(hidden, device=device, dtype=dtype),
                ops.Linear(hidden, ffn, device=device, dtype=dtype, name="fc1"),
                ops.GELU(),
                ops.Linear(ffn, hidden, device=device, dtype=dtype, name=last),
                ops.AddExtraInput(),  # residual
            )
        )
    return torch.nn.ModuleList(blocks)  # type: ignore[return-value]


def run_model(model: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in model:
        x = block(x, x)
    return x


def train(model, data, steps: int, rec, desc: str, lr: float) -> list[float]:  # type: ignore[no-untyped-def]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    it = range(steps)
    # A live bar on a terminal; in logs, a line every 10% instead of a redraw per step.
    bar = (
        tqdm(it, desc=desc, ncols=90, mininterval=0 if sys.stderr.isatty() else 30)
        if tqdm is not None
        else it
    )
    for step in bar:
        x, target = data(step)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = run_model(model, x)
        loss = (y.float() - target.float()).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if tqdm is not None and step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")  # type: ignore[union-attr]
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="current")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tolerance", type=float, default=0.05)
    # Label noise sets a loss floor (noise**2): runs are compared at a realistic loss level rather
    # than at the floor FP8 rounding itself imposes on a noiseless regression.
    ap.add_argument("--noise", type=float, default=0.3)
    args = ap.parse_args()

    torch.manual_seed(0)
    dev, dtype = args.device, torch.bfloat16
    # Learnable task: a fixed random teacher network maps inputs to targets.
    teacher = torch.nn.Sequential(
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, args.hidden),
    ).to(dev)
    gen = torch.Generator(device="cpu").manual_seed(1)

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(args.tokens, args.hidden, generator=gen).to(dev)
        noise = args.noise * torch.randn(args.tokens, args.hidden, generator=gen).to(dev)
        with torch.no_grad():
            t = teacher(x) + noise
        return x.to(dtype), t

    base = make_model(args.layers, args.hidden, args.ffn, dev, dtype)
    fp8 = copy.deepcopy(base)
    rec = RECIPES[args.recipe]()
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        print(base[0].explain(dtype=dtype, device=dev))
    t0 = time.perf_counter()
    gen.manual_seed(1)
    ref_losses = train(base, data, args.steps, None, "bf16", args.lr)
    gen.manual_seed(1)
    losses = train(fp8, data, args.steps, rec, args.recipe, args.lr)
    took = time.perf_counter() - t0
    print(f"\n{'step':>6}{'bf16 loss':>12}{args.recipe + ' loss':>16}")
    for s in sorted({0, *range(args.steps // 10 - 1, args.steps, max(1, args.steps // 10))}):
        print(f"{s + 1:>6}{ref_losses[s]:>12.4f}{losses[s]:>16.4f}")
    # Compare the mean of the last 10% of steps: single-step losses are noisy.
    k = max(1, args.steps // 10)
    ref_end, end = sum(ref_losses[-k:]) / k, sum(losses[-k:]) / k
    ratio = end / ref_end
    print(f"final loss (mean of last {k} steps): bf16 {ref_end:.4f}, {args.recipe} {end:.4f} "
          f"(ratio {ratio:.3f}; label-noise floor {args.noise**2:.4f}); both runs took "
          f"{took:.1f} s on {dev}")  # fmt: skip
    if ratio > 1 + args.tolerance:
        print(f"FAIL: {args.recipe} loss is more than {args.tolerance:.0%} above bf16")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
