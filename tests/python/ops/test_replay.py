"""The replay executor (issue 11, ops/replay.py): a cached plan's step runs as the flat list of
kernel calls the Python executor made for its signature.

Every scenario runs twice from the same seed -- replay disabled (the Python executor) and
enabled -- and compares, bit for bit, what a user can see after several training steps:
outputs, input and parameter gradients, the updated parameters, the recipe state (amax
histories, scales) and the cached weight workspaces. The counters of :func:`replay.stats` say
that replay happened, or that the Python executor ran where it must.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ops_helpers import RECIPES as SHARED_RECIPES
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fusible
from fusible import ops, recipe
from fusible.ops import replay
from fusible.ops.op import BasicOperation
from fusible.optim import MasterWeightOptimizer
from fusible.quantization import Float8CurrentScalingQuantizer, QuantizedTensor, QuantizerRole
from fusible.quantization.data import qdata_tensors

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import peak_memory as pm  # noqa: E402

H, F, T = 64, 128, 32  # MXFP8 and blockwise FP8 want multiples of 32 / 16


@pytest.fixture(autouse=True)
def _default_options():
    """Replay on, the check mode off, the C++ loop where there is one (whatever FUSIBLE_REPLAY,
    FUSIBLE_REPLAY_CHECK and FUSIBLE_REPLAY_CPP say)."""
    with replay.options(enabled=True, check=False, cpp=True):
        yield


def _custom(role: QuantizerRole) -> Any:
    # A custom recipe: current scaling for activations and weights, high precision for fc2's
    # gradient, delayed scaling (a RoleRules child) nowhere -- routing by role.
    if role.is_gradient and role.name == "fc2":
        return None
    return Float8CurrentScalingQuantizer(
        torch.float8_e5m2 if role.is_gradient else torch.float8_e4m3fn, role=role
    )


# The ops tests' recipes (ops_helpers.RECIPES, in their order), with this file's custom recipe
# in place of theirs and one more.
RECIPES: dict[str, Any] = {
    **SHARED_RECIPES,
    "custom": recipe.CustomRecipe(qfactory=_custom),
    # Routed by role: weights and inputs delayed scaling (one child state), the rest current
    # scaling, fc2's gradients high precision.
    "rules": recipe.CustomRecipe(
        qfactory=recipe.RoleRules(
            {
                "weight:*": recipe.DelayedScaling(),
                "input:*": recipe.DelayedScaling(),
                "grad_*:*:fc2": None,
                "*": recipe.Float8CurrentScaling(),
            }
        )
    ),
}


def _block() -> torch.nn.Module:
    return ops.Sequential(ops.LayerNorm(H), ops.Linear(H, F), ops.GELU(), ops.Linear(F, H))


class _Model:
    """A model factory with its input shape and the keywords of its forward."""

    def __init__(self, make: Any, shape: tuple[int, ...], n_extra: int = 0, **kw: Any) -> None:
        self.make, self.shape, self.n_extra, self.kw = make, shape, n_extra, kw


MODELS: dict[str, _Model] = {
    "block": _Model(_block, (T, H)),
    "block3d": _Model(_block, (2, T // 2, H)),
    "residual": _Model(
        lambda: ops.Sequential(
            ops.LayerNorm(H),
            ops.Linear(H, H),
            ops.AddExtraInput(),
            ops.MakeExtraOutput(),
            ops.Linear(H, H),
        ),
        (T, H),
        n_extra=1,
    ),
    "linear": _Model(lambda: fusible.Linear(H, F), (T, H)),
    "layernorm_linear": _Model(lambda: fusible.LayerNormLinear(H, F), (T, H)),
    "layernorm_mlp": _Model(lambda: fusible.LayerNormMLP(H, F), (T, H)),
    "transformer_layer": _Model(lambda: fusible.TransformerLayer(H, F, 4), (2, T, H)),
    "grouped_linear": _Model(
        lambda: fusible.GroupedLinear(3, H, F), (2 * T, H), m_splits=[T, 0, T]
    ),
}


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters (a quantized one's data and scales), recipe state and cached weight
    workspaces, as tensors."""
    out = []
    for p in model.parameters():
        if isinstance(p, QuantizedTensor):
            out += [t.clone() for t in qdata_tensors(p.qdata).values()]
        else:
            out.append(p.detach().clone())
    for m in model.modules():
        if isinstance(m, BasicOperation):
            out += [v.clone() for v in m.get_extra_state().values()]
            caches = [getattr(m, "workspace_cache", None), *getattr(m, "workspace_caches", [])]
            for c in caches:
                if c is not None and c.workspace is not None:
                    out += [t.clone() for t in qdata_tensors(c.workspace).values()]
    return out


def _run(
    name: str,
    rec: Any,
    enabled: bool,
    *,
    steps: int = 5,
    fms: Any = None,
    recipes: Any = None,
    grad: str = "train",
    setup: Any = None,
    init: Any = None,
) -> list[Any]:
    """``steps`` training steps of model ``name`` (SGD; a fixed random loss weight), replay
    ``enabled`` or not; returns everything to compare. ``fms``: is_first_microbatch per step;
    ``recipes``: a recipe per step (overrides ``rec``); ``grad``: "train", "no_grad" or
    "inference" (forward only); ``init``: build the model inside ``quantized_model_init(init)``
    (FP8 weights, trained by ``MasterWeightOptimizer``)."""
    spec = MODELS[name]
    torch.manual_seed(0)
    with fusible.quantized_model_init(init, enabled=init is not None):
        model = spec.make()
    if setup is not None:
        setup(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt: Any = torch.optim.SGD(params, lr=1e-2)
    if init is not None:
        opt = MasterWeightOptimizer(torch.optim.SGD, params, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    got: list[Any] = []
    with replay.options(enabled=enabled):
        for i in range(steps):
            x = torch.randn(*spec.shape, generator=gen).requires_grad_(grad == "train")
            extra = [torch.randn(*spec.shape, generator=gen) for _ in range(spec.n_extra)]
            kw = dict(spec.kw)
            if fms is not None:
                kw["is_first_microbatch"] = fms[i]
            r = recipes[i] if recipes is not None else rec
            ctx: Any = {"train": torch.enable_grad, "no_grad": torch.no_grad,
                        "inference": torch.inference_mode}[grad]()  # fmt: skip
            with ctx, fusible.autocast(enabled=r is not None, recipe=r):
                out = model(x, *extra, **kw)
            ys = list(out) if isinstance(out, tuple) else [out]
            got += [y.detach().clone() for y in ys]
            if grad != "train":
                continue
            loss = sum((y.float() * torch.randn(y.shape, generator=gen)).sum() for y in ys)
            loss.backward()
            got += [x.grad] + [p.grad for p in model.parameters()]
            opt.step()
            opt.zero_grad()
    return got + _state(model)


def _assert_same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        if u is None or v is None:
            assert u is None and v is None, i
            continue
        assert (u.dtype, u.shape) == (v.dtype, v.shape), i
        assert torch.equal(replay._bits(u), replay._bits(v)), f"tensor {i} differs"


def _same_with_replay(run: Callable[[bool], list[Any]]) -> dict[str, int]:
    """``run(enabled)`` without and with replay: the same bits. Returns the replay run's stats."""
    want = run(False)
    replay.reset_stats()
    got = run(True)
    stats = replay.stats()
    _assert_same(want, got)
    return stats


def _compare(name: str, rec: Any, **kw: Any) -> dict[str, int]:
    """The scenario without and with replay: the same bits. Returns the replay run's stats."""
    return _same_with_replay(lambda enabled: _run(name, rec, enabled, **kw))


# ---- bit for bit the Python executor --------------------------------------------------------


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_replay_equals_python(model_name, recipe_name):
    rec = RECIPES[recipe_name]
    try:
        stats = _compare(model_name, rec)
    except (NotImplementedError, ValueError) as e:  # a recipe the model refuses (both paths)
        pytest.skip(f"{model_name} under {recipe_name}: {e}")
    assert stats["forward.replay"] > 0 and stats["backward.replay"] > 0, stats
    assert stats["fallback.plan"] == stats["fallback.signature"] == 0, stats


@pytest.mark.parametrize("init_name", ["current", "mxfp8"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8"])
@pytest.mark.parametrize("model_name", ["linear", "layernorm_mlp", "grouped_linear"])
def test_quantized_weights_replay(model_name, recipe_name, init_name):
    """FP8 weights (``quantized_model_init``, trained by ``MasterWeightOptimizer``, which
    re-quantizes them in place each step): replayed with each weight's data tensors as inputs
    of their own, bit for bit the Python executor, stored formats used as they are or not."""
    stats = _compare(model_name, RECIPES[recipe_name], init=RECIPES[init_name])
    assert stats["forward.replay"] == 3 and stats["backward.replay"] == 2, stats
    assert stats["fallback.plan"] == stats["fallback.signature"] == 0


@pytest.mark.parametrize("loop", ["cpp", "python"])
@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8"])
def test_both_replay_loops(recipe_name, loop):
    # The recorded calls run by the C++ loop (cpp/bindings/replay.cpp) or by the compiled Python
    # function: the same bits either way.
    if loop == "cpp" and replay._PROGRAM is None:
        pytest.skip("the operator library has no C++ replay loop")
    with replay.options(cpp=loop == "cpp"):
        stats = _compare("residual", RECIPES[recipe_name])
        torch.manual_seed(0)
        model = _block()
        _warm(model, RECIPES[recipe_name], n=3)
    assert stats["forward.replay"] > 0 and stats["backward.replay"] > 0, stats
    (plan,) = model._plans.values()
    rec = plan.replay.last
    (brec,) = rec.backward.values()
    assert (rec.run is not None) == (loop == "cpp") == (brec.start is not None)
    if loop == "cpp":
        # start() parks a backward's inputs under an integer token that finish() takes once.
        with pytest.raises(RuntimeError, match="no inputs under token"):
            brec.finish(-1)


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8", "blockwise"])
def test_microbatches_and_the_workspace_cache(recipe_name):
    # True caches the weight copies, False reuses them (workspaces enter the function), None
    # never caches: three signatures, each replayed once seen twice.
    fms = [True, False, False, None, True, False, False, None, True, False]
    stats = _compare("block", RECIPES[recipe_name], steps=len(fms), fms=fms)
    assert stats["forward.replay"] > 0, stats


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8"])
def test_frozen_weights(recipe_name):
    def freeze(model):
        model[1].weight.requires_grad_(False)
        model[0].bias.requires_grad_(False)

    stats = _compare("block", RECIPES[recipe_name], setup=freeze)
    assert stats["backward.replay"] > 0, stats


@pytest.mark.parametrize("grad", ["no_grad", "inference"])
@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current"])
def test_no_grad_and_inference(recipe_name, grad):
    stats = _compare("block", RECIPES[recipe_name], grad=grad)
    assert stats["forward.replay"] > 0, stats


def test_inference_and_no_grad_keep_their_own_recordings():
    torch.manual_seed(0)
    model = _block()
    x = torch.randn(T, H)
    replay.reset_stats()
    outs = []
    for _ in range(3):
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx():
                outs.append(model(x))
    assert all(torch.equal(outs[0], y) for y in outs)
    assert outs[-1].is_inference() and not outs[-2].is_inference()
    assert replay.stats()["forward.replay"] == 2


def test_recipe_changes_between_steps():
    d, c = RECIPES["delayed"], RECIPES["current"]
    # A different recipe builds new recipe states (a new plan); no recipe keeps them aside,
    # and the same recipe coming back restores them (the same plan and recordings).
    seq = [d, d, d, None, None, None, d, d, c, c, c, d, d, d]
    stats = _compare("block", None, steps=len(seq), recipes=seq)
    assert stats["forward.replay"] > 0, stats


def test_delayed_scaling_history_moves_and_matches():
    rec = recipe.DelayedScaling(amax_history_len=3)
    hists = []
    for enabled in (False, True):
        torch.manual_seed(0)
        model = _block()
        hist = []
        with replay.options(enabled=enabled):
            for _ in range(6):
                with fusible.autocast(recipe=rec):
                    y = model(torch.randn(T, H))
                y.sum().backward()
                hist.append(model[1].recipe_state(True).amax_history.clone())
        hists.append(hist)
    assert all(torch.equal(a, b) for a, b in zip(*hists, strict=True))
    assert not torch.equal(hists[0][0], hists[0][-1])


def test_torch_autocast():
    def step_all(enabled):
        torch.manual_seed(0)
        model = _block()
        out = []
        with replay.options(enabled=enabled):
            for _ in range(5):
                x = torch.randn(T, H, requires_grad=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = model(x)
                y.float().sum().backward()
                out += [y, x.grad, *(p.grad for p in model.parameters())]
                model.zero_grad()
        return out

    assert _same_with_replay(step_all)["forward.replay"] > 0


def test_retained_graph_backs_a_second_backward():
    def twice(enabled):
        torch.manual_seed(0)
        model = _block()
        out = []
        with replay.options(enabled=enabled):
            for _ in range(4):
                x = torch.randn(T, H, requires_grad=True)
                with fusible.autocast(recipe=RECIPES["delayed"]):
                    y = model(x)
                y.sum().backward(retain_graph=True)
                y.sum().backward()
                out += [x.grad, *(p.grad for p in model.parameters())]
                model.zero_grad()
        return out

    assert _same_with_replay(twice)["backward.replay"] > 0


# ---- signatures -------------------------------------------------------------------------------


def _steps(model, xs, rec=None):
    outs = []
    for x in xs:
        x = x.detach().requires_grad_(True)
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = model(x)
        y.sum().backward()
        outs += [y.detach(), x.grad]
    return outs


def test_signature_changes_rerecord():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(T, H, generator=g)
    b = torch.randn(2 * T, H, generator=g)
    c = torch.randn(H, T, generator=g).t()  # the shape of a, not contiguous
    xs = [a, a, a, b, b, b, c, c, c, a]
    rec = RECIPES["current"]
    torch.manual_seed(0)
    model = _block()
    with replay.options(enabled=False):
        want = _steps(model, xs, rec)
    torch.manual_seed(0)
    model = _block()
    replay.reset_stats()
    got = _steps(model, xs, rec)
    _assert_same(want, got)
    s = replay.stats()
    assert s["forward.record"] == 3 and s["forward.replay"] == 4, s
    (plan,) = model._plans.values()
    assert len(plan.replay.sigs) == 3


def test_recordings_per_plan_are_bounded():
    torch.manual_seed(0)
    model = _block()
    for n in range(1, 2 * replay.MAX_SIGNATURES + 3):
        for _ in range(2):
            model(torch.randn(n, H))
    (plan,) = model._plans.values()
    assert len(plan.replay.sigs) <= replay.MAX_SIGNATURES


def test_an_assigned_op_attribute_rerecords():
    # The Python reads ConstantScale.scale at every step: assigning it bumps CONFIG_EPOCH.
    def run(enabled):
        torch.manual_seed(0)
        model = ops.Sequential(ops.Linear(H, H), ops.ConstantScale(2.0), ops.Dropout(0.25))
        out = []
        with replay.options(enabled=enabled):
            for i in range(8):
                if i == 4:
                    model[1].scale = 3.0
                    model[2].p = 0.5
                out += _steps(model, [torch.ones(T, H)])
        return out

    assert _same_with_replay(run)["forward.replay"] >= 2


def test_bad_input_still_raises_after_replays():
    model = fusible.Linear(H, H)
    for _ in range(4):
        with fusible.autocast(recipe=RECIPES["current"]):
            model(torch.randn(8, H)).sum().backward()
    assert replay.stats()["forward.replay"] > 0
    with (
        pytest.raises(ValueError, match=f"in_features {H}"),
        fusible.autocast(recipe=RECIPES["current"]),
    ):
        model(torch.randn(8, H - 1))
    with pytest.raises(TypeError), fusible.autocast(recipe=RECIPES["current"]):
        model(torch.randn(8, H, dtype=torch.float64))


# ---- fallbacks ----------------------------------------------------------------------------------


class _Plain(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PlainFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _warm(model, rec=None, n=3):
    g = torch.Generator().manual_seed(2)
    for _ in range(n):
        _steps(model, [torch.randn(T, H, generator=g)], rec)


@pytest.mark.parametrize(
    "condition, reason",
    [
        (lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
         "saved_tensor_hooks"),
        (_Plain, "dispatch_mode"),
        (_PlainFunctions, "torch_function_mode"),
        (torch.autograd.detect_anomaly, "anomaly_mode"),
        (lambda: replay.options(enabled=False), "disabled"),
    ],
    ids=["saved_tensor_hooks", "dispatch_mode", "torch_function_mode", "anomaly", "disabled"],
)  # fmt: skip
def test_fallbacks(condition, reason):
    rec = RECIPES["delayed"]
    torch.manual_seed(0)
    model = _block()
    twin = _block()
    twin.load_state_dict(model.state_dict())
    _warm(model, rec)
    with replay.options(enabled=False):
        _warm(twin, rec)
    replay.reset_stats()
    x = torch.randn(T, H)
    with pytest.warns(UserWarning) if reason == "anomaly_mode" else _nothing():
        with condition():
            got = _steps(model, [x], rec)
    stats = replay.stats()
    assert stats["forward.replay"] == stats["backward.replay"] == 0, stats
    assert stats[f"fallback.{reason}"] >= 1, stats
    with replay.options(enabled=False):
        want = _steps(twin, [x], rec)
    _assert_same(want, got)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_create_graph_runs_the_python_backward():
    torch.manual_seed(0)
    model = _block()
    _warm(model)
    replay.reset_stats()
    x = torch.randn(T, H, requires_grad=True)
    (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    stats = replay.stats()
    assert stats["forward.replay"] == 1 and stats["fallback.grad_mode"] == 1, stats
    assert g.requires_grad


def test_checkpoint_runs_the_python_executor():
    rec = RECIPES["delayed"]
    torch.manual_seed(0)
    model = _block()
    _warm(model, rec)
    replay.reset_stats()
    x = torch.randn(T, H, requires_grad=True)
    with fusible.autocast(recipe=rec):
        y = fusible.checkpoint(model, x)
    y.sum().backward()
    stats = replay.stats()
    assert stats["forward.replay"] == 0 and stats["fallback.saved_tensor_hooks"] >= 1, stats


def test_compile_never_replays():
    torch.manual_seed(0)
    model = _block()
    _warm(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(T, H, requires_grad=True)
    want = model(x)
    replay.reset_stats()
    for _ in range(3):
        got = compiled(x)
        got.sum().backward()
    stats = replay.stats()
    assert stats["forward.replay"] == stats["backward.replay"] == 0, stats
    assert torch.equal(got, want)


def test_disabled_by_environment_variable():
    code = "import fusible.ops.replay as r; print(r.CONFIG.enabled, r.CONFIG.check)"
    env = {**os.environ, "FUSIBLE_REPLAY": "0", "FUSIBLE_REPLAY_CHECK": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8", "blockwise"])
def test_cuda_replay_equals_python(recipe_name):
    # On the GPU too every signature of the block replays (no call it cannot represent).
    def run(enabled):
        torch.manual_seed(0)
        model = _block().cuda().to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        g = torch.Generator(device="cuda").manual_seed(1)
        out = []
        with replay.options(enabled=enabled):
            for _ in range(5):
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
                out += _steps(model, [x], RECIPES[recipe_name])
                out += [p.grad.clone() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
        return out + _state(model)

    stats = _same_with_replay(run)
    assert stats["forward.replay"] == 3 and stats["backward.replay"] == 2, stats


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_runs_the_python_executor():
    torch.manual_seed(0)
    model = _block().cuda()
    x = torch.randn(T, H, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(s)
    replay.reset_stats()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = model(x)
    assert replay.stats()["fallback.cuda_graph_capture"] == 1
    g.replay()
    torch.cuda.synchronize()
    with replay.options(enabled=False):
        assert torch.equal(y, model(x))


# ---- what is never replayed ---------------------------------------------------------------------


class _Counter(BasicOperation):
    """``x * k`` where ``k`` counts the calls in a Python list: a side effect no recording can
    represent."""

    def __init__(self) -> None:
        super().__init__()
        self.k = [0]

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        self.k[0] += 1
        return x * float(self.k[0]), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        return dy * float(self.k[0]), [], []


class _DeclaredCounter(_Counter):
    replayable = True  # wrongly: the check mode catches it


class _Sync(BasicOperation):
    replayable = True

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        return x * float(x.abs().max().item() > 0), []  # a host sync: not representable

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        return dy, [], []


def test_ops_defined_outside_fusible_are_not_replayed_unless_declared():
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(H, H), _Counter())
    replay.reset_stats()
    outs = _steps(model, [torch.ones(T, H)] * 4)
    assert replay.stats()["forward.replay"] == 0 and replay.stats()["fallback.plan"] == 4
    assert torch.equal(outs[-2], outs[0] * 4)  # the Python ran every step
    (plan,) = model._plans.values()
    assert "_Counter is not declared replayable" in plan.replay.reason


def test_check_mode_names_the_plan_and_the_call():
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(H, H), _DeclaredCounter())
    with replay.options(check=True):
        _steps(model, [torch.ones(T, H)] * 2)  # run once, then recorded
        with pytest.raises(replay.ReplayMismatch, match=r"plan \d+ \(BasicLinear -> Bias -> "
                           r"_DeclaredCounter\), forward: .*call \d+ \(aten\.mul"):  # fmt: skip
            _steps(model, [torch.ones(T, H)])


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8"])
def test_check_mode_passes(recipe_name):
    rec = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = _block()
    replay.reset_stats()
    with replay.options(check=True):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for _ in range(5):
            _steps(model, [torch.randn(T, H)], rec)
            opt.step()
            opt.zero_grad()
    stats = replay.stats()
    assert stats["forward.check"] == 3 and stats["backward.check"] == 2, stats


def test_host_sync_makes_the_signature_unreplayable():
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(H, H), _Sync())
    replay.reset_stats()
    _steps(model, [torch.ones(T, H)] * 4)
    stats = replay.stats()
    assert stats["forward.replay"] == 0 and stats["fallback.signature"] == 1, stats
    (plan,) = model._plans.values()
    (entry,) = plan.replay.sigs.values()
    assert "host sync" in entry.reason


def test_the_same_tensor_as_two_inputs():
    # block(x, x): the signature says which inputs are one tensor, so the recording may read
    # one slot there; distinct tensors of the same shape are another signature.
    def run(enabled):
        torch.manual_seed(0)
        model = ops.Sequential(ops.Linear(H, H), ops.AddExtraInput(), ops.Linear(H, H))
        g = torch.Generator().manual_seed(1)
        out = []
        with replay.options(enabled=enabled):
            for i in range(10):
                x = torch.randn(T, H, generator=g, requires_grad=True)
                r = x if i % 5 < 3 else torch.randn(T, H, generator=g, requires_grad=True)
                y = model(x, r)
                y.sum().backward()
                out += [y, x.grad, r.grad]
        return out

    assert _same_with_replay(run)["forward.replay"] >= 3


def test_non_contiguous_parameter():
    torch.manual_seed(0)
    model = _block()
    with torch.no_grad():
        w = model[1].weight
        w.data = w.detach().t().contiguous().t()
    assert not model[1].weight.is_contiguous()
    replay.reset_stats()
    outs = _steps(model, [torch.ones(T, H)] * 4)
    assert replay.stats()["forward.replay"] == 0
    assert torch.equal(outs[0], outs[-2])


# ---- memory -------------------------------------------------------------------------------------


class _Live(pm.LiveBytes):
    replay_transparent = True  # observes every operator, calls it unchanged


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current", "mxfp8"])
def test_replayed_step_peak_is_not_above_the_python_executors(recipe_name):
    rec = RECIPES[recipe_name]
    traces = {}
    for enabled in (False, True):
        torch.manual_seed(0)
        x = torch.randn(2 * H, H, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(2 * H, H, dtype=torch.bfloat16)
        model = pm.fusible_block(H, 4 * H)
        replay.reset_stats()
        with replay.options(enabled=enabled):
            traces[enabled] = _trace(model, rec, x, dy)
        if enabled:
            stats = replay.stats()
            # Warm-up: Python, forward recorded, backward recorded; the traced step: replayed.
            assert stats["forward.replay"] == 2 and stats["backward.replay"] == 1, stats
    python, replayed = traces[False], traces[True]
    assert replayed.peak <= python.peak, (replayed.report(8), python.report(8))
    for phase in ("forward", "backward"):
        assert replayed.phase_peaks[phase] <= python.phase_peaks[phase], phase


def _trace(model, rec, x, dy):
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)

    def step(mode):
        opt.zero_grad(set_to_none=False)
        if mode is not None:
            mode.phase("forward")
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            y = model(x)
        if mode is not None:
            mode.phase("backward")
        y.backward(dy)
        if mode is not None:
            mode.phase("step")
        opt.step()

    for _ in range(3):  # Python, record forward, record backward
        step(None)
    mode = _Live()
    with mode:
        step(mode)
    return mode


def test_dropped_model_is_freed():
    torch.manual_seed(0)
    model = _block()
    _warm(model, RECIPES["delayed"], n=4)
    (plan,) = model._plans.values()
    assert plan.replay.last is not None  # a recording exists
    refs = [weakref.ref(p) for p in model.parameters()]
    ops_ = [weakref.ref(op) for op in model]
    del model, plan
    gc.collect()
    assert all(r() is None for r in refs + ops_)


def test_stats_reset():
    torch.manual_seed(0)
    model = _block()
    _warm(model)
    assert replay.stats()["forward.replay"] > 0
    replay.reset_stats()
    assert not any(replay.stats().values())
