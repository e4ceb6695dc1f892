"""FP8 weights: ``fusible.quantized_model_init`` and ``fusible.optim.MasterWeightOptimizer``.

Construction (the weight is a QuantizedTensor of the recipe's weight quantizer, bit for bit); one
training step against the same model with its original high-precision weights (bit-exact on CPU
for every recipe and dtype: the recipe quantizes those weights exactly as they were stored), and
against high-precision weights set to the dequantized values (where that is exact, below); no
weight quantize kernel in forward or backward; the high-precision fallbacks; the master-weight
optimizer against a hand-written reference; memory (exact byte counts); checkpoints, pickling and
module conversions; bad input; modules training with fusion; torch.compile (against eager, with the
optimizer between steps; a clear error on torch < 2.13); a CUDA-graph step (GPU only).

Exactness of re-quantizing a dequantized weight. MXFP8 rowwise: always (power-of-two scales); but
the columnwise copy is the quantization of the original weight, which the rowwise dequantization
does not determine. Per-tensor FP8 of a bf16 weight: the amax of the dequantized weight rounds
back to the original bf16 amax, so scale and bytes come back. Per-tensor FP8 in fp32 (or of an
fp32 master): ``q * scale_inv`` is rounded to the nominal dtype and the re-derived scale can move
by an ulp (``test_fp32_per_tensor_requantization_within_an_ulp``). Hence checkpoints carry the
exact quantized data besides the dequantized weight.
"""

from __future__ import annotations

import copy
import io
import math
from contextlib import nullcontext

import pytest
import torch
from ops_helpers import (
    E4M3,
    QUANTIZE_OPS,
    assert_same_results,
    rel_err,
    save_load,
    weight_init_recipes,
)

import fusible
from fusible import ops, recipe
from fusible.ops.basic import BasicLinear
from fusible.ops.basic.quantized_weight import compile_quantized_supported
from fusible.optim import MasterWeightOptimizer
from fusible.quantization import (
    Float8BlockData,
    Float8BlockTensor,
    Float8Data,
    Float8Quantizer,
    Float8Tensor,
    MXFP8Tensor,
    QuantizedTensor,
)
from fusible.quantization import quantizers as Q

TOKENS, HIDDEN, FFN = 32, 64, 96  # weights [96, 64] / [64, 96]: no activation has their shape
BF16 = torch.bfloat16

# Recipes quantized_model_init supports. "custom": per-op formats by role (fc1 per-tensor FP8,
# fc2 MXFP8); "custom_hp": fc2's weight stays in high precision.
QRECIPES = weight_init_recipes("fc2")
# Which class each Linear's weight is, in model order (None: a plain high-precision Parameter).
EXPECTED_TYPES = {
    "current": (Float8Tensor, Float8Tensor),
    "mxfp8": (MXFP8Tensor, MXFP8Tensor),
    "blockwise": (Float8BlockTensor, Float8BlockTensor),
    "custom": (Float8Tensor, MXFP8Tensor),
    "custom_hp": (Float8Tensor, None),
}
KINDS = ["sequential", "layernorm_mlp", "layernorm_linear", "linear"]


# ---- helpers -------------------------------------------------------------------------------------


def _build(kind="sequential", rec=None, *, seed=0, dtype=BF16, device="cpu"):
    """A model built inside ``quantized_model_init(rec)`` (plain when ``rec`` is None). The same
    seed gives the same initial high-precision weights either way (quantization draws nothing)."""
    torch.manual_seed(seed)
    kw = {"dtype": dtype, "device": device}
    with fusible.quantized_model_init(rec) if rec is not None else nullcontext():
        if kind == "sequential":
            return ops.Sequential(
                ops.LayerNorm(HIDDEN, **kw),
                ops.Linear(HIDDEN, FFN, name="fc1", **kw),
                ops.GELU(),
                ops.Linear(FFN, HIDDEN, name="fc2", **kw),
            )
        if kind == "residual":  # fused Linear + Bias + residual add; dgrad + branch gradient
            return ops.Sequential(
                ops.LayerNorm(HIDDEN, **kw),
                ops.MakeExtraOutput(),
                ops.Linear(HIDDEN, FFN, name="fc1", **kw),
                ops.GELU(),
                ops.Linear(FFN, HIDDEN, name="fc2", **kw),
                ops.AddExtraInput(),
            )
        if kind == "layernorm_mlp":
            return fusible.LayerNormMLP(HIDDEN, FFN, **kw)
        if kind == "layernorm_linear":
            return fusible.LayerNormLinear(HIDDEN, FFN, name="fc1", **kw)
        return fusible.Linear(HIDDEN, FFN, name="fc1", **kw)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, BasicLinear)]


def _tensors(qdata):
    """The tensors of a quantized container, in field order (None for absent copies)."""
    if isinstance(qdata, Float8Data):
        return [qdata.data, qdata.data_t, qdata.scale_inv]
    if isinstance(qdata, Float8BlockData):
        return [qdata.data, qdata.scale_inv, qdata.data_t, qdata.col_scale_inv]
    return [qdata.data, qdata.scale, qdata.col_data, qdata.col_scale]


def _bits_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _assert_same_qdata(got, want, what=""):
    assert type(got) is type(want), what
    for i, (a, b) in enumerate(zip(_tensors(got), _tensors(want), strict=True)):
        assert _bits_equal(a, b), f"{what}: tensor {i} of {type(got).__name__} differs"


def _weight_quantizer(op, rec):
    """The run-time weight quantizer the recipe gives this op (its RecipeState's)."""
    op.ensure_recipe_state(rec)
    return op.get_quantizer(True, "weight")


def _reference(model, kind, dtype, device):
    """The same model with high-precision weights set to the quantized ones' dequantization."""
    ref = _build(kind, None, dtype=dtype, device=device)
    with torch.no_grad():
        for r, q in zip(_linears(ref), _linears(model), strict=True):
            w = q.weight
            r.weight.copy_(w.dequantize() if isinstance(w, QuantizedTensor) else w)
    return ref


def _data(device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(TOKENS, FFN, generator=g).to(device=device, dtype=dtype)  # sliced to fit
    return x, dy


def _step(model, x, dy, rec, **kw):
    """Forward under ``autocast(rec)`` (disabled for None) and backward with ``dy``: the outputs,
    the input gradients and every parameter gradient, by name. A model with an AddExtraInput
    gets ``dy`` as its residual input; every output gets a slice of ``dy`` as its gradient."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    r = dy[..., :HIDDEN].detach().clone().requires_grad_(True)
    extra = [r] if any(isinstance(op, ops.AddExtraInput) for op in model.modules()) else []
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        out = model(x, *extra, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [dy[..., : o.shape[-1]].flip(0) for o in outs])
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    got = {f"y{i}": o.detach() for i, o in enumerate(outs)}
    return {**got, "dx": x.grad, **({"dr": r.grad} if extra else {}), **grads}


class _QuantizeCalls:
    """Stands in for ``torch.ops.fusible`` inside quantizers.py and records the input shape of
    every quantize call, so that weight quantizations (inputs of a weight's shape) are counted."""

    def __init__(self, real):
        self._real, self.shapes = real, []

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name not in QUANTIZE_OPS:
            return fn

        def recorded(x, *args, **kwargs):
            self.shapes.append(tuple(x.shape))
            return fn(x, *args, **kwargs)

        return recorded

    def clear(self):
        self.shapes = []

    def weight_calls(self, model):
        """Quantize calls on weight-shaped inputs since the last call."""
        shapes = {tuple(op.weight.shape) for op in _linears(model)}
        n = sum(s in shapes for s in self.shapes)
        self.shapes = []
        return n


@pytest.fixture
def quantize_calls(monkeypatch):
    calls = _QuantizeCalls(Q._ops)
    monkeypatch.setattr(Q, "_ops", calls)
    return calls


# ---- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe_name", sorted(QRECIPES))
def test_weight_is_quantized_with_the_recipe_weight_quantizer(recipe_name, kind, dtype, devices):
    rec = QRECIPES[recipe_name]
    model = _build(kind, rec, dtype=dtype, device=devices)
    plain = _build(kind, None, dtype=dtype, device=devices)
    names = {"sequential": ["fc1", "fc2"], "layernorm_mlp": ["fc1", "fc2"]}.get(kind, ["fc1"])
    scope = {"sequential": "linear", "linear": "linear"}.get(kind, kind)
    for i, (op, ref_op) in enumerate(zip(_linears(model), _linears(plain), strict=True)):
        w, hp = op.weight, ref_op.weight.detach()
        assert isinstance(w, torch.nn.Parameter) and w.requires_grad
        want_type = EXPECTED_TYPES[recipe_name][i]
        if want_type is None:
            assert type(w) is torch.nn.Parameter and torch.equal(w, hp)
            continue
        assert type(w) is want_type
        assert w.dtype == dtype and w.shape == hp.shape and w.device.type == devices
        # Quantized with the op's final (module-scoped) role, by the run-time weight quantizer.
        assert w.quantizer.role.qualified == f"weight:{scope}:{names[i]}"
        q = _weight_quantizer(op, rec)
        assert type(q) is type(w.quantizer) and q.dtype == w.quantizer.dtype == E4M3
        mx = want_type in (MXFP8Tensor, Float8BlockTensor)  # block scales: both copies
        assert w.qdata.has_rowwise and w.qdata.has_columnwise == mx  # FP8: rowwise only
        want = q.quantize(hp, rowwise=True, columnwise=mx)
        _assert_same_qdata(w.qdata, want, f"op {i}")
        assert torch.equal(w.dequantize(), want.dequantize(dtype))


def test_enabled_false_and_nesting():
    rec = QRECIPES["current"]
    with fusible.quantized_model_init(rec):
        with fusible.quantized_model_init(rec, enabled=False):
            assert fusible.quantization.get_quantized_model_init_recipe() is None
            inner = ops.Linear(HIDDEN, FFN)
        with fusible.quantized_model_init(QRECIPES["mxfp8"]):
            mx = ops.Linear(HIDDEN, FFN)
        outer = ops.Linear(HIDDEN, FFN)
        assert fusible.quantization.get_quantized_model_init_recipe() is rec
    assert fusible.quantization.get_quantized_model_init_recipe() is None
    after = ops.Linear(HIDDEN, FFN)
    assert type(inner.weight) is torch.nn.Parameter and type(after.weight) is torch.nn.Parameter
    assert type(mx.weight) is MXFP8Tensor and type(outer.weight) is Float8Tensor

    @fusible.quantized_model_init(rec)
    def make():
        return ops.Linear(HIDDEN, FFN)

    assert type(make().weight) is Float8Tensor


def test_set_role_scope_after_construction_follows_the_new_role():
    rec = recipe.CustomRecipe.from_rules(
        {"weight:layernorm_mlp:*": recipe.MXFP8BlockScaling(), "*": recipe.Float8CurrentScaling()}
    )
    torch.manual_seed(0)
    with fusible.quantized_model_init(rec):
        op = BasicLinear(HIDDEN, FFN, dtype=BF16)
        same = BasicLinear(HIDDEN, FFN, dtype=BF16)
    assert type(op.weight) is Float8Tensor
    dequantized = op.weight.dequantize()
    op.set_role_scope("layernorm_mlp", "fc1")  # another format: re-quantized from its value
    assert type(op.weight) is MXFP8Tensor
    assert op.weight.quantizer.role.qualified == "weight:layernorm_mlp:fc1"
    _assert_same_qdata(op.weight.qdata, op.weight.quantizer.quantize(dequantized))
    data = same.weight.qdata.data
    same.set_role_scope("layernorm_linear", "x")  # same format: bits kept, quantizer's role new
    assert same.weight.qdata.data is data
    assert same.weight.quantizer.role.qualified == "weight:layernorm_linear:x"


def test_meta_device_then_to_empty_and_reset_parameters_or_load():
    rec = QRECIPES["mxfp8"]
    model = _build("layernorm_mlp", rec, device="meta")
    assert all(type(op.weight) is torch.nn.Parameter for op in _linears(model))  # nothing to cast
    model.to_empty(device="cpu")  # materialised: quantized from here on
    assert all(type(op.weight) is MXFP8Tensor for op in _linears(model))
    weights = [op.weight for op in _linears(model)]
    torch.manual_seed(0)
    model.reset_parameters()  # every op's, re-initialised in place
    want = _build("layernorm_mlp", rec)  # the same draws from the same seed
    for w, op in zip(weights, _linears(want), strict=True):
        _assert_same_qdata(w.qdata, op.weight.qdata)
    # Or loaded from a checkpoint.
    other = _build("layernorm_mlp", rec, device="meta")
    other.to_empty(device="cpu")
    other.load_state_dict(want.state_dict())
    for a, b in zip(_linears(other), _linears(want), strict=True):
        assert type(a.weight) is MXFP8Tensor
        _assert_same_qdata(a.weight.qdata, b.weight.qdata)


# ---- one training step ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("kind", ["sequential", "residual", "layernorm_mlp"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", sorted(QRECIPES))
def test_step_equals_original_weights_reference(recipe_name, dtype, kind, fused, devices,
                                                quantize_calls):  # fmt: skip
    """Against the same model built with its high-precision weights (same seed): the recipe
    quantizes those weights exactly as they were stored, so every result agrees bit for bit."""
    rec = QRECIPES[recipe_name]
    model = _build(kind, rec, dtype=dtype, device=devices)
    ref = _build(kind, None, dtype=dtype, device=devices)
    x, dy = _data(devices, dtype)
    n_quantized = sum(isinstance(op.weight, QuantizedTensor) for op in _linears(model))
    assert n_quantized == sum(t is not None for t in EXPECTED_TYPES[recipe_name])
    quantize_calls.clear()  # construction quantized the weights
    with nullcontext() if fused else ops.fusion_disabled():
        want = _step(ref, x, dy, rec)
        # The counter sees weight quantizations: the reference's, two per quantized weight (the
        # forward's rowwise copy, and dgrad's columnwise copy made again in backward)...
        assert quantize_calls.weight_calls(ref) == 2 * n_quantized
        got = _step(model, x, dy, rec)
        # ...and none for a stored weight, forward or backward (dgrad's transposed copy is a
        # byte transpose).
        assert quantize_calls.weight_calls(model) == 0
    assert_same_results(got, want, devices, f"{recipe_name} {kind}")
    for op in _linears(model):
        w = op.weight
        assert type(w.grad) is torch.Tensor and w.grad.dtype == dtype and w.grad.shape == w.shape
        if isinstance(w, Float8Tensor):
            assert w.qdata.data_t is None  # the transposed copy was not kept


@pytest.mark.parametrize("kind", ["sequential", "layernorm_mlp"])
@pytest.mark.parametrize("recipe_name", sorted(QRECIPES))
def test_step_equals_dequantized_weights_reference(recipe_name, kind, devices):
    """Against a model whose high-precision weights are the dequantized values (bf16). A
    per-tensor FP8 weight re-quantizes to itself (see the module docstring), so everything
    agrees. An MXFP8 weight's rowwise copy does too, but its columnwise copy (dgrad) is the
    quantization of the original weight, which the rowwise dequantization does not determine:
    there only the forward output is compared."""
    rec = QRECIPES[recipe_name]
    model = _build(kind, rec, device=devices)
    ref = _reference(model, kind, BF16, devices)
    x, dy = _data(devices, BF16)
    got, want = _step(model, x, dy, rec), _step(ref, x, dy, rec)
    if any(t is MXFP8Tensor for t in EXPECTED_TYPES[recipe_name]):
        got, want = {"y0": got["y0"]}, {"y0": want["y0"]}
    assert_same_results(got, want, devices, f"{recipe_name} {kind}")


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_is_first_microbatch_is_ignored(recipe_name, devices, quantize_calls):
    rec = QRECIPES[recipe_name]
    model = _build("sequential", rec, device=devices)
    x, dy = _data(devices, BF16)
    want = _step(model, x, dy, rec)
    quantize_calls.clear()
    for fm in (True, False, None):
        got = _step(model, x, dy, rec, is_first_microbatch=fm)
        assert_same_results(got, want, devices, f"is_first_microbatch={fm}")
        assert quantize_calls.weight_calls(model) == 0
        assert all(op.workspace_cache.workspace is None for op in _linears(model))


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_frozen_quantized_weights(recipe_name, devices):
    """requires_grad=False (e.g. a frozen FP8 base model): dgrad only, equal to the reference."""
    rec = QRECIPES[recipe_name]
    model = _build("sequential", rec, device=devices)
    ref = _build("sequential", None, device=devices)
    for m in (model, ref):
        for op in _linears(m):
            op.weight.requires_grad_(False)
    x, dy = _data(devices, BF16)
    got, want = _step(model, x, dy, rec), _step(ref, x, dy, rec)
    assert_same_results(got, want, devices, "frozen")
    assert all(op.weight.grad is None for op in _linears(model))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_without_autocast_uses_the_dequantized_weight(recipe_name, dtype, devices, quantize_calls):
    model = _build("layernorm_mlp", QRECIPES[recipe_name], dtype=dtype, device=devices)
    ref = _reference(model, "layernorm_mlp", dtype, devices)
    x, dy = _data(devices, dtype)
    quantize_calls.clear()
    assert_same_results(_step(model, x, dy, None), _step(ref, x, dy, None), devices, "no autocast")
    assert quantize_calls.weight_calls(model) == 0


@pytest.mark.parametrize("stored,active", [("current", "mxfp8"), ("mxfp8", "current")])
def test_another_format_quantizes_the_dequantized_weight(stored, active, devices, quantize_calls):
    model = _build("sequential", QRECIPES[stored], device=devices)
    ref = _reference(model, "sequential", BF16, devices)
    x, dy = _data(devices, BF16)
    rec = QRECIPES[active]
    want = _step(ref, x, dy, rec)
    quantize_calls.weight_calls(ref)
    got = _step(model, x, dy, rec)
    assert quantize_calls.weight_calls(model) == 2  # the dequantized weights, by the active recipe
    assert_same_results(got, want, devices, f"{stored} weights under {active}")


def test_per_tensor_weight_under_delayed_scaling_is_used_as_is(devices, quantize_calls):
    """Any per-tensor quantizer accepts a stored per-tensor weight. Reference: a high-precision
    model whose weight role is current-scaled (re-making the stored bits) and everything else
    delayed-scaled, as in the quantized model (first step: every delayed scale is 1)."""
    model = _build("sequential", QRECIPES["current"], device=devices)
    ref = _reference(model, "sequential", BF16, devices)
    x, dy = _data(devices, BF16)
    delayed = recipe.DelayedScaling(amax_history_len=4)
    rules = recipe.CustomRecipe.from_rules(
        {"weight:*": recipe.Float8CurrentScaling(), "*": delayed}
    )
    want = _step(ref, x, dy, rules)
    quantize_calls.weight_calls(ref)
    got = _step(model, x, dy, delayed)
    assert quantize_calls.weight_calls(model) == 0
    assert_same_results(got, want, devices, "delayed")


def test_fp32_per_tensor_requantization_within_an_ulp():
    """Per-tensor FP8 with fp32 nominal dtype: the dequantized weight re-quantizes to the same
    FP8 bytes; its scale may move by one ulp (see the module docstring), so one step of the
    reference agrees to ~1 ulp rather than bit for bit."""
    rec = QRECIPES["current"]
    model = _build("sequential", rec, dtype=torch.float32)
    ref = _reference(model, "sequential", torch.float32, "cpu")
    for op in _linears(model):
        w = op.weight
        again = w.quantizer.quantize(w.dequantize(), rowwise=True, columnwise=False)
        assert _bits_equal(again.data, w.qdata.data)
        assert torch.allclose(again.scale_inv, w.qdata.scale_inv, rtol=2**-23, atol=0)
    x, dy = _data("cpu", torch.float32)
    got, want = _step(model, x, dy, rec), _step(ref, x, dy, rec)
    for k in got:
        assert rel_err(got[k], want[k]) <= 1e-6, k


# ---- MasterWeightOptimizer -----------------------------------------------------------------------


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def _loss_step(model, x, rec):
    with fusible.autocast(recipe=rec):
        y = model(x)
    loss = y.float().pow(2).mean()
    loss.backward()
    return loss.detach()


class _HandReference:
    """Master weights kept by hand: fp32 masters of the quantized weights, the torch optimizer
    over masters and plain parameters, and each master re-quantized with the weight's quantizer
    into a new parameter after each step (no QuantizedTensor.copy_)."""

    def __init__(self, model, cls, kw):
        self.model = model
        self.ops = [op for op in _linears(model) if isinstance(op.weight, QuantizedTensor)]
        self.masters = [op.weight.dequantize(torch.float32) for op in self.ops]
        ids = {id(op.weight) for op in self.ops}
        plain = [p for p in model.parameters() if id(p) not in ids]
        self.opt = cls([*self.masters, *plain], **kw)

    def step(self):
        for op, m in zip(self.ops, self.masters, strict=True):
            m.grad = op.weight.grad.float()
            op.weight.grad = None
        self.opt.step()
        for op, m in zip(self.ops, self.masters, strict=True):
            w = op.weight
            qd = w.quantizer.quantize(m, rowwise=True, columnwise=w.qdata.has_columnwise)
            op.weight = torch.nn.Parameter(QuantizedTensor.wrap(qd, dtype=w.dtype,
                                                                quantizer=w.quantizer))  # fmt: skip

    def zero_grad(self):
        self.opt.zero_grad()


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "custom_hp"])
def test_master_weight_optimizer_equals_hand_reference(recipe_name, opt_name, devices):
    rec = QRECIPES[recipe_name]
    cls, kw = OPTIMIZERS[opt_name]
    model = _build("sequential", rec, device=devices)
    twin = _build("sequential", rec, device=devices)
    opt = MasterWeightOptimizer(cls, model.parameters(), **kw)
    ref = _HandReference(twin, cls, kw)
    weights = [op.weight for op in _linears(model)]
    storage = [[t.data_ptr() for t in _tensors(w.qdata) if t is not None]
               for w in weights if isinstance(w, QuantizedTensor)]  # fmt: skip
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randn(TOKENS, HIDDEN, generator=g).to(devices, BF16)
        opt.zero_grad()
        ref.zero_grad()
        loss = _loss_step(model, x, rec)
        want_loss = _loss_step(twin, x, rec)
        opt.step()
        ref.step()
        assert torch.equal(loss, want_loss), step
        masters = [m for _, m in opt.master_weights]
        assert all(torch.equal(a, b) for a, b in zip(masters, ref.masters, strict=True)), step
        for op, ref_op in zip(_linears(model), _linears(twin), strict=True):
            w, rw = op.weight, ref_op.weight
            if isinstance(w, QuantizedTensor):
                _assert_same_qdata(w.qdata, rw.qdata, f"step {step}")
                assert w.grad is None  # moved to the master
            else:
                assert torch.equal(w, rw), step
        for (name, p), rp in zip(model.named_parameters(), twin.parameters(), strict=True):
            if not isinstance(p, QuantizedTensor):
                assert torch.equal(p, rp), (step, name)
    # Updated in place: the same parameters, holding the same tensors.
    assert all(a is op.weight for a, op in zip(weights, _linears(model), strict=True))
    now = [[t.data_ptr() for t in _tensors(w.qdata) if t is not None]
           for w in weights if isinstance(w, QuantizedTensor)]  # fmt: skip
    assert now == storage


def test_master_weight_optimizer_groups_and_plain_params():
    model = _build("layernorm_mlp", QRECIPES["custom_hp"])
    quantized = [p for p in model.parameters() if isinstance(p, QuantizedTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, QuantizedTensor)]
    opt = MasterWeightOptimizer(
        torch.optim.SGD,
        [{"params": quantized, "lr": 0.5}, {"params": plain}],
        lr=0.1,
    )
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optimizer.param_groups and opt.defaults["lr"] == 0.1
    masters = opt.param_groups[0]["params"]
    assert len(masters) == 1 and masters[0].dtype == torch.float32
    assert torch.equal(masters[0], quantized[0].dequantize(torch.float32))
    assert all(a is b for a, b in zip(opt.param_groups[1]["params"], plain, strict=True))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _loss_step(model, torch.randn(TOKENS, HIDDEN, dtype=BF16), QRECIPES["custom_hp"])
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.25, 0.05]
    with pytest.raises(ValueError, match="more than one group"):
        MasterWeightOptimizer(torch.optim.SGD, [{"params": quantized}, {"params": quantized}])
    with pytest.raises(TypeError, match="iterable of tensors"):
        MasterWeightOptimizer(torch.optim.SGD, quantized[0], lr=0.1)


def test_master_weight_optimizer_zero_grad_and_accumulation():
    rec = QRECIPES["current"]
    model = _build("sequential", rec)
    opt = MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=0.0)
    qparams = [op.weight for op in _linears(model)]
    x1, x2 = torch.randn(2, TOKENS, HIDDEN, dtype=BF16)
    _loss_step(model, x1, rec)
    g1 = [p.grad.clone() for p in qparams]
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    # Two backward passes, then a step: the masters' gradients are the sum (torch semantics).
    _loss_step(model, x1, rec)
    opt.step()
    _loss_step(model, x2, rec)
    g2 = [p.grad.clone() for p in qparams]
    opt.step()
    for (p, m), a, b in zip(opt.master_weights, g1, g2, strict=True):
        assert p.grad is None
        assert torch.equal(m.grad, a.float() + b.float())
    opt.zero_grad()
    assert all(m.grad is None for _, m in opt.master_weights)


def _train(model, opt, rec, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        _loss_step(model, torch.randn(TOKENS, HIDDEN, generator=g, dtype=BF16), rec)
        opt.step()


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_master_weight_optimizer_state_dict_round_trip(recipe_name):
    rec = QRECIPES[recipe_name]
    model = _build("layernorm_mlp", rec)
    opt = MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    _train(model, opt, rec, 2, seed=5)
    model_sd, opt_sd = save_load(model.state_dict()), save_load(opt.state_dict())
    assert len(opt_sd["master_weights"]) == 2 and opt_sd["optimizer"]["state"]
    # A fresh model and optimizer (another initialisation) restored from the checkpoint.
    other = _build("layernorm_mlp", rec, seed=9)
    other_opt = MasterWeightOptimizer(torch.optim.AdamW, other.parameters(), lr=1e-2)
    other.load_state_dict(model_sd)
    other_opt.load_state_dict(opt_sd)
    for (_, a), (_, b) in zip(opt.master_weights, other_opt.master_weights, strict=True):
        assert torch.equal(a, b)
    _train(model, opt, rec, 2, seed=6)
    _train(other, other_opt, rec, 2, seed=6)
    for a, b in zip(_linears(model), _linears(other), strict=True):
        _assert_same_qdata(b.weight.qdata, a.weight.qdata)
    for (_, a), (_, b) in zip(opt.master_weights, other_opt.master_weights, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="expected a dict with keys"):
        other_opt.load_state_dict(opt_sd["optimizer"])
    bad = {**opt_sd, "master_weights": opt_sd["master_weights"][:1]}
    with pytest.raises(ValueError, match="1 master weights in the state dict"):
        other_opt.load_state_dict(bad)


def test_weights_loaded_after_the_optimizer_reseed_the_masters():
    """Fine-tuning from a checkpoint without optimizer state: the optimizer was built before the
    model's weights were loaded, so its masters must follow the loaded weights."""
    rec = QRECIPES["current"]
    trained = _build("sequential", rec)
    _train(trained, MasterWeightOptimizer(torch.optim.SGD, trained.parameters(), lr=0.1),
           rec, 2, seed=5)  # fmt: skip
    sd = trained.state_dict()
    late = _build("sequential", rec, seed=3)
    late_opt = MasterWeightOptimizer(torch.optim.SGD, late.parameters(), lr=0.1)
    late.load_state_dict(sd)
    fresh = _build("sequential", rec, seed=4)
    fresh.load_state_dict(sd)
    fresh_opt = MasterWeightOptimizer(torch.optim.SGD, fresh.parameters(), lr=0.1)
    _train(late, late_opt, rec, 1, seed=7)
    _train(fresh, fresh_opt, rec, 1, seed=7)
    for a, b in zip(_linears(late), _linears(fresh), strict=True):
        _assert_same_qdata(a.weight.qdata, b.weight.qdata)


def test_plain_torch_optimizer_on_quantized_weights_raises():
    model = _build("sequential", QRECIPES["current"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss_step(model, torch.randn(TOKENS, HIDDEN, dtype=BF16), QRECIPES["current"])
    with pytest.raises(RuntimeError, match="MasterWeightOptimizer"):
        opt.step()


# ---- memory --------------------------------------------------------------------------------------


def _param_bytes(model):
    """Bytes of the storages the parameters hold (a QuantizedTensor: its data and scales; the
    wrapper itself owns no storage), each storage counted once."""
    storages = {}
    for p in model.parameters():
        ts = (
            [t for t in _tensors(p.qdata) if t is not None]
            if isinstance(p, QuantizedTensor)
            else [p]
        )
        for t in ts:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _quantized_weight_bytes(out_f, in_f, mx):
    if not mx:
        return out_f * in_f + 4  # rowwise FP8 + the fp32 scale_inv
    return 2 * out_f * in_f + out_f * math.ceil(in_f / 32) + math.ceil(out_f / 32) * in_f


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_parameter_bytes(recipe_name, dtype):
    rec = QRECIPES[recipe_name]
    mx = recipe_name == "mxfp8"
    model = _build("layernorm_mlp", rec, dtype=dtype)
    plain = _build("layernorm_mlp", None, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    n_weights = 2 * HIDDEN * FFN
    others = 2 * HIDDEN + FFN + HIDDEN  # LayerNorm weight + bias, fc1 bias, fc2 bias
    assert _param_bytes(plain) == (n_weights + others) * size
    want = (others * size + _quantized_weight_bytes(FFN, HIDDEN, mx)
            + _quantized_weight_bytes(HIDDEN, FFN, mx))  # fmt: skip
    assert _param_bytes(model) == want
    weights_q = want - others * size
    ratio = weights_q / (n_weights * size)
    if not mx:  # per-tensor FP8: 1 byte/element (+ 4 bytes of scale per weight)
        assert ratio == pytest.approx(1 / size, rel=1e-3)
    else:  # MXFP8 keeps both copies and their scales: 2 + 2/32 bytes/element
        assert ratio == pytest.approx((2 + 2 / 32) / size, rel=1e-3)
    # A training step keeps it so (no transposed copy or gradient kept on the parameter).
    opt = MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    _train(model, opt, rec, 1, seed=0)
    assert _param_bytes(model) == want
    assert all(op.weight.grad is None for op in _linears(model))


# ---- checkpoints and module conversions ----------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_state_dict_saves_dequantized_weights_and_loads_requantized(recipe_name, devices):
    rec = QRECIPES[recipe_name]
    model = _build("layernorm_mlp", rec, device=devices)
    sd = model.state_dict()
    for name, op in (("fc1_weight", model.fc1), ("fc2_weight", model.fc2)):
        assert type(sd[name]) is torch.Tensor and sd[name].dtype == BF16
        assert torch.equal(sd[name], op.weight.dequantize())
    # The exact quantized weight rides along in the extra state (re-quantizing the dequantized
    # weight would not always give it back: e.g. an MXFP8 columnwise copy).
    fields = {"data", "scale_inv"} if recipe_name == "current" else {"data", "scale", "col_data",
                                                                      "col_scale"}  # fmt: skip
    assert {k for k in sd["fc1._extra_state"] if k.startswith("weight.")} == {
        f"weight.{f}" for f in fields
    }
    loaded = save_load(sd)  # plain tensors: weights_only=True
    # Into a quantized model: restored in place, the same bits as saved.
    other = _build("layernorm_mlp", rec, seed=7, device=devices)
    weights = [op.weight for op in _linears(other)]
    ptrs = [op.weight.qdata.data.data_ptr() for op in _linears(other)]
    other.load_state_dict(loaded)
    for a, b, w, ptr in zip(_linears(model), _linears(other), weights, ptrs, strict=True):
        assert b.weight is w and w.qdata.data.data_ptr() == ptr
        _assert_same_qdata(w.qdata, a.weight.qdata)
    # Into a high-precision model, and a high-precision checkpoint into a quantized model.
    plain = _build("layernorm_mlp", None, seed=7, device=devices)
    plain.load_state_dict(loaded)
    assert torch.equal(plain.fc1.weight, model.fc1.weight.dequantize())
    hp = _build("layernorm_mlp", None, seed=8, device=devices)
    other.load_state_dict(hp.state_dict())
    q = other.fc1.weight.quantizer
    _assert_same_qdata(
        other.fc1.weight.qdata,
        q.quantize(hp.fc1.weight.detach(), rowwise=True, columnwise=recipe_name == "mxfp8"),
    )
    # An edited weight is re-quantized (the stale exact copy is not used).
    edited = {**loaded, "fc1_weight": loaded["fc1_weight"] * 2}
    other.load_state_dict(edited)
    want = other.fc1.weight.quantizer.quantize(edited["fc1_weight"], rowwise=True,
                                               columnwise=recipe_name == "mxfp8")  # fmt: skip
    _assert_same_qdata(other.fc1.weight.qdata, want)
    # assign=True keeps the weights quantized (and exact).
    again = _build("layernorm_mlp", rec, seed=7, device=devices)
    again.load_state_dict(loaded, assign=True)
    for a, b in zip(_linears(model), _linears(again), strict=True):
        assert isinstance(b.weight, QuantizedTensor)
        _assert_same_qdata(b.weight.qdata, a.weight.qdata)


def test_module_conversions_keep_weights_quantized():
    model = _build("sequential", QRECIPES["current"])
    w = model[1].weight
    data = w.qdata.data.data_ptr()
    _loss_step(model, torch.randn(TOKENS, HIDDEN, dtype=BF16), QRECIPES["current"])
    model.float()  # the nominal dtype changes; the FP8 data stays as it is
    assert model[1].weight is w and type(w) is Float8Tensor and w.dtype == torch.float32
    assert w.qdata.data.data_ptr() == data and w.grad.dtype == torch.float32
    assert torch.equal(w.dequantize(), w.qdata.dequantize(torch.float32))
    model.to("meta")  # a device move moves the quantized data
    assert model[1].weight is w and w.device.type == "meta" and w.qdata.data.is_meta
    model.to_empty(device="cpu")
    assert type(w) is Float8Tensor and w.qdata.data.device.type == "cpu"
    with pytest.raises(TypeError, match="nominal dtype must be float32, float16 or bfloat16"):
        model.double()
    twin = copy.deepcopy(model)
    assert type(twin[1].weight) is Float8Tensor and twin[1].weight is not w


def test_pickled_model_keeps_quantized_trainable_weights():
    """torch.save of a whole model: the weights come back quantized, as parameters, with their
    quantizer (what re-quantization after an optimizer step needs)."""
    rec = QRECIPES["mxfp8"]
    model = _build("layernorm_mlp", rec)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for a, b in zip(_linears(model), _linears(loaded), strict=True):
        w = b.weight
        assert type(w) is MXFP8Tensor and isinstance(w, torch.nn.Parameter) and w.requires_grad
        assert w.quantizer is not None and w.quantizer.role == a.weight.quantizer.role
        _assert_same_qdata(w.qdata, a.weight.qdata)
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in model.named_parameters()]
    opt = MasterWeightOptimizer(torch.optim.SGD, loaded.parameters(), lr=0.1)
    _train(loaded, opt, rec, 1, seed=0)


# ---- bad input -----------------------------------------------------------------------------------


def test_delayed_scaling_raises():
    with pytest.raises(ValueError, match=r"quantized_model_init: recipe DelayedScaling\(.*\) is "
                                         r"not supported: a delayed-scaling weight's scale comes "
                                         r"from an amax history.*Supported: Float8CurrentScaling, "
                                         r"MXFP8BlockScaling"):  # fmt: skip
        fusible.quantized_model_init(recipe.DelayedScaling())
    rules = recipe.CustomRecipe.from_rules({"weight:*": recipe.DelayedScaling(), "*": None})
    with fusible.quantized_model_init(rules):
        with pytest.raises(ValueError, match=r"gives weight role 'weight:linear:fc1' a "
                                             r"Float8Quantizer \(delayed scaling\)"):  # fmt: skip
            ops.Linear(HIDDEN, FFN, name="fc1")


def test_wrong_arguments_raise():
    with pytest.raises(TypeError, match=r"'recipe' must be a fusible\.recipe recipe"):
        fusible.quantized_model_init("current")
    with pytest.raises(TypeError, match=r"'recipe' must be a fusible\.recipe recipe"):
        fusible.quantized_model_init(recipe.Format.E4M3)
    with pytest.raises(TypeError, match="'enabled' must be a bool"):
        fusible.quantized_model_init(QRECIPES["current"], enabled=1)
    odd = recipe.CustomRecipe(qfactory=lambda role: Float8Quantizer.standalone(E4M3))
    with fusible.quantized_model_init(odd), pytest.raises(ValueError, match="Float8Quantizer"):
        BasicLinear(HIDDEN, FFN)


# ---- modules train, fusion still applies ---------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_layernorm_mlp_trains_and_fuses(recipe_name):
    """A tiny learnable task (y = tanh(x @ T)): the loss falls, the FP8 weights move."""
    rec = QRECIPES[recipe_name]
    model = _build("layernorm_mlp", rec)
    initial = [op.weight.dequantize() for op in _linears(model)]
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    opt = MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        x = torch.randn(TOKENS, HIDDEN, generator=g)
        opt.zero_grad()
        with fusible.autocast(recipe=rec):
            y = model(x.to(BF16))
        loss = (y.float() - torch.tanh(x @ teacher)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    for op, w0 in zip(_linears(model), initial, strict=True):
        assert not torch.equal(op.weight.dequantize(), w0)
    assert all(isinstance(op.weight, QuantizedTensor) for op in _linears(model))
    with fusible.autocast(recipe=rec):
        plan = model.explain(dtype=BF16)
    assert "linear_bias_activation[BasicLinear + Bias + GELU]" in plan
    assert "dact_dbias_quantize[Bias + GELU]" in plan
    name = "Float8Tensor" if recipe_name == "current" else "MXFP8Tensor"
    assert f"stored {name} weight" in plan


# ---- torch.compile -------------------------------------------------------------------------------


def _error_chain(exc):
    out = []
    while exc is not None:
        out.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(out)


_COMPILE_TESTED = compile_quantized_supported()
needs_compile_support = pytest.mark.skipif(
    not _COMPILE_TESTED, reason="torch.compile with quantized weights is tested on torch >= 2.11"
)


@pytest.mark.skipif(_COMPILE_TESTED, reason="torch >= 2.11 compiles quantized weights")
def test_compile_on_older_torch_raises_a_clear_error():
    rec = QRECIPES["current"]
    model = _build("sequential", rec)
    compiled = torch.compile(model, fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception) as excinfo, fusible.autocast(recipe=rec):
        compiled(torch.randn(TOKENS, HIDDEN, dtype=BF16))
    assert "torch.compile with quantized weights" in _error_chain(excinfo.value)
    assert "needs torch >= 2.11" in _error_chain(excinfo.value)


def test_compile_gate_raises_a_clear_error(monkeypatch):
    """The torch-version gate, forced shut on this torch: the compiled forward raises naming the
    op and the torch it needs (the path every torch < 2.11 takes)."""
    from fusible.ops.basic import quantized_weight

    monkeypatch.setattr(quantized_weight, "COMPILE_QUANTIZED_MIN_TORCH", (99, 0))
    rec = QRECIPES["current"]
    compiled = torch.compile(_build("sequential", rec), fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(Exception) as excinfo, fusible.autocast(recipe=rec):
        compiled(torch.randn(TOKENS, HIDDEN, dtype=BF16))
    chain = _error_chain(excinfo.value)
    assert "BasicLinear: torch.compile with quantized weights" in chain
    assert "needs torch >= 99.0" in chain
    torch._dynamo.reset()


@needs_compile_support
def test_compiled_code_keeps_the_quantizer():
    """A quantized weight rebuilt inside compiled code keeps its quantizer (held by identity in
    the flatten context): ``copy_`` re-quantizes under torch.compile as eagerly, and a weight
    returned from compiled code can be re-quantized after."""
    model = _build("linear", QRECIPES["current"], dtype=torch.float32)
    w = _linears(model)[0].weight
    src = torch.randn(w.shape)
    want = copy.deepcopy(w).detach()
    want.copy_(src)
    torch._dynamo.reset()
    out = torch.compile(lambda t: t.detach().clone(), backend="aot_eager")(w)
    assert isinstance(out, QuantizedTensor) and out.quantizer is w.quantizer
    out.copy_(src)
    _assert_same_qdata(out.qdata, want.qdata, "returned, then copy_")
    twin = copy.deepcopy(w).detach()
    torch.compile(lambda t, v: t.copy_(v), backend="aot_eager")(twin, src)
    _assert_same_qdata(twin.qdata, want.qdata, "copy_ compiled")
    torch._dynamo.reset()


def _compiled_step(compiled, model, x, dy, rec):
    """``_step`` through ``compiled`` (an OptimizedModule of ``model``), the gradients named as
    ``model`` names them."""
    got = _step(compiled, x, dy, rec)
    return {k.removeprefix("_orig_mod."): v for k, v in got.items()}


@needs_compile_support
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(
    ("kind", "recipe_name", "train_recipe"),
    [
        ("sequential", "current", "current"),
        ("sequential", "current", "delayed"),  # a stored per-tensor weight under delayed scaling
        ("sequential", "current", None),  # no recipe: the dequantized weight
        ("sequential", "mxfp8", "mxfp8"),
        ("sequential", "blockwise", "blockwise"),
        ("sequential", "custom", "custom"),  # fc1 per-tensor FP8, fc2 MXFP8
        ("residual", "current", "current"),
        ("layernorm_mlp", "current", "current"),
        ("layernorm_mlp", "mxfp8", "mxfp8"),
        ("layernorm_linear", "current", "current"),
    ],
)
def test_compiled_training_equals_eager(kind, recipe_name, train_recipe, backend):
    """``torch.compile(fullgraph=True)`` of a model with quantized weights, three steps with
    ``MasterWeightOptimizer`` (which re-quantizes the weights in place between steps) against
    the same model run eagerly: outputs, input gradients, every parameter gradient and every
    stored weight after each step bit for bit (``aot_eager`` runs eager's kernels; inductor:
    bias gradients, fp32 sums it reassociates, within 1e-5 relative to the largest, and the
    biases re-synchronised after each step). The first step compiles one graph, the later ones
    none: the graph reads the weights' tensors as inputs, so in-place updates need no
    recompile."""
    init = QRECIPES[recipe_name]
    rec = QRECIPES.get(train_recipe) if train_recipe != "delayed" else recipe.DelayedScaling()
    eager, twin = _build(kind, init), _build(kind, init)
    opts = [MasterWeightOptimizer(torch.optim.SGD, m.parameters(), lr=0.1) for m in (eager, twin)]
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend=backend)
    graphs = [torch._dynamo.utils.counters["stats"]["unique_graphs"]]
    for k in range(3):
        x, dy = _data("cpu", BF16, seed=10 + k)
        want = _step(eager, x, dy, rec)
        got = _compiled_step(compiled, twin, x, dy, rec)
        if backend == "inductor":
            for n in [n for n in want if n.endswith("bias")]:
                err = rel_err(got.pop(n).float(), want.pop(n).float())
                assert err < 1e-5, (n, err)
        assert_same_results(got, want, "cpu", f"compiled step {k}")
        for o in opts:
            o.step()
        if backend == "inductor":
            with torch.no_grad():
                for (n, p), q in zip(twin.named_parameters(), eager.parameters(), strict=True):
                    if n.endswith("bias"):
                        p.copy_(q)
        for a, b in zip(_linears(twin), _linears(eager), strict=True):
            if isinstance(b.weight, QuantizedTensor):
                _assert_same_qdata(a.weight.qdata, b.weight.qdata, f"step {k}")
            else:
                assert torch.equal(a.weight, b.weight), f"step {k}"
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] + 1 == graphs[1] == graphs[3], graphs


def test_flatten_protocol_round_trip():
    """QuantizedTensor's traceable-subclass protocol: ``__tensor_flatten__`` names the
    container's tensors (the very tensor objects, absent copies left out) and
    ``__tensor_unflatten__`` rebuilds the same container type, copies and nominal dtype."""
    for name in ("current", "mxfp8", "blockwise"):
        model = _build("linear", QRECIPES[name], dtype=torch.float32)
        w = _linears(model)[0].weight
        names, ctx = w.__tensor_flatten__()
        inner = {n: getattr(w, n) for n in names}
        present = [t for t in _tensors(w.qdata) if t is not None]
        assert len(inner) == len(present)
        assert all(any(t is p for p in present) for t in inner.values()), name
        back = type(w).__tensor_unflatten__(inner, ctx, w.shape, w.stride())
        assert type(back) is type(w) and back.dtype == w.dtype and back.shape == w.shape
        _assert_same_qdata(back.qdata, w.qdata, name)
        assert torch.equal(back.dequantize(), w.dequantize())


# ---- CUDA graphs ---------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_cuda_graph_step_with_master_weights_matches_eager(recipe_name):
    """A whole step (forward, backward, MasterWeightOptimizer.step) captured and replayed: the
    re-quantization writes into the weights' tensors in place, so replays see updated weights."""
    rec = QRECIPES[recipe_name]
    model = _build("sequential", rec, device="cuda")
    twin = _build("sequential", rec, device="cuda")
    kw = {"lr": 0.05, "momentum": 0.9}
    opt = MasterWeightOptimizer(torch.optim.SGD, model.parameters(), **kw)
    twin_opt = MasterWeightOptimizer(torch.optim.SGD, twin.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(TOKENS, HIDDEN, generator=g).to("cuda", BF16) for _ in range(7)]

    def step(m, o, x):
        o.zero_grad(set_to_none=False)
        with fusible.autocast(recipe=rec):
            y = m(x)
        y.backward(x.flip(0))
        o.step()
        return y

    static_x = torch.zeros(TOKENS, HIDDEN, device="cuda", dtype=BF16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            static_x.copy_(data[i])
            step(model, opt, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step(model, opt, static_x)
    for i in range(3):
        step(twin, twin_opt, data[i])
    for i in range(3, 7):
        static_x.copy_(data[i])
        graph.replay()
        want = step(twin, twin_opt, data[i])
        torch.cuda.synchronize()
        assert torch.equal(static_y, want), i
        for a, b in zip(_linears(model), _linears(twin), strict=True):
            _assert_same_qdata(a.weight.qdata, b.weight.qdata, f"replay {i}")


def test_disabled_region_takes_no_recipe():
    with fusible.quantized_model_init(None, enabled=False):
        lin = ops.Linear(32, 32)
    assert not any(isinstance(p, QuantizedTensor) for p in lin.parameters())
    with pytest.raises(TypeError, match="'recipe' must be"):
        fusible.quantized_model_init(None)
