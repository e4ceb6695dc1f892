"""QuantizerRole values and recipe validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusible
from fusible import recipe
from fusible.quantization import (
    QuantizerRole,
    RoleRules,
    as_roles,
    backward_roles,
    forward_roles,
)

# ---- roles --------------------------------------------------------------------------------------


def test_role_value_semantics():
    r = QuantizerRole("input", "linear")
    assert str(r) == "input:linear" and r.qualified == "input:linear"
    assert QuantizerRole.parse("input:linear") == r
    assert QuantizerRole.parse(str(r)) == r
    named = QuantizerRole("grad_output", "layernorm_mlp", "fc1")
    assert str(named) == "grad_output:layernorm_mlp"
    assert named.qualified == "grad_output:layernorm_mlp:fc1"
    assert QuantizerRole.parse(named.qualified) == named
    assert named.is_gradient and not r.is_gradient
    assert len({r, QuantizerRole("input", "linear"), named}) == 2  # hashable values
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.bucket = "weight"  # type: ignore[misc]
    assert named.with_scope("linear") == QuantizerRole("grad_output", "linear", "fc1")
    assert named.with_name(None) == QuantizerRole("grad_output", "layernorm_mlp")
    assert QuantizerRole("qkv", "dpa").qualified == "qkv:dpa"  # extensible buckets
    assert QuantizerRole("s", "dpa").matches("s:*")


@pytest.mark.parametrize(
    "text",
    ["input", "input:", ":linear", "a:b:c:d", "Input:linear", "input:lin ear", "input:linear:",
     "1x:linear", "", "input:linear:FC1"],
)  # fmt: skip
def test_malformed_role_strings_raise(text):
    with pytest.raises(ValueError, match=r"QuantizerRole.parse"):
        QuantizerRole.parse(text)


def test_role_field_validation():
    with pytest.raises(ValueError, match="'bucket' must be a lowercase identifier"):
        QuantizerRole("Weight", "linear")
    with pytest.raises(ValueError, match="'scope' must be a lowercase identifier"):
        QuantizerRole("weight", "")
    with pytest.raises(ValueError, match=r"'name' must be a lowercase identifier .*or None"):
        QuantizerRole("weight", "linear", "fc-1")
    with pytest.raises(ValueError, match="expected a string"):
        QuantizerRole.parse(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"roles\[1\]: .*got 'bad'"):
        as_roles(["input:linear", "bad"])
    with pytest.raises(ValueError, match="a single role"):
        as_roles("input:linear")


def test_standard_role_lists():
    assert [str(r) for r in forward_roles()] == ["input:linear", "weight:linear", "output:linear"]
    assert [r.qualified for r in backward_roles("layernorm_mlp", "fc2")] == [
        "grad_output:layernorm_mlp:fc2",
        "grad_input:layernorm_mlp:fc2",
    ]


# ---- recipes ------------------------------------------------------------------------------------


def test_recipe_defaults_and_reexports():
    assert fusible.recipe is recipe
    d = recipe.DelayedScaling()
    assert (d.margin, d.fp8_format, d.amax_history_len, d.amax_compute_algo, d.reduce_amax) == (
        0, recipe.Format.HYBRID, 1024, "max", True,
    )  # fmt: skip
    assert recipe.Float8CurrentScaling().fp8_format is recipe.Format.HYBRID
    assert recipe.MXFP8BlockScaling().fp8_format is recipe.Format.E4M3
    assert d.delayed() and recipe.MXFP8BlockScaling().mxfp8()
    assert hash(d) == hash(recipe.DelayedScaling()) and d == recipe.DelayedScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.margin = 1  # type: ignore[misc]
    f = recipe.Format
    assert (f.HYBRID.fwd_dtype, f.HYBRID.bwd_dtype) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert (f.E4M3.fwd_dtype, f.E4M3.bwd_dtype) == (torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert f.E5M2.dtype("forward") == torch.float8_e5m2
    assert fusible.__version__ == "0.1.0"


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: recipe.DelayedScaling(margin=-1), "margin"),
        (lambda: recipe.DelayedScaling(margin=1.5), "margin"),
        (lambda: recipe.DelayedScaling(margin=True), "margin"),
        (lambda: recipe.DelayedScaling(amax_history_len=0), "amax_history_len"),
        (lambda: recipe.DelayedScaling(amax_history_len=2.0), "amax_history_len"),
        (lambda: recipe.DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: recipe.DelayedScaling(fp8_format="HYBRID"), "fp8_format"),
        (lambda: recipe.DelayedScaling(reduce_amax=1), "reduce_amax"),
        (lambda: recipe.Float8CurrentScaling(margin=-2), "margin"),
        (lambda: recipe.Float8CurrentScaling(fp8_format=None), "fp8_format"),
        (lambda: recipe.MXFP8BlockScaling(fp8_format="E4M3"), "fp8_format"),
        (lambda: recipe.CustomRecipe(), "qfactory"),
        (lambda: recipe.CustomRecipe(qfactory=3), "qfactory"),
    ],
)
def test_recipe_validation_names_the_field(make, field):
    with pytest.raises(ValueError, match=rf"^\w+: '{field}' must be"):
        make()


def test_role_rules_matching():
    mx, cs = recipe.MXFP8BlockScaling(), recipe.Float8CurrentScaling()
    rules = RoleRules({"weight:*": mx, "*:*:fc2": None, "grad_*:*": cs, "*": cs})
    assert rules.match("weight:linear:fc2") == ("weight:*", mx)  # first match wins
    assert rules.match("input:linear:fc2") == ("*:*:fc2", None)  # matches the qualified name
    assert rules.match("grad_input:layernorm_mlp") == ("grad_*:*", cs)
    assert rules.match(QuantizerRole("qkv", "dpa")) == ("*", cs)
    assert RoleRules([("input:*", None), ("*", cs)]).match("input:linear")[0] == "input:*"
    assert hash(rules) == hash(
        RoleRules({"weight:*": mx, "*:*:fc2": None, "grad_*:*": cs, "*": cs})
    )
    with pytest.raises(ValueError, match="no rule matches role 'output:linear'"):
        RoleRules({"weight:*": mx}).match("output:linear")
    with pytest.raises(ValueError, match="at least one"):
        RoleRules({})
    with pytest.raises(ValueError, match="pattern of rules\\[0\\] must be a non-empty glob"):
        RoleRules({"": None})
    with pytest.raises(ValueError, match="value of rule 'weight:\\*' must be a Recipe"):
        RoleRules({"weight:*": "mxfp8"})
    with pytest.raises(ValueError, match="must be a \\(pattern, value\\) pair"):
        RoleRules(["weight:*"])
    r = recipe.CustomRecipe.from_rules({"*": cs})
    assert isinstance(r.qfactory, RoleRules) and r.custom()
    assert recipe.CustomRecipe.from_rules(rules).qfactory is rules


def test_import_direction():
    """roles, recipe <- data <- tensor <- quantizers (with scale_log) <- state <- autocast,
    model_init; nothing imports ops or modules (tensor names Quantizer for typing only)."""
    import ast
    import pathlib

    import fusible.quantization

    allowed = {
        "roles": set(),
        "recipe": {"roles"},
        "data": {"_kernels"},
        "scale_log": set(),
        "tensor": {"data", "_kernels", "quantizers"},
        "quantizers": {"roles", "recipe", "data", "scale_log", "tensor", "_kernels"},
        "state": {"roles", "recipe", "quantizers", "_kernels"},
        "autocast": {"roles", "recipe", "quantizers", "state", "_kernels"},
        "model_init": {"roles", "recipe", "quantizers", "state"},
        "recompute": {"quantizers", "autocast"},
    }
    pkg = pathlib.Path(fusible.quantization.__file__).parent
    for name, ok in allowed.items():
        tree = ast.parse((pkg / f"{name}.py").read_text())
        used = set()
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "fusible":
                mods = [f"fusible.{a.name}" for a in node.names]  # from fusible import _kernels
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for m in mods:
                if m.startswith("fusible"):
                    used.add(m.removeprefix("fusible.").removeprefix("quantization."))
        assert used <= ok, f"{name}.py imports {sorted(used - ok)}"


def test_recipe_key_equal_for_equal_recipes_and_survives_pickle_and_copy():
    import copy
    import pickle

    from fusible.quantization.recipe import recipe_from_key

    a, b = recipe.DelayedScaling(margin=1), recipe.DelayedScaling(margin=1)
    c = recipe.DelayedScaling(margin=2)
    assert isinstance(a.key, str) and a.key == b.key != c.key
    assert recipe.Float8CurrentScaling().key != recipe.MXFP8BlockScaling().key
    assert recipe_from_key(a.key) == a and recipe_from_key(None) is None
    for clone in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c), copy.copy(c)):
        assert clone == c and clone.key == c.key
    # the key is not a field: it takes no part in equality, repr or dataclasses.replace
    assert "key" not in repr(a)
    assert dataclasses.replace(a, margin=2).key == c.key
