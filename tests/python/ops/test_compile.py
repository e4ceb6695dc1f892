"""torch.compile(fullgraph=True) of training steps: Sequential and the modules, every recipe,
with and without the weight workspace cache, against eager.

Two ways of compiling a step are covered:

* ``module``: the forward (``fusible.autocast`` + the model) is compiled and ``backward()`` is
  called outside, so the backward runs AOTAutograd's compiled backward graph (the joint graph is
  split by its partitioner) -- what ``torch.compile(model)`` gives;
* ``step``: forward and backward in one compiled function (``Tensor.backward`` is traced with
  ``torch._dynamo.config.trace_autograd_ops``).

Tolerance: with ``aot_eager`` the compiled graphs run the very kernels eager runs (fusible's
custom ops and the same ATen ops, functionalized), so outputs, gradients, recipe state and the
cached weight copies must match eager bit for bit. Under inductor the fusible ops stay extern
kernels but the ATen glue around them is generated code: everything is still compared bit for
bit except bias gradients, where the unfused Bias's ``dy.sum(0)`` becomes an inductor reduction
that reassociates the fp32 sum (on CPU: up to 2e-6 absolute on values ~10, 1-2 ulp); those get
rtol 1e-6, atol 1e-5. Every step must trace without graph breaks, and a second step of the same
kind must not recompile.

``fusible.GroupedLinear`` is compiled with changing split sizes (``m_splits``, a per-call
constant of the op: see the recompile counts at ``GROUPED_STEPS``).

Models are tiny (32 tokens, hidden 32) to keep compilation time low; the file is dominated by
dynamo tracing (~1-3 s per graph on CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from ops_helpers import RECIPES

import fusible
from fusible import ops
from fusible.ops.basic import BasicLinear

TOKENS, HIDDEN, FFN = 32, 32, 64
CACHED_STEPS = [True, False, True, False]  # two graphs (True, False), each run twice
PLAIN_STEPS = [None, None]

MODELS = {
    "sequential": lambda: ops.Sequential(
        ops.LayerNorm(HIDDEN),
        ops.Linear(HIDDEN, FFN),
        ops.GELU(),
        ops.Linear(FFN, HIDDEN),
        ops.AddExtraInput(),
    ),
    "LayerNormMLP": lambda: fusible.LayerNormMLP(HIDDEN, FFN),
    "LayerNormLinear": lambda: fusible.LayerNormLinear(HIDDEN, FFN),
    "Linear": lambda: fusible.Linear(HIDDEN, FFN),
    "Linear(save_original_input)": lambda: fusible.Linear(HIDDEN, FFN, save_original_input=True),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given (one per compilation)."""

    def __init__(self, name: str = "aot_eager") -> None:
        self.backend = torch._dynamo.lookup_backend(name)
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return self.backend(gm, example_inputs)


# ---- steps ------------------------------------------------------------------------------------


def _forward(model, x, extra, rec, fm):
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        return model(x, *extra, is_first_microbatch=fm)


def _train_step(model, x, extra, g, rec, fm):
    y = _forward(model, x, extra, rec, fm)
    y.backward(g)
    return y.detach()


def _run(fn, pattern, model, x, extra, g, rec, fm):
    """One step with ``fn`` (compiled or eager) in the given pattern; returns what must match:
    output, input gradients, parameter gradients, recipe state, cached weight copies."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    extra = [e.detach().requires_grad_(True) for e in extra]
    if pattern == "module":
        y = fn(model, x, extra, rec, fm)
        y.backward(g)
        y = y.detach()
    else:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            y = fn(model, x, extra, g, rec, fm)
    out = {"y": y, "x.grad": x.grad}
    out.update({f"extra{i}.grad": e.grad for i, e in enumerate(extra)})
    out.update({f"{n}.grad": p.grad for n, p in model.named_parameters()})
    for i, op in enumerate(model):
        out.update({f"{i}.state.{k}": t for k, t in op.get_extra_state().items()})
        if isinstance(op, BasicLinear) and op.workspace_cache.workspace is not None:
            ws = op.workspace_cache.workspace
            out.update({f"{i}.cached.{k}": t for k, t in vars(ws).items()
                        if isinstance(t, torch.Tensor)})  # fmt: skip
    return out


def _assert_match(got, want, what, exact=True):
    """Bit for bit; with ``exact=False`` (inductor) bias gradients -- the only values an ATen
    reduction that inductor regenerates computes (``dy.sum(0)`` of an unfused Bias) -- may differ
    by fp32 reassociation: rtol 1e-6, atol 1e-5 (~1 ulp at these magnitudes)."""
    assert got.keys() == want.keys(), what
    for name, a in got.items():
        b = want[name]
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {name}"
        if exact or not name.endswith("bias.grad"):
            assert torch.equal(a, b), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5, msg=f"{what}: {name}")


def _data(model_name, device, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(TOKENS, HIDDEN, generator=g).to(device)
        n_out = HIDDEN if model_name in ("sequential", "LayerNormMLP") else FFN
        extra = [torch.randn(TOKENS, HIDDEN, generator=g).to(device)]
        dy = torch.randn(TOKENS, n_out, generator=g).to(device)
        out.append((x, extra if model_name == "sequential" else [], dy))
    return out


def _compare(model_name, recipe_name, pattern, fms, device, backend="aot_eager", exact=True):
    """Compiled vs eager over the steps ``fms`` (is_first_microbatch per step), starting from a
    model never run (recipe state built at trace time). Returns the compile counts after the
    first and the second occurrence of each distinct step kind."""
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = MODELS[model_name]().to(device)
    twin = copy.deepcopy(model)
    counter = CountingBackend(backend)
    compiled = torch.compile(_forward if pattern == "module" else _train_step,
                             backend=counter, fullgraph=True)  # fmt: skip
    eager = _forward if pattern == "module" else _train_step
    counts = []
    data = _data(model_name, device, len(fms))
    for i, ((x, extra, g), fm) in enumerate(zip(data, fms, strict=True)):
        got = _run(compiled, pattern, model, x, extra, g, rec, fm)
        want = _run(eager, pattern, twin, x, extra, g, rec, fm)
        _assert_match(got, want, f"step {i} (is_first_microbatch={fm})", exact)
        counts.append(counter.compiles)
    return counts


# ---- compiled == eager ------------------------------------------------------------------------

ALL_RECIPES = ["none", "current", "mxfp8", "blockwise", "custom", "delayed"]


@pytest.mark.parametrize("pattern", ["module", "step"])
@pytest.mark.parametrize("recipe_name", ALL_RECIPES)
def test_sequential_compiled_matches_eager(recipe_name, pattern, devices):
    """The block (LayerNorm, Linear, GELU, Linear, AddExtraInput). Compiled forward: two
    uncached steps, then the cache (True, False, True, False): three graphs. Whole step: the
    cache only (two graphs). Repeating a step kind never recompiles."""
    steps = PLAIN_STEPS + CACHED_STEPS if pattern == "module" else CACHED_STEPS
    counts = _compare("sequential", recipe_name, pattern, steps, devices)
    if recipe_name == "none":  # is_first_microbatch is never read: one graph serves every step
        assert counts == [1] * len(steps), counts
    elif pattern == "module":
        assert counts == [1, 1, 2, 3, 3, 3], counts
    else:
        assert counts == [1, 2, 2, 2], counts


@pytest.mark.parametrize("recipe_name", ["none", "current", "mxfp8", "blockwise", "custom"])
@pytest.mark.parametrize("model_name", ["LayerNormMLP", "LayerNormLinear", "Linear"])
def test_modules_compiled_matches_eager(model_name, recipe_name, devices):
    """The modules, forward compiled (``torch.compile(model)``-like) with the cache. (Delayed
    scaling is covered on the block, both ways, and by the inductor case.)"""
    counts = _compare(model_name, recipe_name, "module", CACHED_STEPS, devices)
    assert counts == ([1] * 4 if recipe_name == "none" else [1, 2, 2, 2]), counts


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "blockwise", "delayed"])
def test_save_original_input_compiled_matches_eager(recipe_name, devices):
    """A Linear keeping its original input (backward quantizes it again; delayed scaling keeps
    the FP8 copy when compiled, as for the weight), forward compiled, two uncached steps: one
    graph, equal to eager bit for bit."""
    counts = _compare("Linear(save_original_input)", recipe_name, "module", PLAIN_STEPS, devices)
    assert counts == [1, 1], counts


def test_recipe_switched_away_and_back_traces_again(devices):
    """A compiled module run under DelayedScaling, then Float8CurrentScaling, then DelayedScaling
    again: the switch sets the delayed states aside and restores them, which happens at trace
    time only; the graph guards on the container's activation token, so the return traces again
    instead of running the first graph bound to states the ops no longer held (it gave other
    outputs, 1.9 off at this size, and an empty recipe state in ``state_dict()``). Compiled ==
    eager bit for bit, recipe states too, at every step."""
    names = ["delayed", "delayed", "current", "delayed", "delayed"]
    torch.manual_seed(0)
    model = MODELS["Linear"]().to(devices)
    twin = copy.deepcopy(model)
    compiled = torch.compile(_forward, backend=CountingBackend(), fullgraph=True)
    for i, ((x, extra, g), name) in enumerate(
        zip(_data("Linear", devices, len(names)), names, strict=True)
    ):
        got = _run(compiled, "module", model, x, extra, g, RECIPES[name], None)
        want = _run(_forward, "module", twin, x, extra, g, RECIPES[name], None)
        _assert_match(got, want, f"step {i} ({name})")
        assert model.state_dict().keys() == twin.state_dict().keys()


def test_inductor_delayed_scaling_recasts_in_backward(devices):
    """Delayed scaling under inductor (its min-cut partitioner, which recomputes cheap ops such
    as a clone in backward) on the re-cast path: the weight and the kept input are cast again in
    backward with the scale their forward cast read, a copy the cast operator returns
    (``keep_scale``), so it cannot be recomputed from the state the forward graph's update has
    changed. Three uncached steps (the scale changes at each), compiled == eager bit for bit
    (the bias gradient, which inductor sums itself, within fp32 reassociation)."""
    counts = _compare("Linear(save_original_input)", "delayed", "module", [None] * 3, devices,
                      backend="inductor", exact=False)  # fmt: skip
    assert counts == [1, 1, 1], counts


def test_inductor_delayed_scaling_with_cache(devices):
    """One inductor case (its C++ compilation is slow): the block under delayed scaling (state
    mutated in the forward and the backward graphs) with the cache; compiled forward, compiled
    backward."""
    counts = _compare("sequential", "delayed", "module", [True, False, False], devices,
                      backend="inductor", exact=False)  # fmt: skip
    assert counts == [1, 2, 2], counts


# ---- graph breaks -----------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ALL_RECIPES)
def test_no_graph_breaks(recipe_name):
    """torch._dynamo.explain of a whole training step (forward, backward) of the block on the
    cached path (an eager True step filled the cache; the traced step reads it): one graph, no
    breaks. (Every other test compiles with fullgraph=True, which raises on a break.)"""
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = MODELS["sequential"]()
    ((x, extra, g),) = _data("sequential", "cpu", 1)
    _run(_train_step, "step", model, x, extra, g, rec, True)
    x = x.requires_grad_(True)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        explained = torch._dynamo.explain(_train_step)(model, x, extra, g, rec, False)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current"])
def test_dynamic_shapes_compile_once(recipe_name):
    """``torch.compile(dynamic=True)``: token counts on both sides of the Linears' out_features
    reuse the first graph. (Linear's backward used to order its GEMMs by comparing the token
    count with out_features, a guard under dynamic shapes: one recompile per threshold.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = fusible.LayerNormMLP(HIDDEN, FFN)
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    frames = []
    for n in (HIDDEN // 2 + 3, HIDDEN + 5, FFN + 7, 2 * FFN + 1):
        x = torch.randn(n, HIDDEN, requires_grad=True)
        with fusible.autocast(recipe=rec, enabled=rec is not None):
            y = f(x)
        y.sum().backward()
        frames.append(counter.frame_count)
    assert frames == frames[:1] * 4, frames


# ---- cache semantics under compile --------------------------------------------------------------


def test_compiled_cache_follows_replaced_parameter_and_recipe():
    """A replaced parameter and a changed recipe retrace (guards) and re-quantize, like eager."""
    torch.manual_seed(0)
    model = MODELS["Linear"]()
    twin = copy.deepcopy(model)
    counter = CountingBackend()
    compiled = torch.compile(_forward, backend=counter, fullgraph=True)
    data = _data("Linear", "cpu", 4)
    plan = [(True, "current"), (False, "current"), ("replace", None), (False, "current"),
            (False, "mxfp8")]  # fmt: skip
    for i, (fm, rname) in enumerate(plan):
        if fm == "replace":
            new = torch.randn(FFN, HIDDEN)
            model[0].weight = torch.nn.Parameter(new.clone())
            twin[0].weight = torch.nn.Parameter(new.clone())
            continue
        x, extra, g = data[min(i, 3)]
        got = _run(compiled, "module", model, x, extra, g, RECIPES[rname], fm)
        want = _run(_forward, "module", twin, x, extra, g, RECIPES[rname], fm)
        _assert_match(got, want, f"step {i}")
    assert counter.compiles == 4  # True, False, False after the replacement, mxfp8


@pytest.mark.xfail(
    strict=True,
    reason="under torch.compile Tensor._version is an unbacked SymInt that dynamo cannot "
    "guard on, so a compiled is_first_microbatch=False step cannot see in-place weight updates "
    "and reuses the cached copy (eager re-quantizes); pass True after changing weights",
)
def test_compiled_cache_sees_inplace_update():
    rec = RECIPES["current"]
    torch.manual_seed(0)
    model = MODELS["Linear"]()
    twin = copy.deepcopy(model)
    compiled = torch.compile(_forward, backend="aot_eager", fullgraph=True)
    (x, extra, g), (x2, extra2, g2) = _data("Linear", "cpu", 2)
    _run(compiled, "module", model, x, extra, g, rec, True)
    _run(_forward, "module", twin, x, extra, g, rec, True)
    for m in (model, twin):
        with torch.no_grad():
            m[0].weight.add_(0.5)
    got = _run(compiled, "module", model, x2, extra2, g2, rec, False)
    want = _run(_forward, "module", twin, x2, extra2, g2, rec, False)
    _assert_match(got, want, "after an in-place update")


def test_residual_of_the_blocks_own_input_compiles():
    """``block(x, x)`` (AddExtraInput of the block's own input, as a pre-norm residual) traces:
    dynamo refuses one tensor given twice to ``autograd.Function.apply``, so the fuser hands it
    a view (issue 16). Matches eager bit for bit, gradients summed into ``x``."""
    torch.manual_seed(0)
    model = MODELS["sequential"]()
    twin = copy.deepcopy(model)
    compiled = torch.compile(lambda m, x: m(x, x), backend="aot_eager", fullgraph=True)
    ((x, _, g),) = _data("sequential", "cpu", 1)
    outs = []
    for f, m in ((compiled, model), (None, twin)):
        xa = x.clone().requires_grad_(True)
        with fusible.autocast(recipe=RECIPES["current"]):
            y = f(m, xa) if f is not None else m(xa, xa)
        y.backward(g)
        outs.append([y.detach(), xa.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe_name", ALL_RECIPES)
def test_compiled_extra_output_gradient(recipe_name, devices):
    """A branch taken by ``MakeExtraOutput`` after the norm (read on by the Linear's FP8 cast)
    and a residual added at the end: compiled, both outputs' gradients reach the input and the
    norm's parameters, bit for bit as eagerly. On torch 2.11 the compiled backward lost the
    branch's gradient under every FP8 recipe (dynamo traced it with zeros) until the branch
    became a view of the tensor passed on there (misc._BRANCH_AS_VIEW)."""
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.LayerNorm(HIDDEN), ops.MakeExtraOutput(), ops.Linear(HIDDEN, FFN), ops.GELU(),
        ops.Linear(FFN, HIDDEN), ops.AddExtraInput(),
    ).to(devices)  # fmt: skip
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ((x, (r,), g),) = _data("sequential", devices, 1)
    rec = RECIPES[recipe_name]
    results = []
    for m in (compiled, twin):
        xa, ra = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y, branch = m(xa, ra)
        torch.autograd.backward([y, branch], [g, 3 * g.flip(0)])
        results.append([y.detach(), branch.detach(), xa.grad, ra.grad,
                        *(p.grad for p in m.parameters())])  # fmt: skip
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert torch.equal(a, b), f"result {i} differs"


# ---- GroupedLinear: split sizes under torch.compile ------------------------------------------

# (m_splits, is_first_microbatch, compiles so far with a recipe, without one). The first call
# specializes the split sizes; the first other split makes dynamo treat them as symbolic ints,
# so later splits reuse that graph as long as the same experts are empty (the op branches on
# an expert being empty, which is guarded); a True step adds the cached-weight graph.
GROUPED_STEPS = [
    ([32, 0, 64], None, 1, 1),
    ([32, 0, 64], None, 1, 1),
    ([64, 0, 32], None, 2, 2),
    ([96, 0, 0], None, 3, 3),
    ([32, 0, 64], None, 3, 3),
    ([32, 32, 32], None, 4, 4),
    ([32, 32, 32], True, 5, 4),
    ([64, 0, 32], False, 6, 4),
]


@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
def test_grouped_linear_compiled_matches_eager(recipe_name):
    """fusible.GroupedLinear(x, m_splits, is_first_microbatch) compiled (fullgraph) against
    eager, bit for bit (outputs, gradients, recipe state), as the split sizes change."""
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = fusible.GroupedLinear(3, HIDDEN, HIDDEN)
    twin = copy.deepcopy(model)
    counter = CountingBackend()

    def fwd(m, x, splits, fm):
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            return m(x, splits, is_first_microbatch=fm)

    compiled = torch.compile(fwd, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for i, (splits, fm, with_recipe, without) in enumerate(GROUPED_STEPS):
        x, g = torch.randn(96, HIDDEN, generator=gen), torch.randn(96, HIDDEN, generator=gen)
        outs = []
        for f, m in ((compiled, model), (fwd, twin)):
            m.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_(True)
            y = f(m, xx, list(splits), fm)
            y.backward(g)
            out = {"y": y.detach(), "x.grad": xx.grad}
            out.update({f"{n}.grad": p.grad for n, p in m.named_parameters()})
            out.update({f"state.{k}": t for k, t in m[0].get_extra_state().items()})
            outs.append(out)
        _assert_match(outs[0], outs[1], f"step {i} (m_splits={splits}, fm={fm})")
        assert counter.compiles == (with_recipe if rec is not None else without), i


# ---- host side: no aliased graph inputs ---------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_compiled_step_has_no_synthetic_base_inputs(recipe_name):
    """The quantizers' scale and amax slots are views of one state buffer. Traced, they must be
    made in the graph from the buffer: views cached by eager steps would enter as separate graph
    inputs aliasing each other, and AOTAutograd then rebuilds them from a synthetic base at every
    call (host time per step)."""
    import cProfile
    import pstats

    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    m = ops.Sequential(ops.LayerNorm(HIDDEN), ops.Linear(HIDDEN, HIDDEN), ops.GELU(),
                       ops.Linear(HIDDEN, HIDDEN))  # fmt: skip

    def fwd(x):
        with fusible.autocast(recipe=rec):
            return m(x)

    x = torch.randn(8, HIDDEN)
    fwd(x).sum().backward()  # eager first: the slot views get cached
    compiled = torch.compile(fwd, fullgraph=True)
    compiled(x).sum().backward()
    prof = cProfile.Profile()
    prof.enable()
    compiled(x).sum().backward()
    prof.disable()
    names = [f"{f}:{n}" for f, _, n in pstats.Stats(prof).stats]  # type: ignore[attr-defined]
    assert not [n for n in names if "synthetic_base" in n]


# ---- ordinary use: the first call of a fresh model may be a compiled one -------------------------


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8"])
@pytest.mark.parametrize("model_name", ["LayerNormMLP", "TransformerLayer"])
def test_fresh_model_compiled_first(model_name, recipe_name):
    """No eager step before torch.compile: the plans are built while dynamo traces. The result
    equals an eager twin's (outputs and gradients); for TransformerLayer torch's attention and
    the residual adds may be fused differently by inductor, so within rounding."""
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    if model_name == "LayerNormMLP":
        model: torch.nn.Module = fusible.LayerNormMLP(HIDDEN, FFN)
        shape: tuple[int, ...] = (TOKENS, HIDDEN)
    else:
        model = fusible.TransformerLayer(HIDDEN, FFN, 4)
        shape = (2, TOKENS // 2, HIDDEN)
    twin = copy.deepcopy(model)

    def fwd(m, x):
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            return m(x)

    compiled = torch.compile(fwd, fullgraph=True)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got, want = [], []
    for f, m, out in ((compiled, model, got), (fwd, twin, want)):
        xx = x.clone().requires_grad_(True)
        y = f(m, xx)
        y.sum().backward()
        out.extend([y.detach(), xx.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(got, want, strict=True):
        if model_name == "LayerNormMLP":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current"])
@pytest.mark.parametrize("model_name", ["Linear", "LayerNormMLP", "sequential"])
@pytest.mark.parametrize("shape", [(TOKENS, HIDDEN), (2, TOKENS // 2, HIDDEN)], ids=["2d", "3d"])
def test_compiled_output_takes_inplace_ops(model_name, recipe_name, shape):
    """A compiled module's output is not a view of a graph intermediate (the GEMM's 2-D output
    comes out through _compute.gemm_output), so an in-place op on it works, as on a compiled
    nn.Linear's, where it raised "Output 0 of CompiledFunction is a view and is being modified
    inplace"; outputs and gradients equal the eager run's."""
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = MODELS[model_name]()
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    extra = (torch.randn(shape),) if model_name == "sequential" else ()
    got, want = [], []
    for m, out in ((compiled, got), (twin, want)):
        xx = x.clone().requires_grad_(True)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = m(xx, *extra)
        assert y._base is None, "the output is a view"
        y.mul_(2.0)
        y.sum().backward()
        out.extend([y.detach(), xx.grad])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


_ISOLATE = "isolate_recompiles" in __import__("inspect").signature(torch.compile).parameters


@pytest.mark.parametrize("isolate", [False, True])
@pytest.mark.parametrize("recipe_name", ["none", "current"])
def test_per_layer_compile_past_the_recompile_limit(recipe_name, isolate):
    """More fusible layers than ``torch._dynamo.config.recompile_limit``, each compiled on its own
    with ``fullgraph=True``. Each layer's plan ids are constants of its graph; with one shared
    ``forward`` code object the ninth layer failed with ``FailOnRecompileLimitHit``. Each module
    has a ``forward`` of its own code object (``sequential.own_forward``), so it compiles, also
    with torch 2.13's ``isolate_recompiles=True``. Bits equal eager's."""
    if isolate and not _ISOLATE:
        pytest.skip("torch.compile has no isolate_recompiles (torch < 2.13)")
    rec = RECIPES[recipe_name]
    n = torch._dynamo.config.recompile_limit + 2
    torch.manual_seed(0)
    layers = [fusible.Linear(32, 32) for _ in range(n)]
    ref = copy.deepcopy(layers)
    x = torch.randn(16, 32, requires_grad=True)

    def run(mods):
        xi = x.detach().clone().requires_grad_()
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = xi
            for m in mods:
                y = m(y)
        y.float().sum().backward()
        return y, xi.grad

    torch._dynamo.reset()
    kw = {"isolate_recompiles": True} if isolate else {}
    compiled = [torch.compile(m, fullgraph=True, backend="aot_eager", **kw) for m in layers]
    try:
        for _ in range(2):
            got, want = run(compiled), run(ref)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
        for m, r in zip(layers, ref, strict=True):
            assert torch.equal(m.weight.grad, r.weight.grad)
    finally:
        torch._dynamo.reset()


def test_own_forward_follows_copies_and_pickles():
    """Each module's own ``forward`` (a code object of its own) reaches that module -- after
    ``deepcopy`` and a pickle round trip too, never the original -- through a weak reference: a
    dropped module is freed at once, without the cyclic garbage collector."""
    import gc
    import io
    import pickle
    import weakref

    def target(m):
        return m.forward.__closure__[0].cell_contents()

    m = fusible.LayerNormMLP(16, 32)
    other = fusible.LayerNormMLP(16, 32)
    assert target(m) is m
    assert m.forward.__code__ is not other.forward.__code__
    # What tools that bind arguments by name read: the class's forward without self.
    assert list(__import__("inspect").signature(m.forward).parameters)[:1] == ["x"]
    c = copy.deepcopy(m)
    assert target(c) is c
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    u = torch.load(buf, weights_only=False)
    assert target(u) is u
    x = torch.randn(4, 16)
    assert torch.equal(u(x), m(x)) and torch.equal(c(x), m(x))
    t = fusible.TransformerLayer(16, 32, 2)
    t2 = pickle.loads(pickle.dumps(t))
    assert target(t) is t and target(t2) is t2
    # A DataParallel replica (a copy of the module's __dict__) reaches itself, not the original.
    for mod in (m, t):
        rep = mod._replicate_for_data_parallel()
        assert target(rep) is rep
    gc.disable()
    try:
        r = weakref.ref(m)
        del m
        assert r() is None  # freed by reference counting
    finally:
        gc.enable()
