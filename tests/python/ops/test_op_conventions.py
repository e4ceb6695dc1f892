"""PyTorch / TransformerEngine conventions of the ops containers (issue 12): quantizer roles of
``ops.Sequential`` and ``ops.Linear`` (slot order, agreeing with ``num_quantizers`` and
``explain()``), ``reset_parameters()`` on containers (meta-device construction), and
``register_fusion`` rejecting bad arguments at registration."""

from __future__ import annotations

import collections
import math
import re

import pytest
import torch
from ops_helpers import RECIPES

import fusible
from fusible import ops
from fusible.quantization import QuantizerRole

FWD = ["input", "weight", "output"]
BWD = ["grad_output", "grad_input"]


def _explained_roles(text):
    """Qualified roles of the quantizer lines of ``explain()`` ("<role>: <quantizer>")."""
    return [m.group(1) for m in re.finditer(r"(?<![\w:])([a-z_]+:[a-z_]+(?::[a-z_0-9]+)?): ", text)]


def _block():
    return ops.Sequential(
        ops.LayerNorm(64),
        ops.Linear(64, 96, name="fc1"),
        ops.GELU(),
        ops.Linear(96, 64),
        ops.Quantize(forward=True, backward=True, name="cast"),
    )


# ---- quantizer roles of containers -----------------------------------------------------------


def test_ops_linear_roles():
    for m in (ops.Linear(64, 32), ops.Linear(64, 32, bias=False)):
        assert [str(r) for r in m.get_quantizer_roles(True)] == [f"{b}:linear" for b in FWD]
        assert [str(r) for r in m.get_quantizer_roles(False)] == [f"{b}:linear" for b in BWD]
        assert m.num_quantizers(True) == 3 and m.num_quantizers(False) == 2
    named = ops.Linear(64, 32, name="proj")
    assert [r.qualified for r in named.get_quantizer_roles(True)] == [
        f"{b}:linear:proj" for b in FWD
    ]


def test_sequential_roles_in_slot_order():
    model = _block()
    fwd, bwd = model.get_quantizer_roles(True), model.get_quantizer_roles(False)
    assert all(isinstance(r, QuantizerRole) for r in fwd + bwd)
    # Op order, then each op's slots; every role as its op emits it (scope and name).
    assert [r.qualified for r in fwd] == [
        *(f"{b}:linear:fc1" for b in FWD),
        *(f"{b}:linear" for b in FWD),
        "input:quantize:cast",
    ]
    assert [r.qualified for r in bwd] == [
        *(f"{b}:linear:fc1" for b in BWD),
        *(f"{b}:linear" for b in BWD),
        "grad_output:quantize:cast",
    ]
    want = [r for op in model for r in op.get_quantizer_roles(True)]
    assert fwd == want
    assert model.num_quantizers(True) == 7 and model.num_quantizers(False) == 5
    assert (
        ops.Sequential().get_quantizer_roles(True) == []
        and ops.Sequential().num_quantizers(False) == 0
    )


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8", "custom"])
def test_sequential_roles_agree_with_explain(recipe_name):
    model = _block()
    with fusible.autocast(recipe=RECIPES[recipe_name]):
        text = model.explain()
    listed = collections.Counter(_explained_roles(text))
    want = collections.Counter(
        r.qualified for fwd in (True, False) for r in model.get_quantizer_roles(fwd)
    )
    assert listed == want
    assert sum(listed.values()) == model.num_quantizers(True) + model.num_quantizers(False)


def test_nested_containers_keep_their_ops_roles():
    """A nested Sequential is flattened: its ops' roles appear unchanged, where its ops run. A
    plain module child that reports roles (e.g. a user block holding a fusible module) adds
    them at its position; one that does not is opaque (as to the fuser)."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = fusible.LayerNormMLP(64, 96)

        def forward(self, x):
            return self.mlp(x)

        def get_quantizer_roles(self, fwd):
            return self.mlp.get_quantizer_roles(fwd)

    inner = ops.Sequential(ops.Linear(64, 64, name="a"))
    model = ops.Sequential(inner, Block(), torch.nn.Identity(), ops.Linear(64, 64, name="b"))
    names = [(r.scope, r.name) for r in model.get_quantizer_roles(True)]
    assert (
        names
        == [("linear", "a")] * 3
        + [("layernorm_mlp", "fc1")] * 3
        + [("layernorm_mlp", "fc2")] * 3
        + [("linear", "b")] * 3
    )
    assert model.num_quantizers(True) == 12 and model.num_quantizers(False) == 8


def test_custom_recipe_sees_the_container_roles():
    model = _block()
    seen = []

    def qfactory(role):
        seen.append(role)
        return None

    with fusible.autocast(recipe=fusible.recipe.CustomRecipe(qfactory=qfactory)):
        model(torch.randn(4, 64))
    want = model.get_quantizer_roles(True) + model.get_quantizer_roles(False)
    assert collections.Counter(seen) == collections.Counter(want)


# ---- reset_parameters on containers ------------------------------------------------------------


def test_sequential_reset_parameters_resets_every_child():
    torch.manual_seed(0)
    ref = ops.Sequential(ops.LayerNorm(48), ops.Linear(48, 40), ops.GELU(), torch.nn.Linear(40, 8))
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.LayerNorm(48, device="meta"),
        ops.Linear(48, 40, device="meta"),
        ops.GELU(),
        torch.nn.Linear(40, 8, device="meta"),
    )
    model.to_empty(device="cpu")
    model.reset_parameters()
    ref_p, p = dict(ref.named_parameters()), dict(model.named_parameters())
    assert ref_p.keys() == p.keys()
    for n in p:
        assert torch.equal(p[n], ref_p[n]), n
    assert torch.equal(p["0.weight"], torch.ones(48)) and torch.equal(p["2.bias"], torch.zeros(40))
    bound = 1 / math.sqrt(48)  # kaiming_uniform_(a=sqrt(5)), as torch.nn.Linear
    assert p["1.weight"].abs().max() <= bound and p["1.weight"].std() > bound / 3


def test_ops_linear_reset_parameters():
    m = ops.Linear(32, 16)
    with torch.no_grad():
        m.weight.fill_(3.0)
        m.bias.fill_(3.0)
    torch.manual_seed(1)
    m.reset_parameters()
    torch.manual_seed(1)
    ref = torch.nn.Linear(32, 16)
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, torch.zeros(16))


# ---- register_fusion rejects bad arguments at registration ------------------------------------


class _Fused(ops.FusedOperation):
    name = "my_rule"


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"pattern": (ops.Bias,), "factory": 42}, "factory must be callable"),
        ({"pattern": (ops.Bias,), "factory": "_Fused"}, "factory must be callable"),
        ({"pattern": (ops.Bias,), "factory": _Fused, "predicate": 1}, "predicate must be"),
        ({"pattern": (ops.Bias,), "factory": _Fused, "predicate": "x"}, "predicate must be"),
        ({"pattern": 42, "factory": _Fused}, "pattern must be"),
        ({"pattern": ops.Bias, "factory": _Fused}, "pattern must be"),
        ({"pattern": "Bias", "factory": _Fused}, "pattern must be"),
        ({"pattern": (ops.Bias, 3), "factory": _Fused}, "pattern must be"),
        ({"pattern": (ops.Linear,), "factory": _Fused}, "pattern must be"),  # a container
        ({"pattern": (ops.Bias(4),), "factory": _Fused}, "pattern must be"),  # an instance
        ({"pattern": (ops.Bias,), "factory": _Fused, "forward": "yes"}, "forward must be a bool"),
    ],
)
def test_register_fusion_rejects_bad_arguments(kwargs, what):
    from fusible.ops import registry

    before = registry.version()
    kwargs = dict(kwargs)
    pattern, factory = kwargs.pop("pattern"), kwargs.pop("factory")
    with pytest.raises(TypeError, match=what) as err:
        ops.register_fusion(pattern, factory, name="my_rule", **kwargs)
    assert "'my_rule'" in str(err.value)
    assert registry.version() == before  # nothing registered


def test_register_fusion_rejects_a_bad_name():
    with pytest.raises(TypeError, match="name must be a non-empty string, got 42"):
        ops.register_fusion((ops.Bias,), _Fused, name=42)


def test_register_fusion_names_the_rule_from_the_factory():
    with pytest.raises(TypeError, match="rule 'my_rule': predicate must be"):
        ops.register_fusion((ops.Bias,), _Fused, predicate=object())
