"""Checkpoints and materialisation: recipe state in state_dict ("<op>._extra_state", plain
tensors), torch.save / torch.load(weights_only=True), bit-exact restore, tolerant and strict
loading, malformed state, ``.to()``, and construction on the meta device."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import fusible
from fusible import ops, recipe

DELAYED = recipe.DelayedScaling(amax_history_len=4)
# Delayed-scaling state nested in a CustomRecipe: weights current-scaled, the rest delayed.
RULES = recipe.CustomRecipe.from_rules(
    {"weight:*": recipe.Float8CurrentScaling(), "*": recipe.DelayedScaling(amax_history_len=3)}
)
RECIPES = {"delayed": DELAYED, "custom_rules": RULES}
LINEAR_KEYS = {"forward.amax_history", "forward.scale", "backward.amax_history", "backward.scale"}


def _model(seed=0):
    torch.manual_seed(seed)
    return ops.Sequential(
        ops.LayerNorm(32),
        ops.Linear(32, 64),
        ops.GELU(),
        ops.Linear(64, 32),
    )


def _step(model, x, rec, opt=None):
    """One training step; returns the output, the input gradient and the parameter gradients."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with fusible.autocast(recipe=rec):
        y = model(x)
    y.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if opt is not None:
        opt.step()
    return [y.detach(), x.grad, *grads]


def _trained(rec, steps=3):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        _step(model, torch.randn(8, 32, generator=gen), rec, opt)
    return model


def _extra_states(model):
    return [op.get_extra_state() for op in model]


def _assert_states_equal(a, b):
    assert len(a) == len(b)
    for sa, sb in zip(a, b, strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- what a checkpoint holds -------------------------------------------------------------------


def test_state_dict_holds_delayed_scaling_state():
    model = _trained(DELAYED)
    sd = model.state_dict()
    linears = {i for i, op in enumerate(model) if isinstance(op, ops.BasicLinear)}
    assert linears == {1, 4}
    for i in range(len(model)):
        extra = sd[f"{i}._extra_state"]
        assert isinstance(extra, dict)
        if i not in linears:
            assert extra == {}  # no quantizers, no state
            continue
        assert set(extra) == LINEAR_KEYS
        for v in extra.values():
            assert type(v) is torch.Tensor and v.dtype == torch.float32  # plain tensors
        assert extra["forward.amax_history"].shape == (4, 3)  # [history, input/weight/output]
        assert extra["forward.scale"].shape == (3,)
        assert extra["backward.amax_history"].shape == (4, 2)  # [history, grad_out/grad_in]
        assert extra["backward.scale"].shape == (2,)
        # Three steps were recorded (row 0, this step's running max, was rolled in and cleared by
        # the last update) and the scales moved away from their initial 1. The output slot
        # quantizes nothing: its amax stays 0 and its scale 1.
        hist = extra["forward.amax_history"]
        assert (hist[1:, :2] > 0).all() and not hist[0].any() and not hist[:, 2].any()
        assert (extra["forward.scale"][:2] != 1).all() and extra["forward.scale"][2] == 1
        assert (extra["backward.amax_history"][1:, 0] > 0).all()
    # Snapshots, not views: changing the checkpoint does not change the model.
    before = model[1].get_extra_state()["forward.scale"].clone()
    sd["1._extra_state"]["forward.scale"].fill_(123.0)
    assert torch.equal(model[1].get_extra_state()["forward.scale"], before)


def test_state_dict_nested_custom_recipe_state():
    model = _trained(RULES)
    extra = model.state_dict()["1._extra_state"]
    # Forward: input and output slots routed to DelayedScaling (one child state, the first used),
    # the weight to current scaling (a stateless child); backward: both slots delayed.
    assert {k: tuple(v.shape) for k, v in extra.items()} == {
        "forward.children.0.amax_history": (3, 2),
        "forward.children.0.scale": (2,),
        "backward.children.0.amax_history": (3, 2),
        "backward.children.0.scale": (2,),
    }
    assert all(type(v) is torch.Tensor for v in extra.values())
    assert extra["forward.children.0.amax_history"][1:, 0].all()


def test_state_dict_before_any_recipe_run():
    sd = _model().state_dict()
    assert all(sd[f"{i}._extra_state"] == {} for i in range(6))


@pytest.mark.parametrize("rec_name", sorted(RECIPES))
def test_save_load_weights_only(rec_name):
    sd = _trained(RECIPES[rec_name]).state_dict()
    loaded = _roundtrip(sd)
    assert loaded.keys() == sd.keys()
    for k, v in sd.items():
        if isinstance(v, dict):
            assert loaded[k].keys() == v.keys()
            assert all(torch.equal(loaded[k][f], v[f]) for f in v), k
        else:
            assert torch.equal(loaded[k], v), k


# ---- restoring ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rec_name", sorted(RECIPES))
@pytest.mark.parametrize("order", ["load_then_build", "build_then_load", "load_then_forward"])
def test_load_restores_recipe_state_bit_for_bit(rec_name, order):
    rec = RECIPES[rec_name]
    trained = _trained(rec)
    sd = _roundtrip(trained.state_dict())
    fresh = _model(seed=123)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(9))
    if order == "build_then_load":
        for op in fresh:
            op.reset_recipe_state(rec)
    fresh.load_state_dict(sd, strict=True)
    if order == "load_then_build":
        # The state is built lazily; the loaded values wait for it and are applied when it is.
        # Until then the model saves them as loaded (re-saving a loaded model keeps them).
        _assert_states_equal(_extra_states(fresh), _extra_states(trained))
        for op in fresh:
            op.ensure_recipe_state(rec)
    if order != "load_then_forward":
        _assert_states_equal(_extra_states(fresh), _extra_states(trained))
    # The next step uses the restored scales: same output and gradients, same updated state.
    _assert_tensors_equal(_step(fresh, x, rec), _step(trained, x, rec))
    _assert_states_equal(_extra_states(fresh), _extra_states(trained))


def _assert_tensors_equal(a, b):
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(u, v), i


def test_load_into_model_with_another_state_overwrites_it():
    trained = _trained(DELAYED)
    other = _trained(DELAYED, steps=1)
    assert not torch.equal(other[1].get_extra_state()["forward.scale"],
                           trained[1].get_extra_state()["forward.scale"])  # fmt: skip
    other.load_state_dict(trained.state_dict())
    _assert_states_equal(_extra_states(other), _extra_states(trained))


def test_checkpoint_without_extra_state_loads_strict():
    trained = _trained(DELAYED)
    sd = {k: v for k, v in trained.state_dict().items() if not k.endswith("._extra_state")}
    fresh = _model(seed=5)
    result = fresh.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for p, q in zip(fresh.parameters(), trained.parameters(), strict=True):
        assert torch.equal(p, q)
    # No recipe state in the checkpoint: the state starts fresh (zeros / ones).
    for op in fresh:
        op.ensure_recipe_state(DELAYED)
    extra = fresh[1].get_extra_state()
    assert not extra["forward.amax_history"].any() and (extra["forward.scale"] == 1).all()
    # Loaded into a model with state, a checkpoint without any leaves that state as it is.
    before = _extra_states(trained)
    trained.load_state_dict(sd, strict=True)
    _assert_states_equal(_extra_states(trained), before)


def test_checkpoint_from_high_precision_model_loads():
    """A model never run under a recipe saves empty recipe states; they load anywhere."""
    sd = _roundtrip(_model().state_dict())
    trained = _trained(DELAYED)
    before = _extra_states(trained)
    trained.load_state_dict(sd, strict=True)
    _assert_states_equal(_extra_states(trained), before)


@pytest.mark.parametrize("kind", ["empty_uint8", "empty_float", "pickled", "bytesio"])
def test_transformer_engine_extra_state_is_ignored(kind):
    """A TransformerEngine checkpoint's ``_extra_state`` (TE 2.x: an empty uint8 tensor without
    FP8 state, else its pickled FP8 metadata as a uint8 tensor; TE 1.x: an ``io.BytesIO``) loads:
    the weights are taken, the recipe state starts afresh, and only a non-empty one warns (its
    format is not read). It used to raise "malformed recipe state"."""
    value = {
        "empty_uint8": torch.empty(0, dtype=torch.uint8),
        "empty_float": torch.empty(0),
        "pickled": torch.frombuffer(bytearray(b"\x80\x04N."), dtype=torch.uint8),
        "bytesio": io.BytesIO(b"\x80\x04N."),
    }[kind]
    src = _trained(DELAYED)
    sd = {k: (value if k.endswith("_extra_state") else v) for k, v in src.state_dict().items()}
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(sd, strict=True)
    te_warnings = [w for w in caught if "serialized FP8 state" in str(w.message)]
    assert bool(te_warnings) == (kind in ("pickled", "bytesio"))
    for (k, a), b in zip(model.state_dict().items(), src.state_dict().values(), strict=True):
        if not k.endswith("_extra_state"):
            assert torch.equal(a, b), k
    with fusible.autocast(recipe=DELAYED):  # the recipe state is built afresh and trains
        model(torch.randn(4, 32)).sum().backward()


def _bad(sd, value):
    sd = dict(sd)
    sd["1._extra_state"] = value
    return sd


MALFORMED = {
    "not_a_dict": ([1, 2], r"BasicLinear: malformed recipe state in checkpoint: expected a dict"),
    "bad_key": (
        {"amax_history": torch.zeros(4, 3)},
        r"BasicLinear: malformed recipe state key 'amax_history' in checkpoint; expected "
        r"'forward.<field>' or 'backward.<field>'",
    ),
    "not_a_tensor": (
        {"forward.scale": [1.0, 1.0, 1.0]},
        r"BasicLinear: malformed recipe state in checkpoint: 'forward.scale' must be a "
        r"torch.Tensor, got list",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("built", [False, True])
def test_malformed_extra_state_raises(case, built):
    value, match = MALFORMED[case]
    sd = _trained(DELAYED).state_dict()
    model = _trained(DELAYED, steps=1) if built else _model()
    before = _extra_states(model)
    with pytest.raises(ValueError, match=match):
        model.load_state_dict(_bad(sd, value))
    _assert_states_equal(_extra_states(model), before)


SHAPE_ERRORS = {
    "wrong_shape": (
        lambda e: {**e, "forward.scale": torch.ones(5)},
        r"load_recipe_state: 'scale' must be torch.float32 of shape \(3,\).*got torch.float32 "
        r"of shape \(5,\)",
    ),
    "wrong_dtype": (
        lambda e: {**e, "backward.scale": e["backward.scale"].double()},
        r"load_recipe_state: 'scale' must be torch.float32 of shape \(2,\).*got torch.float64",
    ),
    "partial": (
        lambda e: {k: v for k, v in e.items() if k != "forward.amax_history"},
        r"load_recipe_state: DelayedScalingRecipeState checkpoint is partial: has \['scale'\], "
        r"missing \['amax_history'\]",
    ),
    "history_length": (  # a checkpoint of DelayedScaling(amax_history_len=8)
        lambda e: {**e, "forward.amax_history": torch.zeros(8, 3)},
        r"'amax_history' must be torch.float32 of shape \(4, 3\)",
    ),
}


@pytest.mark.parametrize("case", sorted(SHAPE_ERRORS))
def test_state_mismatching_the_recipe_raises(case):
    """Shapes and dtypes depend on the recipe, so they are checked against the built state: at
    load time when it exists (the failing pass's state is not modified), else when it is built
    (first forward)."""
    edit, match = SHAPE_ERRORS[case]
    sd = _trained(DELAYED).state_dict()
    bad = _bad(sd, edit(sd["1._extra_state"]))
    built = _trained(DELAYED, steps=1)
    before = built[1].get_extra_state()
    with pytest.raises(ValueError, match=match):
        built.load_state_dict(bad)
    # Per pass: a forward state that loaded stays loaded when the backward one fails (as torch's
    # load_state_dict keeps the modules it loaded before an error).
    mode = "backward" if case == "wrong_dtype" else "forward"
    after = built[1].get_extra_state()
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith(mode))
    fresh = _model()
    fresh.load_state_dict(bad)
    with pytest.raises(ValueError, match=match):
        _step(fresh, torch.randn(8, 32), DELAYED)


# ---- .to() and the meta device ----------------------------------------------------------------


def test_to_dtype_keeps_recipe_state():
    model = _trained(DELAYED)
    before = _extra_states(model)
    assert model.to(torch.bfloat16) is model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # Scaling state is float32 by definition: .to(dtype) casts parameters, never the state.
    _assert_states_equal(_extra_states(model), before)
    assert model.to("cpu") is model
    out = _step(model, torch.randn(8, 32).to(torch.bfloat16), DELAYED)
    assert out[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in out[2:])
    assert not torch.equal(model[1].get_extra_state()["forward.amax_history"],
                           before[1]["forward.amax_history"])  # fmt: skip


@pytest.mark.cuda
def test_to_cuda_moves_recipe_state():
    """A model trained on the CPU under delayed scaling keeps training after .to("cuda"), and
    continues from the same state as its CPU twin."""
    model = _trained(DELAYED)
    twin = _trained(DELAYED)
    model.to("cuda")
    x = torch.randn(8, 32)
    got = _step(model, x.cuda(), DELAYED)
    ref = _step(twin, x, DELAYED)
    for g, r in zip(got, ref, strict=True):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), r, rtol=1e-2, atol=1e-3)
    for op in model:
        for v in op.get_extra_state().values():
            assert v.device.type == "cuda"


@pytest.mark.cuda
@pytest.mark.parametrize("rec_name", sorted(RECIPES))
def test_delayed_scaling_on_cuda(rec_name):
    """Recipe state lives where the model runs: built on CUDA for a CUDA model."""
    model = _model().cuda()
    for _ in range(2):
        out = _step(model, torch.randn(8, 32, device="cuda"), RECIPES[rec_name])
    assert all(t.device.type == "cuda" and torch.isfinite(t).all() for t in out)
    sd = _roundtrip(model.state_dict())
    fresh = _model(seed=3).cuda()
    fresh.load_state_dict(sd)
    for op in fresh:
        op.ensure_recipe_state(RECIPES[rec_name])
    _assert_states_equal(_extra_states(fresh), _extra_states(model))


def _reset_all(model):
    # As FSDP materialises: reset_parameters() on each module holding parameters of its own (a
    # container's reset_parameters() resets all its children; calling it and then the
    # children's again would draw the Linear weights twice).
    for m in model.modules():
        if hasattr(m, "reset_parameters") and any(True for _ in m.parameters(recurse=False)):
            m.reset_parameters()


META_CASES = {
    "linear": lambda device: ops.Linear(48, 40, device=device),
    "linear_nobias": lambda device: ops.Linear(48, 40, bias=False, device=device),
    "layernorm": lambda device: ops.LayerNorm(48, device=device),
    "layernorm_zc": lambda device: ops.LayerNorm(48, zero_centered_gamma=True, device=device),
    "rmsnorm": lambda device: ops.RMSNorm(48, device=device),
    "block": lambda device: ops.Sequential(
        ops.LayerNorm(48, device=device), ops.Linear(48, 40, device=device), ops.GELU()
    ),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_meta_device_then_to_empty_and_reset_parameters(case):
    make = META_CASES[case]
    torch.manual_seed(0)
    ref = make(None)
    torch.manual_seed(0)
    model = make("meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    _reset_all(model)
    # The same initial values as a model built on the CPU from the same seed.
    ref_params, params = dict(ref.named_parameters()), dict(model.named_parameters())
    assert ref_params.keys() == params.keys()
    for n in params:
        assert params[n].device.type == "cpu"
        assert torch.equal(params[n], ref_params[n]), n
    seq_ref, seq = ops.Sequential(ref), ops.Sequential(model)
    x = torch.randn(16, 48)
    _assert_tensors_equal(_step(seq, x, DELAYED), _step(seq_ref, x, DELAYED))


# ---- copies ----------------------------------------------------------------------------------


def _pickled(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_model_is_independent(how):
    """A copy (copy.deepcopy, or torch.save of the whole module) starts from the original's
    parameters and recipe state and then lives its own life: plans are cached per op, and a copy
    must never run its original's ops."""
    model = _trained(DELAYED)
    twin = copy.deepcopy(model) if how == "deepcopy" else _pickled(model)
    assert [op.uid for op in twin] != [op.uid for op in model]
    _assert_states_equal(_extra_states(twin), _extra_states(model))
    x = torch.randn(8, 32)
    _assert_tensors_equal(_step(twin, x, DELAYED), _step(model, x, DELAYED))
    with torch.no_grad():
        twin[1].weight.zero_()
    y_model, y_twin = _step(model, x, DELAYED)[0], _step(twin, x, DELAYED)[0]
    assert not torch.equal(y_model, y_twin)
    assert model[1].weight.abs().sum() > 0


@pytest.mark.parametrize("rec_name", ["none", "delayed", "current"])
def test_safetensors_round_trip_through_flatten_state_dict(rec_name, tmp_path):
    """``safetensors.torch.save_file(model.state_dict())`` refuses the recipe states (dicts,
    ``{}`` when stateless): ``fusible.flatten_state_dict`` spreads them into tensors and
    ``unflatten_state_dict`` restores them, so a strict load of the file gives the same
    ``state_dict`` bit for bit (an empty recipe state too)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    rec = {"none": None, "delayed": DELAYED, "current": recipe.Float8CurrentScaling()}[rec_name]
    model = _trained(rec) if rec is not None else _model()
    with pytest.raises((ValueError, AttributeError, TypeError)):
        safetensors_torch.save_file(model.state_dict(), str(tmp_path / "plain.safetensors"))
    path = str(tmp_path / "m.safetensors")
    safetensors_torch.save_file(fusible.flatten_state_dict(model.state_dict()), path)
    fresh = _model(seed=1)
    fresh.load_state_dict(fusible.unflatten_state_dict(safetensors_torch.load_file(path)))
    got, want = fresh.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, dict):
            assert got[k].keys() == v.keys(), k
            for f in v:
                assert torch.equal(got[k][f], v[f]), (k, f)
        else:
            assert torch.equal(got[k], v), k
    with pytest.raises(TypeError, match=r"flatten_state_dict: 'x' is a list"):
        fusible.flatten_state_dict({"x": [1]})
