"""FP8 weights of ``ops.GroupedLinear`` / ``fusible.GroupedLinear`` (``quantized_model_init``):
each expert's weight stored with the quantizer of its own weight role; one training step of an
expert MLP against the same model built with its high-precision weights (bit for bit on CPU, the
grouped kernels and the per-expert loop, fused and unfused), with no weight cast; a per-tensor
weight under delayed scaling; the dequantized fallbacks; the master-weight optimizer;
checkpoints, conversions and ``meta``; ``explain()``; compile's clear error. The reasoning on
what re-quantizing a dequantized weight gives is in ``test_quantized_weights.py``."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from ops_helpers import QUANTIZE_OPS, assert_same_results, rel_err, save_load, weight_init_recipes

import fusible
from fusible import _kernels as K
from fusible import ops, recipe
from fusible.ops.basic import GroupedLinear
from fusible.ops.basic import grouped_linear as GL
from fusible.ops.basic.quantized_weight import compile_quantized_supported
from fusible.optim import MasterWeightOptimizer
from fusible.quantization import (
    Float8BlockTensor,
    Float8Tensor,
    MXFP8Tensor,
    QuantizedTensor,
)
from fusible.quantization import quantizers as Q
from fusible.quantization.model_init import weight_init_quantizer

E, H, F = 3, 64, 96  # weights [96, 64] / [64, 96]; no input slice has those shapes (SPLITS)
SPLITS = (32, 0, 128)  # an empty expert; multiples of 32 (MXFP8) and 16 (blockwise)
ODD_SPLITS = (7, 0, 1, 31)  # per-tensor recipes take any split (4 experts)
BF16 = torch.bfloat16

# "custom": expert 1's weight MXFP8, the others per-tensor (routing by role); "custom_hp":
# expert 1's weight stays high precision.
QRECIPES = weight_init_recipes("*gemm1")
EXPECTED = {
    "current": (Float8Tensor, Float8Tensor, Float8Tensor),
    "mxfp8": (MXFP8Tensor, MXFP8Tensor, MXFP8Tensor),
    "blockwise": (Float8BlockTensor, Float8BlockTensor, Float8BlockTensor),
    "custom": (Float8Tensor, MXFP8Tensor, Float8Tensor),
    "custom_hp": (Float8Tensor, None, Float8Tensor),
}


def _mlp(rec=None, *, dtype=BF16, device="cpu", experts=E, seed=0, keep_transpose=False):
    """An expert MLP, GroupedLinear -> GELU(tanh) -> GroupedLinear, built inside
    ``quantized_model_init(rec)`` (plain for None); the same seed gives the same initial
    high-precision values either way (quantizing draws nothing)."""
    torch.manual_seed(seed)
    kw = {"dtype": dtype, "device": device}
    region = fusible.quantized_model_init(rec, enabled=rec is not None,
                                          keep_transpose=keep_transpose)  # fmt: skip
    with region:
        fc1 = ops.GroupedLinear(experts, H, F, name="fc1", **kw)
        fc2 = ops.GroupedLinear(experts, F, H, name="fc2", **kw)
    with torch.no_grad():
        for b in (*fc1.biases(), *fc2.biases()):
            b.normal_()
    return ops.Sequential(fc1, ops.GELU("tanh"), fc2)


def _grouped_ops(model):
    return [m for m in model.modules() if isinstance(m, GroupedLinear)]


def _all_weights(model):
    return [w for op in _grouped_ops(model) for w in op.weights()]


def _data(splits, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(splits), H, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(sum(splits), H, generator=g).to(device=device, dtype=dtype)
    return x, dy


def _step(model, x, dy, splits, rec, **kw):
    """Forward under ``autocast(rec)`` (off for None) and backward with ``dy``: the output, the
    input gradient and every parameter gradient, by name."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = model(x, m_splits=list(splits), **kw)
    y.backward(dy)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return {"y": y.detach(), "dx": x.grad, **grads}


def _same_bits(a, b):
    """Whether two quantized containers hold the same tensors, bit for bit."""
    ta, tb = Q.qdata_tensors(a), Q.qdata_tensors(b)
    if ta.keys() != tb.keys():
        return False
    for k in ta:
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.element_size() == 1:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        if not torch.equal(x, y):
            return False
    return True


def _set_grouped(model, on):
    for op in _grouped_ops(model):
        op._grouped = on


class _Recorder:
    """Stands in for a module of quantize operators (``torch.ops.fusible`` in quantizers.py,
    ``fusible._kernels`` in grouped_linear.py) and records the shape of every tensor a quantize
    call casts (a grouped cast's listed tensors, less those its ``m_splits`` skip)."""

    def __init__(self, real, shapes):
        self._real, self._shapes = real, shapes

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name not in QUANTIZE_OPS:
            return fn

        def recorded(x, *args, **kwargs):
            ts = x if isinstance(x, list) else [x]
            if isinstance(x, list) and len(x) > 1 and args and len(args[0]) == len(x):
                ts = [t for t, m in zip(x, args[0], strict=True) if m]  # m_splits 0: skipped
            self._shapes.extend(tuple(t.shape) for t in ts)
            return fn(x, *args, **kwargs)

        return recorded


class _WeightCasts:
    """Quantize calls on a weight: a cast of a tensor of a weight's shape ([F, H] or [H, F]; no
    activation or gradient slice of these tests has one), whether of the parameter or of a
    stored weight's dequantization."""

    def __init__(self, monkeypatch):
        self.shapes: list[tuple[int, ...]] = []
        monkeypatch.setattr(Q, "_ops", _Recorder(Q._ops, self.shapes))
        monkeypatch.setattr(GL, "K", _Recorder(K, self.shapes))

    def take(self) -> int:
        """How many weights were cast since the last call."""
        n = sum(s in ((F, H), (H, F)) for s in self.shapes)
        self.shapes.clear()
        return n


@pytest.fixture
def weight_casts(monkeypatch):
    return _WeightCasts(monkeypatch)


# ---- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", sorted(QRECIPES))
def test_each_expert_weight_is_stored_with_its_roles_quantizer(recipe_name, dtype, devices):
    rec = QRECIPES[recipe_name]
    model, plain = _mlp(rec, dtype=dtype, device=devices), _mlp(None, dtype=dtype, device=devices)
    for op, ref in zip(_grouped_ops(model), _grouped_ops(plain), strict=True):
        roles = op.weight_roles()
        assert list(roles) == [f"weight{i}" for i in range(E)]
        for i, (name, role) in enumerate(roles.items()):
            assert role.qualified == f"weight:grouped_linear:{op.quantizer_name}_gemm{i}"
            w, hp = op._parameters[name], ref._parameters[name]
            want = EXPECTED[recipe_name][i]
            if want is None:
                assert type(w) is torch.nn.Parameter and torch.equal(w, hp)
                continue
            assert type(w) is want and w.dtype == dtype and w.shape == hp.shape
            assert w.requires_grad
            q = weight_init_quantizer(rec, role, devices)
            both = not isinstance(w, Float8Tensor)  # MXFP8 and blockwise keep both copies
            again = q.quantize(hp.detach(), rowwise=True, columnwise=both)
            assert _same_bits(w.qdata, again), (name, recipe_name)
        # A stored weight is its own workspace: only high-precision ones are cached.
        hp_experts = [i for i, t in enumerate(EXPECTED[recipe_name]) if t is None]
        op.ensure_recipe_state(rec)
        assert [i for i, _, _ in op.workspace_specs()] == [
            i for i in hp_experts if op.gemm_quantizers(True, "weight")[i] is not None
        ]


def test_module_builds_quantized_weights_and_keeps_te_names():
    with fusible.quantized_model_init(QRECIPES["current"]):
        m = fusible.GroupedLinear(2, 32, 48, dtype=BF16)
    assert type(m.weight0) is Float8Tensor and type(m.weight1) is Float8Tensor
    assert type(m.bias0) is torch.nn.Parameter  # biases stay high precision
    sd = m.state_dict()
    assert {"weight0", "weight1", "bias0", "bias1", "_extra_state"} <= sd.keys()
    assert type(sd["weight0"]) is torch.Tensor and sd["weight0"].dtype == BF16
    assert torch.equal(sd["weight0"], m.weight0.dequantize())
    extra = sd["_extra_state"]
    assert torch.equal(extra["weight1.data"].view(torch.uint8),
                       m.weight1.qdata.data.view(torch.uint8))  # fmt: skip


# ---- one training step ---------------------------------------------------------------------------


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", sorted(QRECIPES))
def test_step_equals_original_weights_reference(recipe_name, dtype, fused, grouped, devices,
                                                weight_casts):  # fmt: skip
    """Against the expert MLP built with its high-precision weights: the recipe quantizes them
    exactly as they were stored, so every result agrees bit for bit, and the stored model casts
    no weight (forward or backward: a per-tensor weight's dgrad copy is a byte transpose)."""
    rec = QRECIPES[recipe_name]
    model, ref = _mlp(rec, dtype=dtype, device=devices), _mlp(None, dtype=dtype, device=devices)
    _set_grouped(model, grouped)
    _set_grouped(ref, grouped)
    x, dy = _data(SPLITS, devices, dtype)
    with nullcontext() if fused else ops.fusion_disabled():
        weight_casts.take()
        want = _step(ref, x, dy, SPLITS, rec)
        # The reference casts the weights of the experts with tokens (0 and 2 of each layer),
        # which all have a weight quantizer; the stored model casts none.
        assert weight_casts.take() == 4
        got = _step(model, x, dy, SPLITS, rec)
        assert weight_casts.take() == 0
    assert_same_results(got, want, devices, f"{recipe_name} fused={fused} grouped={grouped}")
    for w in _all_weights(model):
        assert type(w.grad) is torch.Tensor and w.grad.dtype == dtype and w.grad.shape == w.shape
        if isinstance(w, Float8Tensor):
            assert w.qdata.data_t is None  # the transposed copy was not kept


@pytest.mark.parametrize("splits", [ODD_SPLITS, (0, 0, 0, 0), (5, 0, 0, 0)])
def test_odd_splits_current_scaling(splits, devices):
    rec = QRECIPES["current"]
    model = _mlp(rec, device=devices, experts=4)
    ref = _mlp(None, device=devices, experts=4)
    x, dy = _data(splits, devices, BF16)
    assert_same_results(_step(model, x, dy, splits, rec), _step(ref, x, dy, splits, rec), devices)


def test_grouped_path_serves_stored_per_tensor_weights(monkeypatch):
    """Under current and delayed scaling with stored per-tensor weights every pass runs the
    grouped operators (no per-expert GEMM)."""
    model = _mlp(QRECIPES["current"])
    gemms = []
    for name in ("gemm_fprop", "gemm_dgrad", "gemm_wgrad"):
        real = getattr(GL.C, name)

        def counted(*a, _f=real, _n=name, **k):
            gemms.append(_n)
            return _f(*a, **k)

        monkeypatch.setattr(GL.C, name, counted)
    x, dy = _data(SPLITS, "cpu", BF16)
    for rec in (QRECIPES["current"], recipe.DelayedScaling()):
        _step(model, x, dy, SPLITS, rec)
    assert gemms == []


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_per_tensor_weights_under_delayed_scaling_are_used_as_is(dtype, devices, weight_casts):
    """Any per-tensor quantizer takes a stored per-tensor weight (the grouped path with fc1's
    GELU epilogue runs it). Reference: high-precision weights with the weight roles
    current-scaled (re-making the stored bits) and everything else delayed-scaled, which mixed
    quantizers send through the per-expert loop and the GELU kernel; two steps (the second with
    updated delayed scales). In bf16 the epilogue rounds differently from the GELU kernel (see
    test_grouped_linear.py), so bf16 runs unfused."""
    model = _mlp(QRECIPES["current"], device=devices, dtype=dtype)
    ref = _mlp(None, device=devices, dtype=dtype)
    delayed = recipe.DelayedScaling(amax_history_len=4)
    rules = recipe.CustomRecipe.from_rules(
        {"weight:*": recipe.Float8CurrentScaling(), "*": delayed}
    )
    with ops.fusion_disabled() if dtype == BF16 else nullcontext():
        for seed in (1, 2):
            x, dy = _data(SPLITS, devices, dtype, seed)
            want = _step(ref, x, dy, SPLITS, rules)
            weight_casts.take()
            got = _step(model, x, dy, SPLITS, delayed)
            assert weight_casts.take() == 0
            if dtype != BF16:
                # The fused backward sums fc1's bias gradient in the activation kernel's order
                # (test_grouped_linear.py): within fp32 rounding of the unfused sum.
                for i in range(E):
                    assert rel_err(got.pop(f"0.bias{i}"), want.pop(f"0.bias{i}")) < 1e-6
            assert_same_results(got, want, devices, f"delayed step {seed}")


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stored,active", [("current", None), ("mxfp8", None),
                                           ("current", "mxfp8"), ("mxfp8", "current"),
                                           ("blockwise", "current")])  # fmt: skip
def test_another_format_or_no_autocast_uses_the_dequantized_weights(stored, active, dtype,
                                                                    devices):  # fmt: skip
    """Against high-precision weights set to the stored weights' exact dequantization."""
    model = _mlp(QRECIPES[stored], dtype=dtype, device=devices)
    ref = _mlp(None, dtype=dtype, device=devices)
    with torch.no_grad():
        for r, w in zip(_all_weights(ref), _all_weights(model), strict=True):
            r.copy_(w.dequantize())
    x, dy = _data(SPLITS, devices, dtype)
    rec = None if active is None else QRECIPES[active]
    assert_same_results(_step(model, x, dy, SPLITS, rec), _step(ref, x, dy, SPLITS, rec), devices)


def test_is_first_microbatch_is_ignored_and_frozen_experts(weight_casts):
    rec = QRECIPES["current"]
    model = _mlp(rec)
    x, dy = _data(SPLITS, "cpu", BF16)
    want = _step(model, x, dy, SPLITS, rec)
    weight_casts.take()
    for fm in (True, False, None):
        got = _step(model, x, dy, SPLITS, rec, is_first_microbatch=fm)
        assert_same_results(got, want, "cpu", f"is_first_microbatch={fm}")
        assert weight_casts.take() == 0
        for op in _grouped_ops(model):
            assert all(c.workspace is None for c in op.workspace_caches)
    for w in _all_weights(model):
        w.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    xg = x.detach().requires_grad_(True)
    with fusible.autocast(recipe=rec):
        model(xg, m_splits=list(SPLITS)).backward(dy)
    assert torch.equal(xg.grad, want["dx"])
    assert all(w.grad is None for w in _all_weights(model))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_keep_transpose_stores_both_copies_and_transposes_nothing(recipe_name, grouped, devices,
                                                                  monkeypatch):  # fmt: skip
    """``quantized_model_init(..., keep_transpose=True)``: each per-tensor weight stores its
    transposed copy too (the cast's, bit for bit), backward reads it (no byte transpose), the
    step equals the high-precision reference bit for bit, and the master-weight optimizer keeps
    both copies the quantization of the master."""
    init = QRECIPES["current"]
    rec = init if recipe_name == "current" else recipe.CustomRecipe.from_rules(
        {"weight:*": init, "*": recipe.DelayedScaling()}
    )  # fmt: skip
    model = _mlp(init, device=devices, keep_transpose=True)
    ref = _mlp(None, device=devices)
    _set_grouped(model, grouped)
    _set_grouped(ref, grouped)
    for w, hp in zip(_all_weights(model), _all_weights(ref), strict=True):
        assert w.qdata.data is not None and w.qdata.data_t is not None
        assert _same_bits(w.qdata, w.quantizer.quantize(hp.detach(), columnwise=True))
    transposes = []
    real = GL.C._byte_transpose
    monkeypatch.setattr(GL.C, "_byte_transpose", lambda m: transposes.append(m.shape) or real(m))
    x, dy = _data(SPLITS, devices, BF16)
    with ops.fusion_disabled():
        assert_same_results(_step(model, x, dy, SPLITS, rec), _step(ref, x, dy, SPLITS, rec),
                            devices)  # fmt: skip
    assert [s for s in transposes if s in ((F, H), (H, F))] == []
    opt = MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=0.05)
    _step(model, x, dy, SPLITS, rec)
    opt.step()
    for w, m in opt.master_weights:
        assert _same_bits(w.qdata, w.quantizer.quantize(m, rowwise=True, columnwise=True))
    with fusible.quantized_model_init(init, keep_transpose=True):
        dense = ops.Linear(H, F)
    assert dense.weight.qdata.data_t is not None
    with pytest.raises(TypeError, match="'keep_transpose' must be a bool"):
        fusible.quantized_model_init(init, keep_transpose=1)


# ---- training, checkpoints, conversions ----------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "custom_hp"])
def test_master_weight_optimizer_trains_every_expert(recipe_name, devices):
    """Three SGD steps with ``MasterWeightOptimizer``: each step's masters are the previous ones
    minus lr * grad (fp32), each stored weight is its master quantized by the weight's
    quantizer, in place (same parameters and storage), and the loss falls."""
    rec = QRECIPES[recipe_name]
    model = _mlp(rec, device=devices)
    opt = MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=0.05)
    stored = [w for w in _all_weights(model) if isinstance(w, QuantizedTensor)]
    assert (
        len(opt.master_weights)
        == len(stored)
        == 2 * sum(t is not None for t in EXPECTED[recipe_name])
    )
    ptrs = [w.qdata.data.data_ptr() for w in stored]
    x, _ = _data(SPLITS, devices, BF16)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with fusible.autocast(recipe=rec):
            loss = model(x, m_splits=list(SPLITS)).float().pow(2).mean()
        loss.backward()
        before = [(m.detach().clone(), w.grad.float()) for w, m in opt.master_weights]
        opt.step()
        for (w, m), (m0, g) in zip(opt.master_weights, before, strict=True):
            assert torch.equal(m, m0.add(g, alpha=-0.05))  # torch.optim.SGD's update
            assert w.grad is None
            want = w.quantizer.quantize(m, rowwise=True, columnwise=w.qdata.has_columnwise)
            assert torch.equal(w.dequantize(torch.float32), want.dequantize(torch.float32))
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert [w.qdata.data.data_ptr() for w in stored] == ptrs


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "blockwise"])
def test_state_dict_round_trip_is_exact(recipe_name, devices):
    """Saved dequantized with the exact data in ``_extra_state``; loaded into a fresh quantized
    model bit for bit (also with ``assign=True``) and into a high-precision one as values."""
    rec = QRECIPES[recipe_name]
    model = _mlp(rec, device=devices)
    sd = save_load(model.state_dict())
    for i, op in enumerate(_grouped_ops(model)):
        for j, w in enumerate(op.weights()):
            key = f"{2 * i}.weight{j}"
            assert type(sd[key]) is torch.Tensor and torch.equal(sd[key], w.dequantize())
            assert f"weight{j}.data" in sd[f"{2 * i}._extra_state"]
    for assign in (False, True):
        other = _mlp(rec, device=devices, seed=5)
        other.load_state_dict(sd, assign=assign)
        for a, b in zip(_all_weights(other), _all_weights(model), strict=True):
            assert type(a) is type(b) and _same_bits(a.qdata, b.qdata)
    plain = _mlp(None, device=devices, seed=5)
    plain.load_state_dict(sd)
    for a, b in zip(_all_weights(plain), _all_weights(model), strict=True):
        assert type(a) is torch.nn.Parameter and torch.equal(a, b.dequantize())


def test_conversions_and_meta_materialisation():
    rec = QRECIPES["current"]
    model = _mlp(rec)
    model.to(torch.float32)
    assert all(type(w) is Float8Tensor and w.dtype == torch.float32 for w in _all_weights(model))
    with torch.device("meta"):
        lazy = _mlp(rec, device="meta")
    lazy.to_empty(device="cpu")
    for op in _grouped_ops(lazy):
        op.reset_parameters()
    assert all(type(w) is Float8Tensor and w.device.type == "cpu" for w in _all_weights(lazy))
    ref = _mlp(rec)
    lazy.load_state_dict(ref.state_dict())
    x, dy = _data(SPLITS, "cpu", BF16)
    assert_same_results(_step(lazy, x, dy, SPLITS, rec), _step(ref, x, dy, SPLITS, rec), "cpu")


# ---- explain, compile ----------------------------------------------------------------------------


def test_explain_names_the_stored_weights():
    model = _mlp(QRECIPES["current"])
    with fusible.autocast(recipe=QRECIPES["current"]):
        text = model.explain()
    assert "stored Float8Tensor weights used as is: no weight quantize" in text
    assert "fp8 byte transpose of each stored Float8Tensor weight (for dgrad)" in text
    assert "grouped_quantize_fp8(weight)" not in text
    with fusible.autocast(recipe=QRECIPES["mxfp8"]):
        text = model.explain()
    assert "dequantize(stored Float8Tensor weights: another format is active)" in text


@pytest.mark.skipif(
    not compile_quantized_supported(),
    reason="torch.compile with quantized weights is tested on torch >= 2.11",
)
@pytest.mark.parametrize(
    ("recipe_name", "train"), [("current", "current"), ("current", "delayed"), ("mxfp8", "mxfp8")]
)
def test_compiled_training_equals_eager(recipe_name, train):
    """``torch.compile(fullgraph=True, backend="aot_eager")`` of the expert MLP with stored
    weights, three steps with ``MasterWeightOptimizer`` (in-place re-quantization between
    steps) against eager: outputs, gradients and every stored weight bit for bit; one graph."""
    rec = recipe.DelayedScaling() if train == "delayed" else QRECIPES[train]
    eager, twin = _mlp(QRECIPES[recipe_name]), _mlp(QRECIPES[recipe_name])
    opts = [MasterWeightOptimizer(torch.optim.SGD, m.parameters(), lr=0.1) for m in (eager, twin)]
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    graphs = [torch._dynamo.utils.counters["stats"]["unique_graphs"]]
    for k in range(3):
        x, dy = _data(SPLITS, "cpu", BF16, seed=20 + k)
        want = _step(eager, x, dy, SPLITS, rec)
        got = _step(compiled, x, dy, SPLITS, rec)
        got = {n.removeprefix("_orig_mod."): v for n, v in got.items()}
        assert_same_results(got, want, "cpu", f"compiled step {k}")
        for o in opts:
            o.step()
        for a, b in zip(_all_weights(twin), _all_weights(eager), strict=True):
            assert _same_bits(a.qdata, b.qdata), f"step {k}"
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] + 1 == graphs[1] == graphs[3], graphs


# ---- edge cases (a review of the first version) --------------------------------------------------


def test_op_pickled_before_quantized_weights_converts_and_resets():
    """An op saved before ``weight_init_recipe`` / ``weight_init_transpose`` existed (simulated
    by removing them) reads the class defaults."""
    model = _mlp(None)
    for op in _grouped_ops(model):
        op.__dict__.pop("weight_init_recipe", None)
        op.__dict__.pop("weight_init_transpose", None)
    model.to(torch.float32)
    for op in _grouped_ops(model):
        op.reset_parameters()
    assert all(type(w) is torch.nn.Parameter for w in _all_weights(model))


@pytest.mark.parametrize("save_t,load_t", [(False, True), (True, False)])
def test_checkpoint_across_keep_transpose_is_exact(save_t, load_t):
    """A checkpoint saved with one ``keep_transpose`` loads bit for bit into the other layout,
    after a master-weight step moved the weights off their first quantization (where
    re-quantizing the dequantized value can move the scale)."""
    rec = QRECIPES["current"]
    model = _mlp(rec, keep_transpose=save_t)
    opt = MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=0.3)
    x, dy = _data(SPLITS, "cpu", BF16)
    _step(model, x, dy, SPLITS, rec)
    opt.step()
    other = _mlp(rec, keep_transpose=load_t, seed=7)
    other.load_state_dict(save_load(model.state_dict()))
    for a, b in zip(_all_weights(other), _all_weights(model), strict=True):
        assert (a.qdata.data_t is not None) == load_t
        assert torch.equal(a.qdata.scale_inv, b.qdata.scale_inv)
        assert torch.equal(a.qdata.data.view(torch.uint8), b.qdata.data.view(torch.uint8))
        if load_t:
            assert torch.equal(a.qdata.data_t.view(torch.uint8),
                               b.qdata.data.t().contiguous().view(torch.uint8))  # fmt: skip


def test_stored_weights_in_a_mixed_model_are_not_dequantized(monkeypatch):
    """Experts stored per-tensor (used as is) next to one stored MXFP8 (dequantized, cast): the
    grouped cast gets a placeholder for the former, so none of them is dequantized."""
    calls = []
    real = Q.Float8Data.dequantize
    monkeypatch.setattr(Q.Float8Data, "dequantize",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))  # fmt: skip
    model = _mlp(QRECIPES["custom"])
    x, dy = _data(SPLITS, "cpu", BF16)
    with torch.no_grad(), fusible.autocast(recipe=QRECIPES["current"]):
        model(x, m_splits=list(SPLITS))
    assert calls == []
    ref = _mlp(None)
    with torch.no_grad():
        for r, w in zip(_all_weights(ref), _all_weights(model), strict=True):
            r.copy_(w.dequantize())
    # Per-tensor stored weights equal their re-cast (see test_quantized_weights.py), MXFP8 ones
    # are dequantized and cast: the step equals the dequantized-weights reference.
    rec = QRECIPES["current"]
    assert_same_results(_step(model, x, dy, SPLITS, rec), _step(ref, x, dy, SPLITS, rec), "cpu")


def test_explain_notes_with_mixed_formats_and_kept_transposes():
    with fusible.autocast(recipe=QRECIPES["current"]):
        mixed = _mlp(QRECIPES["custom"]).explain()
        kept = _mlp(QRECIPES["current"], keep_transpose=True).explain()
        fused = _mlp(QRECIPES["current"]).explain()
    assert "dequantize(stored MXFP8Tensor weights: another format is active)" in mixed
    assert "byte transpose" not in kept
    # The fused expert MLP keeps the grouped step after the notes.
    assert "used as is: no weight quantize), grouped (x3" in fused
    assert "then grouped (x3): grouped_gemm(dgrad), grouped_gemm(wgrad) (no grouped_bias_grad" in (
        fused
    )


def test_refused_conversion_names_the_weight_and_changes_nothing():
    model = _mlp(QRECIPES["current"])
    with pytest.raises(TypeError, match=r"GroupedLinear\.weight0: a quantized weight's nominal "
                                        r"dtype must be float32, float16 or bfloat16"):  # fmt: skip
        model.double()
    assert all(p.dtype == BF16 for p in model.parameters())


def test_load_with_strict_false_ignores_other_weights_data():
    """A checkpoint of more experts (or a Linear's) loaded with strict=False: the extra
    weights' quantized data is ignored, not reported as malformed recipe state."""
    rec = QRECIPES["current"]
    big, small = _mlp(rec, experts=4), _mlp(rec, experts=2)
    small.load_state_dict(big.state_dict(), strict=False)
    for i in range(2):
        a, b = small[0]._parameters[f"weight{i}"], big[0]._parameters[f"weight{i}"]
        assert _same_bits(a.qdata, b.qdata)
    with fusible.quantized_model_init(rec):
        lin = ops.Linear(H, F)
    small[0].load_state_dict({"_extra_state": lin.state_dict()["0._extra_state"]}, strict=False)
    with pytest.raises(ValueError, match="malformed recipe state key 'junk'"):
        small[0].load_state_dict({"_extra_state": {"junk": torch.zeros(1)}}, strict=False)


def test_assign_load_onto_a_weight_without_quantizer_raises():
    model = _mlp(None)
    op = _grouped_ops(model)[0]
    for i, w in enumerate(op.weights()):
        data = weight_init_quantizer(QRECIPES["current"], op.weight_roles()[f"weight{i}"],
                                     "cpu").quantize(w.detach())  # fmt: skip
        setattr(op, f"weight{i}", torch.nn.Parameter(QuantizedTensor.wrap(data, dtype=w.dtype)))
    sd = {k: v.dequantize() if isinstance(v, QuantizedTensor) else v
          for k, v in op.state_dict(keep_vars=True).items()}  # fmt: skip
    with pytest.raises(ValueError, match="GroupedLinear: load_state_dict\\(assign=True\\) cannot "
                                         "quantize the loaded weight0"):  # fmt: skip
        op.load_state_dict(sd, assign=True)
    assert all(isinstance(w, QuantizedTensor) for w in op.weights())


def test_plain_weights_of_a_quantized_build_stay_put_on_conversion():
    """Weights assigned high precision (fine-tuning) in an op built inside
    quantized_model_init are not quantized again by ``.float()`` (an optimizer keeps them)."""
    model = _mlp(QRECIPES["current"])
    op = _grouped_ops(model)[0]
    for i, w in enumerate(op.weights()):
        setattr(op, f"weight{i}", torch.nn.Parameter(w.dequantize()))
    before = op.weights()
    model.float()
    assert all(a is b and type(a) is torch.nn.Parameter for a, b in zip(op.weights(), before,
                                                                        strict=True))  # fmt: skip
