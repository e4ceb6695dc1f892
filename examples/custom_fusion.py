"""Custom fusion: run adjacent ops of given types as one fused operation of your own.

    python3 examples/custom_fusion.py

``ConstantScale(s)`` followed by a tanh ``GELU`` becomes one unit, ``scaled_gelu``, computing
``gelu(s * x)`` forward and ``s * gelu'(s * x) * dy`` backward with the library's activation
kernels. The rule is registered with ``ops.register_fusion`` and a predicate; user rules are tried
before the built-in ones, ``explain()`` shows which rule ran each unit (and why a rule was not
applied), and ``ops.fusion_disabled()`` runs the unfused reference path to check the numerics.
"""

from __future__ import annotations

import argparse

import torch

import fusible
from fusible import ops, recipe


# ---- the user fusion: a FusedOperation, a predicate, one register_fusion call ------------------
class ScaledGELU(ops.FusedOperation):
    """gelu(s * x) as one unit. It fills each op's context as the unfused ops would (only GELU
    keeps something), so a fused forward may pair with an unfused backward and vice versa."""

    name, forward, backward = "scaled_gelu", True, True

    def kernels(self, fwd):
        return ["act_fwd(gelu) on s * x"] if fwd else ["act_bwd(gelu), times s"]

    def fuser_forward(self, ctxs, x, params, *, next_input_quantizer, extra_inputs):
        scale, gelu = self.ops
        x = x if isinstance(x, torch.Tensor) else x.dequantize()
        # GELU's forward may write its output quantized for the next op (quantizer hand-off).
        q = next_input_quantizer
        y, _ = gelu.op_forward(ctxs[1], x * scale.scale, params[1], next_input_quantizer=q,
                               extra_inputs=[])  # fmt: skip
        return y, [[], []]

    def fuser_backward(self, ctxs, dy, *, prev_grad_quantizer, extra_output_grads):
        scale, gelu = self.ops
        dx, _, _ = gelu.op_backward(ctxs[1], dy, prev_grad_quantizer=None, extra_output_grads=[])
        return dx * scale.scale, [[], []], [[], []]


def tanh_gelu_only(window, recipe):  # None accepts; a reason rejects (explain() shows it)
    return None if window[1].approximate == "tanh" else "this fusion covers the tanh GELU only"


RULE = ops.register_fusion((ops.ConstantScale, ops.GELU), ScaledGELU, predicate=tanh_gelu_only,
                           forward=True, backward=True)  # fmt: skip
# -------------------------------------------------------------------------------------------------


def run(model: ops.Sequential, x: torch.Tensor, rec) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with fusible.autocast(recipe=rec):
        y = model(x)
    y.float().pow(2).mean().backward()
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


def main() -> None:
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.LayerNorm(64),
        ops.Linear(64, 128),
        ops.ConstantScale(0.5),
        ops.GELU(),  # ConstantScale + GELU(tanh): fused by the user rule
        ops.Linear(128, 64),
        ops.ConstantScale(2.0),
        ops.GELU(approximate="none"),  # rejected by the predicate, with its reason
    )
    x = torch.randn(4, 32, 64)
    rec = recipe.Float8CurrentScaling()
    with fusible.autocast(recipe=rec):
        print(model.explain())
    fused = run(model, x, rec)
    with ops.fusion_disabled():
        reference = run(model, x, rec)
    for a, b in zip(fused, reference, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    print(f"\nfused == unfused (bit for bit) for the output and all {len(fused) - 1} gradients")
    ops.unregister_fusion(RULE)  # back to the built-in rules only
    assert "scaled_gelu" not in model.explain()


if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # no options: --help prints the above
    main()
