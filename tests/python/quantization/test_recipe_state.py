"""RecipeState: construction, roles, CustomRecipe factories and rules, delayed scaling against a
plain-torch reference, batched updates, checkpoints."""

from __future__ import annotations

import pytest
import torch
from _quant_reference import FP8_MAX, cast_fp8, delayed_update

from fusible.quantization import (
    CustomRecipeState,
    DelayedScalingRecipeState,
    Float8CurrentScalingQuantizer,
    Float8CurrentScalingRecipeState,
    Float8Quantizer,
    MXFP8BlockScalingRecipeState,
    MXFP8Quantizer,
    QuantizerRole,
    RecipeState,
    backward_roles,
    forward_roles,
    load_recipe_state,
    recipe_state_to_dict,
    update_delayed_scaling,
)
from fusible.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
)

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---- construction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rec", "cls", "qcls", "dtypes"),
    [
        (DelayedScaling(), DelayedScalingRecipeState, Float8Quantizer, (E4, E5)),
        (Float8CurrentScaling(), Float8CurrentScalingRecipeState, Float8CurrentScalingQuantizer,
         (E4, E5)),
        (Float8CurrentScaling(fp8_format=Format.E4M3), Float8CurrentScalingRecipeState,
         Float8CurrentScalingQuantizer, (E4, E4)),
        (MXFP8BlockScaling(), MXFP8BlockScalingRecipeState, MXFP8Quantizer, (E4, E4)),
        (MXFP8BlockScaling(fp8_format=Format.HYBRID), MXFP8BlockScalingRecipeState,
         MXFP8Quantizer, (E4, E5)),
    ],
)  # fmt: skip
def test_create_one_subclass_per_recipe(rec, cls, qcls, dtypes):
    fwd = RecipeState.create(rec, mode="forward", num_quantizers=3, roles=forward_roles())
    bwd = RecipeState.create(rec, mode="backward", num_quantizers=2, roles=backward_roles())
    assert type(fwd) is cls and type(bwd) is cls
    assert [type(q) for q in fwd.quantizers] == [qcls] * 3
    assert {q.dtype for q in fwd.quantizers} == {dtypes[0]}
    assert {q.dtype for q in bwd.quantizers} == {dtypes[1]}
    assert fwd.roles == tuple(forward_roles()) and fwd.quantizers[1].role == forward_roles()[1]
    assert RecipeState.create(rec, "forward", 2).roles is None  # roles optional here


def test_delayed_state_buffers():
    s = RecipeState.create(DelayedScaling(amax_history_len=16), "forward", 3)
    assert isinstance(s, DelayedScalingRecipeState)
    assert s.amax_history.shape == (16, 3) and s.amax_history.dtype == torch.float32
    assert torch.equal(s.amax_history, torch.zeros(16, 3))
    assert torch.equal(s.scale, torch.ones(3)) and s.scale.dtype == torch.float32
    assert [q.slot for q in s.quantizers] == [0, 1, 2]
    assert s.delayed_states() == [s]
    empty = RecipeState.create(DelayedScaling(), "forward", 0)
    empty.update()  # nothing to do


def test_create_errors():
    with pytest.raises(ValueError, match="got 2 roles for num_quantizers=3"):
        RecipeState.create(DelayedScaling(), "forward", 3, roles=["input:linear", "weight:linear"])
    with pytest.raises(ValueError, match="got 3 roles for num_quantizers=2"):
        RecipeState.create(CustomRecipe(qfactory=lambda r: None), "backward", 2, forward_roles())
    with pytest.raises(
        ValueError, match=r"CustomRecipe needs roles .*roles=None for num_quantizers=3"
    ):
        RecipeState.create(CustomRecipe(qfactory=lambda r: None), "forward", 3)
    with pytest.raises(ValueError, match=r"roles\[1\]: .*got 'weight'"):
        RecipeState.create(DelayedScaling(), "forward", 2, roles=["input:linear", "weight"])
    with pytest.raises(ValueError, match="'mode' must be 'forward' or 'backward', got 'fwd'"):
        RecipeState.create(DelayedScaling(), "fwd", 1)
    with pytest.raises(ValueError, match="'num_quantizers' must be an int >= 0"):
        RecipeState.create(DelayedScaling(), "forward", -1)
    with pytest.raises(TypeError, match=r"'recipe' must be a fusible.recipe.Recipe"):
        RecipeState.create("delayed", "forward", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="returned str for role 'weight:linear:fc1'"):
        RecipeState.create(
            CustomRecipe(qfactory=lambda r: "fp8" if r.bucket == "weight" else None),
            "forward", 3, forward_roles("linear", "fc1"),
        )  # fmt: skip


# ---- CustomRecipe -------------------------------------------------------------------------------


def test_custom_factory_called_once_per_slot_with_roles():
    calls: list[QuantizerRole] = []

    def factory(role: QuantizerRole):
        calls.append(role)
        if role.bucket == "output":
            return None  # high precision
        return Float8CurrentScalingQuantizer(E5 if role.is_gradient else E4)

    rec = CustomRecipe(qfactory=factory)
    fwd = RecipeState.create(rec, "forward", 3, forward_roles("layernorm_mlp", "fc1"))
    assert calls == forward_roles("layernorm_mlp", "fc1")
    assert isinstance(fwd, CustomRecipeState)
    assert fwd.quantizers[2] is None and fwd.quantizers[0] is not fwd.quantizers[1]
    calls.clear()
    RecipeState.create(rec, "backward", 2, ["grad_output:linear", "grad_input:linear"])
    assert calls == backward_roles()
    assert all(isinstance(r, QuantizerRole) for r in calls)


def test_custom_recipe_mirroring_current_scaling_is_bit_identical():
    mirror = CustomRecipe(
        qfactory=lambda role: Float8CurrentScalingQuantizer(
            E5 if role.is_gradient else E4, margin=1
        )
    )
    ref = Float8CurrentScaling(margin=1)
    g = torch.Generator().manual_seed(0)
    for mode, roles in (("forward", forward_roles()), ("backward", backward_roles())):
        a = RecipeState.create(mirror, mode, len(roles), roles)
        b = RecipeState.create(ref, mode, len(roles), roles)
        for qa, qb in zip(a.quantizers, b.quantizers, strict=True):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(33, 65, generator=g) * 100).to(dtype)
                da, db = qa.quantize(x), qb.quantize(x)
                assert torch.equal(da.data.view(torch.uint8), db.data.view(torch.uint8))
                assert torch.equal(da.data_t.view(torch.uint8), db.data_t.view(torch.uint8))
                assert torch.equal(da.scale_inv, db.scale_inv) and da.fp8_dtype == db.fp8_dtype


def test_rule_recipe_routes_each_role():
    made: list[str] = []

    def e5m2_current(role):
        made.append(role.qualified)
        return Float8CurrentScalingQuantizer(E5)

    rec = CustomRecipe.from_rules(
        {
            "weight:*": MXFP8BlockScaling(),
            "grad_*:*": e5m2_current,
            "*:*:fc2": None,
            "*": DelayedScaling(amax_history_len=8),
        }
    )
    fc1 = RecipeState.create(rec, "forward", 3, forward_roles("layernorm_mlp", "fc1"))
    fc2 = RecipeState.create(rec, "forward", 3, forward_roles("layernorm_mlp", "fc2"))
    bwd = RecipeState.create(rec, "backward", 2, backward_roles("layernorm_mlp", "fc2"))
    assert isinstance(fc1, CustomRecipeState)
    assert [type(q).__name__ for q in fc1.quantizers] == [
        "Float8Quantizer", "MXFP8Quantizer", "Float8Quantizer",
    ]  # fmt: skip
    assert fc1.routes == ["*", "weight:*", "*"]
    assert fc2.quantizers[0] is None and fc2.quantizers[2] is None  # fc2 in high precision...
    assert isinstance(fc2.quantizers[1], MXFP8Quantizer)  # ...except its weight (rule order)
    assert [type(q) for q in bwd.quantizers] == [Float8CurrentScalingQuantizer] * 2
    assert made == ["grad_output:layernorm_mlp:fc2", "grad_input:layernorm_mlp:fc2"]
    # the DelayedScaling slots share one child state with its own history, updated with the parent
    (child,) = fc1.delayed_states()
    assert child.amax_history.shape == (8, 2) and child.roles == (
        QuantizerRole("input", "layernorm_mlp", "fc1"),
        QuantizerRole("output", "layernorm_mlp", "fc1"),
    )
    fc1.quantizers[2].quantize(torch.full((2, 3), 7.0))
    assert child.amax_history[0].tolist() == [0.0, 7.0]
    fc1.update()
    assert child.scale.tolist() == [1.0, 64.0] and child.amax_history[-1].tolist() == [0.0, 7.0]
    with pytest.raises(ValueError, match="no rule matches role 'input:linear'"):
        RecipeState.create(
            CustomRecipe.from_rules({"weight:*": None}), "forward", 3, forward_roles()
        )


# ---- delayed scaling over many steps against the plain-torch reference --------------------------


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("history_len", [1, 5, 1024])
@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_delayed_scaling_20_steps_matches_reference(algo, margin, history_len, mode):
    rec = DelayedScaling(margin=margin, amax_history_len=history_len, amax_compute_algo=algo)
    n = 3
    state = RecipeState.create(rec, mode, n)
    fp8_dtype = Format.HYBRID.dtype(mode)
    hist, scale = torch.zeros(history_len, n), torch.ones(n)
    g = torch.Generator().manual_seed(history_len * 10 + margin + (algo == "max"))
    for step in range(20):
        for slot, q in enumerate(state.quantizers):
            uses = 2 if slot == 0 else 1  # slot 0 is used twice per step: running max
            for _ in range(uses):
                mag = float(torch.exp2(torch.randint(-12, 12, (1,), generator=g)))
                x = torch.randn(5, 17, generator=g) * mag
                if step == 3 and slot == 1:
                    x.zero_()  # amax 0: the scale must stay unchanged
                if step == 7 and slot == 2:
                    x[0, 0] = float("inf")  # non-finite amax: the scale must stay unchanged
                out = q.quantize(x)
                ref = cast_fp8(x, scale[slot], fp8_dtype)
                assert torch.equal(out.data.view(torch.uint8), ref.view(torch.uint8))
                assert bits_equal(out.scale_inv, (1.0 / scale[slot]).reshape(1))
                hist[0, slot] = torch.maximum(hist[0, slot], x.abs().max())
        assert bits_equal(state.amax_history, hist)
        state.update()
        hist, scale = delayed_update(hist, scale, FP8_MAX[fp8_dtype], algo, margin)
        assert bits_equal(state.amax_history, hist), f"history differs after step {step}"
        assert bits_equal(state.scale, scale), f"scale differs after step {step}"
    assert not torch.equal(scale, torch.ones(n))


def test_update_batches_many_states_into_one_launch(monkeypatch):
    from fusible import _kernels

    launches = []
    real = _kernels.delayed_scaling_update

    def spy(histories, scales, maxes, algo, margin):
        launches.append((len(histories), algo, margin))
        return real(histories, scales, maxes, algo, margin)

    monkeypatch.setattr(_kernels, "delayed_scaling_update", spy)
    a = RecipeState.create(DelayedScaling(), "forward", 3)
    b = RecipeState.create(DelayedScaling(), "backward", 2)
    c = RecipeState.create(DelayedScaling(margin=1), "forward", 1)
    stateless = RecipeState.create(Float8CurrentScaling(), "forward", 3)
    for s in (a, b, c):
        for q in s.quantizers:
            q.quantize(torch.full((2, 2), 3.0))
    update_delayed_scaling([a, b, c, stateless, a])
    assert sorted(launches) == [(1, "max", 1), (2, "max", 0)]  # a, b batched; a once
    f32 = torch.float32
    assert torch.equal(a.scale, torch.full((3,), 448.0, dtype=f32) / torch.tensor(3.0))
    assert torch.equal(b.scale, torch.full((2,), 57344.0, dtype=f32) / torch.tensor(3.0))
    assert torch.equal(c.scale, torch.full((1,), 448.0, dtype=f32) / torch.tensor(3.0) / 2)
    with pytest.raises(TypeError, match="expected RecipeState objects, got int"):
        update_delayed_scaling([1])  # type: ignore[list-item]


def test_update_with_group_requires_distributed():
    s = RecipeState.create(DelayedScaling(), "forward", 1)
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized"):
        s.update(reduce_group=object())
    s2 = RecipeState.create(DelayedScaling(reduce_amax=False), "forward", 1)
    s2.update(reduce_group=object())  # reduce_amax=False: nothing to reduce


# ---- checkpoints --------------------------------------------------------------------------------


def _stepped_state(rec=None, mode="forward", n=3, steps=3, roles=None):
    s = RecipeState.create(rec or DelayedScaling(amax_history_len=4), mode, n, roles)
    for i in range(steps):
        for j, q in enumerate(s.quantizers):
            if q is not None:
                q.quantize(torch.randn(4, 4) * (i + j + 1))
        s.update()
    return s


def test_checkpoint_round_trip_bit_for_bit():
    s = _stepped_state()
    sd = recipe_state_to_dict(s)
    assert set(sd) == {"amax_history", "scale"}
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert sd["scale"].data_ptr() != s.scale.data_ptr()  # a snapshot, not an alias
    fresh = RecipeState.create(DelayedScaling(amax_history_len=4), "forward", 3)
    quantizer = fresh.quantizers[0]
    assert load_recipe_state(fresh, sd) == []
    assert bits_equal(fresh.amax_history, s.amax_history) and bits_equal(fresh.scale, s.scale)
    x = torch.randn(3, 5)
    assert torch.equal(quantizer.quantize(x).dequantize(), s.quantizers[0].quantize(x).dequantize())
    # through torch.save with weights_only=True (plain tensors only)
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    again = RecipeState.create(DelayedScaling(amax_history_len=4), "forward", 3)
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert bits_equal(again.scale, s.scale)


def test_checkpoint_of_rule_recipe_children():
    rec = CustomRecipe.from_rules({"weight:*": MXFP8BlockScaling(), "*": DelayedScaling()})
    s = _stepped_state(rec, roles=forward_roles())
    sd = recipe_state_to_dict(s)
    assert set(sd) == {"children.0.amax_history", "children.0.scale"}
    fresh = RecipeState.create(rec, "forward", 3, forward_roles())
    load_recipe_state(fresh, sd)
    assert bits_equal(fresh.delayed_states()[0].scale, s.delayed_states()[0].scale)


def test_checkpoint_tolerance():
    s = _stepped_state()
    before = recipe_state_to_dict(s)
    assert load_recipe_state(s, None) == [] and load_recipe_state(s, {}) == []  # no state saved
    assert bits_equal(s.scale, before["scale"])
    assert load_recipe_state(None, before) == ["amax_history", "scale"]  # model without recipe
    assert recipe_state_to_dict(None) == {}
    cs = RecipeState.create(Float8CurrentScaling(), "forward", 3)
    assert recipe_state_to_dict(cs) == {}
    assert load_recipe_state(cs, before) == ["amax_history", "scale"]  # recipe changed: ignored


_H, _S = torch.zeros(4, 3), torch.ones(3)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"amax_history": _H}, r"partial: has \['amax_history'\], missing \['scale'\]"),
        ({"amax_history": _H, "scale": [1.0, 1.0, 1.0]}, r"'scale' must be a torch.Tensor"),
        (
            {"amax_history": torch.zeros(8, 3), "scale": _S},
            r"'amax_history' must be torch.float32 of shape \(4, 3\).*"
            r"got torch.float32 of shape \(8, 3\)",
        ),
        (
            {"amax_history": _H, "scale": _S.double()},
            r"'scale' must be torch.float32 of shape \(3,\)",
        ),
        ("not a dict", "expected a mapping"),
    ],
)
def test_malformed_checkpoint_raises_and_leaves_state(bad, match):
    s = _stepped_state()
    before = recipe_state_to_dict(s)
    with pytest.raises(ValueError, match=match):
        load_recipe_state(s, bad)
    assert bits_equal(s.amax_history, before["amax_history"]) and bits_equal(
        s.scale, before["scale"]
    )


def test_state_to_device_keeps_quantizers_attached():
    s = _stepped_state()
    q = s.quantizers[1]
    s.to("cpu")
    s.scale.fill_(8.0)
    assert float(q.quantize(torch.ones(2, 2)).scale_inv) == 0.125
    assert "DelayedScalingRecipeState" in repr(s)


def test_repeated_updates_follow_moved_and_loaded_states():
    """update_delayed_scaling replays its prepared batches only while every state holds the
    tensors they were prepared for: the replay equals a fresh update bit for bit, and moving a
    state or dropping it is seen."""
    import gc
    import weakref

    from fusible.quantization import state as state_mod

    rec = DelayedScaling(amax_history_len=3)
    a, b = (RecipeState.create(rec, mode="forward", num_quantizers=n) for n in (2, 1))
    a2, b2 = (RecipeState.create(rec, mode="forward", num_quantizers=n) for n in (2, 1))

    def fresh_update(states):
        saved = dict(state_mod._PREPARED)
        state_mod._PREPARED.clear()
        update_delayed_scaling(states)
        state_mod._PREPARED.clear()
        state_mod._PREPARED.update(saved)

    for step in range(4):  # from the second call on, [a, b] replays its prepared batch
        if step == 3:
            a.amax_history = a.amax_history.clone()  # new tensors: prepared afresh
        for s, v in ((a, 2.0), (b, 4.0), (a2, 2.0), (b2, 4.0)):
            s.amax_history[0].fill_(v * (step + 1))
        update_delayed_scaling([a, b])
        fresh_update([a2, b2])
        for got, want in ((a, a2), (b, b2)):
            assert torch.equal(got.amax_history, want.amax_history), step
            assert torch.equal(got.scale, want.scale), step
    ref = weakref.ref(b)
    del b, got, want
    gc.collect()
    assert ref() is None  # the prepared entries hold states weakly
    assert len(state_mod._PREPARED) <= state_mod._MAX_PREPARED


@pytest.mark.parametrize("capability, warns", [((9, 0), True), ((8, 9), True), ((10, 0), False)])
def test_mxfp8_warns_once_where_gemms_are_dequantized(capability, warns, monkeypatch):
    """MXFP8 on a CUDA GPU below compute capability 10.0 (no MXFP8 tensor cores) says that its
    GEMMs run on dequantized operands; on CPU and on Blackwell it is silent. The state holds no
    tensors, so a CUDA device needs no GPU here (the capability is the test's)."""
    import warnings

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        RecipeState.create(MXFP8BlockScaling(), num_quantizers=2, device="cuda")
        RecipeState.create(MXFP8BlockScaling(), num_quantizers=2, device="cpu")
    msgs = [str(w.message) for w in got if "MXFP8BlockScaling" in str(w.message)]
    assert len(msgs) == int(warns), msgs
    if warns:
        assert f"{capability[0]}.{capability[1]} < 10.0" in msgs[0]
        assert "Float8BlockScaling" in msgs[0]
