"""Ordinary use must not surprise (issue 12): recipe state survives runs without a recipe and
explain(); outputs are ordinary tensors; several plans compile into one graph cold; torch.autocast
is followed; hooks on inner ops and bad inputs raise clear errors; a dropped model is freed."""

from __future__ import annotations

import copy
import gc
import sys
import weakref

import pytest
import torch

import fusible
from fusible import ops, recipe
from fusible.ops import fuser
from fusible.ops.basic.quantized_weight import compile_quantized_supported

DELAYED = recipe.DelayedScaling(amax_history_len=8)
RECIPES = {
    "none": None,
    "delayed": DELAYED,
    "current": recipe.Float8CurrentScaling(),
    "mxfp8": recipe.MXFP8BlockScaling(),
}


def _train(m, rec, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            m(x).sum().backward()


# ---- 1. recipe state is never discarded by a run without a recipe, or by explain() ----------


def test_eval_forward_without_recipe_keeps_delayed_state():
    m = fusible.Linear(64, 64)
    _train(m, DELAYED, 3)
    before = {k: v.clone() for k, v in m.state_dict()["_extra_state"].items()}
    assert before, "delayed scaling keeps amax histories and scales"
    m.zero_grad(set_to_none=True)
    twin = copy.deepcopy(m)
    with torch.no_grad():
        m(torch.randn(32, 64))  # a high-precision evaluation pass
    after = m.state_dict()["_extra_state"]
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k
    # Training continues exactly as if the evaluation pass had not happened.
    _train(m, DELAYED, 2, seed=1)
    _train(twin, DELAYED, 2, seed=1)
    for (k, a), (_, b) in zip(m.state_dict().items(), twin.state_dict().items(), strict=True):
        if isinstance(a, dict):
            for f in a:
                assert torch.equal(a[f], b[f]), (k, f)
        else:
            assert torch.equal(a, b), k
    for p, q in zip(m.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_eval_forward_without_recipe_does_not_quantize():
    m = fusible.Linear(64, 64)
    _train(m, DELAYED, 1)
    x = torch.randn(8, 64)
    with torch.no_grad():
        y = m(x)
    torch.testing.assert_close(y, x @ m.weight.T + m.bias, rtol=0, atol=1e-5)


def test_explain_before_any_run_says_so():
    m = ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 64))
    lines = m.explain().splitlines()
    assert lines[:2] == [
        "recipe: none (high precision)",
        "(no run yet: explained for a torch.float32 input on cpu; pass dtype, device and recipe "
        "to explain another)",
    ]
    m(torch.randn(2, 64))
    assert "no run yet" not in m.explain()


@pytest.mark.parametrize(
    "make", [lambda: fusible.Linear(32, 32), lambda: fusible.GroupedLinear(2, 32, 32)]
)
def test_explain_marks_quantizer_slots_nothing_reads(make):
    """``output`` and ``grad_input`` are role-list slots (TE's roles) that fusible's GEMMs never
    quantize with: explain() says so, and only for them."""
    text = make().explain(recipe=recipe.DelayedScaling())
    lines = [ln for ln in text.splitlines() if ":linear" in ln or ":grouped_linear" in ln]
    assert lines
    for ln in lines:
        bucket = ln.split(": ")[1].split(":")[0]
        assert ("(not read:" in ln) == (bucket in ("output", "grad_input")), ln


def test_layernorm_mlp_name_labels_repr_and_error_notes():
    m = fusible.LayerNormMLP(64, 128, name="mlp")
    assert "name='mlp'" in repr(m) and "name=" not in repr(fusible.LayerNormMLP(64, 128))
    assert [r.name for r in m.get_quantizer_roles(True)][:2] == ["fc1", "fc1"]  # roles unchanged
    if sys.version_info >= (3, 11):
        with pytest.raises(ValueError) as info:
            m(torch.randn(2, 63))
        assert info.value.__notes__[0].startswith(
            "(raised while running fusible.LayerNormMLP 'mlp', in its ops [0] LayerNorm"
        )
    with pytest.raises(TypeError, match="LayerNormMLP: 'name' must be a str or None, got int"):
        fusible.LayerNormMLP(64, 128, name=3)


def test_explain_outside_autocast_shows_last_run_and_keeps_state():
    m = ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 64))
    _train(m, DELAYED, 2)
    before = copy.deepcopy(m.state_dict())
    text = m.explain()
    assert "DelayedScaling" in text and "input:linear" in text, text
    # Explaining another recipe neither replaces nor resets the held states.
    other = m.explain(recipe=recipe.Float8CurrentScaling())
    assert "Float8CurrentScaling" in other
    none = m.explain(recipe=None)
    assert "recipe: none" in none and "(none)" in none
    after = m.state_dict()
    for k, v in before.items():
        if isinstance(v, dict):
            assert v.keys() == after[k].keys() and all(torch.equal(v[f], after[k][f]) for f in v)
    _train(m, DELAYED, 1)  # and training picks up the same state objects
    assert m[1].recipe_state(True).amax_history.abs().sum() > 0


@pytest.mark.parametrize("dgrad_add", [False, True])
def test_explain_frozen_weight_lists_no_wgrad(dgrad_add):
    """A frozen weight's backward runs no wgrad GEMM; explain() says so instead of listing one
    (the plain backward, and the fused dgrad + branch-gradient add of a residual block)."""
    if dgrad_add:
        m = ops.Sequential(ops.MakeExtraOutput(), ops.Linear(64, 64, bias=False))
    else:
        m = ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 64))
    linear = next(op for op in m if isinstance(op, ops.BasicLinear))
    assert "gemm(wgrad)" in m.explain() and "frozen" not in m.explain()
    linear.weight.requires_grad_(False)
    text = m.explain()
    assert "no gemm(wgrad): the weight is frozen" in text, text
    assert "gemm(dgrad" in text and ", gemm(wgrad)" not in text, text
    if dgrad_add:
        assert "linear_dgrad_add" in text, text


@pytest.mark.parametrize("rec", ["none", "current"])
def test_explain_grouped_linear_frozen_experts(rec):
    """GroupedLinear: explain() names the wgrad GEMMs only for the experts whose weight trains,
    and none when every weight is frozen (per expert and grouped paths)."""
    m = ops.Sequential(ops.GroupedLinear(3, 64, 32))
    explain = lambda: m.explain(recipe=RECIPES[rec])  # noqa: E731
    assert "wgrad" in explain() and "frozen" not in explain() and "experts whose" not in explain()
    m[0].weight1.requires_grad_(False)
    assert "for the 2 experts whose weight trains" in explain(), explain()
    for w in m[0].weights():
        w.requires_grad_(False)
    text = explain()
    assert "no wgrad GEMMs: the weights are frozen" in text and "gemm(wgrad)" not in text, text


def test_different_recipe_replaces_state():
    m = fusible.Linear(64, 64)
    _train(m, DELAYED, 2)
    _train(m, recipe.Float8CurrentScaling(), 1)
    assert m.state_dict()["_extra_state"] == {}  # current scaling has no state


# ---- 2. outputs are ordinary tensors ----------------------------------------------------------


@pytest.mark.parametrize("rec", sorted(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_output_accepts_inplace_add(kind, rec, devices):
    torch.manual_seed(0)
    d = devices
    make = {
        "Linear": lambda: fusible.Linear(64, 64, device=d),
        "LayerNormLinear": lambda: fusible.LayerNormLinear(64, 64, device=d),
        "LayerNormMLP": lambda: fusible.LayerNormMLP(64, 128, device=d),
    }[kind]
    m = make()
    x = torch.randn(2, 32, 64, device=d, requires_grad=True)
    r = torch.randn(2, 32, 64, device=d)
    with fusible.autocast(enabled=RECIPES[rec] is not None, recipe=RECIPES[rec]):
        y = m(x)
        assert y._base is None
        y += r
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("rec", sorted(RECIPES))
def test_branch_gradient_of_a_sum(rec, devices):
    """``(y.sum() + branch.sum()).backward()`` on a block with a ``MakeExtraOutput`` branch: the
    branch's gradient is an expanded (stride 0) tensor, which the FP8 dgrad GEMM that adds it
    could not read ("argument 'c' must be contiguous"). Over four steps (the Python executor,
    the recording, replays): the gradients equal those of the same block given the same
    gradients as contiguous tensors, bit for bit."""
    torch.manual_seed(0)
    model = ops.Sequential(ops.LayerNorm(64), ops.MakeExtraOutput(), ops.Linear(64, 64),
                           ops.GELU(), ops.Linear(64, 64)).to(devices)  # fmt: skip
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(32, 64, generator=g).to(devices)
        results = []
        for m, strided in ((model, True), (twin, False)):
            xa = x.clone().requires_grad_(True)
            with fusible.autocast(enabled=RECIPES[rec] is not None, recipe=RECIPES[rec]):
                y, branch = m(xa)
            if strided:
                (y.sum() + branch.sum()).backward()
            else:
                torch.autograd.backward([y, branch], [torch.ones_like(y), torch.ones_like(branch)])
            results.append([xa.grad, *(p.grad for p in m.parameters())])
            m.zero_grad(set_to_none=True)
        for i, (a, b) in enumerate(zip(*results, strict=True)):
            assert torch.equal(a, b), f"step {step}: gradient {i} differs"


# ---- 3. several plans compile into one graph, cold -----------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, h: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = fusible.LayerNormLinear(h, 3 * h)
        self.proj = fusible.Linear(h, h)
        self.mlp = fusible.LayerNormMLP(h, 2 * h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(x)


@pytest.mark.parametrize("rec", ["none", "delayed", "current"])
def test_compile_several_plans_cold_fullgraph(rec, devices):
    torch._dynamo.reset()
    torch.manual_seed(0)
    d = devices
    lin = [fusible.Linear(64, 64, device=d) for _ in range(2)]
    m = torch.nn.Sequential(lin[0], torch.nn.ReLU(), lin[1])
    twin = copy.deepcopy(m)
    f = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(32, 64, device=devices, requires_grad=True)
    for model in (f, twin):
        with fusible.autocast(enabled=RECIPES[rec] is not None, recipe=RECIPES[rec]):
            y = model(x)
        y.sum().backward()
    for p, q in zip(m.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("rec", ["none", "delayed", "current"])
def test_block_with_sdpa_is_one_graph(rec, devices):
    torch._dynamo.reset()
    m = _Block().to(devices)
    x = torch.randn(2, 32, 64, device=devices)

    def fn(x):
        with fusible.autocast(enabled=RECIPES[rec] is not None, recipe=RECIPES[rec]):
            return m(x)

    info = torch._dynamo.explain(fn)(x)
    assert info.graph_count == 1 and info.graph_break_count == 0, info.break_reasons


# ---- 4. torch.autocast ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_torch_autocast_dtype_is_followed(kind, devices):
    torch.manual_seed(0)
    d = devices
    if kind == "Linear":
        m: torch.nn.Module = fusible.Linear(64, 32, device=d)
    else:
        m = fusible.LayerNormMLP(64, 128, device=d)
    x = torch.randn(16, 64, device=d, requires_grad=True)
    with torch.autocast(d, dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    for p in m.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
    assert x.grad is not None and x.grad.dtype == torch.float32
    if kind == "Linear":
        ref = torch.nn.functional.linear(
            x.detach().bfloat16(), m.weight.detach().bfloat16(), m.bias.detach().bfloat16()
        )
        # The same bf16 operands; the GEMM libraries may round the bias add differently.
        torch.testing.assert_close(y.detach(), ref, rtol=1.6e-2, atol=1e-2)


def test_torch_autocast_with_fp8_recipe_and_weight_cache(devices):
    torch.manual_seed(0)
    m = fusible.Linear(64, 64, device=devices)
    x = torch.randn(32, 64, device=devices)
    with torch.autocast(devices, dtype=torch.bfloat16), fusible.autocast(recipe=DELAYED):
        y1 = m(x, is_first_microbatch=True)
        y2 = m(x, is_first_microbatch=False)  # the cached workspace (of the fp32 weight)
    assert y1.dtype == torch.bfloat16 and torch.equal(y1, y2)


# ---- 8. hooks on inner ops, bad input -----------------------------------------------------------


@pytest.mark.parametrize(
    "hook",
    ["register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook"],
)
def test_hook_on_inner_op_raises(hook):
    m = fusible.LayerNormMLP(64, 128)
    with pytest.raises(RuntimeError, match=f"BasicLinear.{hook}: hooks on a basic op never run"):
        getattr(m.fc1, hook)(lambda *a: None)
    # Hooks on the module itself run as usual.
    seen = []
    m.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    m(torch.randn(4, 64))
    assert seen == [torch.Size([4, 64])]


def test_bad_inputs_name_the_problem():
    m = fusible.Linear(64, 64)
    with pytest.raises(ValueError, match="at least one dimension"):
        m(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor, got list"):
        m([torch.randn(2, 64)])
    with pytest.raises(ValueError, match="in_features 64"):
        m(torch.randn(2, 63))


@pytest.mark.parametrize(
    "make,where",
    [
        (
            lambda: fusible.Linear(63, 32, name="proj"),
            "fusible.Linear, in its ops [0] BasicLinear 'proj', [1] Bias 'proj')",
        ),
        (
            lambda: fusible.LayerNormMLP(63, 128),
            "fusible.LayerNormMLP, in its ops [0] LayerNorm, [1] BasicLinear 'fc1', [2] Bias, "
            "[3] GELU, [4] BasicLinear 'fc2', [5] Bias)",
        ),
        (
            lambda: ops.Sequential(ops.Linear(64, 32), ops.GELU(), ops.Linear(64, 8)),
            "fusible.ops.Sequential, in its ops [0] BasicLinear, [1] Bias, [2] GELU, "
            "[3] BasicLinear, [4] Bias)",
        ),
    ],
    ids=["Linear", "LayerNormMLP", "Sequential"],
)
@pytest.mark.parametrize("rec", ["none", "delayed"])
@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes: Python >= 3.11")
def test_op_error_notes_the_module(make, where, rec):
    """An op's error names the op class (``BasicLinear``, ``LayerNorm``), which the user of a
    module never wrote: the container adds a note (shown under the message) naming the module
    and its ops with their names, once; the message itself is unchanged. The eager plan path
    (a try that costs nothing until it catches) has the same Python call count as before
    (test_overhead_counts)."""
    m = make()
    x = torch.randn(4, 64)
    with fusible.autocast(recipe=RECIPES[rec]):
        with pytest.raises(ValueError, match=r"input feature size (64|32) does not match") as info:
            m(x)
        assert info.value.__notes__ == [f"(raised while running {where}"]
        with pytest.raises(ValueError) as again:  # the cached plan's run notes it too
            m(x)
        assert len(again.value.__notes__) == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: fusible.Linear(64, 32),
        lambda: fusible.LayerNormMLP(64, 128),
        lambda: ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 32), ops.GELU()),
    ],
    ids=["Linear", "LayerNormMLP", "Sequential"],
)
def test_input_on_another_device_names_module_and_parameter(make):
    """An input on another device than the parameters (here meta against cpu, the case every
    machine has) used to fail in the first kernel, naming it and its argument
    (``fusible.norm_fwd: argument 'gamma' is on cpu``); it names the module, the parameter and
    both devices. A forward with input and model both on meta still gives shapes."""
    m = make()
    name = type(m).__name__
    with pytest.raises(ValueError, match=rf"{name}\.forward: the input is on meta but "
                       r"parameter '0\.weight' is on cpu"):  # fmt: skip
        m(torch.randn(4, 64, device="meta"))
    assert m(torch.randn(4, 64)).shape[-1] in (32, 64)
    assert m.to("meta")(torch.randn(4, 64, device="meta")).device.type == "meta"


def test_fused_op_returning_wrong_result_is_named():
    class Bad(ops.FusedOperation):
        name = "bad_fusion"

        def fuser_forward(self, ctxs, x, params, *, next_input_quantizer, extra_inputs):
            return x  # not (y, extra outputs)

    rule = ops.register_fusion((ops.BasicLinear, ops.Bias), Bad)
    try:
        with pytest.raises(TypeError, match="fused op 'bad_fusion': forward must return"):
            fusible.Linear(16, 16)(torch.randn(2, 16))
    finally:
        ops.unregister_fusion(rule)


# ---- issue 11: a dropped model is freed -------------------------------------------------------


@pytest.mark.parametrize("rec", ["none", "delayed"])
def test_dropped_model_is_freed(rec, devices):
    m = fusible.LayerNormMLP(64, 128, device=devices)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(32, 64, generator=g).to(devices)
        with fusible.autocast(enabled=rec != "none", recipe=RECIPES[rec]):
            m(x).sum().backward()
    refs = [weakref.ref(p) for p in m.parameters()]
    ids = list(m._plan_ids)
    assert ids and all(hasattr(fuser._SLOTS, f"p{i}") for i in ids)
    del m
    gc.collect()
    assert all(r() is None for r in refs)
    assert not any(hasattr(fuser._SLOTS, f"p{i}") for i in ids)


def test_many_models_do_not_accumulate_plans():
    gc.collect()
    start = len(vars(fuser._SLOTS))
    for _ in range(50):
        m = fusible.Linear(16, 16)
        m(torch.randn(2, 16)).sum().backward()
    del m
    gc.collect()
    assert len(vars(fuser._SLOTS)) <= start


def test_cached_plan_is_reused():
    m = ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 64), ops.GELU(), ops.Linear(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(3):
        with fusible.autocast(recipe=DELAYED):
            m(x).sum().backward()
    assert len(m._plans) == 1
    with torch.no_grad():
        m(x)  # no grad: a plan of its own (nothing saved, no transposed copies)
    assert len(m._plans) == 2


# ---- 6. a forward on meta tensors gives shapes ------------------------------------------------


@pytest.mark.parametrize("rec", sorted(RECIPES))
def test_meta_forward_gives_shapes_and_materialises(rec):
    r = RECIPES[rec]
    m = fusible.LayerNormMLP(64, 128, device="meta")
    x = torch.randn(32, 64, device="meta", requires_grad=True)
    with fusible.autocast(enabled=r is not None, recipe=r):
        y = m(x)
    assert y.shape == (32, 64) and y.device.type == "meta"
    y.sum().backward()
    assert m.fc1.weight.grad.shape == (128, 64) and x.grad.shape == x.shape
    m.to_empty(device="cpu")
    m.reset_parameters()
    with fusible.autocast(enabled=r is not None, recipe=r):
        y = m(torch.randn(32, 64))
    assert y.device.type == "cpu" and torch.isfinite(y).all()
    if rec == "delayed":
        assert m.fc1.recipe_state(True).amax_history.device.type == "cpu"


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compile_with_quantized_weights(fullgraph):
    """Compiled, a model with quantized weights computes what it computes eagerly (torch >=
    2.11, where it is tested); older torch raises the documented error."""
    torch._dynamo.reset()
    rec = recipe.Float8CurrentScaling()
    with fusible.quantized_model_init(rec):
        m = fusible.Linear(64, 64)
    f = torch.compile(m, fullgraph=fullgraph, backend="aot_eager")
    x = torch.randn(32, 64)
    if not compile_quantized_supported():
        with pytest.raises(RuntimeError, match=r"torch\.compile with quantized weights"):
            with fusible.autocast(recipe=rec):
                f(x)
        return
    with fusible.autocast(recipe=rec):
        assert torch.equal(f(x), m(x))


# ---- found by a new-user probe (session 20) ------------------------------------------------


@pytest.mark.parametrize("rec", ["delayed", "current"])
def test_create_graph_grad_after_an_ordinary_backward(rec):
    """``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty's first step) after
    an ordinary training step: delayed scaling raised autograd's "view created in no_grad mode
    ... modified inplace" from the cast, because the amax slot view it writes was made (and
    cached) in the ordinary backward, under no_grad. The gradient equals the one without
    create_graph, bit for bit."""
    r = RECIPES[rec]
    torch.manual_seed(0)
    m = fusible.Linear(64, 64)
    _train(m, r, 1)
    x = torch.randn(32, 64, requires_grad=True)
    grads = []
    for create_graph in (False, True):
        state = copy.deepcopy(m.state_dict())
        with fusible.autocast(recipe=r):
            y = m(x)
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=create_graph)
        grads.append(g.detach())
        m.load_state_dict(state)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize(
    ("make", "rec"),
    [("linear", "delayed"), ("linear", "current"), ("mlp", "none"), ("mlp", "delayed")],
)
def test_double_backward_through_kernels_names_the_ops(make, rec):
    """Differentiating a gradient taken with ``create_graph=True`` (a gradient penalty) through
    fusible kernels, which have no derivative, raised torch's fallback's "derivative for
    fusible::gemm is not implemented": an operator the user never called. Now the error names
    the plan's ops and what to do; the first gradient is unchanged (bit for bit)."""
    torch.manual_seed(0)
    m = fusible.Linear(64, 64) if make == "linear" else fusible.LayerNormMLP(64, 128)
    x = torch.randn(8, 64, requires_grad=True)
    r = RECIPES[rec]
    _train(m, r, 1)  # a recipe state to restore
    grads = []
    for create_graph in (False, True):
        state = copy.deepcopy(m.state_dict())  # delayed scaling: both steps from one state
        with fusible.autocast(enabled=r is not None, recipe=r):
            y = m(x)
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=create_graph)
        grads.append(g)
        m.load_state_dict(state)
    assert torch.equal(grads[0], grads[1].detach())
    ops_named = "BasicLinear -> Bias" if make == "linear" else "LayerNorm -> BasicLinear 'fc1'"
    with pytest.raises(RuntimeError, match=f"double backward is not supported through {ops_named}"):
        grads[1].pow(2).sum().backward()


@pytest.mark.parametrize("cls", [recipe.DelayedScaling, recipe.Float8CurrentScaling])
def test_pure_e5m2_recipe_is_refused_at_autocast(cls):
    """``DelayedScaling(fp8_format=Format.E5M2)`` as the whole recipe failed at the first GEMM
    ("fusible.gemm: fus_gemm: a and b are both float8_e5m2"); ``fusible.autocast`` now refuses
    it with what to use instead. As a CustomRecipe's rule for the gradient roles it still
    trains."""
    with pytest.raises(ValueError, match=r"fusible.autocast: recipe \w+\(fp8_format=Format.E5M2\)"):
        fusible.autocast(recipe=cls(fp8_format=recipe.Format.E5M2))
    e5m2_grads = recipe.CustomRecipe.from_rules(
        {"grad_*:*": cls(fp8_format=recipe.Format.E5M2), "*": cls()}
    )
    m = fusible.Linear(64, 64)
    with fusible.autocast(recipe=e5m2_grads):
        m(torch.randn(8, 64)).sum().backward()
    assert m.weight.grad is not None and torch.isfinite(m.weight.grad).all()


@pytest.mark.parametrize("run_first", [False, True])
def test_parametrized_op_is_refused_by_name(run_first):
    """``weight_norm`` on an op (torch.nn.utils.parametrize) moves the registered weight away,
    which the kernels read: the forward failed with "not enough values to unpack" inside a
    fused op. Now the plan build refuses it, naming the op, the parametrized name and the
    way out; also after the module ran (a new plan: its parameters changed)."""
    m = fusible.Linear(64, 64)
    x = torch.randn(4, 64)
    if run_first:
        m(x)
    torch.nn.utils.parametrizations.weight_norm(m[0], "weight")
    with pytest.raises(NotImplementedError, match=r"ParametrizedBasicLinear: parametrized "
                                                  r"parameters \(weight: "):  # fmt: skip
        m(x)


def test_transformer_layer_non_tensor_input_is_a_type_error():
    """It was ``AttributeError: 'NoneType' object has no attribute 'dim'``."""
    layer = fusible.TransformerLayer(64, 128, 4)
    for bad in (None, [[1.0] * 64]):
        with pytest.raises(TypeError, match=r"hidden_states must be a torch.Tensor, got"):
            layer(bad)


def test_slicing_a_sequential_gives_a_sequential():
    """``seq[1:3]`` returned a list; like ``torch.nn.Sequential`` it is now a container of the
    same ops (shared parameters and recipe state) that runs: the two halves compose to the
    whole, bit for bit."""
    torch.manual_seed(0)
    m = ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 128), ops.GELU(), ops.Linear(128, 64))
    head, tail = m[:2], m[2:]
    assert isinstance(head, ops.Sequential) and len(head) == 2 and head[1] is m[1]
    assert isinstance(fusible.LayerNormMLP(64, 128)[1:3], ops.Sequential)
    x = torch.randn(4, 64)
    with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
        assert torch.equal(tail(head(x)), m(x))


def test_double_backward_of_torch_only_gradients_still_works():
    """Without a recipe a Linear's backward GEMMs are torch's: its gradient is differentiable,
    and a gradient penalty through it equals plain torch's."""
    torch.manual_seed(0)
    m = fusible.Linear(64, 32)
    ref = torch.nn.Linear(64, 32)
    ref.load_state_dict({"weight": m.weight.detach(), "bias": m.bias.detach()})
    x = torch.randn(8, 64)
    for mod in (m, ref):
        xi = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(mod(xi).pow(2).sum(), xi, create_graph=True)
        g.pow(2).sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    torch.testing.assert_close(m.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("rec", ["delayed", "current", "mxfp8"])
def test_weight_cached_under_inference_mode_then_training(rec):
    """A weight workspace cached under ``torch.inference_mode`` (``is_first_microbatch=True``)
    holds inference tensors, which autograd refuses to save; a training step with
    ``is_first_microbatch=False`` used to fail with torch's "Inference tensors cannot be saved
    for backward". It is now a miss: the step quantizes the weight itself, giving the bits of
    an uncached step."""
    r = RECIPES[rec]
    torch.manual_seed(0)
    m = fusible.Linear(64, 64)
    twin = copy.deepcopy(m)
    x0 = torch.randn(32, 64)
    with torch.inference_mode(), fusible.autocast(recipe=r):
        m(x0, is_first_microbatch=True)
        twin(x0)  # the same recipe-state history as m
    x = torch.randn(32, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    with fusible.autocast(recipe=r):
        y = m(x, is_first_microbatch=False)
        y2 = twin(x2)
    y.sum().backward()
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    assert torch.equal(m.weight.grad, twin.weight.grad)


def test_autocast_recipe_error_lists_every_recipe():
    with pytest.raises(TypeError) as info:
        fusible.autocast(recipe="fp8")  # type: ignore[arg-type]
    for name in ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
                 "Float8BlockScaling", "CustomRecipe"):  # fmt: skip
        assert name in str(info.value)


# ---- found by an ordinary-use audit (session 24) -------------------------------------------


def test_checkpoint_of_another_history_length_raises_on_every_run():
    """Resuming a delayed-scaling checkpoint under a recipe with another ``amax_history_len``
    raised at the first forward, but the loaded state was dropped then: the next forward ran on
    fresh scales (1.0) without a word. It raises on every run now, naming the way out; leaving
    out ``_extra_state`` starts from fresh state."""
    torch.manual_seed(0)
    m = fusible.Linear(64, 64)
    _train(m, recipe.DelayedScaling(amax_history_len=8), 2)
    sd = m.state_dict()
    fresh = fusible.Linear(64, 64)
    fresh.load_state_dict(sd)
    longer = recipe.DelayedScaling(amax_history_len=16)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"from load_state_dict\(\) does not fit the recipe"):
            _train(fresh, longer, 1)
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "_extra_state"})
    _train(fresh, longer, 1)
    assert fresh.state_dict()["_extra_state"]["forward.amax_history"].shape == (16, 3)


@pytest.mark.parametrize("rec", ["none", "delayed", "current"])
def test_basic_op_called_on_its_own(rec):
    """``ops.GELU()(x)`` or ``ops.LayerNorm(64)(x)`` raised torch's ``Module [GELU] is missing
    the required "forward" function``: a basic op ran only inside a container. Called on its
    own it runs as a one-op ``ops.Sequential`` (as TransformerEngine's basic ops do), the same
    bits, gradients included; a dropped op is freed without the cyclic collector."""
    r = RECIPES[rec]
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    for make in (lambda: ops.LayerNorm(64), lambda: ops.GELU(), lambda: ops.BasicLinear(64, 32)):
        op, twin = make(), None
        twin = copy.deepcopy(op)
        seq = ops.Sequential(twin)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fusible.autocast(enabled=r is not None, recipe=r):
            ya, yb = op(xa), seq(xb)
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
        for p, q in zip(op.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    gl = ops.GroupedLinear(2, 64, 32)
    assert gl(x, m_splits=[8, 24]).shape == (32, 32)
    ln = ops.LayerNorm(64)
    ln(x)
    ref = weakref.ref(ln)
    del ln
    assert ref() is None
